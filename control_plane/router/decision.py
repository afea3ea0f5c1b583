"""The routing decision: pure, deterministic, and able to explain itself.

``decide(request, workers, config, rng_seed=..., overlaps=..., inflight=..., rr_cursor=...)``
returns a :class:`Decision`: the chosen worker, one :class:`~schemas.events.CandidateScore` row
per candidate (ineligible ones included, marked ``eligible=False``), a reason that spells out the
winning arithmetic, and the state the caller must carry to the next decision (the round-robin
cursor). No I/O, no clock, no global RNG: the same inputs and seed give a bit-identical
``Decision``, so the replay tool can recompute any recorded decision and compare.

The rule is Dynamo's kv cost with tier weights and the in-flight ledger's speculative overlap;
the formula, a worked example of why a burst of identical prompts spreads, and the tie-break
rules: ``docs/routing-cost.md``. The parts: ``decision_types.py`` (the shapes),
``scoring.py`` (the kv terms, guards and argmin, from the Rust core), ``choice.py`` (the
modes' choices, the reasons, the score rows). The pure-Python specification of the scoring is
the differential oracle ``tests/oracles/scoring.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from operator import attrgetter

import msgspec

from control_plane.router.choice import CHOOSERS, KEEP, word_capacity
from control_plane.router.choice import score_rows as _rows
from control_plane.router.config import RouterConfig
from control_plane.router.decision_types import (
    NO_OVERLAP,
    PEER,
    Decision,
    RoutingRequest,
    WorkerLoad,
    WorkerOverlap,
)
from control_plane.router.errors import NoEligibleWorker
from control_plane.router.ledger import InflightView
from control_plane.router.pairs import PAIR_PREFILLS, PairInputs
from control_plane.router.pairs import choose as _choose_pair
from control_plane.router.sessions import APPLIED
from control_plane.router.sessions import affinity as _affinity

# The steps ``decide`` runs, looked up in this module by name so that the differential tests
# can run the same decision with the oracle's steps (``tests/oracles/scoring.py``).
from control_plane.router.scoring import pick as _pick
from control_plane.router.scoring import predictions
from control_plane.router.scoring import score as _score
from schemas.events import TtftModel
from schemas.types import RequestPhase, RoutingMode, WorkerId

__all__ = ["NO_OVERLAP", "PEER", "Decision", "RoutingRequest", "WorkerLoad", "WorkerOverlap", "decide"]

#: How many excluded workers a reason lists by name.
_REASON_MAX_EXCLUDED = 8
_by_worker_id = attrgetter("worker_id")


def decide(
    request: RoutingRequest,
    workers: Sequence[WorkerLoad],
    config: RouterConfig,
    *,
    rng_seed: int,
    overlaps: Mapping[WorkerId, WorkerOverlap] | None = None,
    inflight: InflightView | None = None,
    rr_cursor: WorkerId | None = None,
    ttft_models: Mapping[WorkerId, TtftModel] | None = None,
    pair: PairInputs | None = None,
    paired: WorkerId = "",
    session_worker: WorkerId = "",
) -> Decision:
    """Choose a worker for ``request`` among ``workers``.

    * ``workers``: every candidate, eligible or not (each gets a row); order does not matter.
    * ``overlaps``: the prefix index's match per worker; a missing worker has no overlap.
    * ``inflight``: the router's :class:`~control_plane.router.ledger.InflightLedger` (only
      read, through ``view``) or a recorded snapshot with the same ``view``; None = nothing in
      flight. Call ``ledger.expire(now)`` before deciding.
    * ``rng_seed``: the only source of randomness (tie-breaks, sampling, random mode); record it.
    * ``rr_cursor``: the previous decision's ``Decision.rr_cursor`` (round_robin mode).
    * ``ttft_models``: each candidate's TTFT model (a missing one is the prior); given, every
      row of a prefill phase carries its predicted TTFT (``scoring.predictions``), and with
      ``config.cost == "ttft"`` that prediction is the kv cost. None = no predictions.
    * ``pair`` (a prefill phase, ``config.pd_pairs``, kv mode): the decode candidates and the
      pair models; the decision then chooses the decode worker with the prefill worker
      (``pairs.py``: ``paired_worker_id``, ``pairs``, ``decode_scores``).
    * ``session_worker`` (``config.session_affinity``, kv mode, a phase that prefills, with
      predictions): the worker of the request's session's previous turn; kept unless another
      is faster by the margin (``sessions.affinity``), its row saying ``applied`` or ``yielded``.
    * ``paired`` (a decode phase, ``config.pd_pairs``, kv mode): the decode worker its prefill
      decision chose; taken unless the guards leave it out.

    Eligible = registered, not draining, role equal to the request's phase (an aggregated
    worker serves aggregated requests only). Raises :class:`NoEligibleWorker` when no candidate
    is eligible, :class:`InvalidRoutingInput` when a worker id appears twice or an integer
    input is beyond 2^53 (the core computes the cost exactly in ``f64`` or not at all).

    Four steps: score every candidate (``scoring.score``), take the guards' and the mode's
    numbers (``scoring.pick``), choose and word the reason (``choice.CHOOSERS``), and write the
    score table (``choice.score_rows``). The native core does the first two in one call; with a
    TTFT cost, ``scoring.pick`` runs the guards again on the predictions.
    """
    if not workers:
        raise NoEligibleWorker(f"request {request.request_id}: no candidate workers")
    ordered = sorted(workers, key=_by_worker_id)
    mine = inflight.view(request.block_hashes) if inflight is not None else {}
    predicts = ttft_models is not None and request.phase is not RequestPhase.DECODE
    ttft_cost = predicts and config.cost == "ttft"  # else a decode phase's kv cost stays blocks
    # With predictions the rows are built by choice.score_rows, each with its prediction, not by
    # the core and then copied.
    t = _score(request, ordered, config, overlaps or {}, mine, ttft_cost, rows=not predicts)
    predicted = predictions(t, ttft_models, mine) if predicts else None
    if ttft_cost:
        # The cost is the prediction: the guards and the argmin run on it here (the native core
        # gave the terms only, see scoring.score).
        t.cost, t.pick, t.rows, t.ttft_cost = predicted[0], None, None, True
    pick = t.pick if t.pick is not None else _pick(t, config)
    if pick is None:
        raise NoEligibleWorker(
            f"request {request.request_id}: no eligible worker among {t.n}: "
            + ", ".join(f"{t.ordered[i].worker_id} ({t.excluded[i]})" for i in range(t.n))
        )
    notes: list[str] = []
    guards: list[str] = []
    word_capacity(t, pick, notes, guards)
    choice = CHOOSERS[config.mode](t, pick, config, rng_seed, rr_cursor, notes, guards)
    reason = choice.reason
    chosen = choice.chosen
    affine, verdict = None, ""
    if (session_worker and config.session_affinity and config.mode is RoutingMode.KV and predicted is not None):
        chosen, affine, verdict, said = _affinity([w.worker_id for w in t.ordered], pick.competing, chosen,
                                                  predicted[0], session_worker, config.session_margin_ms,
                                                  config.session_margin_rel)
        if chosen != choice.chosen:
            reason = f"{said}; else {reason}"
        else:
            reason += f"; {said}"
    paired_id, pairs, decode_rows = "", (), ()
    if config.pd_pairs and config.mode is RoutingMode.KV:
        if pair is not None and request.phase is RequestPhase.PREFILL:
            got = _pair(request, t, pick, chosen, predicted, pair, mine, config, rng_seed,
                        ttft_cost and verdict != APPLIED)
            if got is not None:
                new, paired_id, pairs, decode_rows, said = got
                if new != chosen:
                    chosen, reason = new, f"kv (predicted TTFT) pair argmin: {said}"
                else:
                    reason += f"; {said}"
        elif paired and request.phase is RequestPhase.DECODE:
            paired_id = paired
            at = next((i for i in range(t.n) if t.ordered[i].worker_id == paired), None)
            if at is not None and at in pick.competing:
                chosen = at
                reason = f"paired at the prefill decision: {paired} (decode cost {_fmt_cost(choice.row_cost[at])})"
            else:
                why = (t.excluded[at] or "left out by the guards") if at is not None else "not a candidate now"
                reason = f"paired {paired} passed over ({why}); {reason}"
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
    rows = _rows(t, choice.row_cost, choice.probability, predicted)
    if verdict:
        rows = (*rows[:affine], msgspec.structs.replace(rows[affine], session_affinity=verdict), *rows[affine + 1:])
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
        rr_cursor=choice.next_cursor if choice.next_cursor is not KEEP else rr_cursor,
        prefill_tokens=own_prefill,
        decode_blocks=t.request_blocks,
        speculative_overlap=(t.shared_by_worker if t.shared_by_worker is not None
                             else {w.worker_id: s for w, s in zip(t.ordered, t.shared) if s}),
        guards=tuple(guards),
        paired_worker_id=paired_id,
        pairs=pairs,
        decode_scores=decode_rows,
    )


def _pair(request: RoutingRequest, t, pick, chosen: int, predicted, pair: PairInputs, mine, config: RouterConfig,
          rng_seed: int, ttft_cost: bool):
    """A prefill decision's pair (``pairs.choose``) over its decode candidates, scored as the
    decode decision scores them (the same ledger view: the request's prefill entry is on a
    prefill worker). None when no decode worker is eligible (the decode decision then says so).
    Returns (prefill position, decode worker, pairs, decode rows, the pair's words)."""
    if not pair.workers:
        return None
    dreq = msgspec.structs.replace(request, phase=RequestPhase.DECODE)
    td = _score(dreq, sorted(pair.workers, key=_by_worker_id), config, {}, mine, False, rows=False)
    dpick = td.pick if td.pick is not None else _pick(td, config)
    if dpick is None:
        return None
    word_capacity(td, dpick, [], [])
    decode_rows = _rows(td, list(td.cost), None)
    ttft = predicted[0] if predicted is not None else [0.0] * t.n
    if ttft_cost:
        prefills = sorted(pick.competing, key=lambda i: (ttft[i], t.ordered[i].worker_id))[:PAIR_PREFILLS]
    else:
        prefills = [chosen]
    pc = _choose_pair(prefills, [w.worker_id for w in t.ordered], ttft, decode_rows, dpick.competing, pair,
                      request.prompt_tokens, request.expected_output_tokens, config.itl_slo_ms, rng_seed)
    return pc.prefill, pc.decode, pc.pairs, decode_rows, pc.reason


def _fmt_cost(x: float | None) -> str:
    return "-" if x is None else f"{x:g}"
