"""The metrics projection: a pure fold of enveloped events into Prometheus-shaped numbers.

Feed it every record of the ``kv``, ``requests``, ``workers``, ``planner`` and ``admin``
streams (:meth:`MetricsProjection.apply`), records that would not decode
(:meth:`~MetricsProjection.undecodable`) and the dead-letter topic's records
(:meth:`~MetricsProjection.deadletter`); read it back with :meth:`~MetricsProjection.families`.
The Faust processor (:mod:`control_plane.metrics.stream`), the tests and a replay all drive
this same fold, so the numbers a dashboard shows can be recomputed from the log alone.

Idempotent under redelivery, twice over:

* per ``(stream, partition)`` the projection keeps the next offset to read; a record below it
  (Faust redelivering after a rebalance, or a restart from an older snapshot) is counted as
  ``redelivered`` and changes nothing else;
* per ``(stream:partition, producer)`` a :class:`SequenceTracker` drops events whose
  ``(epoch, seq)`` was already applied (a producer that sent the same event twice) and fences
  older incarnations.

What the numbers mean (goodput, prefix hits, avoidable prefill, index series) and why every
family is the same for any interleaving of the partitions: ``docs/metrics.md``. Beside it: the
state a snapshot keeps (:mod:`.state`), the gauges read from it (:mod:`.gauges`), the read
shapes and the processor's own families (:mod:`.families`), bounded label values
(:mod:`.labels`).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import msgspec

from control_plane.index.errors import IndexRejected
from control_plane.index.native import NativePrefixIndex
from control_plane.metrics.catalog import BY_NAME, SPECS, TIERS, Kind
from control_plane.metrics.families import PROCESSOR_METRICS, Family, HistogramValue, Labels
from control_plane.metrics.gauges import gauge_samples
from control_plane.metrics.labels import UNKNOWN, deadletter_labels, reason_class
from control_plane.metrics.state import (
    SNAPSHOT_FORMAT,
    SUM_SCALE,
    Hist,
    Pending,
    PoolState,
    Snapshot,
    WorkerState,
    hist_value,
)
from control_plane.planner.config import DEFAULT_ITL_SLO_MS, DEFAULT_TTFT_SLO_MS
from common.fleet import NEW, Fleet
from common.log.sequencing import SequenceTracker, Verdict
from schemas.envelope import Envelope
from schemas.events import (
    AdminAction,
    AllBlocksCleared,
    BlockMoved,
    BlockRemoved,
    BlockStored,
    Event,
    KvTransferCompleted,
    KvTransferFailed,
    KvTransferStarted,
    PlannerConfigChanged,
    PoolPinned,
    PoolUpdated,
    PrefillCompleted,
    RequestAdmitted,
    RequestCompleted,
    RequestFailed,
    RequestRejected,
    RequestRouted,
    RouterConfigChanged,
    ScalingApplied,
    ScalingDecision,
    WorkerDeregistered,
    WorkerDraining,
    WorkerDrainRequested,
    WorkerLoadReported,
    WorkerRegistered,
)

@dataclass(frozen=True)
class ProjectionConfig:
    """How the fold interprets events. Part of what a snapshot means: a processor restoring a
    snapshot must use the same values."""

    #: The prefix index's configuration (the router's ``--hash-algo``/``--block-size``): KV
    #: events of other configurations are rejected by the index and not counted as resident.
    hash_algo: str = "sha256"
    block_size: int = 64
    #: SLO of a pool no ``PoolUpdated`` has set (or set to None).
    default_ttft_slo_ms: float = DEFAULT_TTFT_SLO_MS
    default_itl_slo_ms: float = DEFAULT_ITL_SLO_MS
    #: An admitted request with no completion, final failure or rejection after this much event
    #: time is counted as ``abandoned`` and forgotten (the router died mid-request).
    pending_ttl_s: float = 600.0
    #: Bound on remembered admissions per requests partition; beyond it the oldest are counted as
    #: abandoned.
    max_pending: int = 200_000

    def __post_init__(self) -> None:
        if self.default_ttft_slo_ms <= 0 or self.default_itl_slo_ms <= 0:
            raise ValueError("default SLOs must be positive: a request can never meet a zero SLO")
        if self.pending_ttl_s <= 0 or self.max_pending <= 0:
            raise ValueError("pending_ttl_s and max_pending must be positive")



def _v(x) -> str:
    return x.value if isinstance(x, Enum) else str(x)


#: Request metrics whose ``pool`` label is the pool of the worker the event names. Folded per
#: worker id and resolved to the pool when read: the worker's registration is on another topic
#: and may be folded after the request's events (see "Interleavings" in docs/metrics.md).
WORKER_JOINED = frozenset({
    "switchyard_requests_total", "switchyard_request_attempt_failures_total",
    "switchyard_request_ttft_seconds", "switchyard_request_e2e_seconds", "switchyard_request_itl_seconds",
    "switchyard_request_prompt_tokens_total", "switchyard_request_cached_tokens_total",
    "switchyard_request_output_tokens_total", "switchyard_goodput_requests_total", "switchyard_slo_violations_total",
    "switchyard_prefix_lookup_blocks_total", "switchyard_routed_prompt_tokens_total",
    "switchyard_prefix_hit_blocks_total", "switchyard_avoidable_prefill_tokens_total",
    "switchyard_routing_suboptimal_decisions_total", "switchyard_prefill_duration_seconds"})
#: Bound on completions waiting for their worker's registration to be judged; beyond it they
#: are judged against the default SLO at once (and the state may depend on interleaving).
MAX_UNJUDGED = 100_000


# -- the projection ---------------------------------------------------------------------------


class MetricsProjection:
    """Mutable state of the fold. Not thread-safe: apply and read from one thread (the
    processor does both on its event loop)."""

    def __init__(self, config: ProjectionConfig = ProjectionConfig()) -> None:
        self.config = config
        self.index = NativePrefixIndex(config.hash_algo, config.block_size)
        self.tracker = SequenceTracker()
        #: (stream, partition) -> next offset to read.
        self.positions: dict[tuple[str, int], int] = {}
        #: stream -> producer timestamp (ms) of the newest record applied.
        self.last_ts_ms: dict[str, int] = {}
        self.applied = 0
        self._counters: dict[str, dict[Labels, float]] = {}
        self._hists: dict[str, dict[Labels, Hist]] = {}
        self._workers: dict[str, WorkerState] = {}
        #: Each worker's lifecycle (common/fleet.py, the one fold every view shares).
        self.fleet = Fleet()
        self._pools: dict[str, PoolState] = {}
        #: WORKER_JOINED series, labels with the worker id in the pool's place.
        self._wcounters: dict[str, dict[Labels, float]] = {}
        self._whists: dict[str, dict[Labels, Hist]] = {}
        self._unjudged: dict[str, list[tuple[float, float | None]]] = {}
        self._nunjudged = 0
        #: router id -> view state of its latest decision (by event time, then event id).
        self._routers: dict[str, str] = {}
        self._router_at: dict[str, tuple[int, str]] = {}
        self._config_versions: dict[str, int] = {}
        #: request id -> admission facts.
        self._pending: dict[str, Pending] = {}
        #: requests partition -> its pending request ids, oldest admission first.
        self._admission_order: dict[int, OrderedDict[str, None]] = {}
        #: (envelope, payload, partition); only the requests handlers use the partition.
        self._handlers: dict[type[Event], Callable[[Envelope, Event, int], None]] = {
            BlockStored: self._block_stored,
            BlockRemoved: self._block_removed,
            BlockMoved: self._block_moved,
            AllBlocksCleared: self._all_cleared,
            RequestAdmitted: self._admitted,
            RequestRouted: self._routed,
            PrefillCompleted: self._prefill_completed,
            KvTransferStarted: self._transfer_started,
            KvTransferCompleted: self._transfer_completed,
            KvTransferFailed: self._transfer_failed,
            RequestCompleted: self._completed,
            RequestFailed: self._failed,
            RequestRejected: self._rejected,
            WorkerRegistered: self._lifecycle_event,
            WorkerLoadReported: self._load_reported,
            WorkerDraining: self._lifecycle_event,
            WorkerDeregistered: self._lifecycle_event,
            ScalingDecision: self._scaling_decision,
            ScalingApplied: self._scaling_applied,
            RouterConfigChanged: self._config_changed,
            PlannerConfigChanged: self._config_changed,
            PoolUpdated: self._pool_updated,
            PoolPinned: self._pool_pinned,
            WorkerDrainRequested: self._admin_event,
            AdminAction: self._admin_event,
        }

    # -- feeding ------------------------------------------------------------------------------

    def apply(self, env: Envelope[Event], stream: str, partition: int, offset: int, ts_ms: int = 0) -> str:
        """Fold one decoded record; returns its outcome (a ``switchyard_metrics_records_total``
        outcome label)."""
        if not self._advance(stream, partition, offset, ts_ms):
            return "redelivered"
        obs = self.tracker.observe(f"{stream}:{partition}", env.producer, env.epoch, env.seq)
        if obs.gap is not None:
            self._inc("switchyard_sequence_gaps_total", (stream,))
        if obs.verdict is not Verdict.NEW:
            outcome = "duplicate" if obs.verdict is Verdict.DUPLICATE else "stale_epoch"
            self._inc("switchyard_metrics_records_total", (stream, outcome))
            return outcome
        self.applied += 1
        self._inc("switchyard_metrics_records_total", (stream, "applied"))
        self._inc("switchyard_events_total", (stream, env.type))
        if stream in ("kv", "workers"):
            try:
                # Keyed per partition exactly like the router's view (RouterView.apply), so the
                # two folds agree on gaps and staleness.
                self.index.apply(f"{env.producer}@{stream}:{partition}", env.epoch, env.seq, env.data)
            except IndexRejected:
                pass  # counted by the index (switchyard_index_events_total{outcome="rejected"})
        handler = self._handlers.get(type(env.data))
        if handler is not None:
            handler(env, env.data, partition)
        return "applied"

    def undecodable(self, stream: str, partition: int, offset: int, ts_ms: int = 0) -> str:
        """A record of an event stream that is not a valid envelope of a known type/version.

        Counted, not dead-lettered: this processor only observes; the consumers that act on a
        stream dead-letter what they cannot apply (one DLQ record per actor, not per observer)."""
        if not self._advance(stream, partition, offset, ts_ms):
            return "redelivered"
        self._inc("switchyard_metrics_records_total", (stream, "undecodable"))
        return "undecodable"

    def deadletter(self, partition: int, offset: int, reason: str, source: str, ts_ms: int = 0) -> str:
        """One record of the dead-letter topic, with its ``sy-dlq-reason`` header and the stream
        it was taken from (``sy-dlq-source``)."""
        if not self._advance("deadletter", partition, offset, ts_ms):
            return "redelivered"
        self._inc("switchyard_metrics_records_total", ("deadletter", "applied"))
        self._inc("switchyard_deadletter_records_total", deadletter_labels(reason, source))
        return "applied"

    def _advance(self, stream: str, partition: int, offset: int, ts_ms: int) -> bool:
        key = (stream, partition)
        if offset < self.positions.get(key, 0):
            self._inc("switchyard_metrics_records_total", (stream, "redelivered"))
            return False
        self.positions[key] = offset + 1
        if ts_ms > self.last_ts_ms.get(stream, 0):
            self.last_ts_ms[stream] = ts_ms
        return True

    # -- primitives ---------------------------------------------------------------------------

    def _inc(self, name: str, labels: Labels, by: float = 1.0) -> None:
        spec = BY_NAME[name]
        if spec.kind is not Kind.COUNTER or len(labels) != len(spec.labels):
            raise ValueError(f"{name} is a {spec.kind.value} with labels {spec.labels}; got {labels}")
        series = self._counters.setdefault(name, {})
        series[labels] = series.get(labels, 0.0) + by

    def _winc(self, name: str, worker_id: str | None, labels: Labels, by: float = 1.0) -> None:
        """``_inc`` of a WORKER_JOINED counter: ``labels`` without the pool, which is the pool of
        ``worker_id`` when the series is read."""
        if name not in WORKER_JOINED:
            raise ValueError(f"{name} is not joined to a worker's pool")
        series = self._wcounters.setdefault(name, {})
        key = (worker_id or "", *labels)
        series[key] = series.get(key, 0.0) + by

    def _observe(self, name: str, labels: Labels, value: float, hists: dict[str, dict[Labels, Hist]] | None = None) -> None:
        spec = BY_NAME[name]
        series = (self._hists if hists is None else hists).setdefault(name, {})
        h = series.get(labels)
        if h is None:
            h = series[labels] = Hist([0] * (len(spec.buckets) + 1))
        # Prometheus buckets are inclusive upper bounds: value <= le.
        h.counts[bisect.bisect_left(spec.buckets, value)] += 1
        h.qsum += round(value * SUM_SCALE)

    def _wobserve(self, name: str, worker_id: str | None, value: float) -> None:
        """``_observe`` of a WORKER_JOINED histogram (its only label is the pool)."""
        if name not in WORKER_JOINED:
            raise ValueError(f"{name} is not joined to a worker's pool")
        self._observe(name, (worker_id or "",), value, self._whists)

    def pool_of(self, worker_id: str | None) -> str:
        w = self._workers.get(worker_id) if worker_id else None
        return w.pool if w is not None else UNKNOWN

    def slo_ms(self, pool: str) -> tuple[float, float]:
        """(TTFT, ITL) SLO of a pool in milliseconds."""
        p = self._pools.get(pool)
        ttft = p.ttft_slo_ms if p is not None and p.ttft_slo_ms is not None else self.config.default_ttft_slo_ms
        itl = p.itl_slo_ms if p is not None and p.itl_slo_ms is not None else self.config.default_itl_slo_ms
        return ttft, itl

    def _pool(self, name: str) -> PoolState:
        p = self._pools.get(name)
        if p is None:
            p = self._pools[name] = PoolState()
        return p

    # -- kv -----------------------------------------------------------------------------------

    def _block_stored(self, env, ev: BlockStored, partition: int = -1) -> None:
        self._inc("switchyard_kv_blocks_stored_total", (_v(ev.tier),), len(ev.block_hashes))
        if ev.source_tier is not None and _v(ev.tier) == "device":
            # An onboard: the engine loaded these blocks from a slower tier instead of
            # recomputing them (Dynamo's kvbm_onboard_blocks_h2d / _d2d, by source tier).
            self._inc("switchyard_kv_blocks_onboarded_total", (_v(ev.source_tier),), len(ev.block_hashes))

    def _block_removed(self, env, ev: BlockRemoved, partition: int = -1) -> None:
        self._inc("switchyard_kv_blocks_removed_total", (_v(ev.tier),), len(ev.block_hashes))

    def _block_moved(self, env, ev: BlockMoved, partition: int = -1) -> None:
        self._inc("switchyard_kv_blocks_moved_total", (_v(ev.from_tier), _v(ev.to_tier)), len(ev.block_hashes))

    def _all_cleared(self, env, ev: AllBlocksCleared, partition: int = -1) -> None:
        self._inc("switchyard_kv_clears_total", ("all" if ev.tier is None else _v(ev.tier),))

    # -- requests -----------------------------------------------------------------------------

    def _admitted(self, env, ev: RequestAdmitted, partition: int = -1) -> None:
        # Abandonment is decided per requests partition, against the admissions of that
        # partition only: a request's own end is on its partition, so whether it ended before
        # the TTL ran out does not depend on how partitions interleave.
        self._end(ev.request_id)
        self._pending[ev.request_id] = Pending(ev.endpoint, ev.prompt_tokens, len(ev.block_hashes),
                                                ev.block_size, env.occurred_at_ns, partition)
        order = self._admission_order.setdefault(partition, OrderedDict())
        order[ev.request_id] = None
        cutoff = env.occurred_at_ns - int(self.config.pending_ttl_s * 1e9)
        while order:
            rid = next(iter(order))
            oldest = self._pending[rid]
            if oldest.admitted_ns >= cutoff and len(order) <= self.config.max_pending:
                break
            self._end(rid)
            self._inc("switchyard_requests_total", ("none", oldest.endpoint, "abandoned"))

    def _end(self, request_id: str) -> Pending | None:
        """Forget a pending admission (the request ended); its facts, or None."""
        adm = self._pending.pop(request_id, None)
        if adm is not None:
            order = self._admission_order.get(adm.partition)
            if order is not None:
                order.pop(request_id, None)
        return adm

    def _routed(self, env, ev: RequestRouted, partition: int = -1) -> None:
        view_state = ev.view_state or UNKNOWN
        phase = _v(ev.phase)
        self._inc("switchyard_routing_decisions_total", (_v(ev.mode), phase, view_state))
        if ev.router_id and ev.view_state:
            # The router's newest decision by event time (its decisions are spread over the
            # requests partitions, so fold order says nothing).
            at = (env.occurred_at_ns, env.event_id)
            if at > self._router_at.get(ev.router_id, (-1, "")):
                self._routers[ev.router_id] = ev.view_state
                self._router_at[ev.router_id] = at
        adm = self._pending.get(ev.request_id)
        if phase == "decode" or adm is None:
            return  # decode reuses the prefill's KV; without the admission there is no prompt size
        w = ev.worker_id
        chosen = next((s for s in ev.scores if s.worker_id == ev.worker_id), None)
        self._winc("switchyard_prefix_lookup_blocks_total", w, (), adm.prompt_blocks)
        self._winc("switchyard_routed_prompt_tokens_total", w, (), adm.prompt_tokens)
        chosen_overlap = 0
        if chosen is not None:
            chosen_overlap = chosen.overlap_blocks
            for tier, n in chosen.overlap_by_tier.items():
                if tier in TIERS and n > 0:
                    self._winc("switchyard_prefix_hit_blocks_total", w, (tier,), n)
        best = max((s.overlap_blocks for s in ev.scores if s.eligible and not s.stale), default=0)
        self._winc("switchyard_avoidable_prefill_tokens_total", w, (), max(best - chosen_overlap, 0) * adm.block_size)
        self._winc("switchyard_routing_suboptimal_decisions_total", w, (), 1 if best > chosen_overlap else 0)

    def _prefill_completed(self, env, ev: PrefillCompleted, partition: int = -1) -> None:
        self._wobserve("switchyard_prefill_duration_seconds", ev.worker_id, ev.duration_ms / 1000)

    def _transfer_started(self, env, ev: KvTransferStarted, partition: int = -1) -> None:
        self._inc("switchyard_kv_transfers_started_total", (ev.backend,))

    def _transfer_completed(self, env, ev: KvTransferCompleted, partition: int = -1) -> None:
        self._inc("switchyard_kv_transfers_total", (ev.backend, "completed"))
        self._inc("switchyard_kv_transfer_bytes_total", (ev.backend,), ev.bytes)
        self._inc("switchyard_kv_transfer_blocks_total", (ev.backend,), ev.blocks)
        self._observe("switchyard_kv_transfer_duration_seconds", (ev.backend, "completed"), ev.duration_ms / 1000)

    def _transfer_failed(self, env, ev: KvTransferFailed, partition: int = -1) -> None:
        self._inc("switchyard_kv_transfers_total", (ev.backend, "failed"))
        self._inc("switchyard_kv_transfer_failures_total", (ev.backend, reason_class(ev.reason), ev.fallback))
        self._observe("switchyard_kv_transfer_duration_seconds", (ev.backend, "failed"), ev.duration_ms / 1000)

    def _completed(self, env, ev: RequestCompleted, partition: int = -1) -> None:
        w = ev.worker_id
        adm = self._end(ev.request_id)
        self._winc("switchyard_requests_total", w, (adm.endpoint if adm else UNKNOWN, "completed"))
        self._wobserve("switchyard_request_ttft_seconds", w, ev.ttft_ms / 1000)
        self._wobserve("switchyard_request_e2e_seconds", w, ev.e2e_ms / 1000)
        judged_itl = ev.output_tokens > 1
        if judged_itl:
            self._wobserve("switchyard_request_itl_seconds", w, ev.itl_mean_ms / 1000)
        self._winc("switchyard_request_prompt_tokens_total", w, (), ev.prompt_tokens)
        self._winc("switchyard_request_cached_tokens_total", w, (), ev.cached_tokens)
        self._winc("switchyard_request_output_tokens_total", w, (), ev.output_tokens)
        itl = ev.itl_mean_ms if judged_itl else None
        if w in self._workers or self._nunjudged >= MAX_UNJUDGED:
            self._judge(w, ev.ttft_ms, itl)
        else:
            # The SLO is the pool's, and the pool is the worker's: judged once it registers.
            self._unjudged.setdefault(w, []).append((ev.ttft_ms, itl))
            self._nunjudged += 1

    def _judge(self, worker_id: str, ttft_ms: float, itl_ms: float | None,
               into: dict[str, dict[Labels, float]] | None = None) -> None:
        """Count a completion as good or as violating the SLO of its worker's pool."""
        ttft_slo, itl_slo = self.slo_ms(self.pool_of(worker_id))
        ttft_ok = ttft_ms <= ttft_slo
        itl_ok = itl_ms is None or itl_ms <= itl_slo
        # Touch every series of the pool so "no violation yet" is a visible 0.
        for name, labels, n in (("switchyard_goodput_requests_total", (), 1 if ttft_ok and itl_ok else 0),
                                ("switchyard_slo_violations_total", ("ttft",), 0 if ttft_ok else 1),
                                ("switchyard_slo_violations_total", ("itl",), 0 if itl_ok else 1)):
            if into is None:
                self._winc(name, worker_id, labels, n)
            else:
                series = into.setdefault(name, {})
                key = (UNKNOWN, *labels)
                series[key] = series.get(key, 0.0) + n

    def _failed(self, env, ev: RequestFailed, partition: int = -1) -> None:
        w = ev.worker_id
        self._winc("switchyard_request_attempt_failures_total", w, (ev.code, "true" if ev.retried else "false"))
        if not ev.retried:
            adm = self._end(ev.request_id)
            self._winc("switchyard_requests_total", w, (adm.endpoint if adm else UNKNOWN, "failed"))

    def _rejected(self, env, ev: RequestRejected, partition: int = -1) -> None:
        adm = self._end(ev.request_id)
        self._inc("switchyard_requests_total", ("none", adm.endpoint if adm else UNKNOWN, "rejected"))

    # -- workers ------------------------------------------------------------------------------

    def _lifecycle_event(self, env, ev, partition: int = -1) -> None:
        """The registered incarnation's state is the fleet's; each of its lifecycle events is
        counted once, whenever it is folded (before or after its registration)."""
        ch = self.fleet.fold(env)
        reg = ch.registration
        if reg is not None:
            w = self._workers[reg.worker_id] = WorkerState(worker_id=reg.worker_id, epoch=reg.epoch, pool=reg.pool,
                                                       role=reg.role)
            self._pool(reg.pool)
            for ttft_ms, itl_ms in self._unjudged.pop(reg.worker_id, ()):
                self._nunjudged -= 1
                self._judge(reg.worker_id, ttft_ms, itl_ms)
            self._inc("switchyard_worker_lifecycle_total", (reg.pool, "registered"))
            was = NEW  # nothing of a new incarnation counted yet
        else:
            w = self._workers.get(ch.worker_id)
            if w is None:
                return  # counted when its registration is folded
            was = ch.before
        now = ch.after
        w.state = now.state(w.epoch)
        if now.draining == w.epoch > was.draining:
            self._inc("switchyard_worker_lifecycle_total", (w.pool, "draining"))
        if now.ended == w.epoch > was.ended:
            self._inc("switchyard_worker_lifecycle_total", (w.pool, "deregistered"))

    def _load_reported(self, env, ev: WorkerLoadReported, partition: int = -1) -> None:
        cur = self._workers.get(ev.worker_id)
        if cur is None or cur.epoch != env.epoch:
            return  # an older incarnation's, or one whose registration is not folded yet
        cur.running, cur.waiting = ev.running, ev.waiting
        cur.queued_prefill_tokens = ev.queued_prefill_tokens
        cur.tier_usage = dict(ev.tier_usage)

    # -- planner and admin --------------------------------------------------------------------

    def _scaling_decision(self, env, ev: ScalingDecision, partition: int = -1) -> None:
        direction = ("up" if ev.to_replicas > ev.from_replicas else
                     "down" if ev.to_replicas < ev.from_replicas else "hold")
        self._inc("switchyard_scaling_decisions_total", (ev.pool, _v(ev.role), direction))
        self._pool(ev.pool).target[_v(ev.role)] = ev.to_replicas

    def _scaling_applied(self, env, ev: ScalingApplied, partition: int = -1) -> None:
        self._inc("switchyard_scaling_applied_total", (ev.pool, "success" if ev.success else "failure"))
        if ev.success:
            self._pool(ev.pool).applied = ev.replicas

    def _config_changed(self, env, ev: RouterConfigChanged | PlannerConfigChanged, partition: int = -1) -> None:
        self._admin_event(env, ev)
        component = "router" if isinstance(ev, RouterConfigChanged) else "planner"
        self._config_versions[component] = max(self._config_versions.get(component, 0), ev.config_version)

    def _pool_updated(self, env, ev: PoolUpdated, partition: int = -1) -> None:
        self._admin_event(env, ev)
        p = self._pool(ev.pool)
        p.ttft_slo_ms, p.itl_slo_ms = ev.ttft_slo_ms, ev.itl_slo_ms
        p.min_replicas, p.max_replicas = ev.min_replicas, ev.max_replicas

    def _pool_pinned(self, env, ev: PoolPinned, partition: int = -1) -> None:
        self._admin_event(env, ev)
        self._pool(ev.pool).pinned = ev.replicas

    def _admin_event(self, env, ev: Event, partition: int = -1) -> None:
        self._inc("switchyard_admin_events_total", (ev.TYPE,))

    # -- reading ------------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def families(self) -> list[Family]:
        """Every event-derived metric with its current samples (the processor's own come from
        :func:`processor_families`)."""
        stats = self.index.stats()
        gauges = gauge_samples(stats, self._workers, self._pools, self.slo_ms, len(self._pending),
                               self._config_versions, self._routers, self.last_ts_ms)
        counters, hists = self._joined()
        # The index keeps its own counters (they survive in its snapshot); exposed as is.
        counters["switchyard_index_events_total"] = {(k,): float(v) for k, v in stats.counters.items()}
        out = []
        for spec in SPECS:
            if spec.name in PROCESSOR_METRICS:
                continue
            if spec.kind is Kind.COUNTER:
                samples: dict = {labels: 0.0 for labels in spec.init}
                samples.update(counters.get(spec.name, {}))
            elif spec.kind is Kind.HISTOGRAM:
                samples = {labels: hist_value(spec, h) for labels, h in hists.get(spec.name, {}).items()}
            else:
                samples = {labels: 0.0 for labels in spec.init}
                samples.update(gauges.get(spec.name, {}))
            out.append(Family(spec, samples))
        return out

    def _joined(self) -> tuple[dict[str, dict[Labels, float]], dict[str, dict[Labels, Hist]]]:
        """Counters and histograms with the WORKER_JOINED series resolved to their worker's pool
        as the registry stands now (``unknown`` for a worker not registered yet), and the
        completions still waiting for that registration judged against the ``unknown`` pool's SLO.
        One pass over the per-worker series (a few per worker): what a scrape costs extra."""
        counters = {name: dict(series) for name, series in self._counters.items()}
        for name, wseries in self._wcounters.items():
            out = counters.setdefault(name, {})
            for (worker_id, *rest), v in wseries.items():
                key = (self.pool_of(worker_id), *rest)
                out[key] = out.get(key, 0.0) + v
        for worker_id, samples in self._unjudged.items():
            for ttft_ms, itl_ms in samples:
                self._judge(worker_id, ttft_ms, itl_ms, into=counters)
        hists = {name: dict(series) for name, series in self._hists.items()}
        for name, wseries in self._whists.items():
            out = hists.setdefault(name, {})
            for (worker_id,), h in wseries.items():
                key = (self.pool_of(worker_id),)
                cur = out.get(key)
                out[key] = h if cur is None else cur.merged(h)
        return counters, hists

    def as_dict(self) -> dict[str, dict[Labels, float | tuple]]:
        """Comparable plain form of every family (tests compare two folds with it)."""
        out: dict[str, dict[Labels, float | tuple]] = {}
        for f in self.families():
            out[f.spec.name] = {k: ((v.cumulative, round(v.sum, 9)) if isinstance(v, HistogramValue) else v)
                                for k, v in f.samples.items()}
        return out

    # -- checkpoints --------------------------------------------------------------------------

    def snapshot(self) -> bytes:
        snap = Snapshot(
            format=SNAPSHOT_FORMAT, hash_algo=self.index.hash_algo, block_size=self.index.block_size,
            counters=[(n, list(k), v) for n, s in self._counters.items() for k, v in s.items()],
            hists=[(n, list(k), h) for n, s in self._hists.items() for k, h in s.items()],
            workers=list(self._workers.values()), pools=self._pools, routers=self._routers,
            config_versions=self._config_versions, pending=list(self._pending.items()),
            positions=[(s, p, o) for (s, p), o in sorted(self.positions.items())],
            last_ts_ms=self.last_ts_ms, tracker=self.tracker.snapshot(), index=self.index.snapshot(),
            applied=self.applied,
            wcounters=[(n, list(k), v) for n, s in self._wcounters.items() for k, v in s.items()],
            whists=[(n, list(k), h) for n, s in self._whists.items() for k, h in s.items()],
            unjudged=self._unjudged, router_at=self._router_at, lifecycles=self.fleet.by_worker)
        return msgspec.msgpack.encode(snap)

    @classmethod
    def restore(cls, data: bytes, config: ProjectionConfig = ProjectionConfig()) -> MetricsProjection:
        snap = msgspec.msgpack.decode(data, type=Snapshot)
        if snap.format != SNAPSHOT_FORMAT:
            raise ValueError(f"metrics snapshot format {snap.format} not supported (want {SNAPSHOT_FORMAT})")
        if (snap.hash_algo, snap.block_size) != (config.hash_algo, config.block_size):
            raise ValueError(f"snapshot is for {snap.hash_algo}/{snap.block_size}, config says "
                             f"{config.hash_algo}/{config.block_size}")
        p = cls(config)
        for name, labels, value in snap.counters:
            p._counters.setdefault(name, {})[tuple(labels)] = value
        for name, labels, h in snap.hists:
            p._hists.setdefault(name, {})[tuple(labels)] = h
        p._workers = {w.worker_id: w for w in snap.workers}
        p.fleet = Fleet(snap.lifecycles or {w.worker_id: Fleet.of_state(w.epoch, w.state) for w in snap.workers})
        p._pools = dict(snap.pools)
        p._routers = dict(snap.routers)
        p._config_versions = dict(snap.config_versions)
        for name, labels, value in snap.wcounters:
            p._wcounters.setdefault(name, {})[tuple(labels)] = value
        for name, labels, h in snap.whists:
            p._whists.setdefault(name, {})[tuple(labels)] = h
        p._unjudged = {w: [tuple(x) for x in xs] for w, xs in snap.unjudged.items()}
        p._nunjudged = sum(len(xs) for xs in p._unjudged.values())
        p._router_at = {r: tuple(at) for r, at in snap.router_at.items()}
        # Pending admissions in admission order (the order they were stored in), per partition.
        p._pending = dict(snap.pending)
        for rid, adm in snap.pending:
            p._admission_order.setdefault(adm.partition, OrderedDict())[rid] = None
        p.positions = {(s, part): o for s, part, o in snap.positions}
        p.last_ts_ms = dict(snap.last_ts_ms)
        p.tracker = SequenceTracker.restore(snap.tracker)
        p.index = NativePrefixIndex.restore(snap.index)
        p.applied = snap.applied
        return p


__all__ = ["MetricsProjection", "ProjectionConfig"]
