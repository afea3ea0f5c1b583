"""Tiers benchmark: what host and disk KV tiers buy, in virtual time, beside Dynamo's mocker.

8 aggregated workers with the ``mocker`` profile (its timing and its device: 16,384 blocks of 64
tokens), our kv routing, on the conversation trace, three ways: device only, with a host tier,
with host and disk. Every worker offloads its device evictions into its own tiers and onboards a
prefix from them when the load is cheaper than recomputing it (``data_plane/engines/tiers.py``:
host 25 GB/s, disk 5 GB/s + 0.1 ms, 128 KiB of KV per token, i.e. Llama 3 8B BF16; recompute at
the mocker's prefill polynomial). The modelled load time is added to the step that admits the
request. The router weighs a hit in each tier by :func:`~data_plane.engines.tiers.tier_weights`,
derived from the same cost (not Dynamo's hand-set 0.75 / 0.25).

Beside it, Dynamo's mocker with its kv_router (``ai-dynamo-runtime``, ``--group bench``) at its
default device cache and with an unbounded one (``num_gpu_blocks`` 2^22 per worker): the two
anchors of issue 17. Dynamo's replay is not deterministic; it runs once per config here.

Tier sizes per worker (each larger than the one above, or the tier churns): host 2x the device
(32,768 blocks, 256 GiB of KV at 8 MiB a block), disk 8x (131,072 blocks, 1 TiB).

Prints TTFT p50/p99, reuse split into device hits and onboarded tokens (the onboarded part split
by source tier in proportion to the blocks each tier loaded), bytes moved per direction, and the
RESULT line. Run: ``uv run --group bench switchyard bench tiers [--limit N]``.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from benchmarks.routing_bench import load_requests, run_dynamo
from control_plane.demo.up import WHOLE_TRACE
from control_plane.router import RouterConfig, TierWeights
from control_plane.simulation import AGGREGATED_8, run_cluster
from data_plane.engines import load_profile
from data_plane.engines.tiers import OnboardCosts, costs_for, peer_weight, tier_weights
from schemas.types import RoutingMode, Tier

DEFAULT_TRACE = WHOLE_TRACE
#: Per worker, in blocks: host 2x the mocker device, disk 8x.
HOST_BLOCKS = 2 * 16_384
DISK_BLOCKS = 8 * 16_384
#: Dynamo's "unbounded" device cache per worker.
DYNAMO_BIG_BLOCKS = 1 << 22

#: (name, tiers per worker, peer fetch on)
CONFIGS: tuple[tuple[str, dict[Tier, int] | None, bool], ...] = (
    ("device only", None, False),
    ("+host", {Tier.HOST: HOST_BLOCKS}, False),
    ("+host+disk", {Tier.HOST: HOST_BLOCKS, Tier.DISK: DISK_BLOCKS}, False),
    ("+host+disk+peer", {Tier.HOST: HOST_BLOCKS, Tier.DISK: DISK_BLOCKS}, True),
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
    return out


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def main(trace: Path = DEFAULT_TRACE, limit: int | None = None, *, dynamo: bool = True) -> dict[str, Any]:
    prof = load_profile("mocker")
    requests = load_requests(trace, limit, prof)
    costs = costs_for(prof.timing)
    config = derived_router_config(costs)
    peer_config = derived_router_config(costs, peer=True)
    w = config.tier_weights
    print(f"tiers bench: {len(requests)} requests of {trace.name}, 8 aggregated mocker workers, virtual time")
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
        rows["dynamo kv_router"] = run_dynamo(trace, limit, AGGREGATED_8, "kv_router")
        t0 = time.perf_counter()
        from benchmarks.engine_bench import replay_dynamo_mocker

        s, wall = replay_dynamo_mocker(
            trace, limit, "uv run --group bench switchyard bench tiers", router_mode="kv_router",
            num_workers=AGGREGATED_8.aggregated,
            extra_engine_args={"engine": {"num_gpu_blocks": DYNAMO_BIG_BLOCKS}})
        rows["dynamo kv_router, unbounded device"] = {
            "ttft_p50_ms": s["median_ttft_ms"], "ttft_p99_ms": s["p99_ttft_ms"],
            "ttft_p90_ms": s["p90_ttft_ms"], "itl_p50_ms": s["median_itl_ms"],
            "itl_p99_ms": s["p99_itl_ms"], "reuse": s["prefix_cache_reused_ratio"],
            "requests": s["completed_requests"], "wall_s": wall or time.perf_counter() - t0}

    print(f"\n{'config':<36} {'TTFT p50':>10} {'TTFT p90':>10} {'TTFT p99':>10} {'ITL p50':>8} "
          f"{'ITL p99':>8} {'reuse':>7} {'device':>7} {'onboard by tier':<28} {'wall':>6}")
    for name, r in rows.items():
        by_tier = ", ".join(f"{t} {v:.3f}" for t, v in r.get("reuse_by_tier", {}).items())
        dev = r.get("reuse_device")
        print(f"{name:<36} {r['ttft_p50_ms']:>8.1f}ms {r['ttft_p90_ms']:>8.1f}ms {r['ttft_p99_ms']:>8.1f}ms "
              f"{r['itl_p50_ms']:>6.2f}ms {r['itl_p99_ms']:>6.2f}ms {r['reuse']:>7.4f} "
              f"{dev if dev is not None else math.nan:>7.4f} {by_tier or '-':<28} {r['wall_s']:>5.1f}s")
    for name, r in rows.items():
        if r.get("bytes_moved"):
            print(f"bytes moved, {name}: " + ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in r["bytes_moved"].items()))

    peered = rows["ours kv, +host+disk+peer"]
    print(f"peer fetches, +host+disk+peer: {peered['peer_fetches']}")
    tiered = rows["ours kv, +host+disk"]
    result = {"reuse_tiered": tiered["reuse"], "reuse_peer": peered["reuse"]}
    if dynamo:
        d, big = rows["dynamo kv_router"], rows["dynamo kv_router, unbounded device"]
        result.update(reuse_dynamo=d["reuse"], reuse_dynamo_bigcache=big["reuse"],
                      ttft_p99_gain_vs_dynamo=d["ttft_p99_ms"] / tiered["ttft_p99_ms"],
                      ttft_p50_gain_vs_dynamo=d["ttft_p50_ms"] / tiered["ttft_p50_ms"],
                      ttft_p99_gain_peer_vs_dynamo=d["ttft_p99_ms"] / peered["ttft_p99_ms"],
                      ttft_p50_gain_peer_vs_dynamo=d["ttft_p50_ms"] / peered["ttft_p50_ms"])
    print("RESULT " + " ".join(f"{k}={v:.4f}" for k, v in result.items()))
    return {"rows": rows, "result": result}
