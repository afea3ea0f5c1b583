"""The cluster simulator's router side: the router's decision and its in-flight ledger on the
virtual clock of :class:`data_plane.engines.cluster.Cluster` (the one virtual-time driver).

One implementation, used by the routing benchmark (``benchmarks/routing_bench.py``), replay's
what-if (``control_plane/replay/whatif.py``) and the demo's prediction of what a run should show
(``ops/demo/runcheck.py``). :class:`SimRouter` is the driver's
:class:`~data_plane.engines.hooks.ClusterHooks`; its rules:

* **overlaps** from a :class:`~control_plane.index.native.NativePrefixIndex` folded from the
  simulated engines' own KV events, published when the step that produced them ends (plus
  ``kv_event_lag_ms`` of transport if asked for);
* **loads** from ``WorkerLoadReported``-style snapshots of ``EngineCore.stats()`` every
  ``load_report_ms`` of virtual time per worker (staggered);
* the router's **in-flight ledger** with its speculative overlap: ``add`` at the decision,
  ``prefill_done`` at the first token, ``complete`` at the last one (disaggregated:
  ``complete`` on the prefill worker at the hand-off, then a decode decision);
* the disaggregated KV transfer is free and instant (as in Dynamo's mocker without a
  bandwidth): the decode request arrives at the prefill step's end.
"""

from __future__ import annotations

import math
import time
from array import array
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from control_plane.index.native import NativePrefixIndex
from control_plane.router import RouterConfig, WorkerLoad, WorkerOverlap
from control_plane.router.inputs import decision_inputs, execute, routed_event
from control_plane.router.ledger import RouterLedger
from data_plane.engines import EngineRequest, default_hash_config, load_profile
from data_plane.engines.core import EngineStats
from data_plane.engines.profiles import HardwareProfile
from data_plane.engines.records import percentile
from data_plane.engines.cluster import Cluster
from data_plane.engines.hooks import Hooks, Placement
from data_plane.engines.tiers import OnboardCosts
from schemas.envelope import Envelope, EnvelopeFactory
from schemas.events import Event, FirstToken, PrefillCompleted, RequestAdmitted, RequestCompleted
from schemas.types import BlockHash, RequestPhase, RequestId, RoutingMode, Tier, WorkerId, WorkerRole

#: A live worker's ``WorkerSettings.load_interval_s`` default, in ms.
DEFAULT_LOAD_REPORT_MS = 1000.0

@dataclass(frozen=True, slots=True)
class Topology:
    """Workers of one benchmark configuration: ``aggregated`` > 0, or ``prefill`` and ``decode``."""

    name: str
    aggregated: int = 0
    prefill: int = 0
    decode: int = 0

    @property
    def disaggregated(self) -> bool:
        return self.aggregated == 0

    def dynamo_kwargs(self) -> dict[str, Any]:
        if not self.disaggregated:
            return {"num_workers": self.aggregated}
        return {
            "num_prefill_workers": self.prefill,
            "num_decode_workers": self.decode,
            "prefill_engine_args": {"engine": {"worker_type": "prefill"}},
            "decode_engine_args": {"engine": {"worker_type": "decode"}},
        }


AGGREGATED_8 = Topology("8 aggregated", aggregated=8)
DISAGGREGATED_4P4D = Topology("4 prefill + 4 decode", prefill=4, decode=4)
TOPOLOGIES = (AGGREGATED_8, DISAGGREGATED_4P4D)


# ----------------------------------------------------------------------------------------------
# The router adapter: feeds ``decide`` like ``control_plane.router.proxy.Router`` does
# ----------------------------------------------------------------------------------------------


@dataclass(slots=True)
class RouterStats:
    decisions: int = 0
    decide_s: float = 0.0
    kv_events: int = 0
    load_reports: int = 0
    guards: dict[str, int] = field(default_factory=dict)
    #: Decisions whose chosen worker had the longest index match among the candidates.
    chose_best_match: int = 0
    #: Decisions where some candidate had a non-zero index match.
    had_match: int = 0
    #: Peer fetches the chosen workers ran, and the blocks they pulled.
    peer_fetches: int = 0
    peer_blocks: int = 0
    #: Session affinity's verdicts (``applied`` / ``yielded``), from the decisions' score rows.
    affinity: dict[str, int] = field(default_factory=dict)


class SimRouter(Hooks):
    """One router replica in virtual time: prefix index + load reports + the router's ledger.

    It decides and records exactly as the live router does: inputs through
    :func:`~control_plane.router.inputs.decision_inputs` (this object is the
    :class:`~control_plane.router.inputs.CandidateSource`, folded from the simulated engines'
    KV events and load reports), ``decide`` through ``execute``, the ``RequestRouted`` from
    ``routed_event``, and every fact (admission, route, first token, completion) folded into
    its :class:`~control_plane.router.ledger.RouterLedger` as an envelope stamped on the virtual
    clock. ``recorded`` keeps them when asked (``record=True``), as a log a replay could read.

    It is the cluster driver's hooks (:class:`~data_plane.engines.hooks.ClusterHooks`): the
    driver asks it to place arrivals and hand-offs and tells it, in the one-heap loop's order,
    the engines' KV events, load reports, first tokens and completions.
    """

    def __init__(
        self,
        config: RouterConfig,
        workers: Sequence[tuple[WorkerId, WorkerRole]],
        *,
        hash_algo: str,
        block_size: int,
        kv_capacity_blocks: int,
        router_id: str = "sim-router",
        record: bool = False,
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.hash_algo = hash_algo
        self.index = NativePrefixIndex(hash_algo, block_size)
        self.ledger = RouterLedger(config.inflight_ttl_s)
        self.uses_index = config.mode is RoutingMode.KV
        self._seq: dict[WorkerId, int] = {}
        #: The latest load report per worker, as the registry holds it.
        self.loads: dict[WorkerId, WorkerLoad] = {
            wid: WorkerLoad(worker_id=wid, role=role, kv_capacity_blocks=kv_capacity_blocks)
            for wid, role in workers
        }
        self.stats = RouterStats()
        #: Request id -> the client's session id (``run_cluster(sessions=...)``); none: no sessions.
        self.sessions: Mapping[str, str] = {}
        self._now_ns = 0
        self._factory = EnvelopeFactory(router_id, 1, lambda: self._now_ns)
        self.router_id = router_id
        self.recorded: list[Envelope[Event]] | None = [] if record else None
        self._open: dict[str, tuple[tuple[BlockHash, ...], int, int]] = {}
        #: Request -> when it was admitted (ms), until its first token; then its TTFT (ms), until
        #: it completes: ``RequestCompleted.ttft_ms``, so the ledger's TTFT fit learns in virtual
        #: time as it does live (it used to record 0, and the fit never left the prior).
        self._admitted_ms: dict[str, float] = {}
        self._ttft_ms: dict[str, float] = {}
        #: Request -> when its first token came (ms), until it completes (its mean ITL).
        self._first_ms: dict[str, float] = {}
        self.roles: dict[WorkerId, WorkerRole] = dict(workers)
        #: A request's first phase: prefill when the cluster has prefill workers.
        self.entry_phase = (RequestPhase.PREFILL if WorkerRole.PREFILL in self.roles.values()
                            else RequestPhase.AGGREGATED)
        #: The cluster it routes for (``run_cluster`` sets it): peer fetch reads the engines.
        self.cluster: Cluster | None = None
        self._peer: tuple[WorkerId, int] | None = None

    # -- the router's inputs (CandidateSource) -----------------------------------------------

    def candidates(self, role: str) -> list[WorkerLoad]:
        return [w for w in self.loads.values() if w.role == role]

    def overlaps(self, hashes: Sequence[BlockHash]) -> dict[WorkerId, WorkerOverlap]:
        if not self.uses_index:
            return {}  # only kv mode reads the index
        out: dict[WorkerId, WorkerOverlap] = {}
        depth: dict[WorkerId, int] = {}
        for rank, m in self.index.find_matches(hashes).items():
            if m.depth > depth.get(rank.worker_id, -1):
                depth[rank.worker_id] = m.depth
                out[rank.worker_id] = WorkerOverlap.from_tiers(m.by_tier, stale=m.stale)
        return out

    def on_kv_events(self, worker_id: WorkerId, events: Sequence[Any]) -> None:
        """Fold one published batch of a worker's KV events (producer = the worker, epoch 0,
        dense per-worker sequence numbers, as the envelope would carry them)."""
        if not self.uses_index:
            return  # round robin never reads the index; skipping the fold changes nothing
        seq = self._seq.get(worker_id, 0)
        apply = self.index.apply
        for ev in events:
            apply(worker_id, 0, seq, ev)
            seq += 1
        self._seq[worker_id] = seq
        self.stats.kv_events += len(events)

    def on_load_report(self, worker_id: WorkerId, st: EngineStats, t: float = 0.0) -> None:
        """What ``RouterView`` folds from ``WorkerLoadReported`` (see ``WorkerService.load_report``)."""
        self.loads[worker_id] = WorkerLoad(
            worker_id=worker_id,
            role=self.loads[worker_id].role,
            queued_prefill_tokens=st.queued_prefill_tokens,
            active_decode_blocks=st.active_blocks,
            inflight_requests=st.running + st.waiting,
            kv_capacity_blocks=self.loads[worker_id].kv_capacity_blocks,
        )
        self.stats.load_reports += 1

    # -- recording: every fact goes through the ledger's fold ----------------------------------

    def _record(self, payload: Event, now_ms: float) -> None:
        self._now_ns = int(now_ms * 1e6)
        env = self._factory.wrap(payload, correlation_id=getattr(payload, "request_id", None))
        self.ledger.apply(env)
        if self.recorded is not None:
            self.recorded.append(env)

    def admit(self, request_id: str, hashes: Sequence[BlockHash], prompt_tokens: int, max_tokens: int,
              now_ms: float) -> None:
        self._open[request_id] = (tuple(hashes), prompt_tokens, max_tokens)
        self._admitted_ms[request_id] = now_ms
        self._record(RequestAdmitted(request_id=request_id, model="sim", prompt_tokens=prompt_tokens,
                                     max_tokens=max_tokens, block_hashes=list(hashes), block_size=self.block_size,
                                     hash_algo=self.hash_algo), now_ms)

    def route(self, request_id: str, phase: RequestPhase, now_ms: float) -> WorkerId:
        hashes, prompt_tokens, max_tokens = self._open[request_id]
        now = now_ms / 1e3
        inputs = decision_inputs(self, self.ledger, request_id=request_id, prompt_tokens=prompt_tokens,
                                 block_hashes=hashes, block_size=self.block_size,
                                 expected_output_tokens=max_tokens, phase=phase, attempt=0, now=now,
                                 peer_reach=self.config.tier_weights.peer > 0, pairs=self.config.pd_pairs,
                                 session=self.sessions.get(request_id, ""), session_ttl_s=self.config.session_ttl_s)
        t0 = time.perf_counter()
        d = execute(inputs, self.config)
        st = self.stats
        st.decide_s += time.perf_counter() - t0
        st.decisions += 1
        for g in d.guards:
            st.guards[g] = st.guards.get(g, 0) + 1
        if inputs.session_worker:
            for row in d.scores:
                if row.session_affinity:
                    st.affinity[row.session_affinity] = st.affinity.get(row.session_affinity, 0) + 1
        overlaps = inputs.overlaps
        if overlaps:
            st.had_match += 1
            best = max(o.depth for o in overlaps.values())
            got = overlaps.get(d.worker_id)
            if got is not None and got.depth == best:
                st.chose_best_match += 1
        self._record(routed_event(d, inputs, self.config, router_id=self.router_id, decided_at_s=now), now_ms)
        chosen = inputs.overlaps.get(d.worker_id)
        self._peer = (chosen.peer_from, chosen.depth + chosen.peer) if chosen is not None and chosen.peer else None
        return d.worker_id

    def first_token(self, request_id: str, worker_id: WorkerId, now_ms: float) -> None:
        """The client's first token (aggregated serving: the router records the prefill done)."""
        self._record(PrefillCompleted(request_id=request_id, worker_id=worker_id,
                                      prompt_tokens=self._open[request_id][1], duration_ms=0.0), now_ms)

    def complete(self, request_id: str, worker_id: WorkerId, now_ms: float) -> None:
        _, prompt_tokens, max_tokens = self._open.pop(request_id)
        self._admitted_ms.pop(request_id, None)
        first = self._first_ms.pop(request_id, None)
        # The mean ITL (the engines generate max_tokens): the decode ITL fit's observation (pairs.py).
        itl = (now_ms - first) / (max_tokens - 1) if first is not None and max_tokens > 1 else 0.0
        self._record(RequestCompleted(request_id=request_id, worker_id=worker_id, prompt_tokens=prompt_tokens,
                                      output_tokens=0, ttft_ms=self._ttft_ms.pop(request_id, 0.0), e2e_ms=0.0,
                                      itl_mean_ms=itl), now_ms)

    # -- the cluster driver's hooks ---------------------------------------------------------------

    def arrive(self, request: EngineRequest, now: float) -> Placement | None:
        rid = request.request_id
        hashes = block_hashes(request)
        self.admit(rid, hashes, len(request.prompt), request.max_tokens, now)
        self._peer = None
        wid = self.route(rid, self.entry_phase, now)
        if self._peer is not None and self.cluster is not None:
            ms = self._peer_fetch(wid, self._peer[0], hashes[: self._peer[1]])
            if ms > 0:
                cluster = self.cluster
                cluster.schedule(now + ms, lambda t: cluster.place(wid, request, t), before_steps=True)
                return None
        return Placement(wid, request)

    def _peer_fetch(self, wid: WorkerId, holder: WorkerId, hashes: Sequence[BlockHash]) -> float:
        """The chosen worker pulls, from ``holder``, the leading blocks of ``hashes`` it lacks
        and the holder has on its device or in host memory (the live worker's
        ``PeerFetch.fetch``): they land in its host tier now; the request enters its engine
        once the modelled transfer is over, and the engine onboards them from host. Returns
        the transfer's modelled ms (0: nothing fetched)."""
        cl = self.cluster
        mine, theirs = cl.virtual_tiers.get(wid), cl.virtual_tiers.get(holder)
        if mine is None or theirs is None:
            return 0.0
        own_pool, peer_pool = cl.core(wid).pool, cl.core(holder).pool
        have = 0
        for h in hashes:
            if own_pool.get_cached_block(h) is None and not mine.holds_fast(h):
                break
            have += 1
        run = []
        for h in hashes[have:]:
            if peer_pool.get_cached_block(h) is None and not theirs.holds_fast(h):
                break
            run.append(h)
        if not run:
            return 0.0
        stored = mine.store_fetched(run, hashes[have - 1] if have else None)
        st = self.stats
        st.peer_fetches += 1
        st.peer_blocks += stored
        return (cl.onboard_costs or OnboardCosts()).peer_fetch_ms(stored, self.block_size)

    def hand_off(self, request: EngineRequest, worker: WorkerId, token: int, now: float) -> Placement:
        """The prompt's KV is computed and held: route the decode phase (its decision releases
        the prefill entry, as the live router's does); the decode worker generates every output
        token (the prompt counts as transferred)."""
        return Placement(self.route(request.request_id, RequestPhase.DECODE, now), request)

    def on_first_token(self, worker: WorkerId, request_id: RequestId, t: float) -> None:
        if self.roles[worker] is not WorkerRole.PREFILL:  # the client's first token (P/D: the decode worker's)
            admitted = self._admitted_ms.pop(request_id, None)
            if admitted is not None:
                self._ttft_ms[request_id] = t - admitted
                self._first_ms[request_id] = t
                if self.roles[worker] is WorkerRole.DECODE:  # as the live router records it
                    self._record(FirstToken(request_id=request_id, worker_id=worker, ttft_ms=t - admitted), t)
        if self.roles[worker] is WorkerRole.AGGREGATED:  # disaggregated: the hand-off did it
            self.first_token(request_id, worker, t)

    def on_complete(self, worker: WorkerId, request_id: RequestId, t: float) -> None:
        self.complete(request_id, worker, t)

    def on_kv(self, worker: WorkerId, events: list[Any], t: float) -> None:
        self.on_kv_events(worker, events)


def block_hashes(request: EngineRequest) -> tuple[BlockHash, ...]:
    """The wire hashes of a request's full prompt blocks (the trace loader's, when it has them)."""
    if request.prompt_hashes is not None:
        return tuple(request.prompt_hashes)
    return tuple(BlockHash(int.from_bytes(d[-8:], "big")) for d in (request.prompt_digests or ()))


# ----------------------------------------------------------------------------------------------
# The cluster: EngineCores on the driver's virtual clock, routed by a SimRouter
# ----------------------------------------------------------------------------------------------


@dataclass(slots=True)
class RoutedRequest:
    """One trace request through the cluster: where it was routed and what the client saw."""

    request: EngineRequest
    hashes: tuple[BlockHash, ...]
    arrival_ms: float
    cached_tokens: int = 0
    prefill_worker: WorkerId | None = None
    worker: WorkerId | None = None
    #: Disaggregated: when the prefill worker finished the prompt (the hand-off).
    handoff_ms: float | None = None
    #: Delivery times of the tokens the client sees.
    token_times: array = field(default_factory=lambda: array("d"))
    finished: bool = False
    #: Of ``cached_tokens``, those loaded from a tier below the device (``run_cluster(tiers=)``).
    onboarded_tokens: int = 0
    #: The driver's account of its prefill (:class:`~data_plane.engines.records.RequestRecord`):
    #: start of its admitting step, steps through its first token, its prefix's load time.
    admitted_ms: float | None = None
    prefill_steps: int = 0
    onboard_ms: float = 0.0


@dataclass(slots=True)
class ClusterResult:
    """Every request's outcome plus the router's counters; ``summary()`` gives the metrics."""

    records: list[RoutedRequest]
    duration_ms: float
    steps: int
    preemptions: int
    router: RouterStats
    #: With tiers: blocks moved between tiers over the run, by (from tier, to tier), all workers.
    tier_moves: dict[tuple[str, str], int] = field(default_factory=dict)
    #: With ``run_cluster(record=True)``: the router's events in the order it recorded them.
    recorded: list[Envelope[Event]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        done = [r for r in self.records if r.token_times]
        ttft = np.array([r.token_times[0] - r.arrival_ms for r in done])
        itl = (
            np.concatenate([np.diff(np.frombuffer(r.token_times, dtype=np.float64)) for r in done])
            if done else np.array([])
        )
        e2e = np.array([r.token_times[-1] - r.arrival_ms for r in done])
        out_tokens = sum(len(r.token_times) for r in done)
        prompt = sum(len(r.request.prompt) for r in self.records)
        cached = sum(r.cached_tokens for r in self.records)

        pct = percentile
        rs = self.router
        return {
            "ttft_p50_ms": pct(ttft, 50),
            "ttft_p99_ms": pct(ttft, 99),
            "ttft_mean_ms": float(ttft.mean()) if ttft.size else math.nan,
            "ttft_p90_ms": pct(ttft, 90),
            "itl_p50_ms": pct(itl, 50),
            "itl_p99_ms": pct(itl, 99),
            "e2e_p50_ms": pct(e2e, 50),
            "e2e_p99_ms": pct(e2e, 99),
            "output_tok_s": out_tokens / (self.duration_ms / 1e3) if self.duration_ms > 0 else math.nan,
            "reuse": cached / prompt if prompt else 0.0,
            "requests": sum(1 for r in self.records if r.finished),
            "duration_s": self.duration_ms / 1e3,
            "steps": self.steps,
            "preemptions": self.preemptions,
            "decisions": rs.decisions,
            "decide_us": 1e6 * rs.decide_s / rs.decisions if rs.decisions else 0.0,
            "kv_events": rs.kv_events,
            "guards": dict(rs.guards),
            "affinity": dict(rs.affinity),
            "best_match_share": rs.chose_best_match / rs.had_match if rs.had_match else math.nan,
        }


def run_cluster(
    requests: Sequence[EngineRequest],
    topology: Topology,
    config: RouterConfig,
    *,
    profile: HardwareProfile | str = "mocker",
    load_report_ms: float | None = DEFAULT_LOAD_REPORT_MS,
    kv_event_lag_ms: float = 0.0,
    worker_ids: Sequence[str] | None = None,
    tiers: Mapping[Tier, int] | None = None,
    onboard_costs: OnboardCosts | None = None,
    sessions: Mapping[str, str] | None = None,
    record: bool = False,
) -> ClusterResult:
    """Replay ``requests`` (sorted by arrival) on ``topology`` with ``config`` routing them.

    ``tiers``: blocks per tier below the device of every worker (None: device only); engines
    then offload there and onboard at ``onboard_costs`` (see :class:`Cluster`).

    ``load_report_ms``: interval of each worker's load report (None: the router gets no reports
    and relies on its ledger alone, like Dynamo's router). ``kv_event_lag_ms``: transport delay
    of KV events on top of the step that produced them. ``sessions``: request id -> the client's
    session id (``RequestRouted.session``; the session affinity reads them). ``record``: keep the
    router's events in :attr:`ClusterResult.recorded`, as a log a replay could read.
    """
    prof = load_profile(profile) if isinstance(profile, str) else profile
    hash_config = default_hash_config(prof.block_size)
    if topology.disaggregated:
        roles = [WorkerRole.PREFILL] * topology.prefill + [WorkerRole.DECODE] * topology.decode
        names = [f"prefill-{i:02d}" for i in range(topology.prefill)] + [
            f"decode-{i:02d}" for i in range(topology.decode)
        ]
    else:
        roles = [WorkerRole.AGGREGATED] * topology.aggregated
        names = [f"worker-{i:02d}" for i in range(topology.aggregated)]
    if worker_ids is not None:
        if len(worker_ids) != len(names):
            raise ValueError(f"{len(worker_ids)} worker ids for the {len(names)} workers of {topology.name}")
        names = list(worker_ids)
    ids = [WorkerId(n) for n in names]
    router = SimRouter(
        config, list(zip(ids, roles)), hash_algo=hash_config.hash_algo,
        block_size=prof.block_size, kv_capacity_blocks=prof.num_device_blocks, record=record,
    )
    # The prefill worker frees a handed-off prompt's blocks at the hand-off (release after 0 ms).
    cluster = Cluster(prof, router, hash_config=hash_config, disaggregated=topology.disaggregated,
                      release_after_ms=0.0, load_report_ms=load_report_ms, kv_event_lag_ms=kv_event_lag_ms,
                      tiers=tiers, onboard_costs=onboard_costs)
    router.cluster = cluster
    router.sessions = sessions or {}
    cores = [cluster.add_worker(wid, role) for wid, role in zip(ids, roles)]
    out = cluster.run(requests)
    disaggregated = topology.disaggregated
    records = []
    for r in out:
        req = cluster.request(r.request_id)
        # Disaggregated: the client's tokens are the decode worker's (the prefill worker's first
        # token only triggers the hand-off).
        times = r.token_times[1:] if disaggregated and r.handoff_ms is not None else r.token_times
        records.append(RoutedRequest(
            req, block_hashes(req), r.arrival_ms, cached_tokens=r.cached_tokens,
            prefill_worker=r.prefill_worker_id if r.handoff_ms is not None else r.worker_id,
            worker=r.worker_id if not disaggregated or r.handoff_ms is not None else None,
            handoff_ms=r.handoff_ms, token_times=times, finished=r.finished,
            onboarded_tokens=r.onboarded_tokens, admitted_ms=r.admitted_ms,
            prefill_steps=r.prefill_steps, onboard_ms=r.onboard_ms,
        ))
    moves: Counter[tuple[str, str]] = Counter()
    for vt in cluster.virtual_tiers.values():
        moves.update(vt.moves)
    first_arrival = records[0].arrival_ms if records else 0.0
    return ClusterResult(
        records=records,
        duration_ms=max(cluster.last_time, first_arrival) - first_arrival,
        steps=cluster.steps,
        preemptions=sum(c.scheduler.num_preemptions for c in cores),
        router=router.stats,
        tier_moves=dict(moves),
        recorded=router.recorded or [],
    )
