"""Predicted time to first token of a request on a worker, from a decision's score row (issue 39,
item 1: the first part only).

What is built: the prediction the router records for the worker it chose
(``RequestRouted.predicted_ttft_ms``), from that worker's row and its fitted model, so that ``switchyard replay reconcile`` can set it beside the TTFT observed and
replay re-executes it bit for bit. The parameters are fitted from the log
(:mod:`.ttft_fit`, item 2), per worker around its pool's fit around :data:`PRIOR`. Every
candidate row carries its prediction (``decide(ttft_models=...)`` calls :func:`predict`), and
``RouterConfig.cost = "ttft"`` makes it the kv cost (step 2). What is not built yet: onboarding
from slower tiers and the P/D transfer are not modelled apart (the fitted ``base_ms`` absorbs
the handoff's mean).

The model (docs/router.md, "Predicted TTFT"): the worker computes the prefill tokens queued ahead
of the request (:func:`queue_ahead`: this router's own requests not yet
prefilled there, already net of their own cache hits; not the worker's report, which lags; less
what the worker has computed of them since they were routed, :func:`queue_done`) and then
the request's uncached tokens, in chunked-prefill steps of at most ``chunk_tokens`` tokens. A
step of ``n`` new tokens over a context of ``c`` tokens already in the KV costs
``step_ms + n * (ms_per_token + ms_per_token_ctx * (c + n / 2))``: a fixed part, a part linear in
the tokens (the weights) and a part linear in the context they attend to (attention), which
makes a prompt's own prefill superlinear in its length.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from schemas.events import CandidateScore, TtftModel
from schemas.types import RequestPhase


__all__ = ["PRIOR", "TtftModel", "features", "predict", "predict_ttft_ms", "queue_ahead", "queue_done"]

#: The prior every router starts from (conservative: a mid-range GPU's prefill rate for an 8B
#: model, ~20k tokens/s), and what a worker's fit starts from (``ttft_fit.py``).
#: Its decode cost is 0 (the fit learns it; a prior that guessed it would be the simulator's).
PRIOR = TtftModel(ms_per_decode_block_step=0.0)


def queue_ahead(row: CandidateScore) -> int:
    """The prefill tokens the row's prediction waits behind: the router's own in-flight ones,
    the combined ``queued_prefill_tokens`` less what only the report adds
    (``report_only_prefill_tokens``; 0 in rows written before it, predicted behind the combined
    figure)."""
    return max(row.queued_prefill_tokens - row.report_only_prefill_tokens, 0)


def queue_done(pending: Iterable[tuple[float, int]], now_s: float, model: TtftModel) -> int:
    """The tokens of ``pending`` (the router's in-flight prefills on one worker: (routed at, s;
    tokens), in the order the ledger added them; one routed before an earlier entry counts from
    the later time) that the worker has computed by ``now_s``, at
    ``model``'s rate (:meth:`~schemas.events.TtftModel.tokens_per_ms`): first come, first
    served, the worker idle only when all that was routed is done. A fold of the log's decision
    times (replay re-derives it); without it the queue ahead counts in full a request the worker
    has nearly finished."""
    rate = model.tokens_per_ms()
    left = 0.0
    total = 0
    last = None
    for at, tokens in pending:
        if last is not None and at > last:
            left = max(left - rate * (at - last) * 1000.0, 0.0) if math.isfinite(rate) else 0.0
        if last is None or at > last:
            last = at
        left += tokens
        total += tokens
    if last is None:
        return 0
    if now_s > last:
        left = max(left - rate * (now_s - last) * 1000.0, 0.0) if math.isfinite(rate) else 0.0
    return max(total - math.ceil(left), 0)


def features(row: CandidateScore, prompt_tokens: int, block_size: int, chunk_tokens: int,
             queue_done_tokens: int = 0, decode: bool = True) -> tuple[int, int, int, int, int]:
    """What the prediction multiplies by the model's five costs, as integers (so the fit's sums
    are exact): (1 request, engine steps, prompt tokens computed, twice their attention term,
    engine steps times the worker's in-flight KV blocks ``active_decode_blocks``: the decodes
    sharing those steps; 0 without ``decode``, a decision whose model had no decode term).
    The queue ahead (:func:`queue_ahead`, already net of their own cache hits, less the
    ``queue_done_tokens`` the worker has computed of it) is computed first, then the request's uncached tokens (the row's index or in-flight
    overlap, whichever is longer, at most ``prompt_tokens - 1``: an engine computes at least
    the last token) over its cached context. The queue's own context is not known; it counts
    as one prompt with none."""
    q = max(queue_ahead(row) - queue_done_tokens, 0)
    cached = min(max(row.overlap_blocks, row.speculative_overlap) * block_size, max(prompt_tokens - 1, 0))
    n = max(prompt_tokens - cached, 0)
    steps = _steps(q, n, chunk_tokens)
    return 1, steps, q + n, q * q + n * (2 * cached + n), steps * row.active_decode_blocks if decode else 0


def predict_ttft_ms(row: CandidateScore, prompt_tokens: int, block_size: int, phase: RequestPhase,
                    model: TtftModel = PRIOR) -> float:
    """The TTFT the ``row``'s worker gives a request of ``prompt_tokens`` under ``model``: the
    model's costs times :func:`features` (the queue ahead, then its own uncached tokens). 0 for
    a decode phase (its first token follows a transfer, not modelled separately)."""
    if phase is RequestPhase.DECODE:
        return 0.0
    return predict(queue_ahead(row), row.overlap_blocks, row.speculative_overlap, prompt_tokens, block_size, model,
                   row.active_decode_blocks)


def predict(queued_prefill_tokens: int, overlap_blocks: int, speculative_overlap: int, prompt_tokens: int,
            block_size: int, model: TtftModel = PRIOR, decode_blocks: int = 0) -> float:
    """The rule itself, on a row's four columns (what ``decide`` computes for every candidate
    before its rows exist, and :func:`predict_ttft_ms` from a row): the model's base, the queue
    ahead less what the worker has computed of it (``model.queue_done_tokens``), then the
    request's own uncached tokens over its cached context, every step of both slowed by the
    ``decode_blocks`` the worker's requests in flight hold (``model.ms_per_decode_block_step``)."""
    # The same sum as model . features(...), laid out as before the fit existed, so a decision
    # recorded then (under the prior, base 0) re-executes bit for bit.
    cached = min(max(overlap_blocks, speculative_overlap) * block_size, max(prompt_tokens - 1, 0))
    q = max(queued_prefill_tokens - (model.queue_done_tokens or 0), 0)
    n = prompt_tokens - cached
    out = model.base_ms + model.prefill_ms(q) + model.prefill_ms(n, cached)
    per_step = model.ms_per_decode_block_step
    if per_step and decode_blocks > 0:
        out += per_step * (_steps(q, max(n, 0), model.chunk_tokens) * decode_blocks)
    return out


def _steps(queued: int, new: int, chunk_tokens: int) -> int:
    """Engine steps of the prediction: the queue's chunks, then the request's own."""
    return -(-queued // chunk_tokens) + -(-new // chunk_tokens)
