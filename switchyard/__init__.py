"""The ``switchyard`` command: one CLI over both planes and the benchmarks (it composes them;
nothing imports it back)."""
