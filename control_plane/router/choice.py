"""A decision's choice and its words: each routing mode's chooser (kv argmin or softmax, round
robin, random, least loaded) over the scored candidates, the reason spelling out the winning
arithmetic, and the score table (one ``CandidateScore`` row per candidate)."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from itertools import repeat

import msgspec

from control_plane.router.config import RouterConfig
from control_plane.router.decision_types import (
    NO_OVERLAP,
    TIER_NAMES,
    WorkerLoad,
    WorkerOverlap,
)
from control_plane.router.scoring import (
    CAPACITY_EXCLUDED,
    CAPACITY_IGNORED,
    Pick,
    Scored,
    tied_lowest,
)
from schemas.events import CandidateScore
from schemas.types import RoutingMode, WorkerId


def word_capacity(t: Scored, pick: Pick, notes: list[str], guards: list[str]) -> None:
    """The capacity guard's exclusions, guard and note, in words."""
    if pick.capacity == CAPACITY_EXCLUDED:
        for i in pick.over:
            t.excluded[i] = f"over KV capacity: {t.decode[i]} > {t.ordered[i].kv_capacity_blocks} blocks"
        guards.append("capacity")
    elif pick.capacity == CAPACITY_IGNORED:
        notes.append("every eligible worker is over its KV capacity; capacity guard ignored")


#: A chooser's "the cursor does not move".
KEEP = object()


class _Choice(msgspec.Struct):
    chosen: int
    reason: str
    row_cost: list[float | None]
    probability: list[float | None] | None = None
    next_cursor: object = KEEP


def _choose_kv(t: Scored, pick: Pick, config: RouterConfig, rng_seed: int, rr_cursor,
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


def _choose_round_robin(t: Scored, pick: Pick, config: RouterConfig, rng_seed: int, rr_cursor,
                        notes: list[str], guards: list[str]) -> _Choice:
    eligible = pick.eligible
    chosen = _next_round_robin(eligible, t.ordered, rr_cursor)
    picked = t.ordered[chosen].worker_id
    reason = (
        f"round_robin over {len(eligible)} eligible: chose {picked}, the next id after "
        f"cursor {rr_cursor!r}" + (" (wrapped)" if rr_cursor is not None and picked <= rr_cursor else "")
    )
    return _Choice(chosen, reason, [None] * t.n, next_cursor=picked)


def _choose_random(t: Scored, pick: Pick, config: RouterConfig, rng_seed: int, rr_cursor,
                   notes: list[str], guards: list[str]) -> _Choice:
    eligible = pick.eligible
    chosen = eligible[random.Random(rng_seed).randrange(len(eligible))]
    reason = f"random over {len(eligible)} eligible: chose {t.ordered[chosen].worker_id} (rng_seed {rng_seed})"
    return _Choice(chosen, reason, [None] * t.n)


def _choose_least_loaded(t: Scored, pick: Pick, config: RouterConfig, rng_seed: int, rr_cursor,
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
    tied = tied_lowest(eligible, metric)
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


CHOOSERS = {
    RoutingMode.KV: _choose_kv,
    RoutingMode.ROUND_ROBIN: _choose_round_robin,
    RoutingMode.RANDOM: _choose_random,
    RoutingMode.LEAST_LOADED: _choose_least_loaded,
}


#: ``CandidateScore``'s fields in the order :func:`score_rows` passes them (positionally: a
#: keyword call matches 17 names per row, a positional one none).
_ROW_FIELDS = ("worker_id", "overlap_blocks", "overlap_by_tier", "queued_prefill_tokens", "active_decode_blocks",
               "inflight_requests", "stale", "prefill_blocks", "decode_blocks", "cost", "probability", "eligible",
               "speculative_overlap", "excluded", "kv_capacity_blocks", "peer_from", "predicted_ttft_ms",
               "report_only_prefill_tokens")
assert CandidateScore.__struct_fields__[:len(_ROW_FIELDS)] == _ROW_FIELDS, \
    "score_rows passes CandidateScore's leading fields by position (the rest keep their defaults)"


def score_rows(t: Scored, row_cost: list[float | None], probability: list[float | None] | None,
               predicted: tuple[list[float], list[int]] | None = None) -> tuple[CandidateScore, ...]:
    """One score row per candidate, in id order: its combined loads, overlap and terms, and
    with ``predicted`` (``scoring.predictions``) its predicted TTFT and the part of its queue the
    prediction leaves out (set as the row is built, not copied in after).

    The native core builds them for the kv argmin without predictions (positionally, its 15
    leading fields); this builds them otherwise, in one comprehension calling ``CandidateScore``
    with every field by position: a keyword call is slower per row, more so from 16 keywords
    on (CPython passes them through a heap-allocated array; measured, 64 rows: 21 us with 15
    keywords, 48 us with 16; one row: 1.95 us with 15 keywords, 0.77 us with 17 positions).
    """
    if t.rows is not None:  # the native core's, for the kv argmin: their costs, no probability
        if len(t.pick.eligible) == t.n:  # type: ignore[union-attr]  # nothing excluded to word
            return t.rows
        return tuple(r if x is None else msgspec.structs.replace(r, excluded=x) for r, x in zip(t.rows, t.excluded))
    if t.by_tier is None:  # a peer reach (its row names the source) or the oracle's scoring
        t.overlap_blocks = [0 if ov is None else sum(ov.tiers) for ov in t.matched]
        t.by_tier = [{} if ov is None else ov.by_tier() for ov in t.matched]
        t.stale = [ov is not None and ov.stale for ov in t.matched]
        t.decode_f = [float(d) for d in t.decode]
        peer_from = [ov.peer_from if ov is not None else "" for ov in t.matched]
    else:  # the native core's columns: it gives none with a peer reach, so no row has one
        peer_from = repeat("")
    return tuple(
        CandidateScore(w.worker_id, ob, bt, q, a, r, st, p, d, c, pr, x is None, s, x or "", w.kv_capacity_blocks,
                       pf, pt, pq)
        for w, ob, bt, q, a, r, st, p, d, c, pr, x, s, pf, pt, pq in zip(
            t.ordered, t.overlap_blocks, t.by_tier, t.queued, t.active, t.in_flight, t.stale, t.prefill, t.decode_f,
            row_cost, repeat(None) if probability is None else probability, t.excluded, t.shared, peer_from,
            *((repeat(None), repeat(0)) if predicted is None else predicted))
    )


def _real_segments(
    ov: WorkerOverlap, skip: int, limit: int, weights: tuple[float, ...]
) -> list[tuple[int, str, float]]:
    """The index's matched blocks beyond ``skip`` and below ``limit``, per tier, as
    (count, tier name, weight); tiers laid along the prefix fastest first."""
    out = []
    pos = 0
    for count, name, weight in zip(ov.slots(), TIER_NAMES, weights):
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



def _draw(tied: list[int], rng_seed: int) -> int:
    """The one tied, or a seeded draw among them."""
    if len(tied) == 1:
        return tied[0]
    return tied[random.Random(rng_seed).randrange(len(tied))]




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
