"""The gauge families of the metrics fold, read from its state when scraped: the index's
blocks and staleness, the workers, the pools' SLOs and replicas, config versions, the routers'
view states, the newest record per stream. Pure."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from control_plane.index.shapes import IndexStats
from control_plane.metrics.families import Labels
from control_plane.metrics.state import PoolState, WorkerState

#: Same encoding as the router's ``switchyard_router_view_state``.
VIEW_STATES = {"LOADING": 0, "EXACT": 1, "DEGRADED": 2}


def gauge_samples(stats: IndexStats, workers: Mapping[str, WorkerState], pools: Mapping[str, PoolState],
                  slo_ms: Callable[[str], tuple[float, float]], in_flight: int,
                  config_versions: Mapping[str, int], routers: Mapping[str, str],
                  last_ts_ms: Mapping[str, int]) -> dict[str, dict[Labels, float]]:
    """Every gauge's samples: ``workers`` and ``pools`` as the fold keeps them, ``slo_ms`` a
    pool's (TTFT, ITL) SLO in ms, ``in_flight`` the admitted requests not ended, ``routers``
    each router's latest view state."""
    g: dict[str, dict[Labels, float]] = {}
    g["switchyard_index_hashes"] = {(): float(stats.distinct_hashes)}
    stale_ids = {r.worker_id for r in stats.stale}
    # As the router counts them (RouterView.stale_workers): registered workers not gone.
    known = {w for w, st in workers.items() if st.state != "gone"}
    g["switchyard_index_stale_workers"] = {(): float(len(stale_ids & known))}
    # Per-worker series for the workers registered and not gone, holding blocks, or stale;
    # not for every slot the index happens to keep (whether a slot exists, empty, depends
    # on which topic was read first).
    holding = {rank.worker_id for rank, tiers in stats.blocks.items() if any(tiers.values())}
    shown = known | holding | stale_ids
    g["switchyard_index_worker_stale"] = {(w,): float(w in stale_ids) for w in sorted(shown)}
    per_tier: dict[Labels, float] = {}
    per_worker: dict[Labels, float] = {}
    for rank, tiers in stats.blocks.items():
        for tier, n in tiers.items():
            per_tier[(tier.value,)] = per_tier.get((tier.value,), 0.0) + n
            if rank.worker_id in shown:
                key = (rank.worker_id, tier.value)
                per_worker[key] = per_worker.get(key, 0.0) + n
    g["switchyard_kv_blocks"] = per_tier
    g["switchyard_kv_worker_blocks"] = per_worker
    by_state: dict[Labels, float] = {}
    for w in workers.values():
        for state in ("ready", "draining", "gone"):
            by_state.setdefault((w.pool, w.role, state), 0.0)
        by_state[(w.pool, w.role, w.state)] += 1
    g["switchyard_workers"] = by_state
    live = [w for w in workers.values() if w.state != "gone"]
    g["switchyard_worker_running_requests"] = {(w.worker_id, w.pool): float(w.running) for w in live}
    g["switchyard_worker_waiting_requests"] = {(w.worker_id, w.pool): float(w.waiting) for w in live}
    g["switchyard_worker_queued_prefill_tokens"] = {(w.worker_id, w.pool): float(w.queued_prefill_tokens)
                                                    for w in live}
    g["switchyard_worker_tier_usage_ratio"] = {(w.worker_id, w.pool, t): float(u)
                                               for w in live for t, u in w.tier_usage.items()}
    g["switchyard_requests_in_flight"] = {(): float(in_flight)}
    ttft, itl, tgt, applied, lo, hi, pinned = {}, {}, {}, {}, {}, {}, {}
    for name, p in pools.items():
        t_ms, i_ms = slo_ms(name)
        ttft[(name,)], itl[(name,)] = t_ms / 1000, i_ms / 1000
        for role, n in p.target.items():
            tgt[(name, role)] = float(n)
        for dst, val in ((applied, p.applied), (lo, p.min_replicas), (hi, p.max_replicas), (pinned, p.pinned)):
            if val is not None:
                dst[(name,)] = float(val)
    g["switchyard_pool_slo_ttft_seconds"] = ttft
    g["switchyard_pool_slo_itl_seconds"] = itl
    g["switchyard_pool_target_replicas"] = tgt
    g["switchyard_pool_applied_replicas"] = applied
    g["switchyard_pool_min_replicas"] = lo
    g["switchyard_pool_max_replicas"] = hi
    g["switchyard_pool_pinned_replicas"] = pinned
    g["switchyard_config_version"] = {(c,): float(v) for c, v in config_versions.items()}
    g["switchyard_router_last_view_state"] = {(r,): float(VIEW_STATES[s]) for r, s in routers.items()
                                              if s in VIEW_STATES}
    g["switchyard_metrics_last_record_timestamp_seconds"] = {(s,): ts / 1000 for s, ts in last_ts_ms.items()}
    return g
