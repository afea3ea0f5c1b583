"""Routing benchmark: Switchyard's routing decision against Dynamo's KV router, in virtual time.

The whole Mooncake trace replays, at 1x arrivals, on simulated workers (our
:class:`~data_plane.engines.EngineCore` with the ``mocker`` profile, which reproduces Dynamo's
mocker step for step: see ``benchmarks/engine_bench.py``). Every request is placed by
:func:`control_plane.router.decide`, fed the way the live router (``control_plane/router/
core.py``) feeds it:

* **overlaps** from a :class:`~control_plane.index.native.NativePrefixIndex` folded from the
  simulated engines' own KV events (``BlockStored`` / ``BlockRemoved``, sequenced per worker).
  An engine queues a step's events while it plans the step and they are published when the step
  *ends* (``t + duration``), so the index lags the engines by up to one step (10-200 ms here),
  plus ``kv_event_lag_ms`` of transport if asked for;
* **loads** from ``WorkerLoadReported``-style snapshots of ``EngineCore.stats()`` taken every
  ``load_report_ms`` of virtual time per worker (staggered), like a live worker's
  ``load_interval_s`` timer (default 1 s);
* the router's **in-flight ledger** (:class:`~control_plane.router.InflightLedger`) with its
  speculative overlap: ``add`` at the decision, ``prefill_done`` at the first token,
  ``complete`` at the last one (disaggregated: ``complete`` on the prefill worker at the
  hand-off, then a decode decision and its own entry), exactly the calls the live router makes.

Topologies: 8 aggregated workers, and 4 prefill + 4 decode workers (disaggregated: the prefill
phase is routed KV-aware to the prefill workers; when its prompt KV is computed the router
routes the decode phase to the decode workers, whose engines treat the prompt as transferred and
generate every output token, as in Dynamo's mocker and vLLM's NIXL connector). The KV transfer
is **free and instant** (as in Dynamo's mocker without a bandwidth): the decode request arrives
at the prefill step's end and the prefill worker frees its held blocks at that moment.

Both sides get the same tuning budget. Ours runs ``round_robin`` and ``kv`` at its default
config and at every point of :data:`GRID` (``prefill_load_scale``); Dynamo's mocker
(``dynamo._core.run_mocker_trace_replay``, PyPI ``ai-dynamo-runtime``, ``--group bench``) runs
``round_robin`` and ``kv_router`` at its default ``KvRouterConfig`` and at every point of the same
grid of its own ``prefill_load_scale`` (its analogue of ours), on the same topology and trace in the
same invocation. Ours is deterministic and runs once per config; Dynamo's offline replay is not
(its p99 moves by up to ~150 ms run to run), so every Dynamo config runs :data:`DYNAMO_RUNS`
times and its median is reported with the spread. Each side's grid point is picked on the
**tune set** (generated workloads, ``workloads.sets.TUNE_SET``: every family, seed 1), not on the
trace: the lowest mean over the tune cases of TTFT mean relative to the case's best point (p50
sits on one prefill step for every KV router, see below). The picks are scored on the **score
set** (every family, seed 2: each case and the worst) and on the trace, whose "best" columns are
the picks (``--tune '' --score ''``: picked on the trace itself, as before; the in-sample best is
printed beside the picks either way).
Metrics, like ``engine_bench.py``: TTFT p50/p99/mean/p90 (first token seen by the client;
disaggregated: the decode worker's first token, Dynamo's definition), ITL p50/p99 over all
inter-token intervals, e2e p99, output tokens/s (output tokens / (last token - first arrival)),
prefix reuse (prompt tokens served from the prefix cache at first admission / prompt tokens;
disaggregated: on the prefill worker). The last line compares the gains on 8 aggregated
workers (ours: the ``kv`` run)::

    RESULT ttft_p50_gain_ours=<rr/best kv p50> ttft_p50_gain_dynamo=<rr/default kv_router p50>
           ttft_p99_gain_ours=... ttft_p99_gain_dynamo=... reuse_ours=... reuse_dynamo=...
           ttft_p50_gain_ours_default=... ttft_p50_gain_dynamo_best=... dynamo_runs=3
           rate_scale=2 score_cases=5 worst_case=<family:seed> worst_<figure>=... (the worst score case's)

Same workload, same percentile on both sides. Per request the two engines give the same TTFTs
(round robin on every score case; ``tests/unit/test_routing_bench.py``), once (1) Dynamo's TTFT and
e2e percentiles are recomputed from its per-request records with ours (its replay reports the
nearest rank: on long-context:2, 257 requests, that alone made round robin's p99 2,123 ms
against our 2,528 for the same TTFTs) and (2) the case files it reads carry no sessions (its
replay sends a session's later turns a delay after the previous one *completes*; ours, and the
generated timestamps, are open loop). Per score case: each side's round robin and tuned kv p99,
its gains (rr / kv), ``ttft_p99_edge`` (Dynamo's kv p99 / ours), ``ttft_p99_gain_edge`` and
``ttft_p50_gain_edge`` (our gain / Dynamo's gain, each side against its own round robin on its
own engine: the figure that stays fair if the engines ever differ; the worst case is picked by
it), Dynamo's own reported p99 and the spread of its runs, and ``bound_p99_gain``: Dynamo's kv
p99 over the p99 with every request alone on an idle worker and one infinite cache shared by
all (``benchmarks/ttft_bound.py``), the most any router could gain over it on that case.
``--rate-scale`` sets the cases' load (x each family's default rate; 2 by default); several
(``2,1.5,1``) are each tuned and scored, and the RESULT line adds ``rate_scales=...
ttft_p50_gain_vs_best_peer=... ttft_p99_gain_vs_best_peer=...`` (the worst case's gain edges over
the loads >= 1.5x) ``ttft_gain_at_1x_min=...`` (the lowest of both at 1x).

Reading TTFT p50 here: arrivals come in bursts (~10 requests at one millisecond every 3 s) and a
full 8,192-token chunked-prefill step lasts exactly 169.137 ms, so the median of every KV router
(ours, Dynamo's) sits on that step; mean and p90 show the differences p50 cannot.

Run: ``uv run --group bench python benchmarks/routing_bench.py [--limit N] [--jobs N]
[--load-report-ms MS] [--no-dynamo] [--tune family:seed,...] [--score family:seed,...] [--rate-scale X[,Y...]]``. Our six simulations run in two
forked processes on a 2-core box (results are identical to ``--jobs 1``: the simulation is
deterministic); a full run takes about 3 minutes.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from benchmarks import tune_score
from benchmarks.engine_bench import metric_rows, replay_dynamo_mocker
from benchmarks.ttft_bound import bound_ttft_ms
from ops.demo.up import WHOLE_TRACE
from control_plane.router import RouterConfig
from control_plane.simulation import (  # noqa: F401 - re-exported for the tests and callers
    AGGREGATED_8,
    DEFAULT_LOAD_REPORT_MS,
    DISAGGREGATED_4P4D,
    TOPOLOGIES,
    Topology,
    run_cluster,
)
from data_plane.engines import EngineRequest, default_hash_config, load_profile
from data_plane.engines.profiles import HardwareProfile
from data_plane.engines.records import percentile
from data_plane.engines.trace import MooncakeTrace, read_mooncake
from schemas.types import RoutingMode
from workloads.sets import SCORE_SET, TUNE_SET, Case, parse_cases

DEFAULT_TRACE = WHOLE_TRACE
TRACE_BLOCK_SIZE = 512

# ----------------------------------------------------------------------------------------------
# The two sides
# ----------------------------------------------------------------------------------------------


def load_requests(trace: Path, limit: int | None, profile: HardwareProfile) -> list[EngineRequest]:
    records = read_mooncake(trace, limit)
    adapter = MooncakeTrace(default_hash_config(profile.block_size), trace_block_size=TRACE_BLOCK_SIZE)
    return list(adapter.requests(records))


def run_ours(requests: Sequence[EngineRequest], topology: Topology, config: RouterConfig,
             **cluster: Any) -> dict[str, Any]:
    """:func:`run_cluster`'s summary with its wall time; ``cluster`` are run_cluster's keyword
    arguments (profile, load_report_ms, kv_event_lag_ms, ...), so the two cannot drift apart."""
    t0 = time.perf_counter()
    res = run_cluster(requests, topology, config, **cluster)
    out = res.summary()
    out["wall_s"] = time.perf_counter() - t0
    return out


def run_dynamo(trace: Path, limit: int | None, topology: Topology, mode: str,
               overrides: dict[str, float] | None = None, *, engine_args: dict[str, Any] | None = None,
               per_request: bool = False) -> dict[str, Any]:
    """One replay of Dynamo's mocker; ``overrides``: ``KvRouterConfig`` fields (its default when
    None); ``engine_args``: the mocker's engine arguments (aggregated workers), e.g.
    ``{"num_gpu_blocks": ...}``; ``per_request``: keep its per-request records
    (``"per_request"``).

    TTFT and e2e percentiles are recomputed from the replay's per-request records with ours
    (:func:`~data_plane.engines.records.percentile`, linear between closest ranks): the replay
    reports the nearest rank, which on a few hundred requests with a heavy tail moves a p99 by
    ~20% with no change in any request (``ttft_p99_ms_reported`` keeps its own figure). ITL
    stays the replay's own: its records hold only each request's mean ITL."""
    extra: dict[str, Any] = {}
    os.environ.setdefault("DYN_LOG", "warn")  # before dynamo's first import, or it logs every decision
    if overrides is not None:
        from dynamo._core import KvRouterConfig

        extra["router_config"] = KvRouterConfig(**overrides)
    if engine_args is not None:
        extra["extra_engine_args"] = {"engine": dict(engine_args)}
    s, wall = replay_dynamo_mocker(trace, limit, "uv run --group bench python benchmarks/routing_bench.py",
                                   per_request=True, router_mode=mode, **topology.dynamo_kwargs(), **extra)
    done = [r for r in s["per_request"] if r["terminal_status"] == "completed" and r["ttft_ms"] is not None]
    ttft = [r["ttft_ms"] for r in done]
    e2e = [r["e2e_latency_ms"] for r in done]
    out = {
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "ttft_mean_ms": s["mean_ttft_ms"],
        "ttft_p90_ms": percentile(ttft, 90),
        "ttft_p99_ms_reported": s["p99_ttft_ms"],
        "itl_p50_ms": s["median_itl_ms"],
        "itl_p99_ms": s["p99_itl_ms"],
        "e2e_p50_ms": percentile(e2e, 50),
        "e2e_p99_ms": percentile(e2e, 99),
        "output_tok_s": s["output_throughput_tok_s"],
        "reuse": s["prefix_cache_reused_ratio"],
        "requests": s["completed_requests"],
        "duration_s": s["duration_ms"] / 1e3,
        "wall_s": wall,
    }
    if per_request:
        out["per_request"] = s["per_request"]
    return out


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------

#: The tuning grid both sides get: ``prefill_load_scale`` (ours: ``RouterConfig``; Dynamo's:
#: ``KvRouterConfig``), the weight of the prefill term against the decode term. Each side's
#: default is one of the points (ours 5, Dynamo's 1).
GRID = (1.0, 2.5, 5.0, 10.0)
#: Runs of every Dynamo config (its replay is not deterministic; ours is).
DYNAMO_RUNS = 3
_METRICS = ("ttft_p50_ms", "ttft_p99_ms", "ttft_mean_ms", "ttft_p90_ms", "ttft_p99_ms_reported", "itl_p50_ms",
            "itl_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "output_tok_s", "reuse", "requests", "duration_s", "wall_s")


def _variants(default: RouterConfig) -> list[tuple[str, RouterConfig]]:
    """Our configs per topology: round robin, kv at the default, kv at every grid point."""
    out = [("round_robin", msgspec.structs.replace(default, mode=RoutingMode.ROUND_ROBIN)),
           ("kv", msgspec.structs.replace(default, mode=RoutingMode.KV))]
    out += [(f"kv@{g:g}", msgspec.structs.replace(default, mode=RoutingMode.KV, prefill_load_scale=g)) for g in GRID]
    return out


def _dynamo_variants() -> list[tuple[str, str, dict[str, float] | None]]:
    """Dynamo's configs: (name, router mode, KvRouterConfig overrides or None for its default)."""
    return ([("round_robin", "round_robin", None), ("kv_router", "kv_router", None)]
            + [(f"kv_router@{g:g}", "kv_router", {"prefill_load_scale": g}) for g in GRID])


def run_dynamo_median(trace: Path, limit: int | None, topology: Topology, mode: str,
                      overrides: dict[str, float] | None, runs: int = DYNAMO_RUNS, *,
                      engine_args: dict[str, Any] | None = None, per_request: bool = False) -> dict[str, Any]:
    """The median of ``runs`` replays, metric by metric, with each metric's (min, max)
    (``engine_args``, ``per_request``: see :func:`run_dynamo`; the per-request records are the
    run whose TTFT p50 is the median's)."""
    samples = [run_dynamo(trace, limit, topology, mode, overrides, engine_args=engine_args,
                          per_request=per_request) for _ in range(runs)]
    out: dict[str, Any] = {k: statistics.median(s[k] for s in samples) for k in _METRICS}
    out["requests"] = int(out["requests"])
    out["spread"] = {k: (min(s[k] for s in samples), max(s[k] for s in samples)) for k in _METRICS}
    out["runs"] = runs
    if per_request:
        out["per_request"] = sorted(samples, key=lambda s: s["ttft_p50_ms"])[len(samples) // 2]["per_request"]
    return out


def _best(side: dict[str, dict[str, Any]], prefix: str) -> str:
    """The grid point with the lowest TTFT mean."""
    return min((k for k in side if k.startswith(prefix + "@")), key=lambda k: side[k]["ttft_mean_ms"])


#: Set before forking workers (``--jobs``): children inherit the loaded requests copy-on-write.
_FORK_STATE: dict[str, Any] = {}


def _call_forked(i: int) -> Any:
    return _FORK_STATE["fn"](_FORK_STATE["items"][i])


def pool_map(fn: Callable[[Any], Any], items: Sequence[Any], jobs: int) -> list[Any]:
    """``[fn(x) for x in items]``, in ``jobs`` forked processes when more than one (they inherit
    ``fn``'s closure, loaded requests included, copy-on-write)."""
    if jobs <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    import multiprocessing as mp

    _FORK_STATE.update(fn=fn, items=list(items))
    try:
        with mp.get_context("fork").Pool(min(jobs, len(items))) as pool:
            return pool.map(_call_forked, range(len(items)), chunksize=1)
    finally:
        _FORK_STATE.clear()


def tune_and_score(tune: Sequence[Case], score: Sequence[Case], topology: Topology, default: RouterConfig, *,
                   dynamo: bool, dynamo_runs: int, jobs: int, cluster: dict[str, Any],
                   duration_s: float = tune_score.CASE_DURATION_S, rate_scale: float = tune_score.CASE_RATE_SCALE,
                   echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Both sides' ``prefill_load_scale`` picked over :data:`GRID` on the tune cases (lowest TTFT
    mean relative to each case's best), then each side's pick and its round robin scored on the
    score cases. Returns ``{"tuned": {"ours": g, "dynamo": g}, "scores": {case: figures},
    "summary": ScoreSummary}``."""
    tune, score = tune_score.checked(tune, score)
    prof = cluster["profile"]
    with tempfile.TemporaryDirectory(prefix="switchyard-tune-") as tmp:
        traces, requests = tune_score.load_cases((*tune, *score), Path(tmp), prof.block_size, duration_s=duration_s,
                                                 rate_scale=rate_scale)
        kv_at = {g: msgspec.structs.replace(default, mode=RoutingMode.KV, prefill_load_scale=g) for g in GRID}
        rr = msgspec.structs.replace(default, mode=RoutingMode.ROUND_ROBIN)

        def ours(job: tuple[Case, RouterConfig]) -> dict[str, Any]:
            return run_ours(requests[job[0]], topology, job[1], **cluster)

        def dyn(case: Case, mode: str, g: float | None) -> dict[str, Any]:
            return run_dynamo_median(traces[case].path, None, topology, mode,
                                     None if g is None else {"prefill_load_scale": g}, dynamo_runs)

        t0 = time.perf_counter()
        jobs_t = [(c, kv_at[g]) for c in tune for g in GRID]
        out_t = dict(zip(jobs_t, pool_map(ours, jobs_t, jobs)))
        tuned = {"ours": tune_score.pick({c: {g: out_t[(c, kv_at[g])] for g in GRID} for c in tune}, "ttft_mean_ms")}
        if dynamo:
            tuned["dynamo"] = tune_score.pick({c: {g: dyn(c, "kv_router", g) for g in GRID} for c in tune},
                                              "ttft_mean_ms")
        jobs_s = [(c, cfg) for c in score for cfg in (rr, kv_at[tuned["ours"].point])]
        out_s = dict(zip(jobs_s, pool_map(ours, jobs_s, jobs)))
        scores: dict[Case, dict[str, float]] = {}
        for c in score:
            o_rr, o_kv = out_s[(c, rr)], out_s[(c, kv_at[tuned["ours"].point])]
            bound = bound_ttft_ms(requests[c], prof, 99)
            f = {"ttft_p50_gain_ours": o_rr["ttft_p50_ms"] / o_kv["ttft_p50_ms"],
                 "ttft_p99_gain_ours": o_rr["ttft_p99_ms"] / o_kv["ttft_p99_ms"],
                 "reuse_ours": o_kv["reuse"], "ttft_p99_ms_ours": o_kv["ttft_p99_ms"],
                 "ttft_p99_ms_rr_ours": o_rr["ttft_p99_ms"], "ttft_p99_bound_ms": bound,
                 "bound_p99_gain": o_kv["ttft_p99_ms"] / bound}
            if dynamo:
                d_rr, d_kv = dyn(c, "round_robin", None), dyn(c, "kv_router", tuned["dynamo"].point)
                f.update(ttft_p50_gain_dynamo=d_rr["ttft_p50_ms"] / d_kv["ttft_p50_ms"],
                         ttft_p99_gain_dynamo=d_rr["ttft_p99_ms"] / d_kv["ttft_p99_ms"],
                         reuse_dynamo=d_kv["reuse"], ttft_p99_ms_dynamo=d_kv["ttft_p99_ms"],
                         ttft_p99_ms_rr_dynamo=d_rr["ttft_p99_ms"],
                         # Its replay is not deterministic: the lowest and highest p99 of its runs.
                         ttft_p99_ms_dynamo_lo=d_kv["spread"]["ttft_p99_ms"][0],
                         ttft_p99_ms_dynamo_hi=d_kv["spread"]["ttft_p99_ms"][1],
                         ttft_p99_ms_dynamo_reported=d_kv["ttft_p99_ms_reported"],
                         # > 1: our p99 is below Dynamo's on this case (absolute, same percentile rule).
                         ttft_p99_edge=d_kv["ttft_p99_ms"] / o_kv["ttft_p99_ms"],
                         # > 1: our kv gains more over our round robin on our engine than Dynamo's
                         # kv_router over its round robin on its mocker (fair if the engines differ).
                         ttft_p99_gain_edge=(o_rr["ttft_p99_ms"] / o_kv["ttft_p99_ms"])
                         / (d_rr["ttft_p99_ms"] / d_kv["ttft_p99_ms"]),
                         ttft_p50_gain_edge=(o_rr["ttft_p50_ms"] / o_kv["ttft_p50_ms"])
                         / (d_rr["ttft_p50_ms"] / d_kv["ttft_p50_ms"]),
                         # The most any router could gain over Dynamo's p99 on this case.
                         bound_p99_gain=d_kv["ttft_p99_ms"] / bound)
            scores[c] = f
        wall = time.perf_counter() - t0
    # Gains are round robin / the tuned kv router of the same side; the worst case is the one where
    # our gain is lowest against Dynamo's gain (ttft_p99_gain_edge), each on its own engine.
    return tune_score.report(tune, score, GRID, tuned, scores, "ttft_p99_gain_edge" if dynamo else "ttft_p99_gain_ours",
                             where=topology.name, wall_s=wall, duration_s=duration_s, rate_scale=rate_scale, echo=echo)


# ----------------------------------------------------------------------------------------------
# Sessions (issue 39 item 6): the affinity's margin and age picked on the tune set
# ----------------------------------------------------------------------------------------------

#: The families with multi-turn sessions the affinity is measured on.
SESSION_FAMILIES = ("agentic", "chat")
#: (margin ms, age bound s) points of ``RouterConfig.session_margin_ms`` / ``session_ttl_s``; the
#: tune set may also pick "off" (the affinity off: the baseline itself).
SESSION_GRID = ((0.0, 30.0), (0.0, 60.0), (0.0, 300.0), (20.0, 60.0), (50.0, 60.0), (200.0, 300.0))


def session_configs(default: RouterConfig) -> list[tuple[str, RouterConfig]]:
    """"off" (``default`` in kv mode) and the affinity at every :data:`SESSION_GRID` point."""
    base = msgspec.structs.replace(default, mode=RoutingMode.KV, session_affinity=False)
    return [("off", base)] + [(f"{m:g}ms/{ttl:g}s", msgspec.structs.replace(
        base, session_affinity=True, session_margin_ms=m, session_ttl_s=ttl)) for m, ttl in SESSION_GRID]


def session_ids(trace: tune_score.CaseTrace, requests: Sequence[EngineRequest]) -> dict[str, str]:
    """Request id -> the generated session id (the engine requests are the records in order)."""
    if len(trace.records) != len(requests):
        raise ValueError(f"{trace.case}: {len(requests)} requests for {len(trace.records)} records")
    return {q.request_id: r.session_id for q, r in zip(requests, trace.records) if r.session_id}


def sessions_bench(topologies: Sequence[Topology], default: RouterConfig, *, cluster: dict[str, Any], jobs: int,
                   families: Sequence[str] = SESSION_FAMILIES, tune_seed: int = 1, score_seed: int = 2,
                   duration_s: float = tune_score.CASE_DURATION_S, rate_scale: float = tune_score.CASE_RATE_SCALE,
                   echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Session affinity against the same router without it, per topology: the point of
    :func:`session_configs` with the lowest mean TTFT (relative to each tune case's best,
    ``tune_score.pick``) on the tune cases, then "off" and the pick on the score cases.
    Ends with ``RESULT session_...``; returns ``{"picked": {topology: name}, "scores": ...,
    "result": line}``."""
    tune = tuple(Case(f, tune_seed) for f in families)
    score = tuple(Case(f, score_seed) for f in families)
    tune, score = tune_score.checked(tune, score)
    variants = session_configs(default)
    with tempfile.TemporaryDirectory(prefix="switchyard-sessions-") as tmp:
        traces, requests = tune_score.load_cases((*tune, *score), Path(tmp), cluster["profile"].block_size,
                                                 duration_s=duration_s, rate_scale=rate_scale)
    sessions = {c: session_ids(traces[c], requests[c]) for c in traces}

    def run(job: tuple[Case, int, int]) -> dict[str, Any]:
        c, ti, vi = job
        return run_ours(requests[c], topologies[ti], variants[vi][1], sessions=sessions[c], **cluster)

    t0 = time.perf_counter()
    jobs_t = [(c, ti, vi) for ti in range(len(topologies)) for c in tune for vi in range(len(variants))]
    out_t = dict(zip(jobs_t, pool_map(run, jobs_t, jobs)))
    picked = {ti: tune_score.pick({c: {float(vi): out_t[(c, ti, vi)] for vi in range(len(variants))} for c in tune},
                                  "ttft_mean_ms") for ti in range(len(topologies))}
    jobs_s = [(c, ti, vi) for ti in range(len(topologies)) for c in score for vi in dict.fromkeys((0, int(picked[ti].point)))]
    out_s = dict(zip(jobs_s, pool_map(run, jobs_s, jobs)))
    wall = time.perf_counter() - t0
    echo(f"sessions ({', '.join(families)}; {duration_s:g} s of each at {rate_scale:g}x its default rate; "
         f"router {variants[0][1].cost} cost, prefill_load_scale {default.prefill_load_scale:g}; {wall:.0f} s): "
         f"affinity (margin ms / age bound s) picked on tune {', '.join(map(str, tune))}, "
         f"scored on {', '.join(map(str, score))}")
    scores: dict[tuple[str, Case], dict[str, float]] = {}
    for ti, t in enumerate(topologies):
        tuned = picked[ti]
        echo(f"{t.name}: TTFT mean (ms) on the tune set" + "".join(f"{str(c):>14}" for c in tune) + f"{'objective':>11}")
        for vi, (name, _) in enumerate(variants):
            echo(f"  {name:<14}" + "".join(f"{out_t[(c, ti, vi)]['ttft_mean_ms']:>14.1f}" for c in tune)
                 + f"{tuned.objective[float(vi)]:>11.4f}" + ("  <- picked" if vi == int(tuned.point) else ""))
        vi = int(tuned.point)
        echo(f"  score set: {'case':<12}{'p50 off':>9}{'p50 on':>9}{'p99 off':>9}{'p99 on':>9}{'mean off':>10}"
             f"{'mean on':>9}{'reuse off':>10}{'reuse on':>9}  affinity")
        for c in score:
            off, on = out_s[(c, ti, 0)], out_s[(c, ti, vi)]
            scores[(t.name, c)] = {"p50_gain": off["ttft_p50_ms"] / on["ttft_p50_ms"],
                                   "p99_gain": off["ttft_p99_ms"] / on["ttft_p99_ms"],
                                   "mean_gain": off["ttft_mean_ms"] / on["ttft_mean_ms"]}
            echo(f"  {'':<11}{str(c):<12}{off['ttft_p50_ms']:>9.1f}{on['ttft_p50_ms']:>9.1f}{off['ttft_p99_ms']:>9.1f}"
                 f"{on['ttft_p99_ms']:>9.1f}{off['ttft_mean_ms']:>10.1f}{on['ttft_mean_ms']:>9.1f}{off['reuse']:>10.3f}"
                 f"{on['reuse']:>9.3f}  {on['affinity'] or '-'}")
    worst = min(scores, key=lambda k: min(scores[k]["p50_gain"], scores[k]["p99_gain"]))
    w = scores[worst]
    names = {t.name: variants[int(picked[ti].point)][0] for ti, t in enumerate(topologies)}
    result = ("RESULT " + " ".join(f"session_pick_{'pd' if t.disaggregated else 'agg'}={names[t.name]}"
                                   for t in topologies)
              + f" session_p50_gain_min={min(v['p50_gain'] for v in scores.values()):.4f}"
              f" session_p99_gain_min={min(v['p99_gain'] for v in scores.values()):.4f}"
              f" session_mean_gain_min={min(v['mean_gain'] for v in scores.values()):.4f}"
              f" worst_case={worst[1]}@{'pd' if 'prefill' in worst[0] else 'agg'} worst_p50_gain={w['p50_gain']:.4f}"
              f" worst_p99_gain={w['p99_gain']:.4f} rate_scale={rate_scale:g} score_cases={len(scores)}")
    echo("gains are off / on (> 1: the affinity lowered the TTFT); worst case = lowest of its p50 and p99 gain")
    echo(result)
    return {"picked": names, "scores": scores, "result": result}


def main(
    trace: str | Path = DEFAULT_TRACE,
    limit: int | None = None,
    *,
    config: RouterConfig | None = None,
    topologies: Sequence[Topology] = TOPOLOGIES,
    dynamo: bool = True,
    jobs: int | None = None,
    load_report_ms: float | None = DEFAULT_LOAD_REPORT_MS,
    kv_event_lag_ms: float = 0.0,
    dynamo_runs: int = DYNAMO_RUNS,
    tune: Sequence[Case] | None = TUNE_SET,
    score: Sequence[Case] | None = SCORE_SET,
    case_duration_s: float = tune_score.CASE_DURATION_S,
    case_rate_scale: float | Sequence[float] = tune_score.CASE_RATE_SCALE,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run every topology x config on both sides; print the tables and the RESULT line.

    With ``tune`` and ``score`` (default: ``workloads.sets``' sets) each side's
    ``prefill_load_scale`` is first picked on the tune cases and scored on the score cases
    (:func:`tune_and_score`, on the first topology); the trace's "best" columns are then those
    picks, and the RESULT line adds ``score_cases=N worst_case=family:seed worst_<figure>=...``.
    Without them (None) the best is picked on the trace itself, as before.

    ``case_rate_scale``: the cases' load (x each family's default rate), or several: each is tuned
    and scored on its own, the first one's picks and worst case make the trace's columns and the
    ``worst_*`` fields, and the RESULT line adds the issue's figures over all of them
    (:func:`_across_loads`).

    Returns ``{"configs": {topology name: {"ours": {variant: metrics}, "dynamo": {variant:
    metrics}}}, "best": {topology name: {"ours": variant, "dynamo": variant}}, "gains": {...},
    "result": "RESULT ..."}``. ``config``: our default (the product's ``RouterConfig()`` unless
    given). ``jobs``: processes for our simulations (None: 2 on a two-core machine; the
    simulation is single-threaded and deterministic, so results do not change).
    """
    trace = Path(trace)
    default = config or RouterConfig()
    prof = load_profile("mocker")
    t0 = time.perf_counter()
    requests = load_requests(trace, limit, prof)
    load_s = time.perf_counter() - t0
    kwargs = {"profile": prof, "load_report_ms": load_report_ms, "kv_event_lag_ms": kv_event_lag_ms}
    topologies = list(topologies)
    variants = _variants(default)
    if jobs is None:
        jobs = min(2, os.cpu_count() or 1)

    scales = (case_rate_scale,) if isinstance(case_rate_scale, (int, float)) else tuple(case_rate_scale)
    apart = None
    by_load: dict[float, dict[str, Any]] = {}
    if tune is not None and score is not None:
        for x in scales:
            by_load[x] = tune_and_score(tune, score, topologies[0], default, dynamo=dynamo, dynamo_runs=dynamo_runs,
                                        jobs=jobs, cluster=kwargs, duration_s=case_duration_s, rate_scale=x, echo=echo)
            echo("")
        apart = by_load[scales[0]]

    configs: dict[str, dict[str, dict[str, Any]]] = {t.name: {"ours": {}, "dynamo": {}} for t in topologies}
    if dynamo:
        for t in topologies:
            for name, mode, overrides in _dynamo_variants():
                configs[t.name]["dynamo"][name] = run_dynamo_median(trace, limit, t, mode, overrides, dynamo_runs)

    # Longest first (kv runs, disaggregated ones) so two processes finish together.
    job_list = sorted(
        ((ti, vi) for ti in range(len(topologies)) for vi in range(len(variants))),
        key=lambda j: (variants[j[1]][0] == "round_robin", not topologies[j[0]].disaggregated),
    )
    t1 = time.perf_counter()
    results = pool_map(lambda j: (j[0], j[1], run_ours(requests, topologies[j[0]], variants[j[1]][1], **kwargs)),
                       job_list, jobs)
    ours_s = time.perf_counter() - t1
    for ti, vi, out in results:
        configs[topologies[ti].name]["ours"][variants[vi][0]] = out

    scope = f"first {limit} lines of" if limit else "all of"
    echo(
        f"Routing in virtual time, {scope} {trace.name} ({len(requests):,} requests, 1x "
        f"arrivals, mocker profile; loaded and hashed in {load_s:.1f}s, our {len(job_list)} "
        f"simulations in {ours_s:.0f}s on {jobs} process(es))"
    )
    echo(
        f"ours: control_plane.router.decide at its default (prefill_load_scale "
        f"{default.prefill_load_scale:g}) and at prefill_load_scale {', '.join(f'{g:g}' for g in GRID)}; "
        f"load reports every {'(never)' if load_report_ms is None else f'{load_report_ms:g} ms'}, combined "
        f"by {default.load_combine} with the in-flight ledger; KV events at step end + {kv_event_lag_ms:g} ms; "
        f"KV transfer free (as in Dynamo's mocker)"
    )
    if dynamo:
        echo(f"dynamo: mocker kv_router at its default KvRouterConfig and at the same prefill_load_scale "
             f"grid; every config the median of {dynamo_runs} runs (min-max in brackets)")
    rows = metric_rows("ttft_p50_ms", "ttft_p99_ms", "ttft_mean_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p99_ms",
                       "e2e_p99_ms", "output_tok_s", "reuse", "requests", "wall_s")
    gains: dict[str, dict[str, float]] = {}
    best: dict[str, dict[str, str]] = {}
    for t in topologies:
        c = configs[t.name]
        b = {"ours": _best(c["ours"], "kv")}
        if apart:
            b["ours"] = f"kv@{apart['tuned']['ours']:g}"
        cols = [(f"ours {name}", c["ours"][name]) for name, _ in variants]
        if dynamo:
            b["dynamo"] = f"kv_router@{apart['tuned']['dynamo']:g}" if apart else _best(c["dynamo"], "kv_router")
            cols += [(f"dyn {name}", m) for name, m in c["dynamo"].items()]
        best[t.name] = b
        echo("")
        echo(t.name)
        echo(f"{'metric':<16}" + "".join(f"{name:>18}" for name, _ in cols))
        for label, key, fmt in rows:
            echo(f"{label:<16}" + "".join(f"{fmt.format(m[key]):>18}" for _, m in cols))
        if dynamo:
            for key in ("ttft_p50_ms", "ttft_p99_ms"):
                echo(f"{'  spread ' + key[:8]:<16}" + "".join(
                    f"{'':>18}" if "spread" not in m else f"{'[%.0f-%.0f]' % m['spread'][key]:>18}" for _, m in cols))
        kv = c["ours"][b["ours"]]
        if apart:
            echo(f"picked on the tune set: ours {b['ours']}" + (f", dynamo {b['dynamo']}" if dynamo else "")
                 + f"; on this trace itself the best would be ours {_best(c['ours'], 'kv')}"
                 + (f", dynamo {_best(c['dynamo'], 'kv_router')}" if dynamo else ""))
        echo(
            f"ours {b['ours']} ({'tuned' if apart else 'best'}): {kv['decisions']:,} decisions at {kv['decide_us']:.0f} us each, "
            f"{kv['kv_events']:,} KV events folded, guards {kv['guards'] or 'none'}, chose a "
            f"longest-match worker {100 * kv['best_match_share']:.1f}% of the time, {kv['preemptions']} preemptions"
            + (f"; dynamo best: {b['dynamo']}" if dynamo else "")
        )
        rr = c["ours"]["round_robin"]
        g = {f"{k}_ours": v for k, v in _gains(rr, kv).items()}
        g.update({f"{k}_ours_default": v for k, v in _gains(rr, c["ours"]["kv"]).items()})
        if dynamo:
            drr = c["dynamo"]["round_robin"]
            g.update({f"{k}_dynamo": v for k, v in _gains(drr, c["dynamo"]["kv_router"]).items()})
            g.update({f"{k}_dynamo_best": v for k, v in _gains(drr, c["dynamo"][b["dynamo"]]).items()})
        gains[t.name] = g
        echo("gains (rr / kv): " + ", ".join(f"{k} {v:.4f}" for k, v in g.items()))

    head = topologies[0].name
    g, c, b = gains[head], configs[head], best[head]
    nan = math.nan
    result = (
        f"RESULT ttft_p50_gain_ours={g['ttft_p50_gain_ours']:.4f} "
        f"ttft_p50_gain_dynamo={g.get('ttft_p50_gain_dynamo', nan):.4f} "
        f"ttft_p99_gain_ours={g['ttft_p99_gain_ours']:.4f} "
        f"ttft_p99_gain_dynamo={g.get('ttft_p99_gain_dynamo', nan):.4f} "
        f"reuse_ours={c['ours'][b['ours']]['reuse']:.4f} "
        f"reuse_dynamo={c['dynamo']['kv_router']['reuse'] if dynamo else nan:.4f} "
        f"ttft_p50_gain_ours_default={g['ttft_p50_gain_ours_default']:.4f} "
        f"ttft_p50_gain_dynamo_best={g.get('ttft_p50_gain_dynamo_best', nan):.4f} "
        f"dynamo_runs={dynamo_runs if dynamo else 0}"
    )
    if apart:
        result += (f" rate_scale={scales[0]:g} {apart['summary'].result_fields} "
                   f"rate_scales={','.join(f'{x:g}' for x in scales)} "
                   + " ".join(f"{k}={v:.4f}" for k, v in _across_loads(by_load).items()))
    which = "picked on the tune set" if apart else "best on this trace"
    echo("")
    echo(f"RESULT is for {head} on {trace.name}: _ours = our grid point {which} ({b['ours']}), _ours_default = our "
         f"default, _dynamo = Dynamo's default (median of {dynamo_runs}), _dynamo_best = its grid point {which}"
         + (f" ({b['dynamo']})" if dynamo else "")
         + ("; worst_* = the worst score case's figures" if apart else ""))
    echo(result)
    return {"configs": configs, "best": best, "gains": gains, "result": result, "load_s": load_s, "apart": apart}


def _across_loads(by_load: dict[float, dict[str, Any]]) -> dict[str, float]:
    """Issue 39's figures over the loads run (each side against its own round robin, Dynamo the
    only peer in virtual time): ``ttft_p50/p99_gain_vs_best_peer``, the worst score case's
    ``ttft_p50/p99_gain_edge`` over the loads >= 1.5x; ``ttft_gain_at_1x_min``, the lowest of
    both at 1x. NaN when a load was not run, or without Dynamo."""
    def worst(key: str, loads: Sequence[float]) -> float:
        vals = [f.get(key, math.nan) for x in loads for f in by_load[x]["scores"].values()]
        return min(vals) if vals and not any(math.isnan(v) for v in vals) else math.nan

    high = [x for x in by_load if x >= 1.5]
    one = [x for x in by_load if x == 1.0]
    return {"ttft_p50_gain_vs_best_peer": worst("ttft_p50_gain_edge", high),
            "ttft_p99_gain_vs_best_peer": worst("ttft_p99_gain_edge", high),
            "ttft_gain_at_1x_min": min(worst("ttft_p50_gain_edge", one), worst("ttft_p99_gain_edge", one),
                                       key=lambda v: -math.inf if math.isnan(v) else v)}


def _gains(rr: dict[str, Any], kv: dict[str, Any]) -> dict[str, float]:
    return {
        "ttft_p50_gain": rr["ttft_p50_ms"] / kv["ttft_p50_ms"],
        "ttft_p99_gain": rr["ttft_p99_ms"] / kv["ttft_p99_ms"],
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--limit", type=int, default=None, help="replay only the first N trace lines")
    p.add_argument("--jobs", type=int, default=None,
                   help="processes for our simulations (fork; default 2 on a 2-core box)")
    p.add_argument("--no-dynamo", action="store_true", help="skip Dynamo's mocker")
    p.add_argument("--only", choices=["aggregated", "disaggregated"], default=None)
    p.add_argument("--cost", choices=["blocks", "ttft"], default="blocks", help="our kv cost (RouterConfig.cost)")
    p.add_argument("--pd-pairs", action="store_true",
                   help="disaggregated: prefill and decode worker chosen together (RouterConfig.pd_pairs)")
    p.add_argument("--itl-slo-ms", type=float, default=0.0, help="the pairs' ITL SLO (RouterConfig.itl_slo_ms)")
    p.add_argument("--load-report-ms", type=float, default=DEFAULT_LOAD_REPORT_MS,
                   help="load report interval per worker; <= 0: no reports (ledger only)")
    p.add_argument("--kv-event-lag-ms", type=float, default=0.0)
    p.add_argument("--tune", default=",".join(map(str, TUNE_SET)), help="tune cases, family:seed,... ('' : none)")
    p.add_argument("--score", default=",".join(map(str, SCORE_SET)), help="score cases, family:seed,... ('' : none)")
    p.add_argument("--rate-scale", default=f"{tune_score.CASE_RATE_SCALE:g}",
                   help="arrival rate of the tune and score cases, x each family's default rate; several: 2,1.5,1")
    p.add_argument("--sessions", action="store_true",
                   help="only the session affinity bench (agentic and chat, tune seed 1, score seed 2)")
    a = p.parse_args()
    tops = TOPOLOGIES if a.only is None else (
        (AGGREGATED_8,) if a.only == "aggregated" else (DISAGGREGATED_4P4D,)
    )
    if a.sessions:
        for x in (float(x) for x in a.rate_scale.split(",")):
            sessions_bench(tops, RouterConfig(cost=a.cost, pd_pairs=a.pd_pairs, itl_slo_ms=a.itl_slo_ms),
                           cluster={"profile": load_profile("mocker"), "load_report_ms": a.load_report_ms
                                    if a.load_report_ms > 0 else None, "kv_event_lag_ms": a.kv_event_lag_ms},
                           jobs=a.jobs or min(2, os.cpu_count() or 1), rate_scale=x)
        raise SystemExit(0)
    main(a.trace, a.limit, config=RouterConfig(cost=a.cost, pd_pairs=a.pd_pairs, itl_slo_ms=a.itl_slo_ms), topologies=tops, dynamo=not a.no_dynamo, jobs=a.jobs,
         load_report_ms=a.load_report_ms if a.load_report_ms > 0 else None,
         kv_event_lag_ms=a.kv_event_lag_ms, tune=parse_cases(a.tune) if a.tune else None,
         score=parse_cases(a.score) if a.score else None, case_rate_scale=tuple(float(x) for x in a.rate_scale.split(",")))
