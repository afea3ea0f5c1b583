"""Native against reference kv scoring, interleaved in one process (``decide(..., native=...)``).

The scenarios of :mod:`benchmarks.router_decide` (64 and 256 workers, 4K and 32K prompts, ~2
in-flight requests per worker). Each sample runs the same decision once with the Rust scorer
and once with the Python specification, alternating which goes first, so a load change on a
shared box hits both sides alike; then the scoring step alone (``_score_native`` against
``_score``, no ledger view, choice, rows or reason). The two give identical decisions
(``tests/unit/test_native_decide.py``); this measures only what the native loop saves.

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


def run(samples: int = SAMPLES) -> dict:
    rng = random.Random(20260501)
    config = RouterConfig()
    out = {}
    for n_workers, prompt_tokens in SCENARIOS:
        request, workers, overlaps, ledger = _scenario(rng, n_workers, prompt_tokens)
        whole: dict[bool, list[float]] = {True: [], False: []}
        for seed in range(samples):
            for native in ((True, False) if seed % 2 else (False, True)):
                t0 = time.perf_counter_ns()
                decide(request, workers, config, rng_seed=seed, overlaps=overlaps, inflight=ledger,
                       native=native)
                whole[native].append((time.perf_counter_ns() - t0) / 1000.0)
        mine = ledger.view(request.block_hashes)
        ordered = sorted(workers, key=lambda w: w.worker_id)
        scoring: dict[bool, list[float]] = {True: [], False: []}
        for seed in range(samples):
            for native in ((True, False) if seed % 2 else (False, True)):
                score = decision._score_native if native else decision._score
                t0 = time.perf_counter_ns()
                score(request, ordered, config, overlaps, mine)
                scoring[native].append((time.perf_counter_ns() - t0) / 1000.0)
        for native in (False, True):
            a, b = sorted(whole[native]), sorted(scoring[native])
            out[f"{n_workers}w/{prompt_tokens}tok/{'native' if native else 'reference'}"] = {
                "decide_p50_us": _percentile(a, 0.5), "decide_p99_us": _percentile(a, 0.99),
                "score_p50_us": _percentile(b, 0.5), "score_p99_us": _percentile(b, 0.99)}
    return out


def main() -> None:
    results = run()
    print(f"{'scenario':<30}{'decide p50':>12}{'p99 us':>10}{'score p50':>12}{'p99 us':>10}")
    for name, r in results.items():
        print(f"{name:<30}{r['decide_p50_us']:>12.1f}{r['decide_p99_us']:>10.1f}"
              f"{r['score_p50_us']:>12.1f}{r['score_p99_us']:>10.1f}")
    a, b = results["256w/32768tok/reference"], results["256w/32768tok/native"]
    print(f"RESULT score_p50_ratio_256w={a['score_p50_us'] / b['score_p50_us']:.2f} "
          f"decide_p50_ratio_256w={a['decide_p50_us'] / b['decide_p50_us']:.2f}")


if __name__ == "__main__":
    main()
