"""The native decision core against the Python specification, interleaved in one process.

The scenarios of :mod:`benchmarks.router_decide` (64 and 256 workers, 4K and 32K prompts, ~2
in-flight requests per worker). Each side has its own ledger, built from the same random
history: native accounts (``InflightAccounts``, whose view is an ``InflightView``) for the
native side, the specification's accounts (a dict view) for the reference side, as
``SWITCHYARD_INDEX`` selects them. Each sample runs the same decision once per side
(``decide(..., native=...)``), alternating which goes first, so a load change on a shared box
hits both alike; then the decision core alone, without the ledger view, the choice's reason or
the ``Decision``: ``_score_native`` (terms, guards, argmin and score rows in one call) against
``_score`` + ``_pick`` + ``_rows``. The two give identical decisions
(``tests/unit/test_native_decide.py``).

Run: ``uv run python -m benchmarks.router_scoring``.
"""

from __future__ import annotations

import random
import time

from benchmarks.router_decide import _percentile, _scenario
from control_plane.router import RouterConfig, decide
from control_plane.router import decision

SCENARIOS = ((64, 4096), (256, 4096), (64, 32768), (256, 32768))
SAMPLES = 700


def _core(native: bool, request, ordered, config, overlaps, mine) -> None:
    if native:
        t = decision._score_native(request, ordered, config, overlaps, mine)
        decision._rows(t, t.cost, None)
    else:
        t = decision._score(request, ordered, config, overlaps, mine)
        decision._pick(t, config)
        decision._rows(t, list(t.cost), None)


def run(samples: int = SAMPLES) -> dict:
    rng = random.Random(20260501)
    config = RouterConfig()
    out = {}
    for n_workers, prompt_tokens in SCENARIOS:
        state = rng.getstate()
        request, workers, overlaps, native_ledger = _scenario(rng, n_workers, prompt_tokens, native=True)
        rng.setstate(state)
        *_, reference_ledger = _scenario(rng, n_workers, prompt_tokens, native=False)
        ledgers = {True: native_ledger, False: reference_ledger}
        whole: dict[bool, list[float]] = {True: [], False: []}
        for seed in range(samples):
            for native in ((True, False) if seed % 2 else (False, True)):
                t0 = time.perf_counter_ns()
                decide(request, workers, config, rng_seed=seed, overlaps=overlaps, inflight=ledgers[native],
                       native=native)
                whole[native].append((time.perf_counter_ns() - t0) / 1000.0)
        views = {native: ledger.view(request.block_hashes) for native, ledger in ledgers.items()}
        ordered = sorted(workers, key=lambda w: w.worker_id)
        core: dict[bool, list[float]] = {True: [], False: []}
        for seed in range(samples):
            for native in ((True, False) if seed % 2 else (False, True)):
                t0 = time.perf_counter_ns()
                _core(native, request, ordered, config, overlaps, views[native])
                core[native].append((time.perf_counter_ns() - t0) / 1000.0)
        for native in (False, True):
            a, b = sorted(whole[native]), sorted(core[native])
            out[f"{n_workers}w/{prompt_tokens}tok/{'native' if native else 'reference'}"] = {
                "decide_p50_us": _percentile(a, 0.5), "decide_p99_us": _percentile(a, 0.99),
                "core_p50_us": _percentile(b, 0.5), "core_p99_us": _percentile(b, 0.99)}
    return out


def main() -> None:
    results = run()
    print(f"{'scenario':<30}{'decide p50':>12}{'p99 us':>10}{'core p50':>12}{'p99 us':>10}")
    for name, r in results.items():
        print(f"{name:<30}{r['decide_p50_us']:>12.1f}{r['decide_p99_us']:>10.1f}"
              f"{r['core_p50_us']:>12.1f}{r['core_p99_us']:>10.1f}")
    a, b = results["256w/32768tok/reference"], results["256w/32768tok/native"]
    c, d = results["64w/32768tok/reference"], results["64w/32768tok/native"]
    print(f"RESULT core_p50_ratio_256w={a['core_p50_us'] / b['core_p50_us']:.2f} "
          f"decide_p50_ratio_256w={a['decide_p50_us'] / b['decide_p50_us']:.2f} "
          f"decide_p50_ratio_64w={c['decide_p50_us'] / d['decide_p50_us']:.2f}")


if __name__ == "__main__":
    main()
