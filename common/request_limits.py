"""What one generation request may ask of a server: the bounds, and the one check of them. Pure.

Shared by everything that runs a request a client sent: the router checks it before routing
(control_plane/router/limits.py adds its own error type and request-id rule), and each worker
checks it again on its own routes (data_plane/workers/app.py), so a caller that reaches a
worker directly gets no more than the router would have given it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated

import msgspec


class OutOfBounds(ValueError):
    """A request breaks one of :class:`RequestLimits`: ``param`` names the field, ``code`` the
    rule (OpenAI-style error codes)."""

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


#: The simulated model's context length (``switchyard-sim``: a Llama-3.1-8B-shaped engine,
#: 128k context; the Mooncake trace's longest prompt is 126,195 tokens).
SIM_CONTEXT_TOKENS = 131_072
#: The simulated model's vocabulary (the engine profiles' ``vocab_size``: Llama 3's 128,256).
SIM_VOCAB_SIZE = 128_256


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Bounds on one request; a value in the router's and the workers' settings."""

    #: Largest request body in bytes; larger gets 413. A prompt of ``context_tokens`` ids is
    #: ~1 MB of JSON; 4 MiB leaves room for text prompts.
    max_body_bytes: int = 4 * 1024 * 1024
    #: The model's context length: prompt tokens + max_tokens must fit (400
    #: ``context_length_exceeded`` otherwise, as OpenAI and vLLM answer).
    context_tokens: int = SIM_CONTEXT_TOKENS
    #: Largest ``max_tokens`` a request may ask for (one request holds a decode slot that long).
    max_output_tokens: int = 4096
    #: Token ids in a prompt must be below this (the model's vocabulary size).
    vocab_size: int = SIM_VOCAB_SIZE
    #: ``max_tokens`` when the request gives none (OpenAI's completions default).
    default_max_tokens: int = 16
    #: Longest client request id kept as metadata.
    max_client_id_chars: int = 200
    #: Seconds a request's body may take to arrive once its headers have; beyond: 408 and the
    #: connection closed (the headers' own bound is the server's, common/http_server.py).
    body_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "context_tokens", "max_output_tokens", "vocab_size", "default_max_tokens",
                     "max_client_id_chars"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if isinstance(self.body_timeout_s, bool) or not isinstance(self.body_timeout_s, (int, float)) \
                or not self.body_timeout_s > 0:
            raise ValueError(f"body_timeout_s={self.body_timeout_s!r} must be a number > 0")
        if self.default_max_tokens > self.max_output_tokens:
            raise ValueError(f"default_max_tokens={self.default_max_tokens} exceeds max_output_tokens="
                             f"{self.max_output_tokens}: a request without max_tokens would be refused")
        if self.max_output_tokens >= self.context_tokens:
            raise ValueError(f"max_output_tokens={self.max_output_tokens} must be below context_tokens="
                             f"{self.context_tokens}: the prompt needs at least one token of the context")


def check_generation(tokens: Sequence[int], max_tokens: int | None, limits: RequestLimits,
                     max_tokens_param: str = "max_tokens",
                     in_vocabulary: Callable[[Sequence[int], int], bool] | None = None) -> int:
    """The ``max_tokens`` to run with, or :class:`OutOfBounds` when the prompt's ids or its
    length, or the output asked for, break ``limits``. ``in_vocabulary``: a faster test of the
    ids for a caller's own prompt type (:func:`in_vocabulary` otherwise)."""
    if not tokens:
        raise OutOfBounds("the prompt has no tokens", param="prompt", code="empty_prompt")
    out = limits.default_max_tokens if max_tokens is None else max_tokens
    if out < 1:
        raise OutOfBounds(f"{max_tokens_param} must be at least 1, got {out}", param=max_tokens_param,
                             code="invalid_value")
    if out > limits.max_output_tokens:
        raise OutOfBounds(f"{max_tokens_param}={out} exceeds this router's limit of {limits.max_output_tokens} "
                             f"output tokens per request", param=max_tokens_param, code="max_tokens_exceeded")
    if not (in_vocabulary or ids_in_vocabulary)(tokens, limits.vocab_size):
        low, high = min(tokens), max(tokens)
        if low < 0 or high >= limits.vocab_size:
            bad = low if low < 0 else high
            raise OutOfBounds(f"token id {bad} is outside the model's vocabulary [0, {limits.vocab_size})",
                                 param="prompt", code="invalid_token_id")
    if len(tokens) + out > limits.context_tokens:
        raise OutOfBounds(f"This model's maximum context length is {limits.context_tokens} tokens. However, you "
                             f"requested {len(tokens) + out} tokens ({len(tokens)} in the prompt, {out} for the "
                             f"completion). Please reduce the prompt or {max_tokens_param}.",
                             param="prompt" if len(tokens) >= limits.context_tokens else max_tokens_param,
                             code="context_length_exceeded")
    return out


@lru_cache(maxsize=8)
def _ids_below(vocab_size: int) -> object:
    return list[Annotated[int, msgspec.Meta(ge=0, lt=vocab_size)]]


def ids_in_vocabulary(tokens: Sequence[int], vocab_size: int) -> bool:
    """Every id in ``[0, vocab_size)``, checked in one pass in C (2.5x faster than ``min`` and
    ``max`` at 4K ids). False is only a hint (``check_generation`` finds the bad id with ``min``
    and ``max``): ids that are not plain ints land there too."""
    try:
        msgspec.convert(tokens, _ids_below(vocab_size), strict=True)
    except msgspec.ValidationError:
        return False
    return True
