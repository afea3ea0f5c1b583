"""Tiers benchmark: what host and disk KV tiers buy, in virtual time, beside Dynamo's mocker.

8 aggregated workers with the ``mocker`` profile (its timing and its device: 16,384 blocks of 64
tokens), our kv routing, on the conversation trace, four ways: device only, with a host tier,
with host and disk, and with host, disk and peer fetch. Every worker offloads its device
evictions into its own tiers and onboards a prefix from them when the load is cheaper than
recomputing it (``data_plane/engines/tiers.py``: host 25 GB/s, disk 5 GB/s + 0.1 ms, 128 KiB of
KV per token, i.e. Llama 3 8B BF16; recompute at the mocker's prefill polynomial, in the
engine's 8,192-token chunks). A load runs beside the worker's steps; only its request waits for
it. The router weighs a hit in each tier by :func:`~data_plane.engines.tiers.tier_weights`,
derived from the same cost (not Dynamo's hand-set 0.75 / 0.25).

Beside it, Dynamo's mocker with its kv_router (``ai-dynamo-runtime``, ``--group bench``) at its
default device cache and with an unbounded one (``num_gpu_blocks`` 2^22 per worker): the two
anchors of issue 17. Dynamo's replay is not deterministic: each config runs ``dynamo_runs`` (3)
times; the table shows the median and the (min-max) of TTFT p50 and p99, the RESULT the
median.

Tier sizes per worker (each larger than the one above, or the tier churns): host 2x the device
(32,768 blocks, 256 GiB of KV at 8 MiB a block), disk 8x (131,072 blocks, 1 TiB).

Prints TTFT p50/p99, reuse split into device hits and onboarded tokens (the onboarded part split
by source tier in proportion to the blocks each tier loaded), bytes moved per direction; then
where TTFT goes around the median and the 99th percentile, on both sides (:func:`breakdown`), and
a lower bound no router or cache can beat on this trace and engine model (every request alone on
an idle worker, with one infinite cache shared by all: :func:`ideal_uncached`); and the RESULT
line. Run: ``uv run --group bench switchyard bench tiers [--limit N] [--tune ...] [--score ...]``.

Tune and score apart (``docs/workloads.md``): before the trace, both sides' ``prefill_load_scale``
(ours with host and disk tiers, Dynamo's kv_router at its default cache) is picked over the
routing bench's grid on the tune cases (generated workloads, lowest TTFT mean relative to each
case's best), and each pick is scored on the score cases against the other side's pick; the
trace then runs with the picks, and the RESULT line adds ``score_cases=N worst_case=... worst_*``
(the score case where our p99 gain over Dynamo is lowest).
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import numpy as np

from benchmarks import tune_score
from benchmarks.routing_bench import DYNAMO_RUNS, GRID, load_requests, pool_map, run_dynamo_median
from benchmarks.ttft_bound import alone_ms, ideal_uncached
from ops.demo.up import WHOLE_TRACE
from control_plane.router import RouterConfig, TierWeights
from control_plane.simulation import AGGREGATED_8, run_cluster
from data_plane.engines import load_profile
from data_plane.engines.tiers import OnboardCosts, costs_for, peer_weight, tier_weights
from schemas.types import RoutingMode, Tier
from workloads.sets import SCORE_SET, TUNE_SET, Case

DEFAULT_TRACE = WHOLE_TRACE
#: Per worker, in blocks: host 2x the mocker device, disk 8x.
HOST_BLOCKS = 2 * 16_384
DISK_BLOCKS = 8 * 16_384
#: Dynamo's "unbounded" device cache per worker.
DYNAMO_BIG_BLOCKS = 1 << 22
#: Host and disk tiers per worker.
TIERED = {Tier.HOST: HOST_BLOCKS, Tier.DISK: DISK_BLOCKS}

#: (name, tiers per worker, peer fetch on)
CONFIGS: tuple[tuple[str, dict[Tier, int] | None, bool], ...] = (
    ("device only", None, False),
    ("+host", {Tier.HOST: HOST_BLOCKS}, False),
    ("+host+disk", TIERED, False),
    ("+host+disk+peer", TIERED, True),
)


def derived_router_config(costs: OnboardCosts, profile_name: str = "mocker", *, peer: bool = False) -> RouterConfig:
    """Our kv routing with tier weights derived from the engine's own onboarding cost (and,
    with ``peer``, the peer weight from the same cost: fetch over the peer link, then load
    from host)."""
    prof = load_profile(profile_name)
    w = tier_weights(costs, prof.timing, prof.block_size)
    return RouterConfig(mode=RoutingMode.KV, tier_weights=TierWeights(
        device=w[Tier.DEVICE], host=w[Tier.HOST], disk=w[Tier.DISK], object=w[Tier.OBJECT],
        peer=peer_weight(costs, prof.timing, prof.block_size) if peer else 0.0))


def run_tiered(requests, tiers: dict[Tier, int] | None, config: RouterConfig,
               costs: OnboardCosts, block_size: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    res = run_cluster(requests, AGGREGATED_8, config, tiers=tiers, onboard_costs=costs)
    out = res.summary()
    out["wall_s"] = time.perf_counter() - t0
    prompt = sum(len(r.request.prompt) for r in res.records)
    onboarded = sum(r.onboarded_tokens for r in res.records)
    cached = sum(r.cached_tokens for r in res.records)
    out["reuse_device"] = (cached - onboarded) / prompt if prompt else 0.0
    loads = {f: n for (f, t), n in res.tier_moves.items() if t == Tier.DEVICE.value}
    total_loads = sum(loads.values())
    out["reuse_by_tier"] = {f: onboarded / prompt * n / total_loads for f, n in loads.items()} if total_loads else {}
    bpb = costs.kv_bytes_per_token * block_size
    out["bytes_moved"] = {f"{f}->{t}": n * bpb for (f, t), n in sorted(res.tier_moves.items())}
    out["peer_fetches"] = res.router.peer_fetches
    out["served"] = [Served(r.arrival_ms, r.admitted_ms, r.token_times[0], r.worker, len(r.request.prompt),
                            r.cached_tokens, r.prefill_steps, r.onboard_ms)
                     for r in res.records if r.token_times and r.admitted_ms is not None]
    return out


# ----------------------------------------------------------------------------------------------
# Where TTFT goes: a breakdown per request, and what no router could beat
# ----------------------------------------------------------------------------------------------


class Served(NamedTuple):
    """One request as either side served it (virtual ms)."""

    arrival_ms: float
    #: Start of the step that admitted it (its wait in the queue ends there).
    admitted_ms: float
    first_token_ms: float
    worker: Any
    prompt_tokens: int
    cached_tokens: int
    #: Steps its worker ran from its admission through its first token (ours only).
    steps: int | None = None
    #: ms from its admission until its onboarded prefix was in (ours only).
    onboard_ms: float | None = None


def served_dynamo(per_request: Sequence[dict[str, Any]]) -> list[Served]:
    """Dynamo's replay records (``capture_per_request``) in the same form."""
    return [Served(p["arrival_time_ms"], p["first_admit_ms"], p["first_token_ms"], p["decode_worker_idx"],
                   p["input_length"], p["reused_input_tokens"])
            for p in per_request if p.get("first_token_ms") is not None and p.get("first_admit_ms") is not None]


def shares_its_first_step(served: Sequence[Served]) -> np.ndarray:
    """Per request: whether another request that arrived at the same instant (the same burst of
    the trace) went to the same worker and was admitted in the same step: their tokens share
    the step, which lasts as long as all of them."""
    groups: dict[tuple, int] = {}
    keys = [(s.arrival_ms, s.worker, round(s.admitted_ms, 6)) for s in served]
    for k in keys:
        groups[k] = groups.get(k, 0) + 1
    return np.array([groups[k] > 1 for k in keys], dtype=bool)


def breakdown(served: Sequence[Served], timing: Any, chunk: int, lo: float, hi: float) -> dict[str, float]:
    """Means over the requests whose TTFT lies in the [lo, hi] percentile band (if none does,
    the request nearest its middle): TTFT = queue
    (arrival to the start of its admitting step) + service (that start to its first token);
    alone = its uncached tokens alone on an idle worker."""
    ttft = np.array([s.first_token_ms - s.arrival_ms for s in served])
    a, b = np.percentile(ttft, [lo, hi])
    m = (ttft >= a) & (ttft <= b)
    if not m.any():  # a narrow band of few requests can fall between two of them: take the nearer
        m = ttft == ttft[np.argmin(np.abs(ttft - (a + b) / 2))]
    pick = [s for s, k in zip(served, m) if k]
    uncached = [s.prompt_tokens - s.cached_tokens for s in pick]
    shared = shares_its_first_step(served)[m]
    out = {
        "n": float(m.sum()),
        "ttft": float(ttft[m].mean()),
        "queue": float(np.mean([s.admitted_ms - s.arrival_ms for s in pick])),
        "service": float(np.mean([s.first_token_ms - s.admitted_ms for s in pick])),
        "alone": float(alone_ms(timing, uncached, chunk).mean()),
        "uncached": float(np.mean(uncached)),
        "shared": float(shared.mean()),
    }
    if pick and pick[0].steps is not None:
        out["steps"] = float(np.mean([s.steps for s in pick]))
        out["load"] = float(np.mean([s.onboard_ms for s in pick]))
    return out


#: The TTFT bands the breakdown explains: around the median, and around the 99th percentile.
BANDS = (("p50", 45.0, 55.0), ("p99", 98.5, 99.5))


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _spread(r: dict[str, Any], key: str) -> str:
    lo_hi = r.get("spread", {}).get(key)
    return f" ({lo_hi[0]:.0f}-{lo_hi[1]:.0f})" if lo_hi else ""


def tune_and_score(tune: Sequence[Case], score: Sequence[Case], config: RouterConfig, costs: OnboardCosts, *,
                   dynamo: bool, dynamo_runs: int, jobs: int = 2, duration_s: float = tune_score.CASE_DURATION_S,
                   rate_scale: float = tune_score.CASE_RATE_SCALE) -> dict[str, Any]:
    """``prefill_load_scale`` over the routing bench's grid, picked per side on the tune cases
    (ours: kv with host and disk tiers; Dynamo: kv_router at its default cache), then scored on
    the score cases: ours tiered and device-only at its pick, Dynamo at its pick."""
    tune, score = tune_score.checked(tune, score)
    prof = load_profile("mocker")
    with tempfile.TemporaryDirectory(prefix="switchyard-tune-") as tmp:
        traces, requests = tune_score.load_cases((*tune, *score), Path(tmp), prof.block_size, duration_s=duration_s,
                                                 rate_scale=rate_scale)

        def ours(job: tuple[Case, float, bool]) -> dict[str, Any]:
            case, g, tiered = job
            cfg = msgspec.structs.replace(config, prefill_load_scale=g)
            out = run_tiered(requests[case], TIERED if tiered else None, cfg, costs, prof.block_size)
            out.pop("served")
            return out

        def dyn(case: Case, g: float) -> dict[str, Any]:
            return run_dynamo_median(traces[case].path, None, AGGREGATED_8, "kv_router", {"prefill_load_scale": g},
                                     dynamo_runs)

        t0 = time.perf_counter()
        jobs_t = [(c, g, True) for c in tune for g in GRID]
        out_t = dict(zip(jobs_t, pool_map(ours, jobs_t, jobs)))
        tuned = {"ours": tune_score.pick({c: {g: out_t[(c, g, True)] for g in GRID} for c in tune}, "ttft_mean_ms")}
        if dynamo:
            tuned["dynamo"] = tune_score.pick({c: {g: dyn(c, g) for g in GRID} for c in tune}, "ttft_mean_ms")
        g_ours = tuned["ours"].point
        jobs_s = [(c, g_ours, tiered) for c in score for tiered in (True, False)]
        out_s = dict(zip(jobs_s, pool_map(ours, jobs_s, jobs)))
        scores: dict[Case, dict[str, float]] = {}
        for c in score:
            t, dev = out_s[(c, g_ours, True)], out_s[(c, g_ours, False)]
            f = {"reuse_tiered": t["reuse"], "reuse_device_only": dev["reuse"],
                 "ttft_p99_gain_vs_device_only": dev["ttft_p99_ms"] / t["ttft_p99_ms"], "ttft_p99_ms": t["ttft_p99_ms"]}
            if dynamo:
                d = dyn(c, tuned["dynamo"].point)
                f.update(reuse_dynamo=d["reuse"], ttft_p99_gain_vs_dynamo=d["ttft_p99_ms"] / t["ttft_p99_ms"],
                         ttft_p50_gain_vs_dynamo=d["ttft_p50_ms"] / t["ttft_p50_ms"], ttft_p99_ms_dynamo=d["ttft_p99_ms"])
            scores[c] = f
        wall = time.perf_counter() - t0
    return tune_score.report(tune, score, GRID, tuned, scores,
                             "ttft_p99_gain_vs_dynamo" if dynamo else "ttft_p99_gain_vs_device_only",
                             where="8 aggregated, ours with host and disk tiers", wall_s=wall, duration_s=duration_s,
                             rate_scale=rate_scale)


def main(trace: Path = DEFAULT_TRACE, limit: int | None = None, *, dynamo: bool = True,
         dynamo_runs: int = DYNAMO_RUNS, tune: Sequence[Case] | None = TUNE_SET,
         score: Sequence[Case] | None = SCORE_SET, case_duration_s: float = tune_score.CASE_DURATION_S,
         case_rate_scale: float = tune_score.CASE_RATE_SCALE) -> dict[str, Any]:
    """The tables and the RESULT line. With ``tune`` and ``score`` (default: ``workloads.sets``'
    sets), both sides' ``prefill_load_scale`` is picked on the tune cases and scored on the score
    cases first (:func:`tune_and_score`), and the trace runs with the picks; without them (None)
    both sides run at their defaults, as before."""
    prof = load_profile("mocker")
    chunk = prof.max_num_batched_tokens
    requests = load_requests(trace, limit, prof)
    costs = costs_for(prof.timing)
    config = derived_router_config(costs)
    peer_config = derived_router_config(costs, peer=True)
    apart = None
    dyn_overrides = None
    if tune is not None and score is not None:
        apart = tune_and_score(tune, score, config, costs, dynamo=dynamo, dynamo_runs=dynamo_runs,
                               duration_s=case_duration_s, rate_scale=case_rate_scale)
        config = msgspec.structs.replace(config, prefill_load_scale=apart["tuned"]["ours"])
        peer_config = msgspec.structs.replace(peer_config, prefill_load_scale=apart["tuned"]["ours"])
        if dynamo:
            dyn_overrides = {"prefill_load_scale": apart["tuned"]["dynamo"]}
        print("")
    w = config.tier_weights
    print(f"tiers bench: {len(requests)} requests of {trace.name}, 8 aggregated mocker workers, virtual time; "
          f"prefill_load_scale ours {config.prefill_load_scale:g}"
          + (f", dynamo {dyn_overrides['prefill_load_scale']:g}" if dyn_overrides else ", dynamo its default")
          + (" (picked on the tune set)" if apart else " (defaults)"))
    print(f"costs: {costs.kv_bytes_per_token / 1024:.0f} KiB/token; "
          + ", ".join(f"{t.value} {l.bandwidth_bytes_s / 1e9:g} GB/s + {l.latency_ms:g} ms"
                      for t, l in costs.links.items()))
    print(f"router tier weights (derived): device {w.device:.3f}, host {w.host:.3f}, disk {w.disk:.3f}, "
          f"object {w.object:.3f}; peer {peer_config.tier_weights.peer:.3f} (peer link "
          f"{costs.peer.bandwidth_bytes_s / 1e9:g} GB/s + {costs.peer.latency_ms:g} ms, then host -> device)")
    rows: dict[str, dict[str, Any]] = {}
    for name, tiers, peer in CONFIGS:
        rows[f"ours kv, {name}"] = run_tiered(requests, tiers, peer_config if peer else config, costs,
                                              prof.block_size)
    if dynamo:
        for name, engine_args in (("dynamo kv_router", None),
                                  ("dynamo kv_router, unbounded device", {"num_gpu_blocks": DYNAMO_BIG_BLOCKS})):
            r = run_dynamo_median(trace, limit, AGGREGATED_8, "kv_router", dyn_overrides, dynamo_runs,
                                  engine_args=engine_args, per_request=True)
            r["served"] = served_dynamo(r.pop("per_request"))
            rows[name] = r

    print(f"\n{'config':<36} {'TTFT p50':>16} {'TTFT p90':>10} {'TTFT p99':>18} {'ITL p50':>8} "
          f"{'ITL p99':>8} {'reuse':>7} {'device':>7} {'onboard by tier':<28} {'wall':>6}")
    for name, r in rows.items():
        by_tier = ", ".join(f"{t} {v:.3f}" for t, v in r.get("reuse_by_tier", {}).items())
        dev = r.get("reuse_device")
        p50 = f"{r['ttft_p50_ms']:.1f}{_spread(r, 'ttft_p50_ms')}"
        p99 = f"{r['ttft_p99_ms']:.1f}{_spread(r, 'ttft_p99_ms')}"
        print(f"{name:<36} {p50:>14}ms {r['ttft_p90_ms']:>8.1f}ms {p99:>16}ms "
              f"{r['itl_p50_ms']:>6.2f}ms {r['itl_p99_ms']:>6.2f}ms {r['reuse']:>7.4f} "
              f"{dev if dev is not None else math.nan:>7.4f} {by_tier or '-':<28} {r['wall_s']:>5.1f}s")
    if dynamo:
        print(f"(Dynamo: median of {dynamo_runs} replays, (min-max) of TTFT p50 and p99; its replay is not "
              "deterministic, ours is)")
    for name, r in rows.items():
        if r.get("bytes_moved"):
            print(f"bytes moved, {name}: " + ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in r["bytes_moved"].items()))

    peered = rows["ours kv, +host+disk+peer"]
    print(f"peer fetches, +host+disk+peer: {peered['peer_fetches']}")

    # Where TTFT goes, around the median and the 99th percentile.
    print(f"\nTTFT breakdown (means over the band): queue = arrival to the start of the admitting step, "
          f"service = that start to the first token, alone = the uncached tokens alone on an idle worker "
          f"({chunk}-token chunks), shared = share admitted in one step with another request of the same "
          f"arrival instant, load = its prefix's load time")
    print(f"{'config':<36} {'band':<5} {'n':>5} {'TTFT':>8} {'queue':>7} {'service':>8} {'alone':>7} "
          f"{'uncached':>9} {'steps':>6} {'load':>6} {'shared':>7}")
    for name, r in rows.items():
        for band, lo, hi in BANDS:
            b = breakdown(r["served"], prof.timing, chunk, lo, hi)
            r[f"breakdown_{band}"] = b
            print(f"{name:<36} {band:<5} {b['n']:>5.0f} {b['ttft']:>8.1f} {b['queue']:>7.1f} {b['service']:>8.1f} "
                  f"{b['alone']:>7.1f} {b['uncached']:>9.0f} {b.get('steps', math.nan):>6.2f} "
                  f"{b.get('load', math.nan):>6.2f} {b['shared']:>7.3f}")

    # What no router and no cache could beat, on this trace and engine model.
    ideal = alone_ms(prof.timing, ideal_uncached(requests, prof.block_size), chunk)
    bound = {q: float(np.percentile(ideal, q)) for q in (50, 90, 99)}
    print(f"\nlower bound (every request alone on an idle worker, one infinite cache shared by all: reuse "
          f"{1 - sum(ideal_uncached(requests, prof.block_size)) / sum(len(r.prompt) for r in requests):.4f}): "
          f"TTFT p50 {bound[50]:.1f} ms, p90 {bound[90]:.1f} ms, p99 {bound[99]:.1f} ms")
    for name, r in rows.items():
        u = alone_ms(prof.timing, [s.prompt_tokens - s.cached_tokens for s in r["served"]], chunk)
        print(f"  {name}: alone with its own reuse: p50 {np.percentile(u, 50):.1f} ms, "
              f"p99 {np.percentile(u, 99):.1f} ms")

    tiered = rows["ours kv, +host+disk"]
    result = {"reuse_tiered": tiered["reuse"], "reuse_peer": peered["reuse"]}
    if dynamo:
        d, big = rows["dynamo kv_router"], rows["dynamo kv_router, unbounded device"]
        result.update(reuse_dynamo=d["reuse"], reuse_dynamo_bigcache=big["reuse"],
                      ttft_p99_gain_vs_dynamo=d["ttft_p99_ms"] / tiered["ttft_p99_ms"],
                      ttft_p50_gain_vs_dynamo=d["ttft_p50_ms"] / tiered["ttft_p50_ms"],
                      ttft_p99_gain_peer_vs_dynamo=d["ttft_p99_ms"] / peered["ttft_p99_ms"],
                      ttft_p50_gain_peer_vs_dynamo=d["ttft_p50_ms"] / peered["ttft_p50_ms"],
                      ttft_p99_gain_bound=d["ttft_p99_ms"] / bound[99],
                      ttft_p50_gain_bound=d["ttft_p50_ms"] / bound[50])
    result.update(ttft_p99_bound_ms=bound[99], ttft_p50_bound_ms=bound[50])
    line = "RESULT " + " ".join(f"{k}={v:.4f}" for k, v in result.items())
    if apart:
        line += f" {apart['summary'].result_fields}"
    print(line)
    return {"rows": rows, "result": result, "apart": apart, "line": line}
