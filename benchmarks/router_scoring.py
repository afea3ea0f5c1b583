"""The native decision core's latency, whole and alone, in one process.

The scenarios of :mod:`benchmarks.router_decide` (64 and 256 workers, 4K and 32K prompts, ~2
in-flight requests per worker, the ledger's native accounts). Each sample times ``decide`` whole,
then the decision core alone, without the ledger view, the choice's reason or the ``Decision``:
``scoring.score`` (terms, guards, argmin and score rows in one Rust call) and ``choice.score_rows``.

This bench used to run the pure-Python specification beside the core and print their ratio.
That comparison is gone: the specification is now the differential oracle in
``tests/oracles/scoring.py`` (``tests/unit/test_native_decide.py`` holds the two bit-identical),
no production path runs it, and benchmarks do not import the tests. The last ratios measured are
in git history (``git log -p benchmarks/router_scoring.py``).

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


def _core(request, ordered, config, overlaps, mine) -> None:
    t = decision._score(request, ordered, config, overlaps, mine)
    decision._rows(t, t.cost, None)


def run(samples: int = SAMPLES) -> dict:
    rng = random.Random(20260501)
    config = RouterConfig()
    out = {}
    for n_workers, prompt_tokens in SCENARIOS:
        request, workers, overlaps, ledger = _scenario(rng, n_workers, prompt_tokens)
        whole: list[float] = []
        for seed in range(samples):
            t0 = time.perf_counter_ns()
            decide(request, workers, config, rng_seed=seed, overlaps=overlaps, inflight=ledger)
            whole.append((time.perf_counter_ns() - t0) / 1000.0)
        view = ledger.view(request.block_hashes)
        ordered = sorted(workers, key=lambda w: w.worker_id)
        core: list[float] = []
        for _ in range(samples):
            t0 = time.perf_counter_ns()
            _core(request, ordered, config, overlaps, view)
            core.append((time.perf_counter_ns() - t0) / 1000.0)
        a, b = sorted(whole), sorted(core)
        out[f"{n_workers}w/{prompt_tokens}tok"] = {
            "decide_p50_us": _percentile(a, 0.5), "decide_p99_us": _percentile(a, 0.99),
            "core_p50_us": _percentile(b, 0.5), "core_p99_us": _percentile(b, 0.99)}
    return out


def main() -> None:
    results = run()
    print(f"{'scenario':<20}{'decide p50':>12}{'p99 us':>10}{'core p50':>12}{'p99 us':>10}")
    for name, r in results.items():
        print(f"{name:<20}{r['decide_p50_us']:>12.1f}{r['decide_p99_us']:>10.1f}"
              f"{r['core_p50_us']:>12.1f}{r['core_p99_us']:>10.1f}")
    a, b = results["256w/32768tok"], results["64w/32768tok"]
    print(f"RESULT core_p50_us_256w={a['core_p50_us']:.1f} decide_p50_us_256w={a['decide_p50_us']:.1f} "
          f"decide_p50_us_64w={b['decide_p50_us']:.1f}")


if __name__ == "__main__":
    main()
