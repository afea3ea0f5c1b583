"""The routing decision: pure, deterministic, and able to explain itself.

``decide(request, workers, config, rng_seed=..., overlaps=..., inflight=..., rr_cursor=...)``
returns a :class:`Decision`: the chosen worker, one :class:`~schemas.events.CandidateScore` row
per candidate (ineligible ones included, marked ``eligible=False``), a reason that spells out the
winning arithmetic, and the state the caller must carry to the next decision (the round-robin
cursor). No I/O, no clock, no global RNG: the same inputs and seed give a bit-identical
``Decision``, so the replay tool can recompute any recorded decision and compare.

The kv cost (Dynamo's, with tier weights and the in-flight ledger's speculative overlap), a worked
example of why a burst of identical prompts spreads, and the tie-break rules: ``docs/router.md``,
"The kv cost".
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from functools import lru_cache, reduce
from itertools import repeat
from operator import add, attrgetter, mul

import msgspec
from msgspec.structs import astuple

from control_plane.index.implementation import native_core
from control_plane.router.config import RouterConfig
from control_plane.router.errors import InvalidRoutingInput, NoEligibleWorker
from control_plane.router.ledger import InflightLoad, InflightView
from control_plane.router.ttft import PRIOR, predict
from schemas.events import CandidateScore, RequestRouted, TtftModel
from schemas.types import (
    TIER_INDEX,
    TIER_ORDER,
    BlockHash,
    RequestId,
    RequestPhase,
    RoutingMode,
    Tier,
    WorkerId,
    WorkerRole,
)

#: Costs within this relative distance of the best count as a tie (float sums of the same
#: quantities in a different order may differ in the last bits).
_TIE_RTOL = 1e-9
#: How many excluded workers a reason lists by name.
_REASON_MAX_EXCLUDED = 8
_by_worker_id = attrgetter("worker_id")


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------


class RoutingRequest(msgspec.Struct, frozen=True, kw_only=True):
    """The request (or one phase of it) to place."""

    request_id: RequestId
    prompt_tokens: int
    #: Tokens per KV block (the engines' block size).
    block_size: int
    #: Chained hashes of the prompt's full blocks, from the root (``RequestAdmitted``).
    block_hashes: tuple[BlockHash, ...] = ()
    #: Expected output length (``max_tokens`` or a prediction); sizes the decode footprint.
    expected_output_tokens: int = 0
    phase: RequestPhase = RequestPhase.AGGREGATED

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise InvalidRoutingInput(f"block_size={self.block_size} must be > 0")
        if self.prompt_tokens < 0 or self.expected_output_tokens < 0:
            raise InvalidRoutingInput(
                f"prompt_tokens={self.prompt_tokens} and expected_output_tokens="
                f"{self.expected_output_tokens} must be >= 0"
            )
        if len(self.block_hashes) * self.block_size > self.prompt_tokens:
            raise InvalidRoutingInput(
                f"{len(self.block_hashes)} block hashes of {self.block_size} tokens exceed the "
                f"{self.prompt_tokens}-token prompt: only full prompt blocks are hashed"
            )

    @property
    def request_blocks(self) -> int:
        """KV blocks the request holds at its end: ceil((prompt + output) / block_size)."""
        return -(-(self.prompt_tokens + self.expected_output_tokens) // self.block_size)


class WorkerOverlap(msgspec.Struct, frozen=True, kw_only=True):
    """The prefix index's match for one worker: matched blocks per tier, and staleness.

    ``tiers`` holds the counts in :data:`~schemas.types.TIER_ORDER` (fastest first; missing
    trailing tiers count 0), each matched block counted in the fastest tier that holds it, so
    the matched depth is their sum and the two can never disagree. A new tier is one
    ``Tier`` value and its weight in :class:`~control_plane.router.config.TierWeights`; nothing
    here names a tier.
    """

    tiers: tuple[int, ...] = ()
    #: The index's view of this worker is not trusted to be current (lag, gap, new incarnation).
    stale: bool = False
    #: Blocks beyond this worker's own match that another worker (``peer_from``) holds in host
    #: or device memory, which this worker can pull over NIXL instead of recomputing
    #: (``control_plane.router.inputs.with_peer_reach``). Weighted by ``TierWeights.peer`` and
    #: laid after the worker's own tiers along the prefix. 0 when peer fetch is off.
    peer: int = 0
    peer_from: WorkerId = ""

    def __post_init__(self) -> None:
        if len(self.tiers) > len(TIER_ORDER) or any(c < 0 for c in self.tiers):
            raise InvalidRoutingInput(f"tier counts {self.tiers!r}: at most {len(TIER_ORDER)}, none negative")
        if self.peer < 0 or (self.peer > 0) != bool(self.peer_from):
            raise InvalidRoutingInput(f"peer reach {self.peer} from {self.peer_from!r}: a count >= 0, "
                                      "and a source exactly when it is > 0")

    def slots(self) -> tuple[int, ...]:
        """The counts the cost weighs, in weight order: the tiers, then the peer reach (padded
        so the peer count meets ``TierWeights.peer``)."""
        if not self.peer:
            return self.tiers
        return (*self.tiers, *_ZEROS[len(self.tiers):], self.peer)

    @property
    def depth(self) -> int:
        return sum(self.tiers)

    def count(self, tier: Tier | str) -> int:
        i = TIER_INDEX[Tier(tier)]
        return self.tiers[i] if i < len(self.tiers) else 0

    @classmethod
    def of(cls, *, stale: bool = False, **counts: int) -> WorkerOverlap:
        """``WorkerOverlap.of(device=3, host=1)``."""
        return cls.from_tiers(counts, stale=stale)

    @classmethod
    def from_tiers(
        cls, by_tier: Mapping[Tier | str, int] | Sequence[int], *, stale: bool = False,
        peer_from: WorkerId = "",
    ) -> WorkerOverlap:
        """Build from ``{Tier.HOST: 3, ...}``, ``{"host": 3, ...}`` or counts in
        ``TIER_ORDER`` (the prefix index's ``Match.by_tier``)."""
        if isinstance(by_tier, Mapping):
            counts = [0] * len(TIER_ORDER)
            peer = 0
            for k, v in by_tier.items():
                if k == PEER:
                    peer = int(v)
                else:
                    counts[TIER_INDEX[Tier(k)]] = int(v)
            return cls(tiers=tuple(counts), stale=stale, peer=peer, peer_from=peer_from if peer else "")
        return cls(tiers=tuple(by_tier), stale=stale)

    def by_tier(self) -> dict[str, int]:
        """Non-zero tiers by tier name (``CandidateScore.overlap_by_tier``). Built for every
        matched candidate of every decision: the few distinct count vectors of a moment come
        from a cache (a copy of a small dict costs a fifth of building it). The peer reach,
        when there is one, is the key ``"peer"``."""
        return dict(_named_counts(self.slots()))


#: The name of the peer reach in ``overlap_by_tier`` and reasons (not a ``Tier``: a peer's
#: blocks are another worker's residency, reachable from here).
PEER = "peer"
_TIER_NAMES = (*(t.value for t in TIER_ORDER), PEER)
_ZEROS = (0,) * len(TIER_ORDER)


@lru_cache(maxsize=4096)
def _named_counts(tiers: tuple[int, ...]) -> dict[str, int]:
    return {name: c for name, c in zip(_TIER_NAMES, tiers) if c}


NO_OVERLAP = WorkerOverlap()


class WorkerLoad(msgspec.Struct, frozen=True, kw_only=True):
    """One candidate worker as the registry and its latest load report describe it."""

    worker_id: WorkerId
    role: WorkerRole = WorkerRole.AGGREGATED
    registered: bool = True
    draining: bool = False
    queued_prefill_tokens: int = 0
    active_decode_blocks: int = 0
    inflight_requests: int = 0
    #: Device KV capacity in blocks; 0 when unknown (the capacity guard then skips the worker).
    kv_capacity_blocks: int = 0


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


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    """A routing decision, its evidence, and the state to carry forward."""

    request_id: RequestId
    phase: RequestPhase
    worker_id: WorkerId
    mode: RoutingMode
    #: One row per candidate, sorted by worker id; ineligible ones have ``eligible=False``.
    scores: tuple[CandidateScore, ...]
    reason: str
    config_version: int
    rng_seed: int
    #: Round-robin cursor for the next decision (the last worker round robin chose).
    rr_cursor: WorkerId | None = None
    #: What to record in the in-flight ledger for the chosen worker (``InflightLedger.add``):
    #: prompt tokens it must compute (after its cache and in-flight hits) ...
    prefill_tokens: int = 0
    #: ... and every KV block the request will hold there.
    decode_blocks: int = 0
    #: Blocks of the prompt held by in-flight requests, per worker (non-zero only); also in
    #: each row's ``speculative_overlap``.
    speculative_overlap: dict[WorkerId, int] = {}
    #: Guards that changed the candidate set ("capacity", "imbalance").
    guards: tuple[str, ...] = ()

    def to_event(
        self,
        *,
        index_position: Mapping[str, int] | None = None,
        router_id: str = "",
        attempt: int = 0,
    ) -> RequestRouted:
        return RequestRouted(
            request_id=self.request_id,
            worker_id=self.worker_id,
            phase=self.phase,
            mode=self.mode,
            scores=list(self.scores),
            reason=self.reason,
            config_version=self.config_version,
            rng_seed=self.rng_seed,
            index_position=dict(index_position or {}),
            router_id=router_id,
            attempt=attempt,
        )


# ----------------------------------------------------------------------------------------------
# The decision
# ----------------------------------------------------------------------------------------------


def decide(
    request: RoutingRequest,
    workers: Sequence[WorkerLoad],
    config: RouterConfig,
    *,
    rng_seed: int,
    overlaps: Mapping[WorkerId, WorkerOverlap] | None = None,
    inflight: InflightView | None = None,
    rr_cursor: WorkerId | None = None,
    native: bool | None = None,
    ttft_models: Mapping[WorkerId, TtftModel] | None = None,
) -> Decision:
    """Choose a worker for ``request`` among ``workers``.

    * ``workers``: every candidate, eligible or not (each gets a row); order does not matter.
    * ``overlaps``: the prefix index's match per worker; a missing worker has no overlap.
    * ``inflight``: the router's :class:`~control_plane.router.ledger.InflightLedger` (only
      read, through ``view``) or a recorded snapshot with the same ``view``; None = nothing in
      flight. Call ``ledger.expire(now)`` before deciding.
    * ``rng_seed``: the only source of randomness (tie-breaks, sampling, random mode); record it.
    * ``rr_cursor``: the previous decision's ``Decision.rr_cursor`` (round_robin mode).
    * ``native``: score with the Rust core (``switchyard_native.score_kv``, the same terms bit
      for bit) or with :func:`_score`, the specification; None = the process's switch
      (:func:`control_plane.index.implementation.native_core`, ``SWITCHYARD_INDEX``). Inputs the core
      cannot reproduce exactly (integers beyond 2^53, a worker listed twice) go to the
      specification either way, so the choice never changes a decision.
    * ``ttft_models``: each candidate's TTFT model (a missing one is the prior); given, every
      row of a prefill phase carries its predicted TTFT (:func:`_predictions`), and with
      ``config.cost == "ttft"`` that prediction is the kv cost. None = no predictions.

    Eligible = registered, not draining, role equal to the request's phase (an aggregated
    worker serves aggregated requests only). Raises :class:`NoEligibleWorker` when no candidate
    is eligible, :class:`InvalidRoutingInput` when a worker id appears twice.

    Four steps: score every candidate (:func:`_score`), take the guards' and the mode's numbers
    (:func:`_pick`), choose and word the reason (``_CHOOSERS``), and write the score table
    (:func:`_rows`). The native core does the first two in one call.
    """
    if not workers:
        raise NoEligibleWorker(f"request {request.request_id}: no candidate workers")
    ordered = sorted(workers, key=_by_worker_id)
    mine = inflight.view(request.block_hashes) if inflight is not None else {}
    t = None
    predicts = ttft_models is not None and request.phase is not RequestPhase.DECODE
    ttft_cost = predicts and config.cost == "ttft"  # else a decode phase's kv cost stays blocks
    if native_core() if native is None else native:
        t = _score_native(request, ordered, config, overlaps or {}, mine, ttft_cost)
    if t is None:
        t = _score(request, ordered, config, overlaps or {}, mine)
    predicted = _predictions(t, ttft_models) if predicts else None
    if ttft_cost:
        # The cost is the prediction: the guards and the argmin run on it here (the native core
        # gave the terms only, see _score_native).
        t.cost, t.pick, t.rows, t.ttft_cost = predicted, None, None, True
    pick = t.pick or _pick(t, config)
    if pick is None:
        raise NoEligibleWorker(
            f"request {request.request_id}: no eligible worker among {t.n}: "
            + ", ".join(f"{t.ordered[i].worker_id} ({t.excluded[i]})" for i in range(t.n))
        )
    notes: list[str] = []
    guards: list[str] = []
    _word_capacity(t, pick, notes, guards)
    choice = _CHOOSERS[config.mode](t, pick, config, rng_seed, rr_cursor, notes, guards)
    reason = choice.reason
    if notes:
        reason = "; ".join(notes) + ". " + reason
    if len(pick.eligible) < t.n:
        skipped = [i for i in range(t.n) if t.excluded[i] is not None]
        listed = ", ".join(
            f"{t.ordered[i].worker_id} ({t.excluded[i]})" for i in skipped[:_REASON_MAX_EXCLUDED]
        )
        more = len(skipped) - _REASON_MAX_EXCLUDED
        reason += f". Excluded {len(skipped)} of {t.n}: {listed}" + (
            f" and {more} more" if more > 0 else ""
        )
    chosen = choice.chosen
    rows = _rows(t, choice.row_cost, choice.probability)
    if predicted is not None:
        rows = tuple(msgspec.structs.replace(r, predicted_ttft_ms=p) for r, p in zip(rows, predicted))
    own_prefill = (max(round(request.prompt_tokens - t.overlap_w[chosen] * request.block_size), 0)
                   if t.does_prefill else 0)
    return Decision(
        request_id=request.request_id,
        phase=request.phase,
        worker_id=t.ordered[chosen].worker_id,
        mode=config.mode,
        scores=rows,
        reason=reason,
        config_version=config.version,
        rng_seed=rng_seed,
        rr_cursor=choice.next_cursor if choice.next_cursor is not _KEEP else rr_cursor,
        prefill_tokens=own_prefill,
        decode_blocks=t.request_blocks,
        speculative_overlap=(t.shared_by_worker if t.shared_by_worker is not None
                             else {w.worker_id: s for w, s in zip(t.ordered, t.shared) if s}),
        guards=tuple(guards),
    )


# ----------------------------------------------------------------------------------------------
# The steps
# ----------------------------------------------------------------------------------------------


class _Scored:
    """Every candidate's terms, by position in id order (what the rows and the reason show)."""

    __slots__ = ("active", "by_tier", "config", "cost", "decode", "decode_f", "does_prefill", "excluded",
                 "in_flight", "matched", "n", "n_hash", "ordered", "overlap_blocks", "overlap_w", "pick", "prefill",
                 "queued", "request", "request_blocks", "rows", "shared", "shared_by_worker", "stale", "ttft_cost", "weights")

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
        # The terms, filled by _score or the native core.
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
        #: The native core's :class:`_Pick`, when it computed one (else :func:`_pick` does).
        self.pick: _Pick | None = None
        #: The rows' overlap columns (matched blocks, by tier, stale) and the decode term as a
        #: float, when the native core made them (else :func:`_rows` does).
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


def _score(request: RoutingRequest, ordered: list[WorkerLoad], config: RouterConfig,
           overlaps: Mapping[WorkerId, WorkerOverlap], mine_by_worker: Mapping[WorkerId, InflightLoad]) -> _Scored:
    """The kv cost's terms for every candidate (the formula: docs/router.md, "The kv cost")."""
    t = _Scored(request, ordered, config)
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
    # the common path. The overlap is the formula in docs/router.md ("The kv cost"); _real_segments
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
            # along the prefix fastest first (see _real_segments, which states the same for
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


def _score_native(request: RoutingRequest, ordered: list[WorkerLoad], config: RouterConfig,
                  overlaps: Mapping[WorkerId, WorkerOverlap],
                  mine_by_worker: Mapping[WorkerId, InflightLoad], ttft_cost: bool = False) -> _Scored | None:
    """:func:`_score`'s terms, :func:`_pick`'s numbers and the rows' overlap columns from the Rust
    core (``native/src/decide.rs``); None when the core declines the inputs (a peer reach among
    them included: the core weighs the four tiers only), and the caller then runs
    :func:`_score`, which also raises its errors."""
    import switchyard_native  # only when selected: the specification runs without the build

    t = _Scored(request, ordered, config)
    kv = config.mode is RoutingMode.KV
    argmin = kv and config.temperature == 0.0 and not ttft_cost  # a ttft cost's argmin: decide's
    out = switchyard_native.decide_kv(
        list(map(astuple, ordered)), _LOAD_AT, overlaps if type(overlaps) is dict else dict(overlaps), mine_by_worker,
        request.phase.value, t.n_hash, request.block_size, request.prompt_tokens, t.request_blocks,
        t.does_prefill, t.weights[:len(TIER_ORDER)], config.stale_overlap_factor, config.load_combine == "max",
        config.prefill_load_scale, config.capacity_guard,
        (config.imbalance_abs_threshold, config.imbalance_rel_threshold) if kv and config.imbalance_guard else None,
        argmin, (CandidateScore, _ROW_AT) if argmin else None)
    if out is None:
        return None
    ((t.queued, t.active, t.in_flight, t.shared, t.overlap_w, t.prefill, t.decode, t.cost), t.shared_by_worker,
     t.matched, ineligible, pick, t.rows, row_columns) = out
    if row_columns is not None:
        t.overlap_blocks, t.by_tier, t.stale, t.decode_f = row_columns
    phase_value = request.phase.value
    for i in ineligible:
        t.excluded[i] = _exclusion(ordered[i], phase_value)
    if pick is not None:
        t.pick = _Pick(*pick)
    return t


class _Pick(msgspec.Struct):
    """The numbers of a decision after scoring: what the guards left and, in kv mode, who
    competes and who is cheapest (:func:`_pick`, or the native core's identical copy)."""

    #: Eligible candidates over their KV capacity, and what the capacity guard did about them.
    over: list[int]
    capacity: int  # _CAPACITY_UNCHANGED, _CAPACITY_EXCLUDED or _CAPACITY_IGNORED
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


_CAPACITY_UNCHANGED, _CAPACITY_EXCLUDED, _CAPACITY_IGNORED = 0, 1, 2


def _predictions(t: _Scored, models: Mapping[WorkerId, TtftModel]) -> list[float]:
    """Every candidate's predicted TTFT (ms), by position: ``ttft.predict`` (the one rule) on the
    columns its row shows (combined queue, matched blocks, speculative overlap)."""
    req = t.request
    get = models.get
    return [predict(q, 0 if ov is None else sum(ov.tiers), s, req.prompt_tokens, req.block_size,
                    get(w.worker_id, PRIOR))
            for w, q, ov, s in zip(t.ordered, t.queued, t.matched, t.shared)]


def _pick(t: _Scored, config: RouterConfig) -> _Pick | None:
    """The capacity guard, and in kv mode the imbalance guard and the argmin, in numbers; None
    when no candidate is eligible."""
    eligible = [i for i in range(t.n) if t.excluded[i] is None]
    if not eligible:
        return None
    over: list[int] = []
    capacity = _CAPACITY_UNCHANGED
    if config.capacity_guard:
        # Exclude workers whose KV capacity cannot hold their blocks plus this request's,
        # unless that would exclude every eligible one.
        over = [i for i in eligible if 0 < t.ordered[i].kv_capacity_blocks < t.decode[i]]
        if over and len(over) < len(eligible):
            capacity = _CAPACITY_EXCLUDED
            eligible = [i for i in eligible if i not in over]
        elif over:
            capacity = _CAPACITY_IGNORED
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
            tied = _tied(competing, t.cost)
            if len(tied) == 1:
                runner_up = _runner_up(competing, t.cost, tied[0])
    return _Pick(over, capacity, eligible, imbalance, competing, tied, runner_up)


def _word_capacity(t: _Scored, pick: _Pick, notes: list[str], guards: list[str]) -> None:
    """The capacity guard's exclusions, guard and note, in words."""
    if pick.capacity == _CAPACITY_EXCLUDED:
        for i in pick.over:
            t.excluded[i] = f"over KV capacity: {t.decode[i]} > {t.ordered[i].kv_capacity_blocks} blocks"
        guards.append("capacity")
    elif pick.capacity == _CAPACITY_IGNORED:
        notes.append("every eligible worker is over its KV capacity; capacity guard ignored")


#: A chooser's "the cursor does not move".
_KEEP = object()


class _Choice(msgspec.Struct):
    chosen: int
    reason: str
    row_cost: list[float | None]
    probability: list[float | None] | None = None
    next_cursor: object = _KEEP


def _choose_kv(t: _Scored, pick: _Pick, config: RouterConfig, rng_seed: int, rr_cursor,
               notes: list[str], guards: list[str]) -> _Choice:
    cost, ordered = t.cost, t.ordered
    competing = pick.competing
    if pick.imbalance is not None:
        hi, lo = pick.imbalance
        guards.append("imbalance")
        notes.append(
            f"imbalance guard: in-flight spread {hi} - {lo} > "
            f"{config.imbalance_abs_threshold} and {hi} > "
            f"{_fmt(config.imbalance_rel_threshold)} x {lo}, so only the "
            f"{len(competing)} least busy compete"
        )
    probability = None
    tail = ""
    if config.temperature > 0.0:
        chosen, probability = _softmax_sample(competing, cost, config.temperature, t.n, rng_seed)
        best = min(competing, key=cost.__getitem__)
        head = (
            f"kv softmax (temperature {_fmt(config.temperature)}) over {len(competing)} "
            f"candidates sampled"
        )
        tail = (
            f"; p={probability[chosen]:.4f} with rng_seed {rng_seed}; argmin was "
            f"{ordered[best].worker_id} at {_fmt(cost[best])}"
        )
    else:
        tied = pick.tied
        chosen = _draw(tied, rng_seed)
        head = f"kv argmin over {len(competing)} candidates chose"
        if len(tied) > 1:
            tail = f"; {len(tied)} tied, broken by rng_seed {rng_seed}"
        else:
            runner = pick.runner_up
            if runner is not None:
                tail = (
                    f"; runner-up {ordered[runner].worker_id} at {_fmt(cost[runner])} "
                    f"(+{_fmt(cost[runner] - cost[chosen])})"
                )
    ov = t.matched[chosen] or NO_OVERLAP
    factor = config.stale_overlap_factor if ov.stale else 1.0
    req = t.request
    if t.ttft_cost:
        head = head.replace("kv ", "kv (predicted TTFT) ", 1)
        arithmetic = (f"{ordered[chosen].worker_id} at {_fmt(cost[chosen])} ms predicted: "
                      f"{t.queued[chosen]} prefill tokens queued ahead, {max(ov.depth, t.shared[chosen])} "
                      f"of {t.request_blocks} blocks cached")
        return _Choice(chosen, f"{head} {arithmetic}{tail}", list(cost), probability)
    arithmetic = _explain_kv(
        ordered[chosen].worker_id, cost[chosen], config.prefill_load_scale, t.queued[chosen], req.prompt_tokens,
        req.block_size, _overlap_parts(ov, t.shared[chosen], t.n_hash, t.weights, factor), t.overlap_w[chosen],
        t.prefill[chosen], t.active[chosen], t.request_blocks, t.shared[chosen], t.does_prefill, ov.stale, factor,
    )
    return _Choice(chosen, f"{head} {arithmetic}{tail}", list(cost), probability)


def _choose_round_robin(t: _Scored, pick: _Pick, config: RouterConfig, rng_seed: int, rr_cursor,
                        notes: list[str], guards: list[str]) -> _Choice:
    eligible = pick.eligible
    chosen = _next_round_robin(eligible, t.ordered, rr_cursor)
    picked = t.ordered[chosen].worker_id
    reason = (
        f"round_robin over {len(eligible)} eligible: chose {picked}, the next id after "
        f"cursor {rr_cursor!r}" + (" (wrapped)" if rr_cursor is not None and picked <= rr_cursor else "")
    )
    return _Choice(chosen, reason, [None] * t.n, next_cursor=picked)


def _choose_random(t: _Scored, pick: _Pick, config: RouterConfig, rng_seed: int, rr_cursor,
                   notes: list[str], guards: list[str]) -> _Choice:
    eligible = pick.eligible
    chosen = eligible[random.Random(rng_seed).randrange(len(eligible))]
    reason = f"random over {len(eligible)} eligible: chose {t.ordered[chosen].worker_id} (rng_seed {rng_seed})"
    return _Choice(chosen, reason, [None] * t.n)


def _choose_least_loaded(t: _Scored, pick: _Pick, config: RouterConfig, rng_seed: int, rr_cursor,
                         notes: list[str], guards: list[str]) -> _Choice:
    eligible = pick.eligible
    block_size = t.request.block_size
    by_requests = config.least_loaded_metric == "requests"
    if by_requests:
        metric = [float(x) for x in t.in_flight]
        what = "in-flight requests"
    else:
        metric = [t.queued[i] / block_size + t.active[i] for i in range(t.n)]
        what = "blocks (queued prefill tokens / block size + active decode blocks)"
    tied = _tied(eligible, metric)
    chosen, ties = _draw(tied, rng_seed), len(tied)
    detail = (f"{t.in_flight[chosen]} in flight" if by_requests
              else f"{t.queued[chosen]}/{block_size} + {t.active[chosen]}")
    reason = (
        f"least_loaded by {what} over {len(eligible)} eligible: chose {t.ordered[chosen].worker_id} "
        f"with load {_fmt(metric[chosen])} = {detail}"
    )
    if ties > 1:
        reason += f"; {ties} tied, broken by rng_seed {rng_seed}"
    return _Choice(chosen, reason, list(metric))


_CHOOSERS = {
    RoutingMode.KV: _choose_kv,
    RoutingMode.ROUND_ROBIN: _choose_round_robin,
    RoutingMode.RANDOM: _choose_random,
    RoutingMode.LEAST_LOADED: _choose_least_loaded,
}


def _rows(t: _Scored, row_cost: list[float | None], probability: list[float | None] | None) -> tuple[CandidateScore, ...]:
    """One score row per candidate, in id order: its combined loads, overlap and terms.

    The native core builds them for the kv argmin (positionally: a keyword call matches 15
    names per row); this builds them otherwise, in one comprehension with at most 15 keywords
    per row: CPython passes 16 or more arguments through a heap-allocated array, which made
    every row twice as slow (measured, 64 rows: 21 us with 15 keywords, 48 us with 16).
    ``peer_from`` (set with a peer reach only) is added to the few rows that have one.
    """
    if t.rows is not None:  # the native core's, for the kv argmin: their costs, no probability
        if len(t.pick.eligible) == t.n:  # type: ignore[union-attr]  # nothing excluded to word
            return t.rows
        return tuple(r if x is None else msgspec.structs.replace(r, excluded=x) for r, x in zip(t.rows, t.excluded))
    peers: list[tuple[int, WorkerId]] = []
    if t.by_tier is None:  # scored by the specification (the native core declines a peer reach)
        t.overlap_blocks = [0 if ov is None else sum(ov.tiers) for ov in t.matched]
        t.by_tier = [{} if ov is None else ov.by_tier() for ov in t.matched]
        t.stale = [ov is not None and ov.stale for ov in t.matched]
        t.decode_f = [float(d) for d in t.decode]
        peers = [(i, ov.peer_from) for i, ov in enumerate(t.matched) if ov is not None and ov.peer_from]
    rows = [
        CandidateScore(
            worker_id=w.worker_id, overlap_blocks=ob, overlap_by_tier=bt, queued_prefill_tokens=q,
            active_decode_blocks=a, inflight_requests=r, stale=st, prefill_blocks=p, decode_blocks=d, cost=c,
            probability=pr, eligible=x is None, speculative_overlap=s, excluded=x or "",
            kv_capacity_blocks=w.kv_capacity_blocks,
        )
        for w, ob, bt, q, a, r, st, p, d, c, pr, x, s in zip(
            t.ordered, t.overlap_blocks, t.by_tier, t.queued, t.active, t.in_flight, t.stale, t.prefill, t.decode_f,
            row_cost, repeat(None) if probability is None else probability, t.excluded, t.shared)
    ]
    for i, peer_from in peers:
        rows[i] = msgspec.structs.replace(rows[i], peer_from=peer_from)
    return tuple(rows)


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def _exclusion(w: WorkerLoad, phase_value: str) -> str:
    if not w.registered:
        return "not registered"
    if w.draining:
        return "draining"
    return f"role {WorkerRole(w.role).value} does not serve phase {phase_value}"


def _real_segments(
    ov: WorkerOverlap, skip: int, limit: int, weights: tuple[float, ...]
) -> list[tuple[int, str, float]]:
    """The index's matched blocks beyond ``skip`` and below ``limit``, per tier, as
    (count, tier name, weight); tiers laid along the prefix fastest first."""
    out = []
    pos = 0
    for count, name, weight in zip(ov.slots(), _TIER_NAMES, weights):
        start = max(pos, skip)
        end = min(pos + count, limit)
        pos += count
        if end > start:
            out.append((end - start, name, weight))
    return out


def _overlap_parts(
    ov: WorkerOverlap,
    skip: int,
    limit: int,
    weights: tuple[float, ...],
    factor: float,
) -> list[str]:
    parts = [f"in-flight {skip}x{_fmt(weights[0])}"] if skip else []
    real = [
        f"{name} {count}x{_fmt(w)}"
        for count, name, w in _real_segments(ov, skip, limit, weights)
    ]
    if real and factor != 1.0:
        parts.append(f"stale {_fmt(factor)} x ({' + '.join(real)})")
    else:
        parts.extend(real)
    return parts


def _explain_kv(
    wid: WorkerId,
    total: float,
    scale: float,
    queued: int,
    prompt_tokens: int,
    block_size: int,
    overlap_parts: list[str],
    overlap: float,
    prefill: float,
    active: int,
    request_blocks: int,
    shared: int,
    does_prefill: bool,
    stale: bool,
    factor: float,
) -> str:
    decode = f"(active {active} + new {request_blocks}"
    decode += f" - shared in-flight {shared})" if shared else ")"
    if does_prefill:
        ov = f"overlap {_fmt(overlap)}"
        if overlap_parts:
            ov += f" [{' + '.join(overlap_parts)}]"
        elif stale and factor == 0.0:
            ov += " [stale view ignored]"
        return (
            f"{wid}: cost {_fmt(total)} = {_fmt(scale)} x max((queued {queued} + prompt "
            f"{prompt_tokens}) tok / {block_size} - {ov}, 0) + {decode} decode blocks "
            f"= {_fmt(scale)} x {_fmt(prefill)} + {active + request_blocks - shared}"
        )
    return (
        f"{wid}: cost {_fmt(total)} = {decode} decode blocks (decode phase: no prefill term)"
    )


def _tied(candidates: list[int], cost: Sequence[float]) -> list[int]:
    """The candidates with the lowest cost, a tie being within ``_TIE_RTOL`` of it, in the
    order given (id order)."""
    best = min(cost[i] for i in candidates)
    limit = best + _TIE_RTOL * max(1.0, abs(best))
    return [i for i in candidates if cost[i] <= limit]


def _draw(tied: list[int], rng_seed: int) -> int:
    """The one tied, or a seeded draw among them."""
    if len(tied) == 1:
        return tied[0]
    return tied[random.Random(rng_seed).randrange(len(tied))]


def _runner_up(candidates: list[int], cost: Sequence[float], chosen: int) -> int | None:
    others = [i for i in candidates if i != chosen]
    return min(others, key=cost.__getitem__) if others else None


def _softmax_sample(
    candidates: list[int], cost: Sequence[float], temperature: float, n: int, rng_seed: int
) -> tuple[int, list[float | None]]:
    """Dynamo's sampler: costs normalised to [0, 1] over the candidates, logit =
    -normalised / temperature, one draw of ``Random(rng_seed).random()`` over the cumulative
    probabilities in id order."""
    values = [cost[i] for i in candidates]
    lo, hi = min(values), max(values)
    span = hi - lo
    if span > 0.0:
        weights = [math.exp(-((v - lo) / span) / temperature) for v in values]
    else:
        weights = [1.0] * len(values)
    total = math.fsum(weights)
    probs = [w / total for w in weights]
    draw = random.Random(rng_seed).random()
    chosen = candidates[-1]
    acc = 0.0
    for i, p in zip(candidates, probs):
        acc += p
        if draw < acc:
            chosen = i
            break
    probability: list[float | None] = [None] * n
    for i, p in zip(candidates, probs):
        probability[i] = p
    return chosen, probability


def _next_round_robin(
    eligible: list[int], ordered: Sequence[WorkerLoad], cursor: WorkerId | None
) -> int:
    """The first eligible worker whose id sorts after ``cursor``, wrapping around.

    The cursor is a worker id, not a position, so workers joining or leaving never make the
    rotation skip or repeat anyone.
    """
    if cursor is not None:
        for i in eligible:
            if ordered[i].worker_id > cursor:
                return i
    return eligible[0]


def _fmt(x: float) -> str:
    """Compact, deterministic number formatting for reasons: 272, 0.75, 123.46."""
    if x == int(x) and abs(x) < 1e15:
        return str(int(x))
    return f"{x:.2f}".rstrip("0").rstrip(".") if abs(x) >= 0.01 else f"{x:.3g}"
