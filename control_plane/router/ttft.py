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
of the request (:func:`queue_ahead`: this router's own requests not yet prefilled there, already
net of their own cache hits; not the worker's report, which lags; less what the worker has
computed of them since, :func:`queue_done`, drained from the last prefill seen end there at the
rate its prefills were seen to go) and then the request's uncached tokens. The engine packs
them first come first served into steps of at most ``chunk_tokens`` (:func:`packed_steps`); a
step of ``T`` tokens costs ``step_ms + T * ms_per_token + T^2 * ms_per_step_token_sq`` (the
mocker profile's step is exactly that), every step ``ms_per_decode_block_step`` per KV block of
the decodes beside it; the request's own tokens ``n`` over ``c`` cached add their attention
``ms_per_token_ctx * n * (c + n / 2)``, and the request ``base_ms``. With the rate seen
(``TtftModel.queue_tokens_per_ms``) the full steps before the request's last go at it
(:func:`rate_split`) and the costs price the last step alone. A busy worker (``TtftModel.busy_steps``:
the router's prefills or decodes in flight there) adds the step under way, one more ``step_ms``:
an engine adds a request at a step boundary. A model without ``ms_per_step_token_sq``
(logs written before it) costs the queue as one prompt with no context, then the request in
steps of its own: a step of ``n`` new tokens over ``c`` of context
``step_ms + n * (ms_per_token + ms_per_token_ctx * (c + n / 2))``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from schemas.events import CandidateScore, TtftModel
from schemas.types import RequestPhase


__all__ = ["PRIOR", "TtftModel", "cost_vector", "features", "packed_steps", "predict", "predict_ttft_ms", "queue_ahead",
           "queue_done", "rate_split", "split"]

#: The prior every router starts from (conservative: a mid-range GPU's prefill rate for an 8B
#: model, ~20k tokens/s), and what a worker's fit starts from (``ttft_fit.py``).
#: Its decode cost and its steps' squared-token cost are 0 (the fit learns them; a prior that
#: guessed them would be the simulator's).
PRIOR = TtftModel(ms_per_decode_block_step=0.0, ms_per_step_token_sq=0.0, chunk_tokens=8192)


def queue_ahead(row: CandidateScore) -> int:
    """The prefill tokens the row's prediction waits behind: the router's own in-flight ones,
    the combined ``queued_prefill_tokens`` less what only the report adds
    (``report_only_prefill_tokens``; 0 in rows written before it, predicted behind the combined
    figure)."""
    return max(row.queued_prefill_tokens - row.report_only_prefill_tokens, 0)


def queue_done(pending: Iterable[tuple[float, int]], now_s: float, model: TtftModel, decode_blocks: int = 0,
               since_s: float = -math.inf, rate: float | None = None) -> int:
    """The tokens of ``pending`` (the router's in-flight prefills on one worker: (routed at, s;
    tokens), in the order the ledger added them; one routed before an earlier entry counts from
    the later time) that the worker has computed by ``now_s``, at
    ``model``'s rate (:meth:`~schemas.events.TtftModel.tokens_per_ms`): first come, first
    served, the worker idle only when all that was routed is done, and busy until ``since_s``
    (the end of the last prefill seen end there: what was routed before it waited for it);
    its steps slowed by the ``decode_blocks`` the router's requests in flight hold there (a
    model with the engine's steps); ``rate`` (tokens/ms): the worker's measured one instead. A
    fold of the log's decision times and in-flight entries (replay re-derives it); without it
    the queue ahead counts in full a request the worker has nearly finished."""
    if rate is None:
        rate = model.tokens_per_ms(decode_blocks)
    left = 0.0
    total = 0
    last = None
    for at, tokens in pending:
        at = max(at, since_s)
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
             queue_done_tokens: int = 0, decode: bool = True, packed: bool = False, at_rate: bool = False,
             busy_steps: int = 0) -> tuple[int, int, int, int, int, int]:
    """What the prediction multiplies by the model's six costs, as integers (so the fit's sums
    are exact): (1 request, engine steps, prompt tokens computed, twice the attention term,
    engine steps times the worker's in-flight KV blocks ``active_decode_blocks``: the decodes
    sharing those steps, 0 without ``decode``, a decision whose model had no decode term; the
    steps' tokens squared, 0 without ``packed``, a decision whose model had no such cost).
    The queue ahead (:func:`queue_ahead`, already net of their own cache hits, less the
    ``queue_done_tokens`` the worker has computed of it) is computed first, then the request's
    uncached tokens (the row's index or in-flight overlap, whichever is longer, at most
    ``prompt_tokens - 1``: an engine computes at least the last token) over its cached context.
    ``packed`` (:func:`packed_steps`): the engine's steps, the queue and the request in one
    first-come-first-served stream; the attention term is the request's own. Without it (a
    model written before): the queue counts as one prompt with no context, in its own steps.
    ``at_rate``: the last step's alone (a model whose full steps before it went at the rate
    seen, :func:`rate_split`). ``busy_steps`` (a model with the engine's steps): the steps
    under way on the worker that the request waits to end (``TtftModel.busy_steps``), added to
    the steps feature: each costs ``step_ms``."""
    q, cached, n = split(row, prompt_tokens, block_size, queue_done_tokens)
    return _features(q, cached, n, row.active_decode_blocks if decode else 0, chunk_tokens, packed, at_rate,
                     busy_steps)


def split(row: CandidateScore, prompt_tokens: int, block_size: int, queue_done_tokens: int = 0
          ) -> tuple[int, int, int]:
    """(queue ahead left, cached tokens, tokens to compute) of a request of ``prompt_tokens``
    under ``row``: what :func:`features` and the fit's wait read."""
    q = max(queue_ahead(row) - queue_done_tokens, 0)
    cached = min(max(row.overlap_blocks, row.speculative_overlap) * block_size, max(prompt_tokens - 1, 0))
    return q, cached, max(prompt_tokens - cached, 0)


def _features(q: int, cached: int, n: int, decode_blocks: int, chunk_tokens: int, packed: bool,
              at_rate: bool = False, busy_steps: int = 0) -> tuple[int, int, int, int, int, int]:
    """:func:`features` of a queue ahead ``q``, ``cached`` tokens of context and ``n`` to compute."""
    if at_rate:
        last = rate_split(q + n, chunk_tokens)[1]
        step = 1 if last else 0
        return 1, step + busy_steps, last, n * (2 * cached + n), step * decode_blocks, last * last
    if packed:
        steps, sq = packed_steps(q + n, chunk_tokens)
        return 1, steps + busy_steps, q + n, n * (2 * cached + n), steps * decode_blocks, sq
    steps = _steps(q, n, chunk_tokens)
    return 1, steps, q + n, q * q + n * (2 * cached + n), steps * decode_blocks, 0


def rate_split(tokens: int, chunk_tokens: int) -> tuple[int, int]:
    """``tokens`` queued on a worker (the queue ahead left, then the request's own) in the
    engine's steps (:func:`packed_steps`): (the tokens of the full steps before the last, the
    last step's). A model with ``queue_tokens_per_ms`` waits for the full ones at that rate,
    the rate the worker's prefills were seen to go, and costs the last as a step."""
    if tokens <= 0:
        return 0, 0
    full = (-(-tokens // chunk_tokens) - 1) * chunk_tokens
    return full, tokens - full


def packed_steps(tokens: int, chunk_tokens: int) -> tuple[int, int]:
    """The engine steps ``tokens`` prompt tokens queued on a worker form, and the sum of each
    step's tokens squared: full steps of ``chunk_tokens`` (vLLM's chunked-prefill budget, filled
    first come first served across requests), then the remainder."""
    if tokens <= 0:
        return 0, 0
    steps = -(-tokens // chunk_tokens)
    last = tokens - (steps - 1) * chunk_tokens
    return steps, (steps - 1) * chunk_tokens * chunk_tokens + last * last


def cost_vector(model: TtftModel) -> tuple[float, float, float, float, float, float]:
    """The model's costs in the order of :func:`features` (the attention feature is doubled, so
    its cost is halved; an absent cost is 0)."""
    return (model.base_ms, model.step_ms, model.ms_per_token, model.ms_per_token_ctx / 2,
            model.ms_per_decode_block_step or 0.0, model.ms_per_step_token_sq or 0.0)


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
    ``decode_blocks`` the worker's requests in flight hold (``model.ms_per_decode_block_step``).
    A model with ``ms_per_step_token_sq`` costs the steps the engine forms (:func:`packed_steps`)."""
    cached = min(max(overlap_blocks, speculative_overlap) * block_size, max(prompt_tokens - 1, 0))
    q = max(queued_prefill_tokens - (model.queue_done_tokens or 0), 0)
    n = prompt_tokens - cached
    if model.ms_per_step_token_sq is not None:
        rate = model.queue_tokens_per_ms
        n = max(n, 0)
        x = _features(q, cached, n, decode_blocks, model.chunk_tokens, True, rate is not None, model.busy_steps or 0)
        c = cost_vector(model)
        wait = 0.0 if rate is None else rate_split(q + n, model.chunk_tokens)[0] / rate
        return c[0] * x[0] + c[1] * x[1] + c[2] * x[2] + c[3] * x[3] + c[4] * x[4] + c[5] * x[5] + wait
    # Models written before it: the same sum as model . features(...), laid out as before the
    # fit existed, so a decision recorded then (under the prior, base 0) re-executes bit for bit.
    out = model.base_ms + model.prefill_ms(q) + model.prefill_ms(n, cached)
    per_step = model.ms_per_decode_block_step
    if per_step and decode_blocks > 0:
        out += per_step * (_steps(q, max(n, 0), model.chunk_tokens) * decode_blocks)
    return out


def _steps(queued: int, new: int, chunk_tokens: int) -> int:
    """Engine steps of a prediction under a model without ``ms_per_step_token_sq``: the queue's
    chunks, then the request's own."""
    return -(-queued // chunk_tokens) + -(-new // chunk_tokens)
