"""Simulated engine benchmark: our engine (``mocker`` profile) against Dynamo's mocker.

Dynamo's side is ``dynamo._core.run_mocker_trace_replay`` from PyPI ``ai-dynamo-runtime``
(benchmark-only dependency: ``uv sync --group bench``), offline mode. Both sides replay the same
Mooncake trace on 4 aggregated workers, round robin, arrival speed 1x, trace block size 512
(each hash id = 8 engine blocks of 64), with the mocker's defaults (16,384 blocks, 256
sequences, 8,192 batched tokens, chunked prefill, prefix caching). Ours runs
:func:`data_plane.engines.simulate` (``engine_only.py``) with the ``mocker`` profile and requests from
:class:`data_plane.engines.trace.MooncakeTrace`.

Printed side by side: TTFT p50/p99, ITL p50 (over all inter-token intervals), output tokens/s
(output tokens / (last token - first arrival)), prefix reuse ratio (prompt tokens served from
the prefix cache at first admission / prompt tokens), and wall time. Each side runs ``--runs``
times (3), interleaved (mocker, ours, mocker, ours, ...), so a machine whose load changes during
the benchmark weighs on both; a side's wall time is the median of its runs, printed with their
spread (the anchor's included). Our wall time counts loading and hashing the trace, not the
imports. Last line::

    RESULT ttft_p50_ratio=<ours/dynamo> throughput_ratio=<ours/dynamo> reuse_ours=... reuse_dynamo=... wall_ratio=<ours/dynamo median>

Run: ``uv run --group bench python benchmarks/engine_bench.py [--limit N] [--trace PATH]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ops.demo.up import WHOLE_TRACE
from data_plane.engines import default_hash_config, load_profile, simulate
from data_plane.engines.trace import MooncakeTrace, read_mooncake

DEFAULT_TRACE = WHOLE_TRACE
NUM_WORKERS = 4
TRACE_BLOCK_SIZE = 512


def run_ours(trace: Path, limit: int | None) -> dict[str, Any]:
    prof = load_profile("mocker")
    t0 = time.perf_counter()
    records = read_mooncake(trace, limit)
    trace_adapter = MooncakeTrace(default_hash_config(prof.block_size), trace_block_size=TRACE_BLOCK_SIZE)
    requests = list(trace_adapter.requests(records))
    t1 = time.perf_counter()
    res = simulate(requests, prof, num_workers=NUM_WORKERS)
    t2 = time.perf_counter()
    s = res.summary()
    return {
        "ttft_p50_ms": s["ttft_p50_ms"],
        "ttft_p99_ms": s["ttft_p99_ms"],
        "itl_p50_ms": s["itl_p50_ms"],
        "output_tok_s": s["output_tok_s"],
        "reuse": s["prefix_reuse_ratio"],
        "requests": s["completed"],
        "duration_s": s["duration_ms"] / 1e3,
        "wall_s": t2 - t0,
        "wall_detail": f"load+hash {t1 - t0:.1f}s, simulate {t2 - t1:.1f}s ({s['steps']:,} steps)",
    }


def replay_dynamo_mocker(trace: Path, limit: int | None, hint: str, *, per_request: bool = False,
                         **kwargs: Any) -> tuple[dict, float]:
    """Run Dynamo's mocker offline replay on ``trace`` (its first ``limit`` lines); returns its
    summary dict and the wall time. Shared by the engine and routing benchmarks. With
    ``per_request`` the summary also holds the replay's record of every request under
    ``"per_request"`` (arrival, first admission, first token, input length, reused tokens,
    worker, ...: Dynamo's ``capture_per_request``)."""
    os.environ.setdefault("DYN_LOG", "warn")  # else the replay logs every decision
    try:
        from dynamo._core import run_mocker_trace_replay
    except ImportError as e:
        raise SystemExit(f"Dynamo's mocker is not installed ({e}); run `{hint}`") from e
    with tempfile.TemporaryDirectory() as tmp:
        path = trace
        if limit is not None:
            path = Path(tmp) / "trace.jsonl"
            with open(trace) as src, open(path, "w") as dst:
                for i, line in enumerate(src):
                    if i >= limit:
                        break
                    dst.write(line)
        t0 = time.perf_counter()
        r = run_mocker_trace_replay([str(path)], arrival_speedup_ratio=1.0, trace_block_size=TRACE_BLOCK_SIZE,
                                    replay_mode="offline", capture_per_request=per_request, **kwargs)
        wall = time.perf_counter() - t0
        summary = dict(r.summary)
        if per_request:
            summary["per_request"] = r.per_request
        return summary, wall


def run_dynamo(trace: Path, limit: int | None) -> dict[str, Any]:
    s, wall = replay_dynamo_mocker(trace, limit, "uv run --group bench python benchmarks/engine_bench.py",
                                   num_workers=NUM_WORKERS, router_mode="round_robin")
    return {
        "ttft_p50_ms": s["median_ttft_ms"],
        "ttft_p99_ms": s["p99_ttft_ms"],
        "itl_p50_ms": s["median_itl_ms"],
        "output_tok_s": s["output_throughput_tok_s"],
        "reuse": s["prefix_cache_reused_ratio"],
        "requests": s["completed_requests"],
        "duration_s": s["duration_ms"] / 1e3,
        "wall_s": wall,
        "wall_detail": "Rust, native",
    }


def _median_run(runs: list[dict[str, Any]], side: str) -> tuple[dict[str, Any], list[float]]:
    """The first run's numbers with the median wall time; every run must agree on the results
    (both simulators are deterministic)."""
    walls = sorted(r["wall_s"] for r in runs)
    out = dict(runs[0])
    for r in runs[1:]:
        if any(r[k] != out[k] for k in ("ttft_p50_ms", "ttft_p99_ms", "output_tok_s", "reuse", "requests")):
            raise SystemExit(f"{side} gave different results from one run to the next")
    out["wall_s"] = statistics.median(walls)
    return out, walls


def _spread(walls: list[float]) -> str:
    med = statistics.median(walls)
    return (
        f"median of {len(walls)} runs: {', '.join(f'{w:.2f}' for w in walls)} s "
        f"(spread {walls[-1] - walls[0]:.2f} s, {100 * (walls[-1] - walls[0]) / med:.0f}%)"
    )


#: How the simulation benches print a metric of a run's summary: key -> (label, format).
METRIC_ROWS: dict[str, tuple[str, str]] = {
    "ttft_p50_ms": ("TTFT p50 (ms)", "{:.1f}"),
    "ttft_p99_ms": ("TTFT p99 (ms)", "{:.1f}"),
    "ttft_mean_ms": ("TTFT mean (ms)", "{:.1f}"),
    "ttft_p90_ms": ("TTFT p90 (ms)", "{:.1f}"),
    "itl_p50_ms": ("ITL p50 (ms)", "{:.3f}"),
    "itl_p99_ms": ("ITL p99 (ms)", "{:.2f}"),
    "e2e_p99_ms": ("e2e p99 (ms)", "{:.0f}"),
    "output_tok_s": ("output tok/s", "{:.1f}"),
    "reuse": ("prefix reuse", "{:.5f}"),
    "requests": ("requests done", "{}"),
    "duration_s": ("simulated s", "{:.1f}"),
    "wall_s": ("wall s", "{:.1f}"),
}


def metric_rows(*keys: str) -> list[tuple[str, str, str]]:
    """(label, key, format) of each of ``keys``, in that order: one bench's table rows."""
    return [(METRIC_ROWS[k][0], k, METRIC_ROWS[k][1]) for k in keys]


def main(trace: str | Path = DEFAULT_TRACE, limit: int | None = None, runs: int = 3) -> dict[str, Any]:
    trace = Path(trace)
    # Interleaved (mocker, ours, mocker, ours, ...): a machine whose load changes during the
    # benchmark weighs on both sides alike, and each side's median drops a passing spike.
    dyn_runs, our_runs = [], []
    for _ in range(runs):
        dyn_runs.append(run_dynamo(trace, limit))
        our_runs.append(run_ours(trace, limit))
    dyn, dyn_walls = _median_run(dyn_runs, "Dynamo's mocker")
    ours, our_walls = _median_run(our_runs, "our engine")
    dyn["wall_detail"] = _spread(dyn_walls)
    ours["wall_detail"] = f"{_spread(our_walls)}; fastest run: {min(our_runs, key=lambda r: r['wall_s'])['wall_detail']}"
    rows = metric_rows("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "output_tok_s", "reuse", "requests",
                       "duration_s", "wall_s")
    scope = f"first {limit} lines of" if limit else "all of"
    print(
        f"Engine simulation, {scope} {trace.name}: "
        f"{NUM_WORKERS} aggregated workers, round robin, 1x arrivals"
    )
    print(f"{'metric':<16}{'switchyard':>14}{'dynamo mocker':>16}{'ratio':>9}")
    for label, key, fmt in rows:
        a, b = ours[key], dyn[key]
        ratio = f"{a / b:.4f}" if b else "-"
        print(f"{label:<16}{fmt.format(a):>14}{fmt.format(b):>16}{ratio:>9}")
    print(f"ours: {ours['wall_detail']}")
    print(f"dynamo mocker: {dyn['wall_detail']}")
    out = {
        "ours": ours,
        "dynamo": dyn,
        "ttft_p50_ratio": ours["ttft_p50_ms"] / dyn["ttft_p50_ms"],
        "throughput_ratio": ours["output_tok_s"] / dyn["output_tok_s"],
        "wall_ratio": ours["wall_s"] / dyn["wall_s"],
        "dynamo_walls": dyn_walls,
        "our_walls": our_walls,
    }
    print(
        f"RESULT ttft_p50_ratio={out['ttft_p50_ratio']:.4f} throughput_ratio={out['throughput_ratio']:.4f} "
        f"reuse_ours={ours['reuse']:.4f} reuse_dynamo={dyn['reuse']:.4f} wall_ratio={out['wall_ratio']:.4f}"
    )
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--limit", type=int, default=None, help="replay only the first N trace lines")
    p.add_argument("--runs", type=int, default=3, help="runs of each side, interleaved (median wall time)")
    a = p.parse_args()
    if a.runs < 1:
        p.error("--runs must be at least 1")
    main(a.trace, a.limit, a.runs)
