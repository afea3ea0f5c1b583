"""Every metric the metrics processor exposes: name, type, help, labels, buckets. Pure.

Names follow the Prometheus conventions: a ``switchyard_`` prefix, base units (``_seconds``,
``_bytes``), ``_total`` on counters, ``_ratio`` on fractions. The dashboards under
``dashboards/`` may only reference names defined here, by the router's ``RouterMetrics`` or by
Prometheus itself (``up``); ``tests/integration/test_dashboards.py`` enforces it.

Label values are bounded: pools, roles, tiers, backends, streams and machine-readable codes.
Per-worker gauges carry ``worker_id`` (one series per worker, the fleet size); free-text
reasons are reduced to a short class (see :func:`control_plane.metrics.labels.reason_class`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from schemas.types import TIER_ORDER


class Kind(str, Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    #: Upper bounds of a histogram's buckets, seconds (``+Inf`` is implicit).
    buckets: tuple[float, ...] = ()
    #: Label sets always exposed (as 0 until something happens), so "nothing happened" is a
    #: sample a query can see rather than an absent series.
    init: tuple[tuple[str, ...], ...] = ()

    def __post_init__(self) -> None:
        if not self.name.startswith("switchyard_"):
            raise ValueError(f"{self.name}: every metric name starts with switchyard_")
        if (self.kind is Kind.COUNTER) != self.name.endswith("_total"):
            raise ValueError(f"{self.name}: counters, and only counters, end in _total")
        if self.kind is Kind.HISTOGRAM and list(self.buckets) != sorted(self.buckets):
            raise ValueError(f"{self.name}: buckets must be increasing")


#: Streams whose records are events (``snapshots`` holds checkpoints, ``deadletter`` raw bytes).
EVENT_STREAMS = ("kv", "requests", "workers", "planner", "admin")
#: Streams the processor reads.
CONSUMED_STREAMS = (*EVENT_STREAMS, "deadletter")
#: What happened to one record read by the processor.
RECORD_OUTCOMES = ("applied", "duplicate", "stale_epoch", "redelivered", "undecodable")
TIERS = tuple(t.value for t in TIER_ORDER)

# The default SLO (2 s TTFT, 50 ms ITL) sits on a bucket boundary of each histogram, so
# histogram_quantile is exact where it matters most.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)

C, G, H = Kind.COUNTER, Kind.GAUGE, Kind.HISTOGRAM

SPECS: tuple[MetricSpec, ...] = (
    # -- requests (stream "requests") ---------------------------------------------------------
    MetricSpec("switchyard_requests_total", C,
               "Requests finished, by pool of the serving worker (none when rejected), endpoint and "
               "outcome (completed, failed, rejected; abandoned: admitted, no end in the log after the TTL).",
               ("pool", "endpoint", "outcome")),
    MetricSpec("switchyard_request_attempt_failures_total", C,
               "RequestFailed events (every attempt), by pool, machine-readable code and whether the "
               "router retried.", ("pool", "code", "retried")),
    MetricSpec("switchyard_requests_in_flight", G,
               "Requests admitted whose completion, final failure or rejection is not in the log yet."),
    MetricSpec("switchyard_request_ttft_seconds", H, "Time to first token of completed requests (RequestCompleted).",
               ("pool",), TTFT_BUCKETS),
    MetricSpec("switchyard_request_itl_seconds", H,
               "Mean inter-token latency of each completed request with more than one output token.",
               ("pool",), ITL_BUCKETS),
    MetricSpec("switchyard_request_e2e_seconds", H, "End-to-end latency of completed requests.",
               ("pool",), E2E_BUCKETS),
    MetricSpec("switchyard_request_prompt_tokens_total", C, "Prompt tokens of completed requests.", ("pool",)),
    MetricSpec("switchyard_request_cached_tokens_total", C,
               "Prompt tokens of completed requests the engine served from its prefix cache.", ("pool",)),
    MetricSpec("switchyard_request_output_tokens_total", C, "Output tokens of completed requests.", ("pool",)),
    MetricSpec("switchyard_prefill_duration_seconds", H, "Prefill duration (PrefillCompleted), by pool.",
               ("pool",), TTFT_BUCKETS),
    # -- SLOs and goodput ---------------------------------------------------------------------
    MetricSpec("switchyard_goodput_requests_total", C,
               "Completed requests meeting their pool's TTFT and ITL SLOs.", ("pool",)),
    MetricSpec("switchyard_slo_violations_total", C,
               "Completed requests missing an SLO, by pool and which SLO (ttft, itl); a request can "
               "miss both.", ("pool", "slo")),
    MetricSpec("switchyard_pool_slo_ttft_seconds", G, "TTFT SLO of each known pool (PoolUpdated, else the default).",
               ("pool",)),
    MetricSpec("switchyard_pool_slo_itl_seconds", G, "ITL SLO of each known pool (PoolUpdated, else the default).",
               ("pool",)),
    # -- routing and prefix reuse (RequestRouted) ---------------------------------------------
    MetricSpec("switchyard_routing_decisions_total", C,
               "Routing decisions, by mode, phase and the router view's state when deciding.",
               ("mode", "phase", "view_state")),
    MetricSpec("switchyard_router_last_view_state", G,
               "View state each router recorded in its latest decision: 0 loading, 1 exact, 2 degraded.",
               ("router_id",)),
    MetricSpec("switchyard_prefix_lookup_blocks_total", C,
               "Prompt blocks looked up by prefill/aggregated routing decisions (each retry is a decision), "
               "by pool of the chosen worker.",
               ("pool",)),
    MetricSpec("switchyard_prefix_hit_blocks_total", C,
               "Prompt blocks the chosen worker already held, by the fastest tier holding each.",
               ("pool", "tier")),
    MetricSpec("switchyard_routed_prompt_tokens_total", C,
               "Prompt tokens of prefill/aggregated routing decisions, by pool of the chosen worker.", ("pool",)),
    MetricSpec("switchyard_avoidable_prefill_tokens_total", C,
               "Tokens the best eligible candidate held beyond the chosen worker's overlap "
               "((best - chosen) overlap blocks x block size).", ("pool",)),
    MetricSpec("switchyard_routing_suboptimal_decisions_total", C,
               "Decisions whose chosen worker held less of the prompt than the best eligible candidate.",
               ("pool",)),
    # -- prefix index (NativePrefixIndex folded from kv + workers) ----------------------------
    MetricSpec("switchyard_index_hashes", G, "Distinct block hashes in the prefix index folded from the log."),
    MetricSpec("switchyard_index_stale_workers", G,
               "Registered workers (not gone) whose index entries are stale (a sequence gap, or a new "
               "incarnation not yet registered)."),
    MetricSpec("switchyard_index_worker_stale", G, "1 when this worker's index entries are stale, else 0.",
               ("worker_id",)),
    MetricSpec("switchyard_index_events_total", C,
               "Events offered to the prefix index, by outcome (applied, duplicate, fenced, ignored, "
               "rejected) and the gaps, new epochs and resyncs it saw.", ("outcome",),
               init=tuple((o,) for o in ("applied", "duplicate", "fenced", "ignored", "rejected", "gaps",
                                         "new_epochs", "resyncs"))),
    # -- KV tiers (stream "kv") ---------------------------------------------------------------
    MetricSpec("switchyard_kv_blocks", G, "Blocks resident per tier, summed over workers (index fold).", ("tier",),
               init=tuple((t,) for t in TIERS)),
    MetricSpec("switchyard_kv_worker_blocks", G, "Blocks resident per worker and tier (index fold).",
               ("worker_id", "tier")),
    MetricSpec("switchyard_kv_blocks_stored_total", C,
               "Blocks in BlockStored events (engines re-send prefix hits as stores).", ("tier",),
               init=tuple((t,) for t in TIERS)),
    MetricSpec("switchyard_kv_blocks_removed_total", C, "Blocks in BlockRemoved events.", ("tier",),
               init=tuple((t,) for t in TIERS)),
    MetricSpec("switchyard_kv_blocks_moved_total", C, "Blocks moved between tiers (BlockMoved).",
               ("from_tier", "to_tier")),
    MetricSpec("switchyard_kv_blocks_onboarded_total", C,
               "Blocks loaded into the device from a slower tier instead of recomputed (BlockStored "
               "device with a source_tier); offloads are switchyard_kv_blocks_moved_total from device.",
               ("from_tier",)),
    MetricSpec("switchyard_kv_clears_total", C, "AllBlocksCleared events, by tier (all: every tier).", ("tier",)),
    # -- KV transfers (NIXL) ------------------------------------------------------------------
    MetricSpec("switchyard_kv_transfers_started_total", C, "KV transfers started.", ("backend",)),
    MetricSpec("switchyard_kv_transfers_total", C, "KV transfers finished, by outcome (completed, failed).",
               ("backend", "outcome")),
    MetricSpec("switchyard_kv_transfer_bytes_total", C, "Bytes of completed KV transfers.", ("backend",)),
    MetricSpec("switchyard_kv_transfer_blocks_total", C, "Blocks of completed KV transfers.", ("backend",)),
    MetricSpec("switchyard_kv_transfer_duration_seconds", H, "Duration of finished KV transfers.",
               ("backend", "outcome"), TRANSFER_BUCKETS),
    MetricSpec("switchyard_kv_transfer_failures_total", C,
               "Failed KV transfers, by reason class and the request's fallback (recompute, failed).",
               ("backend", "reason", "fallback")),
    # -- workers (stream "workers") -----------------------------------------------------------
    MetricSpec("switchyard_workers", G, "Worker incarnations by pool, role and state (ready, draining, gone).",
               ("pool", "role", "state")),
    MetricSpec("switchyard_worker_lifecycle_total", C,
               "Worker lifecycle events by pool and event (registered, draining, deregistered).",
               ("pool", "event")),
    MetricSpec("switchyard_worker_running_requests", G, "Running requests of each live worker (its last load report).",
               ("worker_id", "pool")),
    MetricSpec("switchyard_worker_waiting_requests", G, "Waiting requests of each live worker (its last load report).",
               ("worker_id", "pool")),
    MetricSpec("switchyard_worker_queued_prefill_tokens", G, "Prefill tokens queued on each live worker.",
               ("worker_id", "pool")),
    MetricSpec("switchyard_worker_tier_usage_ratio", G, "Used fraction of each tier of each live worker.",
               ("worker_id", "pool", "tier")),
    # -- planner (stream "planner") and admin -------------------------------------------------
    MetricSpec("switchyard_scaling_decisions_total", C,
               "Scaling decisions by pool, role and direction (up, down, hold).", ("pool", "role", "direction")),
    MetricSpec("switchyard_scaling_applied_total", C, "Scaling decisions applied by a scaler, by outcome.",
               ("pool", "outcome")),
    MetricSpec("switchyard_pool_target_replicas", G, "Replicas the latest scaling decision asked for.",
               ("pool", "role")),
    MetricSpec("switchyard_pool_applied_replicas", G, "Replicas the latest successful ScalingApplied reported.",
               ("pool",)),
    MetricSpec("switchyard_pool_min_replicas", G, "Lower replica bound of each pool (PoolUpdated).", ("pool",)),
    MetricSpec("switchyard_pool_max_replicas", G, "Upper replica bound of each pool (PoolUpdated).", ("pool",)),
    MetricSpec("switchyard_pool_pinned_replicas", G, "Replica count an operator pinned the pool to (PoolPinned).",
               ("pool",)),
    MetricSpec("switchyard_config_version", G, "Latest config version by component (router, planner).",
               ("component",)),
    MetricSpec("switchyard_admin_events_total", C, "Operator actions and config changes, by event type.", ("type",)),
    # -- the event pipeline -------------------------------------------------------------------
    MetricSpec("switchyard_events_total", C, "Events applied (first delivery only), by stream and type.",
               ("stream", "type")),
    MetricSpec("switchyard_metrics_records_total", C,
               "Records read by the metrics processor, by stream and outcome (applied, duplicate, "
               "stale_epoch, redelivered, undecodable).", ("stream", "outcome"),
               init=tuple((s, o) for s in EVENT_STREAMS for o in RECORD_OUTCOMES)),
    MetricSpec("switchyard_sequence_gaps_total", C,
               "Holes in a producer's per-partition sequence (lost events), by stream.", ("stream",),
               init=tuple((s,) for s in EVENT_STREAMS)),
    MetricSpec("switchyard_metrics_last_record_timestamp_seconds", G,
               "Producer timestamp of the newest record applied, per stream (freshness: time() - this).",
               ("stream",)),
    MetricSpec("switchyard_deadletter_records_total", C,
               "Records in the dead-letter topic, by reason header and the stream they came from.",
               ("reason", "source")),
    # Known to the processor, not folded from events: broker probes and its own errors.
    MetricSpec("switchyard_metrics_lag_records", G,
               "Records between the metrics processor's position and the log end, per stream and partition.",
               ("stream", "partition")),
    MetricSpec("switchyard_log_end_offset", G,
               "High watermark of each partition (rate() of it is the write rate).", ("stream", "partition")),
    MetricSpec("switchyard_consumer_group_lag_records", G,
               "Records between a consumer group's committed offset and the log end, for every group "
               "under this topic prefix.", ("group", "stream", "partition")),
    MetricSpec("switchyard_consumer_group_members", G, "Members of each consumer group under this topic prefix.",
               ("group",)),
    MetricSpec("switchyard_metrics_fold_errors_total", C,
               "Records whose fold raised (a bug in the processor: logged, dead-lettered, the stream goes on)."),
)

BY_NAME: dict[str, MetricSpec] = {s.name: s for s in SPECS}
if len(BY_NAME) != len(SPECS):
    raise ValueError("duplicate metric name in the catalog")
