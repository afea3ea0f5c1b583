"""Predicted time to first token of a request on a worker, from a decision's score row (issue 39,
item 1: the first part only).

What is built: the prediction the router records for the worker it chose
(``RequestRouted.predicted_ttft_ms``), from that worker's row alone, under a fixed prior
(:data:`PRIOR`), so that ``switchyard replay reconcile`` can set it beside the TTFT observed and
replay re-executes it bit for bit. What is not built yet: the cost is still the block count of
``docs/router.md`` ("The kv cost"), not this prediction; the parameters are not fitted from the
log (item 2); onboarding from slower tiers and the P/D transfer are not in it.

The model (docs/router.md, "Predicted TTFT"): the worker computes the prefill tokens queued ahead
of the request (the row's ``queued_prefill_tokens``, already net of their own cache hits) and then
the request's uncached tokens, in chunked-prefill steps of at most ``chunk_tokens`` tokens. A
step of ``n`` new tokens over a context of ``c`` tokens already in the KV costs
``step_ms + n * (ms_per_token + ms_per_token_ctx * (c + n / 2))``: a fixed part, a part linear in
the tokens (the weights) and a part linear in the context they attend to (attention), which
makes a prompt's own prefill superlinear in its length.
"""

from __future__ import annotations

import msgspec

from schemas.events import CandidateScore
from schemas.types import RequestPhase


class TtftModel(msgspec.Struct, frozen=True, kw_only=True):
    """Parameters of the prediction; every field in milliseconds or tokens."""

    #: Fixed cost of one engine step.
    step_ms: float = 2.0
    #: Cost of one prompt token, context aside (the weights' share).
    ms_per_token: float = 0.05
    #: Extra cost of one prompt token per token of context it attends to.
    ms_per_token_ctx: float = 2e-6
    #: Prompt tokens one step computes at most (vLLM's ``max_num_batched_tokens``).
    chunk_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1 or min(self.step_ms, self.ms_per_token, self.ms_per_token_ctx) < 0:
            raise ValueError(f"TtftModel: chunk_tokens must be >= 1 and the costs >= 0, got {self}")

    def prefill_ms(self, new_tokens: int, context_tokens: int = 0) -> float:
        """Time to compute ``new_tokens`` after ``context_tokens`` already in the KV: the sum of
        the steps' costs, in closed form (the chunks tile the ``N`` new tokens, so their
        attention terms add up to ``N * context + N^2 / 2`` whatever the chunk size)."""
        if new_tokens <= 0:
            return 0.0
        steps = -(-new_tokens // self.chunk_tokens)
        return (steps * self.step_ms + new_tokens * self.ms_per_token
                + self.ms_per_token_ctx * new_tokens * (context_tokens + new_tokens / 2))


#: The prior every router starts from (conservative: a mid-range GPU's prefill rate for an 8B
#: model, ~20k tokens/s). Not fitted yet.
PRIOR = TtftModel()


def predict_ttft_ms(row: CandidateScore, prompt_tokens: int, block_size: int, phase: RequestPhase,
                    model: TtftModel = PRIOR) -> float:
    """The TTFT the ``row``'s worker gives a request of ``prompt_tokens``: the queue ahead, then
    its own uncached tokens (the row's index or in-flight overlap, whichever is longer, at most
    ``prompt_tokens - 1``: an engine computes at least the last token). 0 for a decode phase (its
    first token follows a transfer, not modelled yet)."""
    if phase is RequestPhase.DECODE:
        return 0.0
    cached = min(max(row.overlap_blocks, row.speculative_overlap) * block_size, max(prompt_tokens - 1, 0))
    wait = model.prefill_ms(row.queued_prefill_tokens)
    return wait + model.prefill_ms(prompt_tokens - cached, cached)
