"""What a client may ask of the router: bounds on one request, and the request-id rule. Pure.

Invariant: nothing a client sends reaches a worker unless it is within these bounds, so a
client can neither hold a worker for minutes (``max_output_tokens``), flood the KV log
(``context_tokens``: a 1M-token prompt is ~47k KV events and a lagging view), nor make a worker
fail in a way the router would blame on the worker (token ids outside the vocabulary). Every
refusal is an :class:`~control_plane.router.errors.InvalidRequest` naming the parameter and
the bound, which the HTTP front turns into an OpenAI-style 4xx.

Request ids are the server's: one per request, never reused, never taken from the client
(a client's id would be a routing and ledger key it controls: sent twice, two requests share
one ledger entry; with a newline it broke the worker call). A client's own id is kept as
metadata (``RequestAdmitted.client_request_id``) so it can still find its request.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from control_plane.router.errors import InvalidRequest
from control_plane.router.prompt import PromptIds
from common.request_limits import SIM_CONTEXT_TOKENS, SIM_VOCAB_SIZE, OutOfBounds, RequestLimits, ids_in_vocabulary
from common.request_limits import check_generation as _check_generation
from schemas.types import RequestId

__all__ = ["SIM_CONTEXT_TOKENS", "SIM_VOCAB_SIZE", "RequestLimits", "check_client_id", "check_generation",
           "new_request_id"]


def check_generation(tokens: Sequence[int], max_tokens: int | None, limits: RequestLimits,
                     max_tokens_param: str = "max_tokens") -> int:
    """The ``max_tokens`` to run with, or :class:`InvalidRequest` when the prompt's ids or its
    length, or the output asked for, break ``limits`` (:func:`common.request_limits.check_generation`,
    with the fast vocabulary test of a prompt read natively)."""
    try:
        return _check_generation(tokens, max_tokens, limits, max_tokens_param, _in_vocabulary)
    except OutOfBounds as e:
        raise InvalidRequest(str(e), param=e.param, code=e.code) from None


def _in_vocabulary(tokens: Sequence[int], vocab_size: int) -> bool:
    """A prompt read natively (:class:`~control_plane.router.prompt.PromptIds`) was read only if
    every id is below its bound: known already; anything else is checked."""
    if isinstance(tokens, PromptIds):
        if tokens.below <= vocab_size:
            return True
        tokens = tokens.ids()
    return ids_in_vocabulary(tokens, vocab_size)


def check_client_id(value: object, limits: RequestLimits, param: str = "request_id") -> str | None:
    """A client's request id as kept in metadata: printable ASCII, at most
    ``max_client_id_chars`` (a header-safe string); ``None`` when none was given."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise InvalidRequest(f"{param} must be a string", param=param, code="invalid_type")
    if len(value) > limits.max_client_id_chars:
        raise InvalidRequest(f"{param} is {len(value)} characters; at most {limits.max_client_id_chars}",
                             param=param, code="invalid_value")
    if not all(" " <= ch <= "~" for ch in value):
        raise InvalidRequest(f"{param} must be printable ASCII (no control characters)", param=param,
                             code="invalid_value")
    return value


def new_request_id(endpoint: str = "completions") -> RequestId:
    """A fresh server request id, OpenAI-shaped (``cmpl-…`` / ``chatcmpl-…``)."""
    return RequestId(f"{'chatcmpl' if endpoint == 'chat' else 'cmpl'}-{uuid.uuid4().hex}")
