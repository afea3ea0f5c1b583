"""The kv cost's reference scoring: the Python specification the Rust core
(``native/src/decide.rs``) is held bit-identical to.

:func:`score` computes every candidate's terms (the formula: ``docs/routing-cost.md``),
:func:`pick` applies the capacity and imbalance guards and finds the kv argmin, in numbers;
:func:`score_native` gets the same from the core through ``switchyard_native.decide_kv``. The
words (reasons, score rows) are ``choice.py``'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import reduce
from operator import add, mul

import msgspec
from msgspec.structs import astuple

from control_plane.router.config import RouterConfig
from control_plane.router.decision_types import (
    RoutingRequest,
    WorkerLoad,
    WorkerOverlap,
)
from control_plane.router.errors import InvalidRoutingInput
from control_plane.router.ledger import InflightLoad
from control_plane.router.ttft import PRIOR, predict
from schemas.events import CandidateScore, TtftModel
from schemas.types import TIER_ORDER, RequestPhase, RoutingMode, WorkerId, WorkerRole

#: Costs within this relative distance of the best count as a tie (float sums of the same
#: quantities in a different order may differ in the last bits).
_TIE_RTOL = 1e-9


#: Where ``decide_kv`` finds each field it reads in ``msgspec.structs.astuple(WorkerLoad)``.
_LOAD_AT = tuple(WorkerLoad.__struct_fields__.index(f) for f in (
    "worker_id", "role", "registered", "draining", "queued_prefill_tokens", "active_decode_blocks",
    "inflight_requests", "kv_capacity_blocks"))
#: Where ``decide_kv`` puts each score row field it fills in ``CandidateScore``'s positional
#: arguments: the leading 15 fields, so the rest (``peer_from``) keep their defaults.
_ROW_AT = tuple(CandidateScore.__struct_fields__.index(f) for f in (
    "worker_id", "overlap_blocks", "overlap_by_tier", "queued_prefill_tokens", "active_decode_blocks",
    "inflight_requests", "stale", "prefill_blocks", "decode_blocks", "cost", "probability", "eligible",
    "speculative_overlap", "excluded", "kv_capacity_blocks"))
assert sorted(_ROW_AT) == list(range(len(_ROW_AT))), "decide_kv fills CandidateScore's leading fields"


class Scored:
    """Every candidate's terms, by position in id order (what the rows and the reason show)."""

    __slots__ = ("active", "by_tier", "config", "cost", "decode", "decode_f", "does_prefill", "excluded",
                 "in_flight", "matched", "n", "n_hash", "ordered", "overlap_blocks", "overlap_w", "pick", "prefill",
                 "queued", "request", "request_blocks", "rows", "shared", "shared_by_worker", "stale", "ttft_cost",
                 "weights")

    def __init__(self, request: RoutingRequest, ordered: list[WorkerLoad], config: RouterConfig) -> None:
        n = len(ordered)
        self.request = request
        self.config = config
        self.ordered = ordered
        self.n = n
        self.n_hash = len(request.block_hashes)
        self.request_blocks = request.request_blocks
        self.does_prefill = request.phase is not RequestPhase.DECODE
        self.weights = config.tier_weights.as_tuple()
        # The terms, filled by score or the native core.
        self.queued: list[int]
        self.active: list[int]
        self.in_flight: list[int]
        self.shared: list[int]
        self.overlap_w: list[float]
        self.prefill: list[float]
        self.decode: list[int]
        self.cost: list[float]
        self.matched: list[WorkerOverlap | None]
        self.excluded: list[str | None] = [None] * n
        #: The native core's :class:`Pick`, when it computed one (else :func:`pick` does).
        self.pick: Pick | None = None
        #: The rows' overlap columns (matched blocks, by tier, stale) and the decode term as a
        #: float, when the native core made them (else ``choice.score_rows`` does).
        self.overlap_blocks: list[int] | None = None
        self.by_tier: list[dict[str, int]] | None = None
        self.stale: list[bool] | None = None
        self.decode_f: list[float] | None = None
        #: The score rows, when the native core built them (kv argmin; excluded ones unworded).
        self.rows: tuple[CandidateScore, ...] | None = None
        #: The non-zero speculative overlaps by worker id, when the native core made them.
        self.shared_by_worker: dict[WorkerId, int] | None = None
        #: The cost is each candidate's predicted TTFT (``RouterConfig.cost``), set by decide.
        self.ttft_cost = False


def score(request: RoutingRequest, ordered: list[WorkerLoad], config: RouterConfig,
           overlaps: Mapping[WorkerId, WorkerOverlap], mine_by_worker: Mapping[WorkerId, InflightLoad]) -> Scored:
    """The kv cost's terms for every candidate (the formula: docs/routing-cost.md)."""
    t = Scored(request, ordered, config)
    n = t.n
    t.queued, t.active, t.in_flight, t.shared, t.decode = [0] * n, [0] * n, [0] * n, [0] * n, [0] * n
    t.overlap_w, t.prefill, t.cost = [0.0] * n, [0.0] * n, [0.0] * n
    t.matched = [None] * n
    n_hash = t.n_hash
    block_size = request.block_size
    prompt_tokens = request.prompt_tokens
    request_blocks = t.request_blocks
    does_prefill = t.does_prefill
    phase_value = request.phase.value
    serving_role = WorkerRole(phase_value)
    weights = t.weights
    wd = weights[0]  # the in-flight (speculative) blocks are being written to the device
    stale_factor = config.stale_overlap_factor
    use_max = config.load_combine == "max"
    scale = config.prefill_load_scale
    get_mine = mine_by_worker.get
    get_overlap = overlaps.get
    queued, active, in_flight, shared = t.queued, t.active, t.in_flight, t.shared
    overlap_w, prefill, decode, cost, excluded, matched = t.overlap_w, t.prefill, t.decode, t.cost, t.excluded, t.matched

    # The hot loop (every request, every worker): straight-line arithmetic, no helper calls on
    # the common path. The overlap is the formula in docs/routing-cost.md; choice._real_segments
    # states the same layout for the reason, and the unit tests check decide against an
    # independent block-by-block implementation.
    previous_id = None
    for i, w in enumerate(ordered):
        wid = w.worker_id
        if wid == previous_id:
            raise InvalidRoutingInput(f"worker {wid!r} is listed twice")
        previous_id = wid
        q = w.queued_prefill_tokens
        d = w.active_decode_blocks
        r = w.inflight_requests
        s = 0
        mine = get_mine(wid)
        if mine is not None and mine.requests:
            if use_max:
                if mine.prefill_tokens > q:
                    q = mine.prefill_tokens
                if mine.decode_blocks > d:
                    d = mine.decode_blocks
                if mine.requests > r:
                    r = mine.requests
            else:
                q += mine.prefill_tokens
                d += mine.decode_blocks
                r += mine.requests
            s = mine.shared_blocks
        ov = get_overlap(wid)
        if ov is None:
            ow = wd * s
        else:
            matched[i] = ov
            # The index's blocks at positions [s, n_hash), weighted by tier, the tiers laid
            # along the prefix fastest first (see choice._real_segments, which states the same for
            # the reason).
            counts = ov.tiers if not ov.peer else ov.slots()
            if s == 0 and sum(counts) <= n_hash:
                # Every matched block counts: the dot product, summed left to right in C
                # (reduce, not sum: sum() compensates float rounding on newer Pythons, and the
                # result must be the same double everywhere).
                real = reduce(add, map(mul, counts, weights), 0.0)
            else:
                real = 0.0
                pos = 0
                for c, wt in zip(counts, weights):
                    if c:  # an empty tier adds nothing
                        lo = pos if pos > s else s
                        pos += c
                        x = (pos if pos < n_hash else n_hash) - lo
                        if x > 0:
                            real += wt * x
            ow = wd * s + (stale_factor if ov.stale else 1.0) * real
        if does_prefill:
            p = (q + prompt_tokens) / block_size - ow
            if p < 0.0:
                p = 0.0
        else:
            p = 0.0
        dec = d + request_blocks - s
        queued[i] = q
        active[i] = d
        in_flight[i] = r
        shared[i] = s
        overlap_w[i] = ow
        prefill[i] = p
        decode[i] = dec
        cost[i] = scale * p + dec
        if w.role != serving_role or w.draining or not w.registered:
            excluded[i] = _exclusion(w, phase_value)
    return t


def score_native(request: RoutingRequest, ordered: list[WorkerLoad], config: RouterConfig,
                  overlaps: Mapping[WorkerId, WorkerOverlap],
                  mine_by_worker: Mapping[WorkerId, InflightLoad], ttft_cost: bool = False,
                  rows: bool = True) -> Scored | None:
    """:func:`score`'s terms, :func:`pick`'s numbers and the rows' overlap columns from the Rust
    core (``native/src/decide.rs``); None when the core declines the inputs (a peer reach among
    them included: the core weighs the four tiers only), and the caller then runs
    :func:`score`, which also raises its errors. ``rows``: let the core build the kv argmin's
    score rows (False: only their columns, for ``choice.score_rows`` to build them with the
    predictions)."""
    import switchyard_native  # only when selected: the specification runs without the build

    t = Scored(request, ordered, config)
    kv = config.mode is RoutingMode.KV
    argmin = kv and config.temperature == 0.0 and not ttft_cost  # a ttft cost's argmin: decide's
    out = switchyard_native.decide_kv(
        list(map(astuple, ordered)), _LOAD_AT, overlaps if type(overlaps) is dict else dict(overlaps), mine_by_worker,
        request.phase.value, t.n_hash, request.block_size, request.prompt_tokens, t.request_blocks,
        t.does_prefill, t.weights[:len(TIER_ORDER)], config.stale_overlap_factor, config.load_combine == "max",
        config.prefill_load_scale, config.capacity_guard,
        (config.imbalance_abs_threshold, config.imbalance_rel_threshold) if kv and config.imbalance_guard else None,
        argmin, (CandidateScore, _ROW_AT) if argmin and rows else None)
    if out is None:
        return None
    ((t.queued, t.active, t.in_flight, t.shared, t.overlap_w, t.prefill, t.decode, t.cost), t.shared_by_worker,
     t.matched, ineligible, native_pick, t.rows, row_columns) = out
    if row_columns is not None:
        t.overlap_blocks, t.by_tier, t.stale, t.decode_f = row_columns
    phase_value = request.phase.value
    for i in ineligible:
        t.excluded[i] = _exclusion(ordered[i], phase_value)
    if native_pick is not None:
        t.pick = Pick(*native_pick)
    return t


def predictions(t: Scored, models: Mapping[WorkerId, TtftModel], mine_by_worker: Mapping[WorkerId, InflightLoad]
                ) -> tuple[list[float], list[int]]:
    """Every candidate's predicted TTFT (ms) and the part of its combined queue left out of it,
    by position: ``ttft.predict`` (the one rule) on the columns its row shows (the router's own
    in-flight prefill tokens, matched blocks, speculative overlap). The queue is the ledger's,
    not the combined load: a worker's report lags
    (``CandidateScore.report_only_prefill_tokens``)."""
    req = t.request
    get = models.get
    get_mine = mine_by_worker.get
    queue = [m.prefill_tokens if (m := get_mine(w.worker_id)) is not None and m.requests else 0 for w in t.ordered]
    return [predict(q, 0 if ov is None else sum(ov.tiers), s, req.prompt_tokens, req.block_size,
                    get(w.worker_id, PRIOR))
            for w, q, ov, s in zip(t.ordered, queue, t.matched, t.shared)], [c - q for c, q in zip(t.queued, queue)]


class Pick(msgspec.Struct):
    """The numbers of a decision after scoring: what the guards left and, in kv mode, who
    competes and who is cheapest (:func:`pick`, or the native core's identical copy)."""

    #: Eligible candidates over their KV capacity, and what the capacity guard did about them.
    over: list[int]
    capacity: int  # CAPACITY_UNCHANGED, CAPACITY_EXCLUDED or CAPACITY_IGNORED
    #: Eligible after the capacity guard, in id order.
    eligible: list[int]
    #: kv mode: the in-flight spread (hi, lo) when the imbalance guard narrowed the competitors,
    #: and the competitors.
    imbalance: tuple[int, int] | None
    competing: list[int]
    #: kv mode at temperature 0: the competitors tied for the lowest cost (within
    #: ``_TIE_RTOL``), and with one tied the cheapest other competitor.
    tied: list[int]
    runner_up: int | None


CAPACITY_UNCHANGED, CAPACITY_EXCLUDED, CAPACITY_IGNORED = 0, 1, 2


def pick(t: Scored, config: RouterConfig) -> Pick | None:
    """The capacity guard, and in kv mode the imbalance guard and the argmin, in numbers; None
    when no candidate is eligible."""
    eligible = [i for i in range(t.n) if t.excluded[i] is None]
    if not eligible:
        return None
    over: list[int] = []
    capacity = CAPACITY_UNCHANGED
    if config.capacity_guard:
        # Exclude workers whose KV capacity cannot hold their blocks plus this request's,
        # unless that would exclude every eligible one.
        over = [i for i in eligible if 0 < t.ordered[i].kv_capacity_blocks < t.decode[i]]
        if over and len(over) < len(eligible):
            capacity = CAPACITY_EXCLUDED
            eligible = [i for i in eligible if i not in over]
        elif over:
            capacity = CAPACITY_IGNORED
    competing = eligible
    imbalance = None
    tied: list[int] = []
    runner_up = None
    if config.mode is RoutingMode.KV:
        if config.imbalance_guard and len(eligible) > 1:
            loads = [t.in_flight[i] for i in eligible]
            hi, lo = max(loads), min(loads)
            if hi - lo > config.imbalance_abs_threshold and hi > config.imbalance_rel_threshold * lo:
                imbalance = (hi, lo)
                competing = [i for i in eligible if t.in_flight[i] == lo]
        if config.temperature == 0.0:
            tied = tied_lowest(competing, t.cost)
            if len(tied) == 1:
                runner_up = _runner_up(competing, t.cost, tied[0])
    return Pick(over, capacity, eligible, imbalance, competing, tied, runner_up)



def _exclusion(w: WorkerLoad, phase_value: str) -> str:
    if not w.registered:
        return "not registered"
    if w.draining:
        return "draining"
    return f"role {WorkerRole(w.role).value} does not serve phase {phase_value}"



def tied_lowest(candidates: list[int], cost: Sequence[float]) -> list[int]:
    """The candidates with the lowest cost, a tie being within ``_TIE_RTOL`` of it, in the
    order given (id order)."""
    best = min(cost[i] for i in candidates)
    limit = best + _TIE_RTOL * max(1.0, abs(best))
    return [i for i in candidates if cost[i] <= limit]



def _runner_up(candidates: list[int], cost: Sequence[float], chosen: int) -> int | None:
    others = [i for i in candidates if i != chosen]
    return min(others, key=cost.__getitem__) if others else None

