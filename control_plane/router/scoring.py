"""The kv cost's numbers, from the Rust core (``native/src/decide.rs``).

:func:`score` computes every candidate's terms (the formula: ``docs/routing-cost.md``) and, in
the same call, the capacity and imbalance guards and the kv argmin (:class:`Pick`);
:func:`pick` runs those guards alone over a cost computed afterwards (the predicted TTFT). The
words (reasons, score rows) are ``choice.py``'s. The pure-Python executable specification of
both steps is the differential oracle ``tests/oracles/scoring.py``; ``tests/unit/test_native_decide.py``
holds the two bit-identical on random decisions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec
import switchyard_native
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
from schemas.types import RequestPhase, RoutingMode, WorkerId, WorkerRole

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
          overlaps: Mapping[WorkerId, WorkerOverlap], mine_by_worker: Mapping[WorkerId, InflightLoad],
          ttft_cost: bool = False, rows: bool = True) -> Scored:
    """Every candidate's kv terms (the formula: docs/routing-cost.md), the guards' and the kv
    argmin's numbers (:class:`Pick`, none when nothing is eligible) and, for the kv argmin, the
    score rows, from the Rust core (``native/src/decide.rs``, ``switchyard_native.decide_kv``).

    ``ordered``: the candidates in worker id order. With ``ttft_cost`` the core gives the terms
    and :func:`pick` runs later on the predicted costs. ``rows=False``: the core gives the rows'
    columns only, for ``choice.score_rows`` to build them with their predictions. Raises :class:`InvalidRoutingInput` for
    what the core refuses: a worker listed twice, or an integer beyond the range where ``f64``
    is exact (2^53; the core never rounds where exact arithmetic would not).
    """
    t = Scored(request, ordered, config)
    kv = config.mode is RoutingMode.KV
    argmin = kv and config.temperature == 0.0 and not ttft_cost  # a ttft cost's argmin: decide's
    out = switchyard_native.decide_kv(
        list(map(astuple, ordered)), _LOAD_AT, overlaps if type(overlaps) is dict else dict(overlaps), mine_by_worker,
        request.phase.value, t.n_hash, request.block_size, request.prompt_tokens, t.request_blocks,
        t.does_prefill, t.weights, config.stale_overlap_factor, config.load_combine == "max",
        config.prefill_load_scale, config.capacity_guard, _imbalance(config),
        argmin, (CandidateScore, _ROW_AT) if argmin and rows else None)
    if out is None:
        raise _refused(ordered)
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


def _imbalance(config: RouterConfig) -> tuple[int, float] | None:
    if config.mode is RoutingMode.KV and config.imbalance_guard:
        return config.imbalance_abs_threshold, config.imbalance_rel_threshold
    return None


def _refused(ordered: Sequence[WorkerLoad]) -> InvalidRoutingInput:
    """Why the core refused a decision's inputs, in words."""
    for a, b in zip(ordered, ordered[1:]):
        if a.worker_id == b.worker_id:
            return InvalidRoutingInput(f"worker {a.worker_id!r} is listed twice")
    return InvalidRoutingInput(
        "a load, overlap or request size beyond 2^53 (or not an integer): the kv cost is computed "
        "exactly in f64 and refuses what it cannot reproduce")


def predictions(t: Scored, models: Mapping[WorkerId, TtftModel], mine_by_worker: Mapping[WorkerId, InflightLoad]
                ) -> tuple[list[float], list[int]]:
    """Every candidate's predicted TTFT (ms) and the part of its combined queue left out of it,
    by position: ``ttft.predict`` (the one rule) on the columns its row shows (the router's own
    in-flight prefill tokens, matched blocks, speculative overlap, active decode blocks). The queue is the ledger's,
    not the combined load: a worker's report lags
    (``CandidateScore.report_only_prefill_tokens``)."""
    req = t.request
    get = models.get
    get_mine = mine_by_worker.get
    queue = [m.prefill_tokens if (m := get_mine(w.worker_id)) is not None and m.requests else 0 for w in t.ordered]
    return [predict(q, 0 if ov is None else sum(ov.tiers), s, req.prompt_tokens, req.block_size,
                    get(w.worker_id, PRIOR), a)
            for w, q, ov, s, a in zip(t.ordered, queue, t.matched, t.shared, t.active)], \
        [c - q for c, q in zip(t.queued, queue)]


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
    """The capacity guard, and in kv mode the imbalance guard and (at temperature 0) the argmin,
    over ``t.cost`` as it stands: the Rust core's ``pick_kv``, the same step ``decide_kv``
    takes, for a cost computed after scoring (the predicted TTFT). None when no candidate is
    eligible; raises :class:`InvalidRoutingInput` for an integer beyond the exact range."""
    eligible = [i for i in range(t.n) if t.excluded[i] is None]
    if not eligible:
        return None
    out = switchyard_native.pick_kv(
        t.cost, t.in_flight, t.decode, [w.kv_capacity_blocks for w in t.ordered] if config.capacity_guard else [0] * t.n,
        eligible, config.capacity_guard, _imbalance(config),
        config.mode is RoutingMode.KV and config.temperature == 0.0)
    if out is None:
        raise _refused(t.ordered)
    return Pick(*out)


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
