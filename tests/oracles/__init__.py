"""Differential oracles: the pure-Python executable specifications of rules the product runs
natively (the Rust core in ``native/``, through ``switchyard_native``).

* :mod:`.prefix_index` (with :mod:`.index_residency`, :mod:`.index_snapshot`): the prefix index,
  against ``control_plane.index.native.NativePrefixIndex``;
* :mod:`.scoring`: the kv cost's terms and the guards/argmin, against the native steps of
  ``control_plane.router.decision.decide``;
* :mod:`.ledger`: the in-flight accounts, against ``switchyard_native.InflightAccounts``.

Each is written for clarity, not speed, and the property tests (``tests/unit/test_native_*.py``,
``tests/unit/test_view_interleavings.py``) fold the same random inputs through both sides and
require the same state, bytes and decisions. Nothing in the product imports them.
"""
