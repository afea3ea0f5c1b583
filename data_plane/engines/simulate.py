"""Engine workers on a virtual clock: the one discrete-event driver of every simulation.

``simulate(requests, "mocker", num_workers=4)`` replays requests (each with ``arrival_ms``)
through ``EngineCore`` s and returns per-request TTFT, inter-token latencies, end-to-end
latency, token counts and prefix-cache hits, plus the usual aggregates. It is the engine-only
entry point of :class:`Cluster`, which also runs the cluster with a router side: the routing
benchmark, replay's what-if and the demo's predictions (``control_plane.simulation``), and the
planner benchmark (``benchmarks/planner_bench.py``). The router side plugs in through
:class:`ClusterHooks`; this package imports nothing from the control plane.

Its clock rules, the order every speed-up keeps, and how it goes fast: ``docs/engine.md``,
"The virtual clock".
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple, Protocol

import numpy as np

from kernel.hashing import HashConfig
from data_plane.engines.core import DecodeRun, EngineCore, EngineStats, StepResult
from data_plane.engines.gcpause import paused_gc
from data_plane.engines.profiles import HardwareProfile, load_profile
from data_plane.engines.request import EngineRequest
from data_plane.engines.tiers import OnboardCosts, VirtualTiers
from data_plane.kvbm.admission import AdmissionConfig
from kernel.log.sink import EventSink
from schemas.events import KvEvent
from schemas.types import RequestId, Tier, WorkerId, WorkerRole

Router = Callable[[EngineRequest, Sequence[EngineCore]], int]

_INF = math.inf


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request (times in virtual ms from the clock origin)."""

    request_id: RequestId
    #: The worker of its last placed phase (None until placed).
    worker_id: WorkerId | None
    arrival_ms: float
    prompt_tokens: int
    max_tokens: int
    #: Prompt tokens served from the prefix cache at its first admission (0 until admitted);
    #: disaggregated: on the prefill worker.
    cached_tokens: int = 0
    #: Delivery time of every output token, in order (disaggregated: the prefill worker's first
    #: token, then the decode worker's).
    token_times: array = field(default_factory=lambda: array("d"))
    #: Through its last phase (its last token came from an aggregated or decode worker, or the
    #: hooks said it has no decode phase).
    finished: bool = False
    #: Disaggregated: the prefill worker and the instant it handed the request off.
    prefill_worker_id: WorkerId | None = None
    handoff_ms: float | None = None
    #: Of ``cached_tokens``, those loaded from a tier below the device (``Cluster(tiers=...)``).
    onboarded_tokens: int = 0
    #: Start of the step that first admitted it (its wait in the queue ends there; None until
    #: admitted). Disaggregated: on the prefill worker.
    admitted_ms: float | None = None
    #: Steps its worker ran from that admission through its first token (stalls included).
    prefill_steps: int = 0
    #: From its admission, ms until its onboarded prefix was in (0: nothing loaded).
    onboard_ms: float = 0.0

    @property
    def output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def first_token_ms(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def ttft_ms(self) -> float | None:
        return self.token_times[0] - self.arrival_ms if self.token_times else None

    @property
    def e2e_ms(self) -> float | None:
        return self.token_times[-1] - self.arrival_ms if self.token_times else None

    @property
    def itl_ms(self) -> list[float]:
        t = self.token_times
        return [t[i + 1] - t[i] for i in range(len(t) - 1)]


@dataclass(slots=True)
class SimulationResult:
    requests: list[RequestRecord]
    #: Last token delivery minus first arrival.
    duration_ms: float
    steps: int
    preemptions: int
    profile: str
    num_workers: int

    def summary(self) -> dict[str, Any]:
        """Aggregates comparable with Dynamo's replay report.

        ``itl_p50_ms`` is over all inter-token intervals of all requests (Dynamo's
        ``median_itl_ms``); ``tpot_p50_ms`` over requests of (e2e - ttft) / (tokens - 1).
        ``prefix_reuse_ratio`` = cached prompt tokens / prompt tokens (Dynamo's
        ``prefix_cache_reused_ratio``).
        """
        done = [r for r in self.requests if r.token_times]
        ttft = np.array([r.ttft_ms for r in done])
        e2e = np.array([r.e2e_ms for r in done])
        itl = (
            np.concatenate([np.diff(np.frombuffer(r.token_times, dtype=np.float64)) for r in done])
            if done
            else np.array([])
        )
        tpot = np.array(
            [(r.e2e_ms - r.ttft_ms) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
        )
        out_tokens = sum(r.output_tokens for r in done)
        prompt = sum(r.prompt_tokens for r in self.requests)
        cached = sum(r.cached_tokens for r in self.requests)

        def pct(a: np.ndarray, q: float) -> float:
            return float(np.percentile(a, q)) if a.size else math.nan

        return {
            "profile": self.profile,
            "num_workers": self.num_workers,
            "requests": len(self.requests),
            "completed": sum(1 for r in self.requests if r.finished),
            "duration_ms": self.duration_ms,
            "steps": self.steps,
            "preemptions": self.preemptions,
            "output_tokens": out_tokens,
            "output_tok_s": out_tokens / (self.duration_ms / 1e3) if self.duration_ms > 0 else math.nan,
            "ttft_mean_ms": float(ttft.mean()) if ttft.size else math.nan,
            "ttft_p50_ms": pct(ttft, 50),
            "ttft_p90_ms": pct(ttft, 90),
            "ttft_p99_ms": pct(ttft, 99),
            "itl_mean_ms": float(itl.mean()) if itl.size else math.nan,
            "itl_p50_ms": pct(itl, 50),
            "itl_p99_ms": pct(itl, 99),
            "tpot_p50_ms": pct(tpot, 50),
            "e2e_p50_ms": pct(e2e, 50),
            "e2e_p99_ms": pct(e2e, 99),
            "prefix_reuse_ratio": cached / prompt if prompt else 0.0,
        }


# ----------------------------------------------------------------------------------------------
# The router side's port
# ----------------------------------------------------------------------------------------------


class Placement(NamedTuple):
    """Where a request's phase runs, and the engine request the worker gets for it."""

    worker: WorkerId
    request: EngineRequest


class HandOff(Enum):
    #: ``hand_off``'s answer for a request with no decode phase (its prefill token was its last
    #: one): it is finished there.
    FINISHED = "finished"


class ClusterHooks(Protocol):
    """What the driver asks and tells the router side, in the one-heap loop's order.

    The two deciding hooks, :meth:`arrive` and :meth:`hand_off`, and timer callbacks see every
    notification that precedes them. A timer callback and ``arrive`` may read any engine (every
    worker is at that instant); ``hand_off`` may read the engines of workers that are not
    prefill workers (those run ahead, see :class:`Cluster`). The notifications (``on_*``) get
    values, never live engines: they may be delivered after the engine has moved on.
    """

    def arrive(self, request: EngineRequest, now: float) -> Placement | None:
        """A request arrives: place its first phase (None: the hooks keep it and place it later
        with :meth:`Cluster.place`, e.g. when a worker becomes ready)."""
        ...

    def hand_off(self, request: EngineRequest, worker: WorkerId, token: int,
                 now: float) -> Placement | HandOff | None:
        """Prefill ``worker`` delivered ``request``'s first token (``token``): place its decode
        phase (None: the hooks place it later with :meth:`Cluster.place`; ``HandOff.FINISHED``:
        it has none)."""
        ...

    def on_first_token(self, worker: WorkerId, request_id: RequestId, t: float) -> None:
        """A worker that is not a prefill worker delivered the token of index 0 of its request."""
        ...

    def on_complete(self, worker: WorkerId, request_id: RequestId, t: float) -> None:
        """A worker that is not a prefill worker delivered its request's last token."""
        ...

    def on_kv(self, worker: WorkerId, events: list[KvEvent], t: float) -> None:
        """``worker``'s KV events of the step that ended ``kv_event_lag_ms`` before ``t``."""
        ...

    def on_load_report(self, worker: WorkerId, stats: EngineStats, t: float) -> None:
        """``worker``'s periodic load report (``Cluster(load_report_ms=...)``)."""
        ...

    def on_ready(self, worker: WorkerId, t: float) -> None:
        """A worker added with a start-up delay can take requests from now on."""
        ...

    def on_gone(self, worker: WorkerId, t: float) -> None:
        """A drained worker has nothing left (no work, no held blocks), or was cancelled before
        it became ready."""
        ...


class Hooks:
    """Silent hooks to subclass: a notification a subclass does not override is never even
    buffered (the driver checks), so a router side pays only for what it listens to."""

    def arrive(self, request: EngineRequest, now: float) -> Placement | None:
        raise NotImplementedError("a cluster's hooks must place arrivals")

    def hand_off(self, request: EngineRequest, worker: WorkerId, token: int,
                 now: float) -> Placement | HandOff | None:
        return HandOff.FINISHED

    def on_first_token(self, worker: WorkerId, request_id: RequestId, t: float) -> None:
        pass

    def on_complete(self, worker: WorkerId, request_id: RequestId, t: float) -> None:
        pass

    def on_kv(self, worker: WorkerId, events: list[KvEvent], t: float) -> None:
        pass

    def on_load_report(self, worker: WorkerId, stats: EngineStats, t: float) -> None:
        pass

    def on_ready(self, worker: WorkerId, t: float) -> None:
        pass

    def on_gone(self, worker: WorkerId, t: float) -> None:
        pass


def _listens(hooks: Any, name: str) -> bool:
    return getattr(type(hooks), name, None) is not getattr(Hooks, name)


# ----------------------------------------------------------------------------------------------
# The driver
# ----------------------------------------------------------------------------------------------

# Kinds of events at one instant, in the order the one-heap loop pops them. A limit of kind
# _C_NONE at ``t`` stops before everything at ``t``.
_C_NONE, _C_KV, _C_REPORT, _C_ARRIVAL, _C_BEFORE, _C_STEP, _C_AFTER, _C_END = -1, 0, 1, 2, 3, 4, 5, 6
# A step boundary's group: the boundary, then what it pushed for its own instant, in kind order
# (KV delivery if the lag rounds to nothing, hand-offs, releases), then its worker going away.
_G_SELF, _G_KV, _G_HANDOFF, _G_RELEASE, _G_GONE = -3, -2, 0, 1, 9
# Buffered notifications.
_N_KV, _N_FIRST, _N_DONE, _N_REPORT, _N_GONE = range(5)

#: Arrivals between two flushes of the merged notifications (routing fixed in advance).
_FLUSH_EVERY = 256

# Event nodes (what the order comparator walks): ("B", w, b) boundary b of worker w; ("A", i)
# arrival i; ("H", w, b, k) hand-off k of boundary (w, b); ("R", w, b, k) its release k;
# ("K", w, b) the lagged delivery of its KV events; ("G", w, b) worker w gone at it;
# ("P", w, k) load report k of worker w; ("I", w) the start, which scheduled w's first report;
# ("T", j) timer j.


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
        self._n_kv = _listens(hooks, "on_kv")
        self._n_first = _listens(hooks, "on_first_token")
        self._n_done = _listens(hooks, "on_complete")
        self._n_report = load_report_ms is not None and _listens(hooks, "on_load_report")
        self._n_gone = _listens(hooks, "on_gone")
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
        kind = _C_BEFORE if before_steps else _C_AFTER
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
                gt, gc, gnode = self._arrival_t[i], _C_ARRIVAL, ("A", i)
            else:
                gt, gc, gnode = _INF, _C_END, None
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
                    if wk.handoffs is not None and (h is None or self._before(("B", wk.index, wk.handoff_b),
                                                                               ("B", h.index, h.handoff_b))):
                        h = wk
            if h is not None:
                lt = h.times[h.handoff_b]
                lnode = ("H", h.index, h.handoff_b, 0)
                for wk in workers:
                    self._advance(wk, lt, _C_STEP, lnode, lt, False)
                self._flush(lt, _C_STEP, lnode)
                self._hand_off(h, lt)
                continue
            for wk in workers:
                if not wk.producer:
                    self._advance(wk, gt, gc, gnode, gt, final)
            if final:
                break
            if gc != _C_ARRIVAL and self.completed == self._total:
                self._end_reports()  # a timer after the last request: no report waits for it
            self._flush(gt, gc, gnode)
            self.now = gt
            self._cur, self._cur_k = gnode, 0
            if gc == _C_ARRIVAL:
                self._arrive(i, reqs[i])
                i += 1
            else:
                _, _, j, fn = heapq.heappop(self._timers)
                fn(gt)
        self._end_reports()
        self._flush(_INF, _C_END, None)

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
                    self._advance(wk, h, _C_NONE, None, _INF, False)
                self._flush(h, _C_NONE, None)
        for wk in workers:
            self._advance(wk, _INF, _C_END, None, _INF, True)
        self._end_reports()
        self._flush(_INF, _C_END, None)

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
                    if tk > lt or (tk == lt and lc <= _C_KV):
                        return
                    _, b, events = kvq.popleft()
                    buf.append((tk, ("K", w, b), _N_KV, events))
                    continue
                if tp <= ta and tp <= tr and tp <= t:
                    if final and ta == _INF and tr == _INF and t == _INF and not kvq:
                        return  # only reports left: the run's end decides how many remain
                    if tp > lt or (tp == lt and lc <= _C_REPORT):
                        return
                    self._report(wk, tp)
                    continue
            if ta <= tr and ta <= t:
                if ta >= lt and (ta > lt or ta == _INF or lc <= _C_ARRIVAL):  # INF: nothing left
                    return
                _, seq, req = arrivals[wk.next_arrival]
                wk.next_arrival += 1
                self._add(wk, ta, req, ("A", seq), 0)
                continue
            if tr <= t:
                if tr >= lt and (tr > lt or tr == _INF or not self._release_before(releases[0], w, lc, lnode)):
                    return
                _, pusher, k, rid, _ = heapq.heappop(releases)
                core.release(rid)
                if wk.next_t is None:
                    if core.has_work():
                        self._push(wk, tr, None, (("R", w, pusher, k), 0))
                    elif wk.draining:
                        self._check_gone(wk, tr, ("R", w, pusher, k))
                continue
            if t >= lt and (t > lt or t == _INF or lc < _C_STEP
                            or (lc == _C_STEP and not self._before(("B", w, wk.cur), lnode))):
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
                            kind = _C_STEP if tr == t else _C_BEFORE
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

    def _release_before(self, rel: tuple, w: int, lc: int, lnode: tuple | None) -> bool:
        """Whether a release at the limit's instant comes before the limit."""
        kind = rel[4]
        if kind != lc:
            return kind < lc
        if kind == _C_BEFORE:
            return True  # releases before timers
        return self._before(("R", w, rel[1], rel[2]), lnode)

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

    # ------------------------------------------------------------------- the order of events

    def _flush(self, lt: float, lc: int, lnode: tuple | None) -> None:
        """Deliver the buffered notifications before the limit, in the one-heap loop's order."""
        if not self.track:
            return
        batch: list[_Order] = []
        for wk in self.workers:
            buf = wk.buffer
            w = wk.index
            while buf:
                e = buf[0]
                t = e[0]
                if t > lt or (t == lt and not self._entry_before(e[1], lc, lnode)):
                    break
                buf.popleft()
                batch.append(_Order(t, w, len(batch), e, self))
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

    def _entry_before(self, node: tuple, lc: int, lnode: tuple | None) -> bool:
        _, c = self._pos(node)
        if c != lc:
            return c < lc
        return c == _C_BEFORE or self._before(node, lnode)

    def _pos(self, x: tuple) -> tuple[float, int]:
        """(time, kind) of an event node."""
        tag = x[0]
        if tag == "B" or tag == "H" or tag == "G":
            return self.workers[x[1]].times[x[2]], _C_STEP
        if tag == "A":
            return self._arrival_t[x[1]], _C_ARRIVAL
        if tag == "R":
            tb = self.workers[x[1]].times[x[2]]
            t = tb + self.release_after_ms
            return t, (_C_STEP if t == tb else _C_BEFORE)
        if tag == "K":
            tb = self.workers[x[1]].times[x[2]]
            t = tb + self.lag
            return t, (_C_STEP if t == tb else _C_KV)
        if tag == "P":
            return self.workers[x[1]].report_times[x[2]], _C_REPORT
        if tag == "T":
            return self._timer_at[x[1]]
        return -_INF, _C_NONE  # "I": the start

    @staticmethod
    def _group(x: tuple) -> tuple[tuple, tuple[int, int]]:
        """A node at its boundary's instant: (the boundary, its place in the group)."""
        tag = x[0]
        if tag == "B":
            return x, (_G_SELF, 0)
        b = ("B", x[1], x[2])
        if tag == "H":
            return b, (_G_HANDOFF, x[3])
        if tag == "R":
            return b, (_G_RELEASE, x[3])
        if tag == "K":
            return b, (_G_KV, 0)
        return b, (_G_GONE, 0)

    def _pusher(self, x: tuple) -> tuple[tuple, int]:
        """(the event that pushed ``x``, the order of ``x`` among its pushes)."""
        tag = x[0]
        if tag == "B":
            w, b = x[1], x[2]
            return self.workers[w].wake.get(b) or (("B", w, b - 1), 0)
        if tag == "P":
            return (("P", x[1], x[2] - 1), 0) if x[2] > 0 else (("I", x[1]), 0)
        if tag == "R":
            return ("B", x[1], x[2]), x[3]
        return ("B", x[1], x[2]), 0  # "K"

    def _before(self, x: tuple, y: tuple) -> bool:
        """Whether event ``x`` came off the one heap before event ``y`` (distinct events).

        The heap orders by (time, kind, push order). An event is pushed while the heap
        processes the one that scheduled it, so at equal time and kind, compare what pushed
        them, back until they differ. Step boundaries at one instant pop in push order, each
        followed by what it pushed for that instant (a group, :meth:`_group`). Arrivals were all
        pushed first, in arrival order; timers are compared by the order they were scheduled
        (they are scheduled by events the loop processes in order).
        """
        pos, pusher = self._pos, self._pusher
        while True:
            tx, cx = pos(x)
            ty, cy = pos(y)
            if tx != ty:
                return tx < ty
            if cx != cy:
                return cx < cy
            if cx == _C_STEP:
                gx, sx = self._group(x)
                gy, sy = self._group(y)
                if gx == gy:
                    return sx < sy
                x, kx = pusher(gx)
                y, ky = pusher(gy)
            elif cx == _C_ARRIVAL or cx == _C_AFTER or cx == _C_NONE:
                return x[1] < y[1]
            elif cx == _C_BEFORE and (x[0] == "T" or y[0] == "T"):
                return y[0] == "T" and (x[0] != "T" or x[1] < y[1])  # releases before timers
            else:
                x, kx = pusher(x)
                y, ky = pusher(y)
            if x == y:
                return kx < ky


class _Order:
    """Sort key of one buffered notification in :meth:`Cluster._flush`."""

    __slots__ = ("t", "w", "i", "entry", "sim")

    def __init__(self, t: float, w: int, i: int, entry: tuple, sim: Cluster) -> None:
        self.t, self.w, self.i, self.entry, self.sim = t, w, i, entry, sim

    def __lt__(self, other: _Order) -> bool:
        if self.t != other.t:
            return self.t < other.t
        if self.w == other.w:
            return self.i < other.i
        return self.sim._before(self.entry[1], other.entry[1])


# ----------------------------------------------------------------------------------------------
# The engine-only entry point
# ----------------------------------------------------------------------------------------------


def round_robin() -> Router:
    """Request ``i`` (in arrival order) goes to worker ``i mod n``."""
    counter = 0

    def route(request: EngineRequest, cores: Sequence[EngineCore]) -> int:
        nonlocal counter
        i = counter % len(cores)
        counter += 1
        return i

    return route


class _EngineOnly(Hooks):
    """``simulate``'s router side: a router over the engines (no sink: nothing is buffered)."""

    def __init__(self, route: Router, cores: Callable[[], list[EngineCore]], ids: list[WorkerId]) -> None:
        self.route = route
        self.cores = cores
        self.ids = ids

    def arrive(self, request: EngineRequest, now: float) -> Placement:
        return Placement(self.ids[self.route(request, self.cores())], request)


class _EngineOnlyToSink(_EngineOnly):
    """... and every KV event to the sink, in the one-heap loop's order."""

    def __init__(self, route: Router, cores: Callable[[], list[EngineCore]], ids: list[WorkerId],
                 sink: EventSink) -> None:
        super().__init__(route, cores, ids)
        self.publish = sink.publish

    def on_kv(self, worker: WorkerId, events: list[KvEvent], t: float) -> None:
        publish = self.publish
        for ev in events:
            publish(ev)


def simulate(
    requests: Iterable[EngineRequest],
    profile: HardwareProfile | str = "mocker",
    *,
    num_workers: int = 1,
    role: WorkerRole = WorkerRole.AGGREGATED,
    router: Router | str = "round_robin",
    sink: EventSink | None = None,
    hash_config: HashConfig | None = None,
    worker_ids: Sequence[WorkerId] | None = None,
    release_after_ms: float | None = 0.0,
    emit_token_ids: bool = False,
    coalesce: bool = True,
    tiers: Mapping[Tier, int] | None = None,
    onboard_costs: OnboardCosts | None = None,
    tier_admission: AdmissionConfig | None = None,
) -> SimulationResult:
    """Run ``requests`` to completion on ``num_workers`` simulated workers.

    ``sink`` receives every KV event (per worker in step order, at step end). In the prefill
    role, a held request is released ``release_after_ms`` after its first token (None: never,
    e.g. to inspect held blocks). Requests without ``arrival_ms`` arrive at 0.

    ``coalesce`` (default) lets a worker apply runs of identical decode steps at once
    (:meth:`EngineCore.run_decode`); False runs every step through ``EngineCore.step``. The
    results, the KV events and their order are the same either way.

    ``tiers`` / ``onboard_costs`` / ``tier_admission``: tiers below each worker's device, see
    :class:`Cluster`.
    """
    prof = load_profile(profile) if isinstance(profile, str) else profile
    if worker_ids is None:
        worker_ids = [WorkerId(f"worker-{i}") for i in range(num_workers)]
    ids = list(worker_ids)
    if len(ids) != num_workers:
        raise ValueError(f"{len(ids)} worker ids for {num_workers} workers")
    route = round_robin() if router == "round_robin" else router
    if isinstance(route, str):
        raise ValueError(f"unknown router {router!r} (known: round_robin, or a callable)")

    def cores() -> list[EngineCore]:
        return engines

    hooks = _EngineOnly(route, cores, ids) if sink is None else _EngineOnlyToSink(route, cores, ids, sink)
    cluster = Cluster(prof, hooks, hash_config=hash_config, emit_token_ids=emit_token_ids, coalesce=coalesce,
                      release_after_ms=release_after_ms, tiers=tiers, onboard_costs=onboard_costs,
                      tier_admission=tier_admission)
    engines = [cluster.add_worker(w, role) for w in ids]
    # Round robin reads no engine: every worker runs on its own from its share of the arrivals.
    records = cluster.run(requests, fixed_routing=router == "round_robin")
    first_arrival = records[0].arrival_ms if records else 0.0
    return SimulationResult(
        requests=records,
        duration_ms=cluster.last_time - first_arrival,
        steps=cluster.steps,
        preemptions=sum(c.scheduler.num_preemptions for c in engines),
        profile=prof.name,
        num_workers=num_workers,
    )
