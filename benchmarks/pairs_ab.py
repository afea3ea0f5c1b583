"""P/D pairs against separate decisions, in virtual time (issue 39 item 5; ``RouterConfig.pd_pairs``).

The same generated cases (``workloads.sets``; the tune set by default) on 4 prefill + 4 decode
simulated workers (``benchmarks/routing_bench.py``'s simulation, mocker profile), our kv router
at one ``prefill_load_scale`` and one cost, once with the decode worker chosen at the hand-off
(``pd_pairs`` off, the default) and once chosen with the prefill worker (on). Virtual time is
deterministic: the box's load does not change the figures. Prints each case's TTFT mean and p99
and ITL p99 for both, then::

    RESULT cases=N ttft_mean_ratio=<mean over cases of pairs / separate> ttft_p99_ratio=...
           worst_case=<family:seed> worst_ttft_p99_ratio=... itl_p99_ratio=...

(< 1: pairs are faster). Run: ``uv run --group bench python -m benchmarks.pairs_ab [--cases
agentic:1,...] [--scale 5] [--cost blocks|ttft] [--itl-slo-ms 0] [--rate-scale 2] [--duration-s 120] [--jobs 2]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import msgspec

from benchmarks import tune_score
from benchmarks.routing_bench import DEFAULT_LOAD_REPORT_MS, DISAGGREGATED_4P4D, pool_map, run_ours
from control_plane.router import RouterConfig
from data_plane.engines import load_profile
from workloads.sets import TUNE_SET, parse_cases


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(map(str, TUNE_SET)))
    p.add_argument("--scale", type=float, default=RouterConfig().prefill_load_scale, help="prefill_load_scale")
    p.add_argument("--cost", choices=["blocks", "ttft"], default="blocks")
    p.add_argument("--itl-slo-ms", type=float, default=0.0)
    p.add_argument("--rate-scale", type=float, default=tune_score.CASE_RATE_SCALE)
    p.add_argument("--duration-s", type=float, default=tune_score.CASE_DURATION_S, help="seconds of arrivals a case")
    p.add_argument("--jobs", type=int, default=2)
    a = p.parse_args()
    cases = parse_cases(a.cases)
    prof = load_profile("mocker")
    base = RouterConfig(prefill_load_scale=a.scale, cost=a.cost, itl_slo_ms=a.itl_slo_ms)
    configs = {"separate": base, "pairs": msgspec.structs.replace(base, pd_pairs=True)}
    with tempfile.TemporaryDirectory(prefix="switchyard-pairs-") as tmp:
        _, requests = tune_score.load_cases(cases, Path(tmp), prof.block_size, rate_scale=a.rate_scale,
                                            duration_s=a.duration_s)
        jobs = [(c, name) for c in cases for name in configs]
        out = dict(zip(jobs, pool_map(
            lambda j: run_ours(requests[j[0]], DISAGGREGATED_4P4D, configs[j[1]], profile=prof,
                               load_report_ms=DEFAULT_LOAD_REPORT_MS), jobs, a.jobs)))
    print(f"4P+4D, kv cost {a.cost} at prefill_load_scale {a.scale:g}, itl_slo_ms {a.itl_slo_ms:g}, "
          f"rate x{a.rate_scale:g}, {a.duration_s:g} s a case; separate -> pairs")
    ratios = {}
    for c in cases:
        s, q = out[(c, "separate")], out[(c, "pairs")]
        ratios[c] = {k: q[k] / s[k] for k in ("ttft_mean_ms", "ttft_p99_ms", "itl_p99_ms")}
        print(f"{str(c):<16} ttft mean {s['ttft_mean_ms']:8.1f} -> {q['ttft_mean_ms']:8.1f}  "
              f"p99 {s['ttft_p99_ms']:8.1f} -> {q['ttft_p99_ms']:8.1f}  itl p99 {s['itl_p99_ms']:6.2f} -> "
              f"{q['itl_p99_ms']:6.2f}")
    worst = max(cases, key=lambda c: ratios[c]["ttft_p99_ms"])
    print(f"RESULT cases={len(cases)} "
          f"ttft_mean_ratio={statistics.fmean(r['ttft_mean_ms'] for r in ratios.values()):.4f} "
          f"ttft_p99_ratio={statistics.fmean(r['ttft_p99_ms'] for r in ratios.values()):.4f} "
          f"worst_case={worst} worst_ttft_p99_ratio={ratios[worst]['ttft_p99_ms']:.4f} "
          f"itl_p99_ratio={statistics.fmean(r['itl_p99_ms'] for r in ratios.values()):.4f}")


if __name__ == "__main__":
    main()
