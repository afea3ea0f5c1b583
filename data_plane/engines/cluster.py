"""Engine workers on a virtual clock: the one discrete-event driver of every simulation.

:class:`Cluster` runs ``EngineCore`` s with a router side: the engine-only ``simulate``
(:mod:`.engine_only`), the routing benchmark, replay's what-if and the demo's predictions
(``control_plane.simulation``), and the planner benchmark (``benchmarks/planner_bench.py``). The
router side plugs in through :class:`~.hooks.ClusterHooks`; this package imports nothing from
the control plane. What it records per request is in :mod:`.records`; the order in which the
one-heap loop would pop two events, which every merge of the workers' timelines keeps, is
:mod:`.event_order`. What stays here is the loop and each worker's timeline (placement,
hand-offs, releases, decode runs, load reports, delivery of notifications): they share the hot
loop's state, so they are one module.

Its clock rules, the order every speed-up keeps, and how it goes fast: ``docs/engine.md``,
"The virtual clock".
"""


from __future__ import annotations

import heapq
import math
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from data_plane.engines.core import DecodeRun, EngineCore, StepResult
from data_plane.engines.event_order import (
    C_AFTER,
    C_ARRIVAL,
    C_BEFORE,
    C_END,
    C_KV,
    C_NONE,
    C_REPORT,
    C_STEP,
    EventOrder,
    OrderKey,
)
from data_plane.engines.gcpause import paused_gc
from data_plane.engines.hooks import ClusterHooks, HandOff, Placement, listens
from data_plane.engines.profiles import HardwareProfile, load_profile
from data_plane.engines.records import RequestRecord
from data_plane.engines.request import EngineRequest
from data_plane.engines.tiers import OnboardCosts, VirtualTiers
from data_plane.kvbm.offload_filter import AdmissionConfig
from common.hashing import HashConfig
from schemas.events import KvEvent
from schemas.types import RequestId, Tier, WorkerId, WorkerRole

_INF = math.inf

# Buffered notifications.
_N_KV, _N_FIRST, _N_DONE, _N_REPORT, _N_GONE = range(5)

#: Arrivals between two flushes of the merged notifications (routing fixed in advance).
_FLUSH_EVERY = 256


class _RunEnd:
    """The pending boundary a decode run leaves: the requests of its last step (one more token
    each) and that step's KV events, delivered with the boundary, not before it."""

    __slots__ = ("request_ids", "events")

    def __init__(self, request_ids: list[RequestId], events: list[KvEvent]) -> None:
        self.request_ids = request_ids
        self.events = events


class _Worker:
    """One engine's own timeline: its routed arrivals (fixed routing), releases, pending step
    boundary, KV deliveries and load reports, and the notifications it has not delivered."""

    __slots__ = (
        "index", "id", "role", "core", "producer", "holds", "ready", "draining", "gone",
        "arrivals", "next_arrival", "releases", "next_t", "payload", "cur", "num_boundaries",
        "times", "wake", "buffer", "kv", "report_t", "report_times", "handoffs", "handoff_b",
        "prefilling",
    )

    def __init__(self, index: int, wid: WorkerId, role: WorkerRole, core: EngineCore, producer: bool) -> None:
        self.index = index
        self.id = wid
        self.role = role
        self.core = core
        #: A prefill worker of a disaggregated cluster: its boundaries cause hand-offs.
        self.producer = producer
        #: Its finished requests stay held (prefill role) until released.
        self.holds = role is WorkerRole.PREFILL
        self.ready = False
        self.draining = False
        self.gone = False
        #: (time, arrival index, request), routed here in advance, not yet added.
        self.arrivals: list[tuple[float, int, EngineRequest]] = []
        self.next_arrival = 0
        #: (time, boundary that pushed it, order there, request id, kind at its instant).
        self.releases: list[tuple[float, int, int, RequestId, int]] = []
        #: The pending step boundary: its time (None: idle), what it delivers, its index.
        self.next_t: float | None = None
        self.payload: Any = None
        self.cur = -1
        self.num_boundaries = 0
        # When the order matters: every boundary's time, and what scheduled the boundaries that
        # start a busy period ((node, push index)); notifications not yet delivered, as
        # (time, node, kind, argument), in this worker's order.
        self.times = array("d")
        self.wake: dict[int, tuple] = {}
        self.buffer: deque[tuple[float, tuple, int, Any]] = deque()
        #: (delivery time, boundary, events): KV events in transport.
        self.kv: deque[tuple[float, int, list]] = deque()
        self.report_t = _INF
        self.report_times = array("d")
        #: The tokens of a boundary that hands requests off, waiting for the driver's loop.
        self.handoffs: list | None = None
        self.handoff_b = -1
        #: Records of requests admitted here (first admission) whose first token is not out yet.
        self.prefilling: dict[RequestId, RequestRecord] = {}


class Cluster:
    """Engine workers on one virtual clock, with a router side behind :class:`ClusterHooks`.

    Build it, :meth:`add_worker` the initial workers, then :meth:`run` the requests. During the
    run, timer callbacks (:meth:`schedule`) may add, drain and place. The loop, in rounds:

    1. the next arrival or timer ``G`` is the next moment a hook may look at the engines;
    2. prefill workers (disaggregated) advance to ``G``, each stopping after a boundary that
       hands requests off; the earliest such boundary, if any, comes first: every other worker
       advances to it, the buffered notifications before it are delivered, its hand-offs are
       decided and placed (on decode workers: a prefill worker is never the target of a
       hand-off, since it may have run past it). Repeat;
    3. every worker advances to ``G``, the notifications before ``G`` are delivered, ``G`` runs.

    ``disaggregated``: prefill-role workers hand their tokens off (``ClusterHooks.hand_off``) and
    free the held blocks ``release_after_ms`` after the hand-off (None: never), or before their
    next step (``release_before_step``). ``load_report_ms``: each worker reports its stats every
    so often, the first at the first arrival + (w + 1) / n of the interval (staggered: a live
    worker's timer has no reason to align with the others'), rescheduled while a request is
    unfinished (arrived later or not yet through its last phase); a gone worker stops.
    ``kv_event_lag_ms``: transport delay of KV events. ``coalesce``: decode runs at once (False:
    every step through ``EngineCore.step``; same results).
    """

    def __init__(
        self,
        profile: HardwareProfile | str,
        hooks: ClusterHooks,
        *,
        hash_config: HashConfig | None = None,
        emit_token_ids: bool = False,
        coalesce: bool = True,
        disaggregated: bool = False,
        release_after_ms: float | None = 0.0,
        release_before_step: bool = False,
        load_report_ms: float | None = None,
        kv_event_lag_ms: float = 0.0,
        tiers: Mapping[Tier, int] | None = None,
        onboard_costs: OnboardCosts | None = None,
        tier_admission: AdmissionConfig | None = None,
    ) -> None:
        self.profile = load_profile(profile) if isinstance(profile, str) else profile
        #: Blocks per tier below the device of every worker (None: device only, as before).
        #: Each worker gets :class:`~data_plane.engines.tiers.VirtualTiers` of these sizes:
        #: evictions are offloaded there and its engine onboards from them at ``onboard_costs``
        #: (the request waits for its modelled load, the others' steps do not); their events join
        #: the engine's.
        self.tier_capacities = dict(tiers) if tiers else None
        self.onboard_costs = onboard_costs
        #: The KVBM's admission filter in every worker's tiers (None: every block admitted).
        self.tier_admission = tier_admission
        self.virtual_tiers: dict[WorkerId, VirtualTiers] = {}
        self.hooks = hooks
        self.hash_config = hash_config
        self.emit_token_ids = emit_token_ids
        self.coalesce = coalesce
        self.disaggregated = disaggregated
        self.release_after_ms = None if release_before_step else release_after_ms
        self.release_before_step = release_before_step
        if load_report_ms is not None and not load_report_ms > 0:
            raise ValueError(f"load_report_ms must be > 0, got {load_report_ms}")
        if kv_event_lag_ms < 0:
            raise ValueError(f"kv_event_lag_ms must be >= 0, got {kv_event_lag_ms}")
        self.lag = kv_event_lag_ms
        self._n_kv = listens(hooks, "on_kv")
        self._n_first = listens(hooks, "on_first_token")
        self._n_done = listens(hooks, "on_complete")
        self._n_report = load_report_ms is not None and listens(hooks, "on_load_report")
        self._n_gone = listens(hooks, "on_gone")
        #: None when nobody listens: then no worker reports at all.
        self.load_report_ms = load_report_ms if self._n_report else None
        # Boundary times and wake-ups are kept only when something needs the order.
        self.track = disaggregated or self._n_kv or self._n_first or self._n_done or self._n_report or self._n_gone
        self.workers: list[_Worker] = []
        self._index: dict[WorkerId, int] = {}
        self.records: dict[RequestId, RequestRecord] = {}
        self.ordered: list[RequestRecord] = []
        self._requests: dict[RequestId, EngineRequest] = {}
        self.steps = 0
        self.last_time = 0.0
        self.completed = 0
        self.last_completion = -_INF
        self._timers: list[tuple[float, int, int, Callable[[float], None]]] = []
        self._timer_at: list[tuple[float, int]] = []
        self._arrival_t: list[float] = []
        self._total = 0
        self._started = False
        self.now = 0.0
        #: The global event being processed (what schedules a boundary it wakes) and its pushes.
        self._cur: tuple = ("I", -1)
        self._cur_k = 0
        self._handing_off = False
        #: The one-heap loop's order of events, read from the workers' timelines.
        self._order = EventOrder(self.workers, self._timer_at, self.release_after_ms, self.lag)

    # ------------------------------------------------------------------------------ the API

    def add_worker(self, worker_id: WorkerId, role: WorkerRole = WorkerRole.AGGREGATED, *,
                   ready_in_ms: float = 0.0) -> EngineCore:
        """A worker from now on (before :meth:`run`: from the start), taking requests after
        ``ready_in_ms`` (``on_ready`` then; at once when 0)."""
        if worker_id in self._index:
            raise ValueError(f"worker {worker_id!r} already exists")
        if self._started and self.load_report_ms is not None:
            raise ValueError("load reports start with the run: add every worker before it")
        role = WorkerRole(role)
        core = EngineCore(self.profile, worker_id=worker_id, role=role, hash_config=self.hash_config,
                          emit_token_ids=self.emit_token_ids, onboard_costs=self.onboard_costs)
        if self.tier_capacities:
            vt = VirtualTiers(self.tier_capacities, worker_id=worker_id, block_size=self.profile.block_size,
                              hash_algo=core.hash_config.hash_algo, emit=core.pool.queue_event,
                              admission=self.tier_admission)
            core.pool.on_evict = vt.on_device_evicted
            core.scheduler.tiers = vt
            self.virtual_tiers[worker_id] = vt
        wk = _Worker(len(self.workers), worker_id, role, core, self.disaggregated and role is WorkerRole.PREFILL)
        self.workers.append(wk)
        self._index[worker_id] = wk.index
        if ready_in_ms > 0:
            self.schedule(self.now + ready_in_ms, lambda t: self._ready(wk, t), before_steps=True)
        else:
            self._ready(wk, self.now)
        return core

    def core(self, worker_id: WorkerId) -> EngineCore:
        return self.workers[self._index[worker_id]].core

    def request(self, request_id: RequestId) -> EngineRequest:
        """The request as it arrived."""
        return self._requests[request_id]

    def schedule(self, t: float, fn: Callable[[float], None], *, before_steps: bool = False) -> None:
        """Call ``fn(t)`` at virtual time ``t``: after the step boundaries of that instant, or
        before them (after its arrivals and releases) with ``before_steps``. Equal times and
        kinds: in the order scheduled."""
        if t < self.now:
            raise ValueError(f"timer at {t} is in the past (now {self.now})")
        j = len(self._timer_at)
        kind = C_BEFORE if before_steps else C_AFTER
        self._timer_at.append((t, kind))
        heapq.heappush(self._timers, (t, kind, j, fn))

    def place(self, worker_id: WorkerId, request: EngineRequest, now: float) -> None:
        """Add ``request`` (already arrived) to a ready worker at ``now``, the current instant (from
        a timer callback or a hook)."""
        if now != self.now:
            raise ValueError(f"placement at {now} outside the current instant {self.now}")
        self._place(Placement(worker_id, request))

    def drain(self, worker_id: WorkerId, now: float) -> None:
        """Take a worker out: it finishes what it holds, then it is gone (``on_gone``); a worker
        not ready yet is gone at once."""
        wk = self.workers[self._index[worker_id]]
        if wk.gone:
            return
        if not wk.ready:
            self._gone(wk)  # never served: its start-up timer finds it gone
            self.hooks.on_gone(wk.id, now)
            return
        wk.draining = True
        core = wk.core
        if not core.has_work() and not core.scheduler.held:
            self._gone(wk)
            self.hooks.on_gone(wk.id, now)

    def has_work(self) -> bool:
        """Whether some engine has a request waiting or running (at a timer: right now)."""
        return any(wk.core.has_work() for wk in self.workers)

    # ------------------------------------------------------------------------------ the run

    def run(self, requests: Iterable[EngineRequest], *, fixed_routing: bool = False) -> list[RequestRecord]:
        """Run ``requests`` (sorted by arrival, ties in input order) to the end; returns their
        records in that order.

        ``fixed_routing``: ``arrive`` decides from the order of arrivals alone (it reads no
        engine and no notification), so it is asked for every request up front and the workers
        run apart (needs unique request ids, which the records are found by).
        """
        if self._started:
            raise RuntimeError("a Cluster runs once")
        if fixed_routing and (self._timers or self.disaggregated):
            raise ValueError("fixed routing decides every arrival up front: no timers, no hand-offs")
        self._started = True
        reqs = sorted(requests, key=lambda r: r.arrival_ms or 0.0)  # stable: ties keep input order
        self._arrival_t = [r.arrival_ms or 0.0 for r in reqs]
        self._order.arrival_t = self._arrival_t
        self._total = len(reqs)
        if self.load_report_ms is not None and self.workers:
            first = self._arrival_t[0] if reqs else 0.0
            n = len(self.workers)
            for wk in self.workers:
                wk.report_t = first + (wk.index + 1) * self.load_report_ms / n
        with paused_gc():
            if fixed_routing:
                self._run_fixed(reqs)
            else:
                self._run(reqs)
        return self.ordered

    def _run(self, reqs: list[EngineRequest]) -> None:
        workers = self.workers
        n = len(reqs)
        i = 0
        while True:
            if i < n:
                gt, gc, gnode = self._arrival_t[i], C_ARRIVAL, ("A", i)
            else:
                gt, gc, gnode = _INF, C_END, None
            if self._timers:
                tt, tc, j, _ = self._timers[0]
                if tt < gt or (tt == gt and tc < gc):
                    gt, gc, gnode = tt, tc, ("T", j)
            final = gnode is None
            # Prefill workers first: the earliest hand-off before G, if any, comes first.
            h = None
            for wk in workers:
                if wk.producer:
                    self._advance(wk, gt, gc, gnode, gt, final)
                    if wk.handoffs is not None and (h is None or self._order.before(("B", wk.index, wk.handoff_b),
                                                                               ("B", h.index, h.handoff_b))):
                        h = wk
            if h is not None:
                lt = h.times[h.handoff_b]
                lnode = ("H", h.index, h.handoff_b, 0)
                for wk in workers:
                    self._advance(wk, lt, C_STEP, lnode, lt, False)
                self._flush(lt, C_STEP, lnode)
                self._hand_off(h, lt)
                continue
            for wk in workers:
                if not wk.producer:
                    self._advance(wk, gt, gc, gnode, gt, final)
            if final:
                break
            if gc != C_ARRIVAL and self.completed == self._total:
                self._end_reports()  # a timer after the last request: no report waits for it
            self._flush(gt, gc, gnode)
            self.now = gt
            self._cur, self._cur_k = gnode, 0
            if gc == C_ARRIVAL:
                self._arrive(i, reqs[i])
                i += 1
            else:
                _, _, j, fn = heapq.heappop(self._timers)
                fn(gt)
        self._end_reports()
        self._flush(_INF, C_END, None)

    def _run_fixed(self, reqs: list[EngineRequest]) -> None:
        """Routing fixed in advance: every worker runs apart from its share of the arrivals."""
        if len({r.request_id for r in reqs}) != len(reqs):
            return self._run(reqs)  # the records are found by id: keep them apart in time
        for i, r in enumerate(reqs):
            self._cur, self._cur_k = ("A", i), 0
            self.now = self._arrival_t[i]
            rec = self._record(r)
            p = self.hooks.arrive(r, self.now)
            if p is not None:
                wk = self.workers[self._index[p.worker]]
                rec.worker_id = wk.id
                wk.arrivals.append((self.now, i, p.request))
        workers = self.workers
        if self.track:
            # Deliver the merged notifications every so many arrivals (bounded buffers).
            for k in range(_FLUSH_EVERY, len(reqs), _FLUSH_EVERY):
                h = self._arrival_t[k]
                for wk in workers:
                    self._advance(wk, h, C_NONE, None, _INF, False)
                self._flush(h, C_NONE, None)
        for wk in workers:
            self._advance(wk, _INF, C_END, None, _INF, True)
        self._end_reports()
        self._flush(_INF, C_END, None)

    # --------------------------------------------------------------------- global events

    def _record(self, req: EngineRequest) -> RequestRecord:
        rec = RequestRecord(req.request_id, None, req.arrival_ms or 0.0, len(req.prompt), req.max_tokens)
        self.records[req.request_id] = rec
        self.ordered.append(rec)
        self._requests[req.request_id] = req
        return rec

    def _arrive(self, i: int, req: EngineRequest) -> None:
        self._record(req)
        p = self.hooks.arrive(req, self.now)
        if p is not None:
            self._place(p)

    def _hand_off(self, wk: _Worker, t: float) -> None:
        """The hand-offs of ``wk``'s boundary at ``t`` (every notification before them is out)."""
        b = wk.handoff_b
        tokens = wk.handoffs
        wk.handoffs = None
        self.now = t
        self._handing_off = True
        try:
            for k, tok in enumerate(tokens):
                rid = tok.request_id
                rec = self.records[rid]
                rec.prefill_worker_id = wk.id
                rec.handoff_ms = t
                self._cur, self._cur_k = ("H", wk.index, b, k), 0
                p = self.hooks.hand_off(self._requests[rid], wk.id, tok.token_id, t)
                if p is HandOff.FINISHED:
                    rec.finished = True
                    self.completed += 1
                    if t > self.last_completion:
                        self.last_completion = t
                elif p is not None:
                    self._place(p)
        finally:
            self._handing_off = False

    def _place(self, p: Placement) -> None:
        wk = self.workers[self._index[p.worker]]
        if not wk.ready or wk.draining or wk.gone:
            state = "gone" if wk.gone else "draining" if wk.draining else "not ready"
            raise ValueError(f"cannot place {p.request.request_id} on {wk.id}: {state}")
        if self._handing_off and wk.producer:
            raise ValueError(f"a hand-off went to prefill worker {wk.id}: prefill workers run ahead "
                             "of hand-offs, only the others can take one")
        self.records[p.request.request_id].worker_id = wk.id
        self._add(wk, self.now, p.request, self._cur, self._cur_k)
        self._cur_k += 1

    def _ready(self, wk: _Worker, t: float) -> None:
        if wk.gone:
            return
        wk.ready = True
        self.hooks.on_ready(wk.id, t)

    # ----------------------------------------------------------------------- a worker's timeline

    def _add(self, wk: _Worker, t: float, req: EngineRequest, pusher: tuple, k: int) -> None:
        wk.core.add_request(req)
        if wk.next_t is None:
            self._push(wk, t, None, (pusher, k))

    def _push(self, wk: _Worker, t: float, payload: Any, woken_by: tuple | None = None) -> None:
        """The worker's next step boundary (``woken_by``: it was idle, this (node, k) woke it)."""
        b = wk.num_boundaries
        wk.num_boundaries = b + 1
        if self.track:
            wk.times.append(t)
            if woken_by is not None:
                wk.wake[b] = woken_by
        wk.next_t = t
        wk.payload = payload
        wk.cur = b

    def _advance(self, wk: _Worker, lt: float, lc: int, lnode: tuple | None, run_cap: float, final: bool) -> None:
        """Process ``wk``'s events before the limit (at ``lt``, of kind ``lc``: the event node
        ``lnode`` breaks ties among step boundaries). No decode run starts a step at or after
        ``run_cap`` (the next time something outside may look at the worker). A prefill worker
        stops after a boundary that hands off (the loop decides those). ``final``: nothing
        outside is left; a worker whose only event is its next load report stops there."""
        if wk.handoffs is not None:
            return
        core = wk.core
        w = wk.index
        arrivals = wk.arrivals
        releases = wk.releases
        kvq = wk.kv
        buf = wk.buffer
        records = self.records
        release_after = self.release_after_ms if wk.holds else None
        release_first = self.release_before_step and wk.holds
        producer = wk.producer
        n_kv, n_first, n_done = self._n_kv, self._n_first, self._n_done
        track = self.track
        lag = self.lag
        while True:
            ta = arrivals[wk.next_arrival][0] if wk.next_arrival < len(arrivals) else _INF
            tr = releases[0][0] if releases else _INF
            t = wk.next_t if wk.next_t is not None else _INF
            # The earliest event; equal times in kind order: KV deliveries, reports, arrivals,
            # releases, the boundary (a release at a boundary's own instant belongs to an
            # earlier boundary: the pending one was pushed after it).
            if kvq or wk.report_t < _INF:  # the rarer kinds, first at equal times
                tk = kvq[0][0] if kvq else _INF
                tp = wk.report_t
                if tk <= tp and tk <= ta and tk <= tr and tk <= t:
                    if tk > lt or (tk == lt and lc <= C_KV):
                        return
                    _, b, events = kvq.popleft()
                    buf.append((tk, ("K", w, b), _N_KV, events))
                    continue
                if tp <= ta and tp <= tr and tp <= t:
                    if final and ta == _INF and tr == _INF and t == _INF and not kvq:
                        return  # only reports left: the run's end decides how many remain
                    if tp > lt or (tp == lt and lc <= C_REPORT):
                        return
                    self._report(wk, tp)
                    continue
            if ta <= tr and ta <= t:
                if ta >= lt and (ta > lt or ta == _INF or lc <= C_ARRIVAL):  # INF: nothing left
                    return
                _, seq, req = arrivals[wk.next_arrival]
                wk.next_arrival += 1
                self._add(wk, ta, req, ("A", seq), 0)
                continue
            if tr <= t:
                if tr >= lt and (tr > lt or tr == _INF or not self._order.release_before(releases[0], w, lc, lnode)):
                    return
                _, pusher, k, rid, _ = heapq.heappop(releases)
                core.release(rid)
                if wk.next_t is None:
                    if core.has_work():
                        self._push(wk, tr, None, (("R", w, pusher, k), 0))
                    elif wk.draining:
                        self._check_gone(wk, tr, ("R", w, pusher, k))
                continue
            if t >= lt and (t > lt or t == _INF or lc < C_STEP
                            or (lc == C_STEP and not self._order.before(("B", w, wk.cur), lnode))):
                return
            # A step boundary: deliver the step that just ended, then start the next one.
            payload = wk.payload
            b = wk.cur
            handoffs = None
            if payload is not None:
                node = ("B", w, b) if track else None
                if type(payload) is StepResult:
                    for rid, cached in payload.admitted:
                        rec = records[rid]
                        if rec.handoff_ms is None:  # its first admission (not the decode side's)
                            rec.cached_tokens = cached
                    for rid, loaded, ms in payload.onboarded:
                        rec = records[rid]
                        if rec.handoff_ms is None:
                            rec.onboarded_tokens = loaded
                            rec.onboard_ms = ms
                    if payload.admitted or wk.prefilling:
                        self._count_prefill_step(wk, payload, t)
                    if producer:
                        for tok in payload.tokens:
                            records[tok.request_id].token_times.append(t)
                        if payload.tokens:
                            handoffs = payload.tokens
                    else:
                        for tok in payload.tokens:
                            rid = tok.request_id
                            rec = records[rid]
                            rec.token_times.append(t)
                            if n_first and tok.index == 0:
                                buf.append((t, node, _N_FIRST, rid))
                            if tok.finished:
                                rec.finished = True
                                self.completed += 1
                                if t > self.last_completion:
                                    self.last_completion = t
                                if n_done:
                                    buf.append((t, node, _N_DONE, rid))
                    if payload.finished:
                        if release_first:
                            for rid in payload.finished:
                                core.release(rid)
                        elif release_after is not None:
                            tr = t + release_after
                            kind = C_STEP if tr == t else C_BEFORE
                            for k, rid in enumerate(payload.finished):
                                heapq.heappush(releases, (tr, b, k, rid, kind))
                    events = core.take_kv_events()
                else:  # the last step of a decode run: one more token each
                    for rid in payload.request_ids:
                        records[rid].token_times.append(t)
                    events = payload.events
                    more = core.take_kv_events()
                    if more:
                        events = events + more
                if events and n_kv:
                    if lag > 0.0:
                        kvq.append((t + lag, b, events))
                    else:
                        buf.append((t, node, _N_KV, events))
                if t > self.last_time:  # workers run apart: the latest delivery, not the last
                    self.last_time = t
            run = None
            if self.coalesce:
                limit = run_cap
                if ta < limit:
                    limit = ta
                if releases and releases[0][0] < limit:
                    limit = releases[0][0]
                if wk.report_t < limit:
                    limit = wk.report_t
                run = core.run_decode(t, limit)
            if run is None:
                res = core.step()
                if res.num_scheduled == 0:
                    wk.next_t = None
                    wk.payload = None
                    if wk.draining:
                        self._check_gone(wk, t, ("G", w, b))
                else:
                    self.steps += 1
                    self._push(wk, t + res.duration_ms, res)
            else:
                self._take_run(wk, b, run)
            if handoffs is not None:
                wk.handoffs = handoffs
                wk.handoff_b = b
                return

    def _count_prefill_step(self, wk: _Worker, res: StepResult, t: float) -> None:
        """The step ending at ``t``: when it started for the requests it admitted first, and
        one more step for every request still before its first token."""
        prefilling = wk.prefilling
        records = self.records
        for rid, _ in res.admitted:
            rec = records[rid]
            if rec.handoff_ms is None and rec.admitted_ms is None:
                rec.admitted_ms = t - res.duration_ms
                prefilling[rid] = rec
        for rec in prefilling.values():
            rec.prefill_steps += 1
        for tok in res.tokens:
            prefilling.pop(tok.request_id, None)

    def _report(self, wk: _Worker, tp: float) -> None:
        k = len(wk.report_times)
        wk.report_times.append(tp)
        wk.buffer.append((tp, ("P", wk.index, k), _N_REPORT, wk.core.stats()))
        wk.report_t = tp + self.load_report_ms

    def _check_gone(self, wk: _Worker, t: float, node: tuple) -> None:
        core = wk.core
        if not wk.gone and not core.has_work() and not core.scheduler.held:
            self._gone(wk)
            if self._n_gone:
                wk.buffer.append((t, node, _N_GONE, None))

    @staticmethod
    def _gone(wk: _Worker) -> None:
        wk.gone = True
        wk.report_t = _INF  # a gone worker reports no more

    def _take_run(self, wk: _Worker, b: int, run: DecodeRun) -> None:
        """Record a decode run started at boundary ``b``: its steps' boundaries, tokens and
        events, and the boundary it leaves pending."""
        k = run.num_steps
        final = run.final
        self.steps += k + (final is not None)
        records = self.records
        ends = run.starts[1:]
        # Boundaries b+1..b+k end the run's steps. All but the last are behind us; the last is
        # too when the run ends with a normal step (which starts there), else it is pending.
        inner = k if final is not None else k - 1
        if inner > 0:
            done = array("d", ends[:inner])
            for rid in run.request_ids:
                records[rid].token_times.extend(done)
            if done[-1] > self.last_time:
                self.last_time = done[-1]
            if self.track:
                wk.times.extend(done)
        events = run.events
        last_events: list = []
        if self._n_kv and events:
            w = wk.index
            base = b + 1
            lag = self.lag
            for j, evs in events:
                if not evs:
                    continue
                if j >= inner:  # the pending boundary's own: delivered with it
                    last_events = evs
                elif lag > 0.0:
                    wk.kv.append((ends[j] + lag, base + j, evs))
                else:
                    wk.buffer.append((ends[j], ("B", w, base + j), _N_KV, evs))
        wk.num_boundaries += inner
        if final is not None:
            self._push(wk, run.starts[k] + final.duration_ms, final)
        else:
            self._push(wk, ends[k - 1], _RunEnd(run.request_ids, last_events))

    def _end_reports(self) -> None:
        """Settle the load reports once the last request is through (at ``last_completion``):
        each worker's reports end with its first one after it (that one was scheduled while a
        request was still running). Reports fired past that are dropped (never delivered: every
        delivery so far preceded a moment with a request unfinished); a worker that stopped at
        its next report (the run's end) fires the rest, from its idle engine."""
        if self.load_report_ms is None:
            return
        end = self.last_completion
        for wk in self.workers:
            rt = wk.report_times
            k = 0
            while k < len(rt) and rt[k] <= end:
                k += 1
            if k < len(rt):
                if k + 1 < len(rt):
                    wk.buffer = deque(e for e in wk.buffer if not (e[2] == _N_REPORT and e[1][2] > k))
                    del rt[k + 1:]
            else:
                while wk.report_t < _INF:
                    tp = wk.report_t
                    self._report(wk, tp)
                    if tp > end:
                        break
            wk.report_t = _INF

    # ----------------------------------------------------------- delivering the notifications

    def _flush(self, lt: float, lc: int, lnode: tuple | None) -> None:
        """Deliver the buffered notifications before the limit, in the one-heap loop's order."""
        if not self.track:
            return
        order = self._order
        batch: list[OrderKey] = []
        for wk in self.workers:
            buf = wk.buffer
            w = wk.index
            while buf:
                e = buf[0]
                t = e[0]
                if t > lt or (t == lt and not order.entry_before(e[1], lc, lnode)):
                    break
                buf.popleft()
                batch.append(OrderKey(t, w, len(batch), e, order))
        if len(batch) > 1:
            batch.sort()
        hooks = self.hooks
        workers = self.workers
        for o in batch:
            t, node, kind, arg = o.entry
            wid = workers[node[1]].id
            if kind == _N_KV:
                hooks.on_kv(wid, arg, t)
            elif kind == _N_FIRST:
                hooks.on_first_token(wid, arg, t)
            elif kind == _N_DONE:
                hooks.on_complete(wid, arg, t)
            elif kind == _N_REPORT:
                hooks.on_load_report(wid, arg, t)
            else:
                hooks.on_gone(wid, t)
