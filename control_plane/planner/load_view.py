"""The planner's load view: a pure projection of the ``requests`` and ``workers`` streams.

``LoadView.apply(envelope, topic, partition, offset)`` folds one record; ``snapshot(now_ns)``
answers what the planner core reads (:class:`LoadSnapshot`). The same fold runs in the Faust
agent (``control_plane/planner/stream.py``), in ``switchyard planner backtest``, in the
benchmark and in tests, so a view rebuilt from the log equals the live one at the same offsets.

Workers (per incarnation, the envelope's epoch; which registration is admitted and when an
incarnation is draining or gone is the fleet's rule, ``common/fleet.py``):

* ``starting``: registered, no load report yet (the process is up but has not served);
* ``ready``: has reported load; ``ready_at`` is its first report's event time;
* ``draining``: ``WorkerDraining`` seen (takes no new work, finishes in-flight requests);
* ``gone``: ``WorkerDeregistered`` of it or of a newer incarnation seen. A ready worker with no
  report for ``stale_after_s`` at snapshot time counts as ``stale``, not ready (killed with -9:
  nobody deregistered it).

Pools are attributed per request: ``RequestRouted`` names the worker, the worker's registration
names the pool. The registration is on another topic and may be folded after the request's
events; those wait for it (see :class:`LoadView`), so the view does not depend on the
interleaving. One request counts one arrival in each pool it is routed to (a retry in the same
pool is not a new arrival; prefill and decode pools of a disaggregated request each count it).
A completion is counted at ``RequestCompleted``'s event time: in the completing worker's pool
(OSL, ITL, and TTFT too when the request had no separate prefill pool) and, for a disaggregated
request, its TTFT in the prefill worker's pool. Goodput counts completions that met the pool's
SLO (TTFT for prefill pools, ITL for decode pools, both for aggregated ones). The prefix hit
rate is cached_tokens / prompt_tokens of the pool's completions (``PrefillCompleted`` for a
prefill pool).

Windows are keyed by event time, one accumulator per pool and hopping step, with exact
integer sums so that windows merge exactly: ``windows.py``. What the planner reads:
``load_snapshot.py``.

"Steady" latency sums only count completions on workers that have been ready for ``warmup_s``
at the completion's event time (decided when a window is read: the first load report may be
folded after the completion): a slow new worker must not make the planner believe the whole
pool got slower (Dynamo #12430).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

import msgspec

from common.fleet import GONE, READY, Change, Fleet, Lifecycle
from control_plane.planner.load_snapshot import (
    LoadSnapshot,
    PoolLoad,
    PoolWorker,
    ReplicaCounts,
    pool_entry,
)
from control_plane.planner.load_state import (
    SNAPSHOT_FORMAT,
    Incarnation,
    RequestRecord,
    Step,
    ViewState,
    WorkerRecord,
)
from control_plane.planner.windows import (
    _SUM_SCALE,
    NS,
    Accumulator,
    Histogram,
    LoadViewConfig,
    Percentiles,
    PoolSlo,
    WindowStats,
    window_stats,
)
from schemas.envelope import Envelope
from schemas.events import (
    Event,
    PrefillCompleted,
    RequestAdmitted,
    RequestCompleted,
    RequestFailed,
    RequestRouted,
    WorkerDeregistered,
    WorkerDraining,
    WorkerLoadReported,
    WorkerRegistered,
)
from schemas.types import RequestPhase

#: Re-exported: the planner, its tests and tools import the view's configuration and shapes from
#: here (``windows.py`` and ``load_snapshot.py`` define them).
__all__ = [
    "NS", "SNAPSHOT_FORMAT", "Histogram", "LoadSnapshot", "LoadView", "LoadViewConfig", "Percentiles", "PoolLoad",
    "PoolSlo", "PoolWorker", "ReplicaCounts", "WindowStats", "pool_entry", "stamp",
]



def stamp(payload: Event, at_ns: int, *, epoch: int = 1, producer: str = "sim", seq: int = 0) -> Envelope[Event]:
    """Wrap a payload in an envelope at event time ``at_ns`` (simulations, tests, benchmarks
    that feed the fold without a broker)."""
    return Envelope(event_id=f"{producer}-{at_ns}-{seq}", type=payload.TYPE, version=payload.VERSION,
                    key=payload.key(), producer=producer, epoch=epoch, seq=seq, occurred_at_ns=at_ns,
                    data=payload)


# ----------------------------------------------------------------------------------------------
# The fold
# ----------------------------------------------------------------------------------------------


#: Bound on parked steps (requests whose worker's registration has not been folded yet); beyond
#: it new steps of unknown workers are dropped, and the view may depend on interleaving.
MAX_PARKED = 10_000
MAX_INCARNATIONS = 8

#: What one fold step counted: (pool, counter, event time ns) per increment. Counters:
#: "arrivals", "completions", "good", "failures".
Counted = tuple[tuple[str, str, int], ...]


class LoadView:
    """Mutable fold state; everything it answers is an immutable :class:`LoadSnapshot`.

    Order-independence (any interleaving of the ``requests`` and ``workers`` partitions that
    keeps each partition's order folds to the same state, ``digest`` included): a request's
    events are in one partition (keyed by request id), a worker's in one other. The join
    between them, the worker's pool, is made only once the worker's registration is folded: a
    request step naming an unregistered worker is parked, with every later step of that
    request, and folded in order when the registration arrives. Whether a completion's worker
    was warmed up is decided when a window is read, from the incarnation serving at the
    completion's event time. Sums are exact integers; ``start_ns`` is the earliest event time
    folded. Bounds: a worker id keeps one pool across incarnations; lags shorter than
    ``retention_s`` and ``request_ttl_s``; at most ``MAX_PARKED`` parked steps.
    """

    def __init__(self, config: LoadViewConfig | None = None, *, start_ns: int | None = None) -> None:
        self.config = config or LoadViewConfig()
        self.workers: dict[str, WorkerRecord] = {}
        #: Each worker's lifecycle (common/fleet.py): which registration is new, which incarnation
        #: is draining or gone. Kept after a gone worker is evicted, so a copy never brings it back.
        self.fleet = Fleet()
        self._requests: dict[str, RequestRecord] = {}
        self._buckets: dict[str, dict[int, Accumulator]] = {}
        self._parked: dict[str, list[Step]] = {}
        self._nparked = 0
        self.positions: dict[tuple[str, int], int] = {}
        self.watermark_ns = 0
        #: Windows starting before this are not reported (the view saw nothing of them).
        self.start_ns = start_ns
        self._start_fixed = start_ns is not None
        self.applied = 0
        self.late_dropped = 0
        #: Bumped by every fold that can change whether a completion was warm (a registration,
        #: a first load report); keys ``_steady_cache``.
        self._warm_version = 0
        #: (pool, bucket) -> ((warm version, samples), steady sums): derived, never stored.
        self._steady_cache: dict[tuple[str, int], tuple[tuple[int, int], tuple[int, int, int, int]]] = {}

    # -- folding ----------------------------------------------------------------------------

    def apply_record(self, env: Envelope[Event], topic: str, partition: int, offset: int) -> Counted | None:
        """Fold one record read at ``topic:partition@offset``; None if already covered."""
        tp = (topic, partition)
        if offset < self.positions.get(tp, 0):
            return None
        self.positions[tp] = offset + 1
        return self.apply(env)

    def apply(self, env: Envelope[Event]) -> Counted:
        """Fold one event (position bookkeeping is the caller's, see :meth:`apply_record`).
        Returns what it counted in which pool (stream processors mirror it in their tables)."""
        self.applied += 1
        counted: Counted = ()
        at = env.occurred_at_ns
        if self.start_ns is None or (not self._start_fixed and at < self.start_ns):
            self.start_ns = at
        if at > self.watermark_ns:
            self.watermark_ns = at
        ev = env.data
        if isinstance(ev, (WorkerRegistered, WorkerDraining, WorkerDeregistered)):
            counted = self._lifecycle_event(self.fleet.fold(env))
        elif isinstance(ev, WorkerLoadReported):
            self._load_reported(ev, env.epoch, at)
        elif isinstance(ev, RequestAdmitted):
            self._req(ev.request_id, at).prompt_tokens = ev.prompt_tokens
        else:
            step = _step_of(ev, at)
            if step is not None:
                counted = self._step(step)
            elif isinstance(ev, RequestFailed) and not ev.retried:
                self._requests.pop(ev.request_id, None)  # failed before any worker was chosen
        self._evict()
        return counted

    def apply_all(self, envs: Iterable[Envelope[Event]]) -> None:
        for env in envs:
            self.apply(env)

    def _req(self, rid: str, at: int) -> RequestRecord:
        r = self._requests.get(rid)
        if r is None:
            r = self._requests[rid] = RequestRecord(seen_ns=at)
        return r

    def _acc(self, pool: str, at: int) -> Accumulator | None:
        b = at // self.config.bucket_ns
        horizon = self.watermark_ns - int(self.config.retention_s * NS)
        if (b + 1) * self.config.bucket_ns <= horizon:
            self.late_dropped += 1
            return None
        per_pool = self._buckets.setdefault(pool, {})
        acc = per_pool.get(b)
        if acc is None:
            acc = per_pool[b] = Accumulator()
        return acc

    def _pool_of(self, worker_id: str | None) -> str | None:
        w = self.workers.get(worker_id) if worker_id else None
        return w.pool if w is not None else None

    def _warm(self, worker_id: str, at: int) -> bool:
        """Was the incarnation serving ``worker_id`` at ``at`` ready for ``warmup_s`` by then?"""
        w = self.workers.get(worker_id)
        if w is None:
            return False
        ready = w.ready_at_ns
        if w.registered_at_ns > at:
            serving = [i for i in w.earlier if i.registered_at_ns <= at]
            ready = serving[-1].ready_at_ns if serving else None
        return ready is not None and at - ready >= int(self.config.warmup_s * NS)

    # workers

    def _lifecycle_event(self, ch: Change) -> Counted:
        reg = ch.registration
        if reg is None:
            cur = self.workers.get(ch.worker_id)
            if cur is not None:
                self._set_state(cur, ch.after)
            return ()
        cur = self.workers.get(reg.worker_id)
        earlier = []
        if cur is not None:
            earlier = [*cur.earlier, Incarnation(cur.epoch, cur.registered_at_ns, cur.ready_at_ns)][-MAX_INCARNATIONS:]
        w = self.workers[reg.worker_id] = WorkerRecord(worker_id=reg.worker_id, epoch=reg.epoch, pool=reg.pool,
                                                  role=reg.role, registered_at_ns=reg.registered_at_ns,
                                                  earlier=earlier)
        self._set_state(w, ch.after)
        self._warm_version += 1
        return self._unpark(reg.worker_id)

    @staticmethod
    def _set_state(w: WorkerRecord, life: Lifecycle) -> None:
        """The incarnation's state: the fleet's draining or gone; while ready, ``starting``
        until its first load report."""
        state = life.state(w.epoch)
        if state == READY:
            w.state = "ready" if w.ready_at_ns is not None else "starting"
        else:
            w.state = state
        w.gone_at_ns = life.ended_at_ns if state == GONE else None

    def _load_reported(self, ev: WorkerLoadReported, epoch: int, at: int) -> None:
        cur = self.workers.get(ev.worker_id)
        if cur is None or epoch != cur.epoch:
            return  # an older incarnation, or one whose registration we have not folded
        if cur.state == "starting":
            cur.state = "ready"
            cur.ready_at_ns = at
            self._warm_version += 1
        cur.reported_at_ns = max(cur.reported_at_ns, at)
        cur.running, cur.waiting = ev.running, ev.waiting
        cur.queued_prefill_tokens = ev.queued_prefill_tokens
        cur.active_decode_blocks = ev.active_decode_blocks
        cur.kv_usage = float(ev.tier_usage.get("device", 0.0))

    # requests: the join

    def _step(self, step: Step) -> Counted:
        """Fold a request's step now if its worker's pool is known and nothing of the request is
        parked before it; else park it behind the request's earlier steps."""
        parked = self._parked.get(step.request_id)
        if parked is None and self._pool_of(step.worker_id) is not None:
            return self._fold_step(step)
        if self._nparked < MAX_PARKED:
            self._parked.setdefault(step.request_id, []).append(step)
            self._nparked += 1
        return ()

    def _unpark(self, worker_id: str) -> Counted:
        """Fold, in order, the parked steps a registration of ``worker_id`` releases."""
        out: list[tuple[str, str, int]] = []
        for rid in [rid for rid, steps in self._parked.items() if steps[0].worker_id == worker_id]:
            steps = self._parked[rid]
            while steps and self._pool_of(steps[0].worker_id) is not None:
                out.extend(self._fold_step(steps.pop(0)))
                self._nparked -= 1
            if not steps:
                del self._parked[rid]
        return tuple(out)

    def _fold_step(self, s: Step) -> Counted:
        if s.kind == "routed":
            return self._routed(s)
        if s.kind == "prefill":
            self._prefill_completed(s)
            return ()
        if s.kind == "completed":
            return self._completed(s)
        return self._failed(s)

    def _routed(self, s: Step) -> Counted:
        pool = self._pool_of(s.worker_id)
        r = self._req(s.request_id, s.at_ns)
        if s.phase == RequestPhase.PREFILL.value:
            r.prefill_worker = s.worker_id
        if pool in r.pools:
            return ()  # a retry inside the same pool is not a new arrival
        r.pools.append(pool)
        acc = self._acc(pool, s.at_ns)
        if acc is None:
            return ()
        acc.arrivals += 1
        if r.prompt_tokens >= 0:
            acc.isl.add(r.prompt_tokens)
        return ((pool, "arrivals", s.at_ns),)

    def _prefill_completed(self, s: Step) -> None:
        acc = self._acc(self._pool_of(s.worker_id), s.at_ns)
        if acc is not None:
            acc.prompt_tokens += s.prompt_tokens
            acc.cached_tokens += s.cached_tokens

    def _completed(self, s: Step) -> Counted:
        out: list[tuple[str, str, int]] = []
        at = s.at_ns
        r = self._requests.pop(s.request_id, None)
        pool = self._pool_of(s.worker_id)
        itl = s.itl_ms if s.output_tokens > 1 else None
        prefill_pool = self._pool_of(r.prefill_worker) if r is not None and r.prefill_worker else None
        split = prefill_pool is not None and prefill_pool != pool
        if split:
            acc = self._acc(prefill_pool, at)
            if acc is not None:
                acc.completions += 1
                out.append((prefill_pool, "completions", at))
                acc.ttft.add(s.ttft_ms)
                if self.config.slo(prefill_pool).met(s.ttft_ms, None):
                    acc.good += 1
                    out.append((prefill_pool, "good", at))
                bisect.insort(acc.steady, (at, r.prefill_worker, s.ttft_ms, -1.0))
        acc = self._acc(pool, at)
        if acc is None:
            return tuple(out)
        acc.completions += 1
        out.append((pool, "completions", at))
        acc.osl.add(s.output_tokens)
        if itl is not None:
            acc.itl.add(itl)
        ttft = None if split else s.ttft_ms
        if ttft is not None:
            acc.ttft.add(ttft)
            acc.prompt_tokens += s.prompt_tokens
            acc.cached_tokens += s.cached_tokens
        if self.config.slo(pool).met(ttft, itl):
            acc.good += 1
            out.append((pool, "good", at))
        if ttft is not None or itl is not None:
            bisect.insort(acc.steady, (at, s.worker_id, -1.0 if ttft is None else ttft, -1.0 if itl is None else itl))
        return tuple(out)

    def _failed(self, s: Step) -> Counted:
        self._requests.pop(s.request_id, None)
        pool = self._pool_of(s.worker_id)
        acc = self._acc(pool, s.at_ns)
        if acc is None:
            return ()
        acc.failures += 1
        return ((pool, "failures", s.at_ns),)

    def _evict(self) -> None:
        """Drop what no window can need any more (bounded memory on an endless log)."""
        cfg = self.config
        if self.applied % 256:
            return
        horizon_b = (self.watermark_ns - int(cfg.retention_s * NS)) // cfg.bucket_ns
        for per_pool in self._buckets.values():
            for b in [b for b in per_pool if b < horizon_b]:
                del per_pool[b]
        for key in [k for k in self._steady_cache if k[1] < horizon_b]:
            del self._steady_cache[key]
        ttl = self.watermark_ns - int(cfg.request_ttl_s * NS)
        if len(self._requests) > 1024:
            for rid in [k for k, r in self._requests.items() if r.seen_ns < ttl]:
                del self._requests[rid]
        gone = self.watermark_ns - int(cfg.retention_s * NS)
        for wid in [k for k, w in self.workers.items() if w.gone_at_ns is not None and w.gone_at_ns < gone]:
            del self.workers[wid]
        for rid in [rid for rid, steps in self._parked.items() if steps[0].at_ns < ttl]:
            self._nparked -= len(self._parked.pop(rid))

    # -- answering --------------------------------------------------------------------------

    def pools(self) -> list[str]:
        return sorted({w.pool for w in self.workers.values()} | set(self._buckets))

    def window(self, pool: str, start_ns: int, end_ns: int) -> WindowStats:
        """Aggregates of ``pool`` over ``[start_ns, end_ns)`` (bucket-aligned)."""
        bn = self.config.bucket_ns
        acc = Accumulator()
        steady = [0, 0, 0, 0]
        per_pool = self._buckets.get(pool, {})
        for b in range(start_ns // bn, end_ns // bn):
            a = per_pool.get(b)
            if a is not None:
                acc.merge(a)
                for i, x in enumerate(self._steady_sums(pool, b, a)):
                    steady[i] += x
        return window_stats(acc, start_ns, end_ns, *steady)

    def _steady_sums(self, pool: str, b: int, a: Accumulator) -> tuple[int, int, int, int]:
        """(TTFT count, TTFT sum, ITL count, ITL sum) of one bucket's completions on warmed-up
        workers, sums in ``_SUM_SCALE`` units. One pass over the bucket's completions, cached
        until a completion lands in it or a registration or first report is folded: a planner
        tick re-reads the newest bucket only."""
        key = (self._warm_version, len(a.steady))
        hit = self._steady_cache.get((pool, b))
        if hit is not None and hit[0] == key:
            return hit[1]
        nt = st = ni = si = 0
        for at, worker_id, ttft, itl in a.steady:
            if self._warm(worker_id, at):
                if ttft >= 0:
                    nt += 1
                    st += round(ttft * _SUM_SCALE)
                if itl >= 0:
                    ni += 1
                    si += round(itl * _SUM_SCALE)
        sums = (nt, st, ni, si)
        self._steady_cache[(pool, b)] = (key, sums)
        return sums

    def closed_windows(self, pool: str, now_ns: int, size_s: float, limit: int) -> list[WindowStats]:
        """The last ``limit`` closed windows of ``size_s``, aligned to multiples of the size,
        oldest first. Only windows the view saw whole (starting at or after ``start_ns``, inside
        retention) are reported."""
        if self.start_ns is None:
            return []
        size = int(round(size_s * NS))
        end = (now_ns - int(self.config.grace_s * NS)) // size * size
        min_start = max(-(-self.start_ns // size) * size,
                        -(-(self.watermark_ns - int(self.config.retention_s * NS)) // size) * size)
        out: list[WindowStats] = []
        while len(out) < limit and end - size >= min_start:
            out.append(self.window(pool, end - size, end))
            end -= size
        out.reverse()
        return out

    def snapshot(self, now_ns: int, *, history: int = 12) -> LoadSnapshot:
        cfg = self.config
        stale_ns = int(cfg.stale_after_s * NS)
        bn = cfg.bucket_ns
        grace = int(cfg.grace_s * NS)
        hop = int(round(cfg.hopping_s * NS))
        pools = []
        for name in self.pools():
            workers = []
            counts = {"starting": 0, "ready": 0, "draining": 0, "stale": 0}
            roles: dict[str, int] = {}
            for w in sorted(self.workers.values(), key=lambda w: w.worker_id):
                if w.pool != name:
                    continue
                state = w.state
                if state == "ready" and now_ns - w.reported_at_ns > stale_ns:
                    state = "stale"
                if state in counts:
                    counts[state] += 1
                if state != "gone":
                    roles[w.role] = roles.get(w.role, 0) + 1
                workers.append(PoolWorker(
                    worker_id=w.worker_id, pool=w.pool, role=w.role, epoch=w.epoch, state=state,
                    registered_at_ns=w.registered_at_ns, ready_at_ns=w.ready_at_ns,
                    reported_at_ns=w.reported_at_ns, running=w.running, waiting=w.waiting,
                    queued_prefill_tokens=w.queued_prefill_tokens, active_decode_blocks=w.active_decode_blocks,
                    kv_usage=w.kv_usage))
            last_step_end = (now_ns - grace) // bn * bn
            hopping = None
            if self.start_ns is not None and last_step_end - hop >= -(-self.start_ns // bn) * bn:
                hopping = self.window(name, last_step_end - hop, last_step_end)
            role = max(sorted(roles), key=lambda r: roles[r]) if roles else ""
            pools.append(PoolLoad(
                pool=name, role=role, replicas=ReplicaCounts(**counts), workers=tuple(workers),
                windows=tuple(self.closed_windows(name, now_ns, cfg.tumbling_s, history)), hopping=hopping))
        return LoadSnapshot(now_ns=now_ns, pools=tuple(pools), watermark_ns=self.watermark_ns)

    # -- checkpoints ------------------------------------------------------------------------

    def _state(self, positions: list[tuple[str, int, int]], applied: int) -> ViewState:
        return ViewState(format=SNAPSHOT_FORMAT, workers=self.workers, requests=self._requests,
                      buckets=self._buckets, parked=self._parked, positions=positions,
                      watermark_ns=self.watermark_ns, start_ns=self.start_ns, start_fixed=self._start_fixed,
                      applied=applied, late_dropped=self.late_dropped, lifecycles=self.fleet.by_worker)

    def to_bytes(self) -> bytes:
        return msgspec.msgpack.encode(self._state([(t, p, o) for (t, p), o in sorted(self.positions.items())],
                                                  self.applied))

    @classmethod
    def from_bytes(cls, data: bytes, config: LoadViewConfig | None = None) -> LoadView:
        st = msgspec.msgpack.decode(data, type=ViewState)
        if st.format != SNAPSHOT_FORMAT:
            raise ValueError(f"load view snapshot format {st.format} not supported (want {SNAPSHOT_FORMAT})")
        v = cls(config, start_ns=st.start_ns)
        v.workers, v._requests, v._buckets, v._parked = st.workers, st.requests, st.buckets, st.parked
        v.fleet = Fleet(st.lifecycles or {
            w.worker_id: Fleet.of_state(w.epoch, w.state, w.gone_at_ns or 0) for w in st.workers.values()})
        v._nparked = sum(len(steps) for steps in st.parked.values())
        v._start_fixed = st.start_fixed
        v.positions = {(t, p): o for t, p, o in st.positions}
        v.watermark_ns, v.applied, v.late_dropped = st.watermark_ns, st.applied, st.late_dropped
        return v

    def digest(self) -> str:
        """Fingerprint of the folded state (positions and the count of records applied
        excluded): equal digests, equal views."""
        import hashlib

        st = msgspec.to_builtins(self._state([], 0), str_keys=True)
        return hashlib.sha256(msgspec.json.encode(st, order="sorted")).hexdigest()


def _step_of(ev: Event, at: int) -> Step | None:
    """The step a request event names a worker for (None: it counts nothing)."""
    if isinstance(ev, RequestRouted):
        return Step("routed", ev.request_id, ev.worker_id, at,
                     phase=ev.phase.value if hasattr(ev.phase, "value") else str(ev.phase))
    if isinstance(ev, PrefillCompleted) and ev.worker_id:
        return Step("prefill", ev.request_id, ev.worker_id, at, prompt_tokens=ev.prompt_tokens,
                     cached_tokens=ev.cached_tokens)
    if isinstance(ev, RequestCompleted) and ev.worker_id:
        return Step("completed", ev.request_id, ev.worker_id, at, prompt_tokens=ev.prompt_tokens,
                     cached_tokens=ev.cached_tokens, output_tokens=ev.output_tokens, ttft_ms=ev.ttft_ms,
                     itl_ms=ev.itl_mean_ms)
    if isinstance(ev, RequestFailed) and ev.worker_id and not ev.retried:
        # A retried attempt counts nothing: the router tries another worker, the request goes on.
        return Step("failed", ev.request_id, ev.worker_id, at)
    return None

