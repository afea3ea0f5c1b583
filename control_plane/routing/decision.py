"""The routing decision: pure, deterministic, and able to explain itself.

``decide(request, workers, config, rng_seed=..., overlaps=..., inflight=..., rr_cursor=...)``
returns a :class:`Decision`: the chosen worker, one :class:`~schemas.events.CandidateScore` row
per candidate (ineligible ones included, marked ``eligible=False``), a reason that spells out the
winning arithmetic, and the state the caller must carry to the next decision (the round-robin
cursor). No I/O, no clock, no global RNG: the same inputs and seed give a bit-identical
``Decision``, so the replay tool can recompute any recorded decision and compare.

The kv cost
-----------
For worker ``w`` (lower wins), in blocks::

    prefill_blocks  = max((queued_prefill_tokens(w) + prompt_tokens) / block_size - overlap(w), 0)
    decode_blocks   = active_decode_blocks(w) + request_blocks - shared_inflight(w)
    cost            = prefill_load_scale * prefill_blocks + decode_blocks

    overlap(w) = w_device * shared_inflight(w)
               + f * sum over the index's matched blocks beyond shared_inflight(w) of w_tier

This is Dynamo's cost with four tier weights (device 1.0, host 0.75, disk 0.25, object 0.1; see
:class:`~control_plane.routing.config.TierWeights`), plus:

* ``f`` = ``stale_overlap_factor`` (default 0) when the index marks ``w``'s view stale, else 1;
* ``request_blocks`` = ceil((prompt_tokens + expected_output_tokens) / block_size): the KV the
  request holds at its end;
* ``shared_inflight(w)`` = the request's leading blocks that requests this router sent to ``w``
  still hold (the ledger's speculative overlap). They count as device hits (the blocks are being
  written to ``w``'s device pool, and cannot be evicted while in use) and as blocks ``w`` does
  not have to allocate again (an engine stores shared prefix blocks once, as Dynamo counts).
* Loads combine the worker's report with the router's ledger (``load_combine``: max or sum).
* Tiers are laid along the prefix fastest first (device, host, disk, object): engines evict a
  chain's tail first and offload cascades one tier down, so the deeper blocks sit in slower
  tiers. The layout only matters when the speculative overlap covers part of the real one.
* A decode-phase request (disaggregated serving) has no prefill term: its KV arrives by transfer.

Each score row carries the two terms (``prefill_blocks`` after the overlap, ``decode_blocks``)
so ``cost = prefill_load_scale * prefill_blocks + decode_blocks`` checks from the row alone; its
load columns are the combined (reported and in-flight) values the cost used.

In-flight accounting and speculative overlap (why a burst spreads)
------------------------------------------------------------------
Speculative overlap alone would be a trap: after the first of N identical prompts goes to A, A
"has" the prefix, so every later one prefers A and all N pile up there. The ledger therefore
records the *load* each routed request adds as well, and the two cancel exactly where they
should. Take 4 empty workers and identical prompts of P = 128 blocks (2,048 tokens) with 16
output blocks (request_blocks = 144), prefill_load_scale 1:

* r1: every worker costs 128 + 144 = 272; a seeded tie-break picks A. The ledger now holds, for
  A, 2,048 queued prefill tokens, 144 blocks and the 128 hashes.
* r2 on A: prefill = (2,048 + 2,048)/16 - 128 = 128 (r2 waits for r1's prefill, which is the
  time its cache hit saves: the hit exactly pays for the queue), decode = 144 + 144 - 128 = 160
  (only r2's own 16 blocks are new), cost 288. On B, C or D: 272. r2 goes to an empty worker,
  and so do r3 and r4; r5..r8 see 288 everywhere and land one more per worker. No pile-up.
* Once r1's prefill is done (``prefill_done``), A's queue is empty: r on A costs
  max(128 - 128, 0) + 160 = 160 against 272 elsewhere, so a new identical prompt *does* go to A.

So identical requests spread exactly while the load they would queue behind exceeds the cache
benefit, and concentrate once the cached prefix is cheaper than a fresh prefill. Without the
load term all N pile onto A; without the speculative term A looks cold until its KV events
arrive (cost 128 + 288 = 416 after r1's prefill) and the burst scatters, recomputing the prefix
on every worker.

Tie-breaks and sampling use ``random.Random(rng_seed)`` built per decision (never dict order,
never a global RNG): a fixed order (lowest id) would hot-spot one worker whenever the cluster
is idle, and a recorded seed keeps the choice replayable. CPython's Mersenne Twister,
``random()`` and ``randrange()`` are stable across versions for integer seeds.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from operator import attrgetter

import msgspec

from control_plane.routing.config import RouterConfig
from control_plane.routing.errors import InvalidRoutingInput, NoEligibleWorker
from control_plane.routing.inflight import InflightView
from schemas.events import CandidateScore, RequestRouted
from schemas.types import (
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

    The matched depth is the sum of the tiers (each matched block counted in the fastest tier
    that holds it), so the two can never disagree.
    """

    device: int = 0
    host: int = 0
    disk: int = 0
    object: int = 0
    #: The index's view of this worker is not trusted to be current (lag, gap, new incarnation).
    stale: bool = False

    def __post_init__(self) -> None:
        if self.device < 0 or self.host < 0 or self.disk < 0 or self.object < 0:
            raise InvalidRoutingInput(f"negative block count in {self!r}")

    @property
    def depth(self) -> int:
        return self.device + self.host + self.disk + self.object

    @classmethod
    def from_tiers(
        cls, by_tier: Mapping[Tier | str, int] | Sequence[int], *, stale: bool = False
    ) -> WorkerOverlap:
        """Build from ``{Tier.HOST: 3, ...}``, ``{"host": 3, ...}`` or four counts in
        ``TIER_ORDER`` (the prefix index's ``Match.by_tier``)."""
        if isinstance(by_tier, Mapping):
            counts = {Tier(k).value: int(v) for k, v in by_tier.items()}
            return cls(**counts, stale=stale)
        device, host, disk, obj = by_tier
        return cls(device=device, host=host, disk=disk, object=obj, stale=stale)

    def by_tier(self) -> dict[str, int]:
        """Non-zero tiers by tier name (``CandidateScore.overlap_by_tier``)."""
        out: dict[str, int] = {}
        if self.device:
            out["device"] = self.device
        if self.host:
            out["host"] = self.host
        if self.disk:
            out["disk"] = self.disk
        if self.object:
            out["object"] = self.object
        return out


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
) -> Decision:
    """Choose a worker for ``request`` among ``workers``.

    * ``workers``: every candidate, eligible or not (each gets a row); order does not matter.
    * ``overlaps``: the prefix index's match per worker; a missing worker has no overlap.
    * ``inflight``: the router's :class:`~control_plane.routing.inflight.InflightLedger` (only
      read, through ``view``) or a recorded snapshot with the same ``view``; None = nothing in
      flight. Call ``ledger.expire(now)`` before deciding.
    * ``rng_seed``: the only source of randomness (tie-breaks, sampling, random mode); record it.
    * ``rr_cursor``: the previous decision's ``Decision.rr_cursor`` (round_robin mode).

    Eligible = registered, not draining, role equal to the request's phase (an aggregated
    worker serves aggregated requests only). Raises :class:`NoEligibleWorker` when no candidate
    is eligible, :class:`InvalidRoutingInput` when a worker id appears twice.
    """
    if not workers:
        raise NoEligibleWorker(f"request {request.request_id}: no candidate workers")
    ordered = sorted(workers, key=_by_worker_id)
    if overlaps is None:
        overlaps = {}

    hashes = request.block_hashes
    n_hash = len(hashes)
    block_size = request.block_size
    prompt_tokens = request.prompt_tokens
    request_blocks = request.request_blocks
    does_prefill = request.phase is not RequestPhase.DECODE
    phase_value = request.phase.value
    serving_role = WorkerRole(phase_value)
    weights = config.tier_weights.as_tuple()
    wd, wh, wk, wo = weights
    stale_factor = config.stale_overlap_factor
    use_max = config.load_combine == "max"
    scale = config.prefill_load_scale
    mine_by_worker = inflight.view(hashes) if inflight is not None else {}
    get_mine = mine_by_worker.get
    get_overlap = overlaps.get

    n = len(ordered)
    queued = [0] * n
    active = [0] * n
    in_flight = [0] * n
    shared = [0] * n
    overlap_w = [0.0] * n
    prefill = [0.0] * n
    decode = [0] * n
    cost = [0.0] * n
    excluded: list[str | None] = [None] * n
    matched: list[WorkerOverlap | None] = [None] * n

    # The hot loop (every request, every worker): straight-line arithmetic, no helper calls on
    # the common path. The overlap is the formula in the module docstring; _real_segments
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
            dev, host, disk, obj = ov.device, ov.host, ov.disk, ov.object
            if s == 0 and dev + host + disk + obj <= n_hash:
                real = wd * dev + wh * host + wk * disk + wo * obj
            else:
                real = _tail_weight(dev, host, disk, obj, s, n_hash, wd, wh, wk, wo)
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

    eligible = [i for i in range(n) if excluded[i] is None]
    if not eligible:
        raise NoEligibleWorker(
            f"request {request.request_id}: no eligible worker among {n}: "
            + ", ".join(f"{ordered[i].worker_id} ({excluded[i]})" for i in range(n))
        )

    notes: list[str] = []
    guards: list[str] = []
    if config.capacity_guard:
        over = [
            i for i in eligible
            if 0 < ordered[i].kv_capacity_blocks < decode[i]
        ]
        if over and len(over) < len(eligible):
            for i in over:
                excluded[i] = (
                    f"over KV capacity: {decode[i]} > {ordered[i].kv_capacity_blocks} blocks"
                )
            eligible = [i for i in eligible if excluded[i] is None]
            guards.append("capacity")
        elif over:
            notes.append("every eligible worker is over its KV capacity; capacity guard ignored")

    mode = config.mode
    probability: list[float | None] | None = None
    row_cost: list[float | None]
    chosen: int
    next_cursor = rr_cursor

    if mode is RoutingMode.KV:
        competing = eligible
        if config.imbalance_guard and len(eligible) > 1:
            loads = [in_flight[i] for i in eligible]
            hi, lo = max(loads), min(loads)
            spread_limit = config.imbalance_abs_threshold
            if hi - lo > spread_limit and hi > config.imbalance_rel_threshold * lo:
                competing = [i for i in eligible if in_flight[i] == lo]
                guards.append("imbalance")
                notes.append(
                    f"imbalance guard: in-flight spread {hi} - {lo} > "
                    f"{config.imbalance_abs_threshold} and {hi} > "
                    f"{_fmt(config.imbalance_rel_threshold)} x {lo}, so only the "
                    f"{len(competing)} least busy compete"
                )
        row_cost = list(cost)
        tail = ""
        if config.temperature > 0.0:
            chosen, probability = _softmax_sample(competing, cost, config.temperature, n, rng_seed)
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
            chosen, ties = _argmin(competing, cost, rng_seed)
            head = f"kv argmin over {len(competing)} candidates chose"
            if ties > 1:
                tail = f"; {ties} tied, broken by rng_seed {rng_seed}"
            else:
                runner = _runner_up(competing, cost, chosen)
                if runner is not None:
                    tail = (
                        f"; runner-up {ordered[runner].worker_id} at {_fmt(cost[runner])} "
                        f"(+{_fmt(cost[runner] - cost[chosen])})"
                    )
        wid = ordered[chosen].worker_id
        ov = overlaps.get(wid, NO_OVERLAP)
        factor = stale_factor if ov.stale else 1.0
        arithmetic = _explain_kv(
            wid, cost[chosen], scale, queued[chosen], prompt_tokens, block_size,
            _overlap_parts(ov, shared[chosen], n_hash, weights, factor), overlap_w[chosen],
            prefill[chosen], active[chosen], request_blocks, shared[chosen], does_prefill,
            ov.stale, factor,
        )
        reason = f"{head} {arithmetic}{tail}"
    elif mode is RoutingMode.ROUND_ROBIN:
        row_cost = [None] * n
        chosen = _next_round_robin(eligible, ordered, rr_cursor)
        next_cursor = ordered[chosen].worker_id
        reason = (
            f"round_robin over {len(eligible)} eligible: chose {next_cursor}, the next id after "
            f"cursor {rr_cursor!r}" + (" (wrapped)" if rr_cursor is not None
                                       and next_cursor <= rr_cursor else "")
        )
    elif mode is RoutingMode.RANDOM:
        row_cost = [None] * n
        chosen = eligible[random.Random(rng_seed).randrange(len(eligible))]
        reason = (
            f"random over {len(eligible)} eligible: chose {ordered[chosen].worker_id} "
            f"(rng_seed {rng_seed})"
        )
    elif mode is RoutingMode.LEAST_LOADED:
        if config.least_loaded_metric == "requests":
            metric = [float(x) for x in in_flight]
            what = "in-flight requests"
        else:
            metric = [queued[i] / block_size + active[i] for i in range(n)]
            what = "blocks (queued prefill tokens / block size + active decode blocks)"
        row_cost = list(metric)
        chosen, ties = _argmin(eligible, metric, rng_seed)
        c = ordered[chosen]
        detail = (
            f"{in_flight[chosen]} in flight" if config.least_loaded_metric == "requests"
            else f"{queued[chosen]}/{block_size} + {active[chosen]}"
        )
        reason = (
            f"least_loaded by {what} over {len(eligible)} eligible: chose {c.worker_id} "
            f"with load {_fmt(metric[chosen])} = {detail}"
        )
        if ties > 1:
            reason += f"; {ties} tied, broken by rng_seed {rng_seed}"
    else:  # pragma: no cover - RouterConfig validates the mode
        raise InvalidRoutingInput(f"unknown routing mode {mode!r}")

    if notes:
        reason = "; ".join(notes) + ". " + reason
    skipped = [i for i in range(n) if excluded[i] is not None]
    if skipped:
        listed = ", ".join(
            f"{ordered[i].worker_id} ({excluded[i]})" for i in skipped[:_REASON_MAX_EXCLUDED]
        )
        more = len(skipped) - _REASON_MAX_EXCLUDED
        reason += f". Excluded {len(skipped)} of {n}: {listed}" + (
            f" and {more} more" if more > 0 else ""
        )

    rows = []
    append = rows.append
    for i, w in enumerate(ordered):
        ov = matched[i]
        if ov is None:
            append(CandidateScore(
                worker_id=w.worker_id,
                queued_prefill_tokens=queued[i],
                active_decode_blocks=active[i],
                inflight_requests=in_flight[i],
                prefill_blocks=prefill[i],
                decode_blocks=float(decode[i]),
                cost=row_cost[i],
                probability=None if probability is None else probability[i],
                eligible=excluded[i] is None,
                speculative_overlap=shared[i],
                excluded=excluded[i] or "",
                kv_capacity_blocks=w.kv_capacity_blocks,
            ))
        else:
            append(CandidateScore(
                worker_id=w.worker_id,
                overlap_blocks=ov.device + ov.host + ov.disk + ov.object,
                overlap_by_tier=ov.by_tier(),
                queued_prefill_tokens=queued[i],
                active_decode_blocks=active[i],
                inflight_requests=in_flight[i],
                stale=ov.stale,
                prefill_blocks=prefill[i],
                decode_blocks=float(decode[i]),
                cost=row_cost[i],
                probability=None if probability is None else probability[i],
                eligible=excluded[i] is None,
                speculative_overlap=shared[i],
                excluded=excluded[i] or "",
                kv_capacity_blocks=w.kv_capacity_blocks,
            ))

    if does_prefill:
        own_prefill = max(round(prompt_tokens - overlap_w[chosen] * block_size), 0)
    else:
        own_prefill = 0
    return Decision(
        request_id=request.request_id,
        phase=request.phase,
        worker_id=ordered[chosen].worker_id,
        mode=mode,
        scores=tuple(rows),
        reason=reason,
        config_version=config.version,
        rng_seed=rng_seed,
        rr_cursor=next_cursor,
        prefill_tokens=own_prefill,
        decode_blocks=request_blocks,
        speculative_overlap={ordered[i].worker_id: shared[i] for i in range(n) if shared[i]},
        guards=tuple(guards),
    )


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def _tail_weight(
    dev: int, host: int, disk: int, obj: int, skip: int, limit: int,
    wd: float, wh: float, wk: float, wo: float,
) -> float:
    """The index's blocks at positions [skip, limit), weighted by tier, tiers laid along the
    prefix fastest first: ``sum(weight * count)`` over :func:`_real_segments`, in the same
    order, without building the segments."""
    real = 0.0
    a = dev
    b = a + host
    c = b + disk
    e = c + obj
    x = (a if a < limit else limit) - skip
    if x > 0:
        real += wd * x
    x = (b if b < limit else limit) - (a if a > skip else skip)
    if x > 0:
        real += wh * x
    x = (c if c < limit else limit) - (b if b > skip else skip)
    if x > 0:
        real += wk * x
    x = (e if e < limit else limit) - (c if c > skip else skip)
    if x > 0:
        real += wo * x
    return real


def _exclusion(w: WorkerLoad, phase_value: str) -> str:
    if not w.registered:
        return "not registered"
    if w.draining:
        return "draining"
    return f"role {WorkerRole(w.role).value} does not serve phase {phase_value}"


def _real_segments(
    ov: WorkerOverlap, skip: int, limit: int, weights: tuple[float, float, float, float]
) -> list[tuple[int, str, float]]:
    """The index's matched blocks beyond ``skip`` and below ``limit``, per tier, as
    (count, tier name, weight); tiers laid along the prefix fastest first."""
    out = []
    pos = 0
    for count, name, weight in (
        (ov.device, "device", weights[0]),
        (ov.host, "host", weights[1]),
        (ov.disk, "disk", weights[2]),
        (ov.object, "object", weights[3]),
    ):
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
    weights: tuple[float, float, float, float],
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


def _argmin(candidates: list[int], cost: Sequence[float], rng_seed: int) -> tuple[int, int]:
    """Lowest cost; a tie (within ``_TIE_RTOL``) goes to a seeded draw over the tied, in id
    order. Returns (chosen index, number tied)."""
    best = min(cost[i] for i in candidates)
    limit = best + _TIE_RTOL * max(1.0, abs(best))
    tied = [i for i in candidates if cost[i] <= limit]
    if len(tied) == 1:
        return tied[0], 1
    return tied[random.Random(rng_seed).randrange(len(tied))], len(tied)


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
