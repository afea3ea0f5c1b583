"""The routing decision's kv scoring and guards in pure Python: the executable specification
of the Rust core's ``decide_kv`` / ``pick_kv`` (``native/src/decide.rs``), kept as a
differential oracle.

:func:`score` computes every candidate's terms (the formula: ``docs/routing-cost.md``),
:func:`pick` applies the capacity and imbalance guards and finds the kv argmin, in numbers, on
the product's shapes (``control_plane.router.scoring.Scored`` / ``Pick``). :func:`oracle_steps`
runs ``decision.decide`` itself with these two steps in place of the native ones, so the whole
decision (reasons, rows, choice) is compared, not only the numbers.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import reduce
from operator import add, mul
from unittest import mock

from control_plane.router import decision
from control_plane.router.config import RouterConfig
from control_plane.router.decision_types import RoutingRequest, WorkerLoad, WorkerOverlap
from control_plane.router.errors import InvalidRoutingInput
from control_plane.router.ports import InflightLoad
from control_plane.router.scoring import (
    CAPACITY_EXCLUDED,
    CAPACITY_IGNORED,
    CAPACITY_UNCHANGED,
    Pick,
    Scored,
    _exclusion,
    tied_lowest,
)
from schemas.types import RoutingMode, WorkerId, WorkerRole


@contextmanager
def oracle_steps() -> Iterator[None]:
    """Within: ``decision.decide`` scores and picks with this module's :func:`score` and
    :func:`pick` (the steps it looks up in its module by name)."""
    with mock.patch.object(decision, "_score", score), mock.patch.object(decision, "_pick", pick):
        yield


def score(request: RoutingRequest, ordered: list[WorkerLoad], config: RouterConfig,
          overlaps: Mapping[WorkerId, WorkerOverlap], mine_by_worker: Mapping[WorkerId, InflightLoad],
          ttft_cost: bool = False, rows: bool = True) -> Scored:
    """The kv cost's terms for every candidate (the formula: docs/routing-cost.md); no
    :class:`Pick` (``decide`` then calls :func:`pick`). ``ttft_cost`` and ``rows`` change nothing here."""
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





def _runner_up(candidates: list[int], cost: Sequence[float], chosen: int) -> int | None:
    others = [i for i in candidates if i != chosen]
    return min(others, key=cost.__getitem__) if others else None
