"""The router's HTTP front: OpenAI-compatible API, health and metrics (FastAPI).

Routes only parse, call :class:`control_plane.router.proxy.Router` and frame the answer (SSE or
JSON). Errors are OpenAI-style JSON (``{"error": {"message", "type", "param", "code"}}``): a
request outside :mod:`control_plane.router.limits` or not understood is a 4xx before it is
admitted (nothing reaches the log or a worker), no worker is 503. Nothing a client sends raises
out of a route: a raised exception would be a 500 and cost the client its keep-alive connection.

API keys (:mod:`control_plane.router.keys`): with :attr:`RouterApp.auth` set, the generation
routes take ``Authorization: Bearer sk-sy_...`` first, before the body is read: a missing,
invalid, revoked or expired key is a 401, a key over its rate or concurrency a 429 (with
``Retry-After``). A request holds its key's concurrency slot until its last byte is sent,
streamed or not. ``/v1/models``, ``/health``, ``/metrics`` and ``/router/view`` take no key.

The two generation routes are plain ASGI endpoints in the app's router (:class:`_Generation`),
not FastAPI routes: FastAPI's per-request dependency solving cost about as much CPU as
everything the router does for a 4K-token request outside the worker call (profiled). They
keep everything a FastAPI route gave them: the same checks in the same order (key, body,
model...), the app's exception handlers for every refusal, Starlette's 405 for another method,
and their operations in the OpenAPI document, generated from the same Structs
(:func:`_component_schemas`).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import re
import time
from contextlib import asynccontextmanager
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
import msgspec.inspect as mi
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPBearer
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from control_plane.router.errors import InvalidRequest
from control_plane.router.keys import Denied, KeyTable, RouterKey
from control_plane.router.limits import RequestLimits, check_client_id, check_generation, new_request_id
from control_plane.router.prompt import read_prompt_ids, tokenize_prompt
from control_plane.router.proxy import Admission, Chunk, Router, RouterRejected
from control_plane.router.shared_gate import Gate, LocalGate
from kernel.tokenizer import Tokenizer, chat_tokens

log = logging.getLogger(__name__)


# -- request shapes ---------------------------------------------------------------------------
#
# msgspec Structs, decoded straight from the body bytes (``msgspec.json.decode(body, type=...)``,
# in C: a 32K-token prompt is one pass, no intermediate dict or per-item validator). They are
# the one definition of each rule, and the OpenAPI document is generated from them
# (``msgspec.json.schema_components``). Strict: a wrong type is refused, never coerced (token
# ids, content parts, stream), and ``forbid_unknown_fields``: an argument the router does not
# know is refused (OpenAI's "Unrecognized request argument"), never silently dropped. Bounds
# that depend on the model (context, vocabulary, output) are checked in
# :mod:`control_plane.router.limits`.


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


def _ranged(low: float, high: float) -> Any:
    return Annotated[float, msgspec.Meta(ge=low, le=high)] | None


class _Base(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: Annotated[str, msgspec.Meta(
        description="A served model (GET /v1/models); empty: the router's default.")] = ""
    max_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    #: Extension: the client's own id for the request. Kept as metadata
    #: (``RequestAdmitted.client_request_id``, ``X-Client-Request-Id``); the request id is the router's.
    request_id: str | None = None
    # Accepted; the engines sample their own way, so these do not change the answer's shape.
    temperature: _ranged(0, 2) = None
    top_p: _ranged(0, 1) = None
    presence_penalty: _ranged(-2, 2) = None
    frequency_penalty: _ranged(-2, 2) = None
    seed: int | None = None
    user: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    metadata: Annotated[dict[str, Annotated[str, msgspec.Meta(max_length=512)]],
                        msgspec.Meta(max_length=16)] | None = None
    ignore_eos: bool | None = None
    # Accepted only at their neutral value (see ``_unsupported``).
    n: int | None = None
    stop: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    top_logprobs: int | None = None


#: What ``prompt`` may be, as published: msgspec's unions hold one array type, so the list is
#: decoded as ``list[int | str | list[int]]`` and :func:`_one_kind` requires one kind of item.
_PROMPT_SCHEMA = {"anyOf": [
    {"type": "string"}, {"type": "array", "items": {"type": "integer"}},
    {"type": "array", "items": {"type": "string"}},
    {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}]}


class CompletionRequest(_Base, kw_only=True):
    prompt: Annotated[str | list[int | str | list[int]], msgspec.Meta(
        description="Text, or token ids.", extra_json_schema=_PROMPT_SCHEMA)]
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    logprobs: int | None = None


class _IdsCompletionRequest(CompletionRequest, kw_only=True):
    """A completion body with its prompt left as the JSON the client sent, for
    :func:`_completion_body` to read natively (not published: the document shows
    :class:`CompletionRequest`)."""

    prompt: msgspec.Raw


class TextPart(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class ChatMessage(msgspec.Struct):  # unknown fields ignored: name, tool_call_id...: not part of the prompt
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


class ChatRequest(_Base, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None


_KIND_NAMES = {int: "integer", str: "string", list: "list"}


def _one_kind(body: CompletionRequest) -> None:
    """A list prompt is token ids, strings or token-id lists, never a mix: :class:`InvalidRequest`
    at the first item of another kind than the first."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt:
        kind = type(prompt[0])
        try:  # one pass in C; the loop below only finds where, on a mixed list
            msgspec.convert(prompt, list[kind], strict=True)  # type: ignore[valid-type]
            return
        except msgspec.ValidationError:
            pass
        for i, x in enumerate(prompt):
            if type(x) is not kind:
                where = f"prompt.{i}"
                raise InvalidRequest(f"{where}: Input should be a valid {_KIND_NAMES[kind]}", param=where,
                                     code="invalid_body")


def _unsupported(body: _Base) -> InvalidRequest | None:
    """The first argument whose value the router cannot honour (answered 400, never ignored)."""
    checks: list[tuple[str, bool, str]] = [
        ("n", (body.n or 1) != 1, "only n=1 is supported (one choice per request)"),
        ("stop", bool(body.stop), "stop sequences are not supported"),
        ("logit_bias", bool(body.logit_bias), "logit_bias is not supported"),
        ("top_logprobs", bool(body.top_logprobs), "logprobs are not supported"),
    ]
    if isinstance(body, CompletionRequest):
        checks += [("best_of", (body.best_of or 1) != 1, "only best_of=1 is supported"),
                   ("echo", bool(body.echo), "echo is not supported"),
                   ("suffix", bool(body.suffix), "suffix is not supported"),
                   ("logprobs", bool(body.logprobs), "logprobs are not supported")]
    if isinstance(body, ChatRequest):
        fmt = (body.response_format or {}).get("type", "text")
        checks += [("logprobs", bool(body.logprobs), "logprobs are not supported"),
                   ("tools", bool(body.tools), "tools are not supported"),
                   ("tool_choice", body.tool_choice not in (None, "none", "auto"), "tool_choice is not supported"),
                   ("functions", bool(body.functions), "functions are not supported"),
                   ("function_call", body.function_call not in (None, "none", "auto"),
                    "function_call is not supported"),
                   ("response_format", fmt != "text", f"response_format {fmt!r} is not supported; only 'text'")]
        for i, m in enumerate(body.messages):
            if m.content is None and m.role != "assistant":
                return InvalidRequest(f"messages[{i}].content must be a string or a list of text parts "
                                      f"(null only for an assistant message)", param=f"messages.{i}.content",
                                      code="invalid_type")
    for param, bad, why in checks:
        if bad:
            return InvalidRequest(why, param=param, code="unsupported_parameter")
    return None


# -- metrics ----------------------------------------------------------------------------------


@dataclass
class RouterMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes...
        self.requests = Counter("switchyard_router_requests_total", "Requests by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        self.failures = Counter("switchyard_router_worker_failures_total", "Worker failures seen by the router",
                                ["code", "retried"], registry=r)
        self.decision_seconds = Histogram("switchyard_router_decision_seconds", "Time to decide one route",
                                          buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2), registry=r)
        self.ttft_seconds = Histogram("switchyard_router_ttft_seconds", "Time to first token seen by the router",
                                      buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=r)
        self.itl_seconds = Histogram("switchyard_router_itl_seconds", "Inter-token latency seen by the router",
                                     buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25), registry=r)
        self.view_state = Gauge("switchyard_router_view_state", "0 loading, 1 exact, 2 degraded", registry=r)
        self.view_lag_events = Gauge("switchyard_router_view_lag_events", "Records behind the log end", registry=r)
        self.view_lag_seconds = Gauge("switchyard_router_view_lag_seconds", "Age of the view when lagging", registry=r)
        self.index_hashes = Gauge("switchyard_index_hashes", "Distinct block hashes in the prefix index", registry=r)
        self.stale_workers = Gauge("switchyard_index_stale_workers",
                                   "Registered workers (not gone) whose index entries are stale", registry=r)
        self.workers = Gauge("switchyard_router_workers", "Routable workers by role", ["role"], registry=r)
        self.key_gate_fallbacks = Counter("switchyard_router_key_gate_fallbacks_total",
                                          "API-key limit calls this replica counted alone: Redis (the shared "
                                          "limits) unreachable", ["op"], registry=r)


# -- the app ----------------------------------------------------------------------------------


@dataclass
class RouterAuth:
    """The router's API keys: the table folded from the log, the per-key limits (this replica's
    :class:`LocalGate`, or the :class:`~control_plane.router.shared_gate.SharedKeyGate` every
    replica shares through Redis), the clocks."""

    table: KeyTable
    gate: Gate = field(default_factory=LocalGate)
    #: Unix ns (expiry is a time on the log) and a monotonic clock in seconds (the limits).
    clock_ns: Callable[[], int] = time.time_ns
    monotonic: Callable[[], float] = time.monotonic


@dataclass
class RouterApp:
    """What the routes need; built by :func:`control_plane.router.wiring.build_router`."""

    router: Router
    tokenizer: Tokenizer
    metrics: RouterMetrics
    served_model: str
    health: Any  # () -> RouterHealth
    start: Any = None  # async () -> None
    stop: Any = None  # async () -> None
    limits: RequestLimits = RequestLimits()
    #: API keys on the generation routes; None: auth is off (``--no-auth``, in-process tests).
    auth: RouterAuth | None = None

    def models(self) -> list[str]:
        """The served models: the router's default and every routable worker's."""
        return sorted({self.served_model} | {w.model for w in self.router.view.routable() if w.model})


async def get_ctx(request: Request) -> RouterApp:
    return request.app.state.ctx  # async: a sync dependency would run in a worker thread


Ctx = Annotated[RouterApp, Depends(get_ctx)]

api_key_scheme = HTTPBearer(auto_error=False, scheme_name="ApiKey", bearerFormat="sk-sy_<id>_<secret>",
                            description="A router API key (an admin issues it: POST /router-keys on the admin API).")


class KeyRefused(Exception):
    """A generation call without a valid key, or over its key's limits."""

    def __init__(self, denied: Denied) -> None:
        super().__init__(denied.message)
        self.denied = denied


async def api_key(auth: RouterAuth, request: Request) -> RouterKey:
    """The caller's key, checked, holding one of its concurrency slots (the caller releases it:
    ``auth.gate.release``); :class:`KeyRefused` when it may not call."""
    creds = await api_key_scheme(request)
    got = auth.table.verify(creds.credentials if creds is not None else None, auth.clock_ns())
    if isinstance(got, Denied):
        raise KeyRefused(got)
    over = await auth.gate.admit(got, auth.monotonic())
    if over is not None:
        raise KeyRefused(over)
    return got

#: Beyond the limit, a body is read and dropped up to this many bytes so the client's
#: connection stays usable; a larger one is answered and the connection closed.
_DRAIN_BYTES = 64 * 1024 * 1024
#: A surrogate code point can only reach a decoded string through a JSON escape (raw UTF-8 bytes
#: of one are invalid UTF-8 and fail the decode): ``\uD800``-``\uDFFF``, any case.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
#: An answer's JSON, straight to UTF-8 bytes (what Starlette's JSONResponse sends, without the
#: stdlib encoder's str in between).
_json = msgspec.json.encode
#: A text prompt longer than this is tokenized off the event loop.
_TOKENIZE_INLINE_CHARS = 64 * 1024


class _BodyTooLarge(InvalidRequest):
    def __init__(self, limit: int, drained: bool) -> None:
        super().__init__(f"request body exceeds {limit} bytes", param=None, code="request_too_large", status=413)
        self.drained = drained


class _BodyTimeout(InvalidRequest):
    """The body did not arrive within ``RequestLimits.body_timeout_s`` (a slow or stalled
    client): 408, and the connection is closed, since the rest of the body may still come."""

    drained = False

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"the request body did not arrive within {timeout_s:g} s", param=None,
                         code="request_timeout", status=408)


def _error(status: int, message: str, code: str, type_: str = "invalid_request_error",
           retry_after_s: int | None = None, param: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    headers = dict(headers or {})
    if retry_after_s:
        headers["Retry-After"] = str(retry_after_s)
    return JSONResponse(status_code=status, headers=headers or None,
                        content={"error": {"message": message, "type": type_, "param": param, "code": code}})


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorBody(msgspec.Struct):
    """Every refusal, as OpenAI sends it."""

    error: ErrorDetail


#: The published schemas of the bodies and of a refusal, generated from the Structs that decode
#: them, and the components their references point to.
(_COMPLETION_SCHEMA, _CHAT_SCHEMA, _ERROR_SCHEMA), _COMPONENTS = msgspec.json.schema_components(
    (CompletionRequest, ChatRequest, ErrorBody), ref_template="#/components/schemas/{name}")


def _openapi(schema: dict, success: str) -> dict:
    """What a generation route declares: its JSON body (read by hand, so that a bad one is an
    OpenAI-style 400, not FastAPI's 422) and every answer it can give."""
    refusal = {"content": {"application/json": {"schema": _ERROR_SCHEMA}}}
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "responses": {
            "200": {"description": success, "content": {"application/json": {"schema": {}}, "text/event-stream": {}}},
            **{str(code): {"description": why, **refusal} for code, why in (
                (400, "the request is invalid (the message and param say why)"),
                (401, "no API key, or one that is invalid, revoked or expired"),
                (404, "unknown model"), (413, "the body is over the limit"),
                (429, "over the key's rate (Retry-After) or concurrency limit, or the router's queue is full"),
                (503, "no worker can take it now"))},
        },
    }


def _component_schemas(app: FastAPI) -> None:
    """The generation routes' operations (FastAPI lists only its own routes), the key's
    security scheme, and the bodies' Structs where ``_openapi``'s references point."""
    base = app.openapi

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        doc = base()
        doc["paths"] = {**{r.path: {"post": r.operation()} for r in _GENERATION}, **doc.get("paths", {})}
        components = doc.setdefault("components", {})
        components.setdefault("securitySchemes", {})[api_key_scheme.scheme_name] = api_key_scheme.model.model_dump(
            mode="json", by_alias=True, exclude_none=True)
        comps = components.setdefault("schemas", {})
        for name, sub in _COMPONENTS.items():
            comps.setdefault(name, sub)
        return doc

    app.openapi = openapi  # type: ignore[method-assign]


def _error_type(status: int) -> str:
    return {429: "rate_limit_exceeded", 503: "service_unavailable"}.get(status, "invalid_request_error")


def _refused(e: InvalidRequest) -> JSONResponse:
    close = {"Connection": "close"} if isinstance(e, (_BodyTooLarge, _BodyTimeout)) and not e.drained else None
    return _error(e.status, str(e), e.code, param=e.param, headers=close)


async def _read_body(request: Request, limits: RequestLimits) -> bytes:
    """The body's bytes, at most ``limits.max_body_bytes`` (joined once, not grown chunk by chunk),
    within ``limits.body_timeout_s``."""
    limit = limits.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > _DRAIN_BYTES:
        raise _BodyTooLarge(limit, drained=False)  # not worth reading: answer and close
    chunks: list[bytes] = []
    seen = 0
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            async for chunk in request.stream():
                seen += len(chunk)
                if seen > _DRAIN_BYTES:
                    raise _BodyTooLarge(limit, drained=False)
                if seen <= limit and chunk:
                    chunks.append(chunk)
    except TimeoutError:
        raise _BodyTimeout(limits.body_timeout_s) from None
    if seen > limit:
        raise _BodyTooLarge(limit, drained=True)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _check_json(body: bytes) -> None:
    """:class:`InvalidRequest` when ``body`` is not JSON (``invalid_json``) or a string in it is
    not valid Unicode (``invalid_unicode``, naming where). Off the hot path: run only when a
    body failed to decode, or escapes a surrogate."""
    try:
        obj = json.loads(body, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # ValueError covers JSONDecodeError and UnicodeDecodeError
        raise InvalidRequest(f"the body is not valid JSON: {str(e)[:200]}", code="invalid_json") from None
    bad = _bad_string(obj, "")
    if bad is not None:
        raise InvalidRequest(f"{bad or 'body'}: invalid Unicode (a lone surrogate)", param=bad or None,
                             code="invalid_unicode")


def _escapes_surrogate(body: bytes) -> bool:
    """Whether ``body`` may escape a surrogate code point (the only way one reaches a decoded
    string): a one-byte scan for a backslash (memchr, ~0.3 us for 20 KB), then the pattern
    only when there is one (7 us)."""
    return b"\\" in body and _SURROGATE_ESCAPE.search(body) is not None


def _decoded(model: type[_Base], body: bytes) -> Any:
    """``body`` decoded as ``model``, or :class:`InvalidRequest`: ``invalid_json`` and
    ``invalid_unicode`` first (as a parse then a walk would find them, whatever the field
    order), then ``invalid_body`` naming the parameter."""
    try:
        out = msgspec.json.decode(body, type=model)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as e:
        _check_json(body)
        if isinstance(e, msgspec.ValidationError):
            raise _invalid_body(e, model) from None
        raise InvalidRequest(f"the body is not valid JSON: {str(e)[:200]}", code="invalid_json") from None
    if _escapes_surrogate(body):
        _check_json(body)
    if isinstance(out, CompletionRequest):
        _one_kind(out)
    return out


_IDS_BODY = msgspec.json.Decoder(_IdsCompletionRequest)


def _completion_body(c: RouterApp, body: bytes) -> CompletionRequest:
    """``body`` decoded as :func:`_decoded` decodes it, with a prompt of token ids in the
    narrow form read natively (:mod:`control_plane.router.prompt`: no Python int per id; the
    same prompt, hashes and worker body). Any other body, or one that fails anywhere, is
    decoded the general way, which words its error."""
    try:
        fast = _IDS_BODY.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return _decoded(CompletionRequest, body)
    ids = read_prompt_ids(fast.prompt, c.limits.vocab_size, c.router.hash_config)
    if ids is None or _escapes_surrogate(body):
        return _decoded(CompletionRequest, body)
    fast.prompt = ids  # type: ignore[assignment]
    return fast


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _bad_string(obj: Any, path: str) -> str | None:
    """The path of the first string or key that is not encodable as UTF-8, else None."""
    stack = [(obj, path)]
    while stack:
        o, p = stack.pop()
        if type(o) is str:
            try:
                o.encode()
            except UnicodeEncodeError:
                return p
        elif type(o) is list:
            stack.extend((x, f"{p}.{i}" if p else str(i)) for i, x in enumerate(o) if type(x) in (str, list, dict))
        elif type(o) is dict:
            for k, v in o.items():
                sub = f"{p}.{k}" if p else str(k)
                try:
                    k.encode()
                except UnicodeEncodeError:
                    return p or "body"
                stack.append((v, sub))
    return None


_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")
_EXPECTED = re.compile(r"^Expected `(?P<kind>[^`]+)`(?:, got `[^`]+`)?"
                       r"(?: (?P<length>of length )?(?P<op>>=|<=|>|<) (?P<bound>\S+))?$")
_KINDS = {"str": "a valid string", "int": "a valid integer", "float": "a valid number", "bool": "a valid boolean",
          "object": "a valid dictionary", "array": "a valid list", "null": "None"}
_OPS = {">=": "greater than or equal to", "<=": "less than or equal to", ">": "greater than", "<": "less than"}
_SIZED = {"str": ("String", "character"), "array": ("List", "item"), "object": ("Dictionary", "item")}


def _loc(path: str) -> list[str | int]:
    """msgspec's error path (``.messages[0].content[0].text``) as steps (a dict's key is not
    named: ``[...]``)."""
    return [name or int(index) for name, index in _STEP.findall(path) if name or index != "..."]


def _type_at(t: Any, loc: list[str | int]) -> Any:
    """The declared type at ``loc`` in ``t`` (a :mod:`msgspec.inspect` type), or None."""
    for step in loc:
        while isinstance(t, mi.Metadata):
            t = t.type
        if isinstance(t, mi.UnionType):
            want = mi.ListType if isinstance(step, int) else (mi.StructType, mi.DictType)
            t = next((m for m in t.types if isinstance(m, want)), None)
        if isinstance(t, mi.ListType) and isinstance(step, int):
            t = t.item_type
        elif isinstance(t, mi.StructType) and isinstance(step, str):
            t = next((f.type for f in t.fields if f.encode_name == step), None)
        elif isinstance(t, mi.DictType):
            t = t.value_type
        else:
            return None
    while isinstance(t, mi.Metadata):
        t = t.type
    return t


def _literal(t: Any) -> str | None:
    """'Input should be ...' for a Literal (or a union holding one), else None."""
    members = t.types if isinstance(t, mi.UnionType) else (t,)
    lit = next((m for m in members if isinstance(m, mi.LiteralType)), None)
    if lit is None:
        return None
    vals = [repr(v) for v in lit.values]
    return "Input should be " + (vals[0] if len(vals) == 1 else f"{', '.join(vals[:-1])} or {vals[-1]}")


def _invalid_body(e: msgspec.ValidationError, model: type[_Base]) -> InvalidRequest:
    """msgspec's first error as the router words it: ``<param>: <what it should be>``, or
    ``Unrecognized request argument supplied: <param>``; ``param`` names the field."""
    m = _AT.match(str(e))
    what, loc = (m["msg"], _loc(m["path"] or "")) if m else (str(e), [])
    declared = _type_at(mi.type_info(model), loc)
    if got := re.fullmatch(r"Object contains unknown field `(.+)`", what):
        where = ".".join(map(str, [*loc, got[1]]))
        return InvalidRequest(f"Unrecognized request argument supplied: {where}", param=where, code="invalid_body")
    if got := re.fullmatch(r"Object missing required field `(.+)`", what):
        loc, why = [*loc, got[1]], "Field required"
    elif (lit := _literal(declared)) is not None and (what.startswith("Invalid enum value")
                                                      or what.startswith("Expected")):
        why = lit
    elif (got := _EXPECTED.match(what)) and got["op"]:
        kind = got["kind"].split(" | ")[0]
        if got["length"]:
            noun, unit = _SIZED.get(kind, ("Value", "item"))
            amount = "at least" if got["op"].startswith(">") else "at most"
            n = got["bound"]
            why = f"{noun} should have {amount} {n} {unit}{'' if n == '1' else 's'}"
        else:
            bound = got["bound"].removesuffix(".0")
            why = f"Input should be {_OPS[got['op']]} {bound}"
    elif got:
        why = f"Input should be {_KINDS.get(got['kind'].split(' | ')[0], got['kind'])}"
    elif what == "Number out of range":
        base = declared.types[0] if isinstance(declared, mi.UnionType) else declared
        why = "Input should be a valid integer" if isinstance(base, mi.IntType) else "Input should be a finite number"
    else:
        why = what
    where = ".".join(map(str, loc))
    return InvalidRequest(f"{where or 'body'}: {why}", param=where or None, code="invalid_body")


async def _encode(c: RouterApp, text: str) -> Sequence[int]:
    if len(text) <= _TOKENIZE_INLINE_CHARS:
        return tokenize_prompt(c.tokenizer, text, c.router.hash_config)
    return await asyncio.to_thread(tokenize_prompt, c.tokenizer, text, c.router.hash_config)


async def _prompt_tokens(c: RouterApp, body: CompletionRequest) -> Sequence[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        if len(prompt) != 1:
            raise InvalidRequest("batched prompts are not supported; send one prompt", param="prompt",
                                 code="unsupported_parameter")
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise InvalidRequest("batched string prompts are not supported; send one prompt", param="prompt",
                                 code="unsupported_parameter")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return await _encode(c, prompt)
    return prompt  # ids read natively, or a list of ints fresh from the decoder: nothing else holds it


async def _chat_tokens(c: RouterApp, body: ChatRequest) -> list[int]:
    messages = msgspec.to_builtins(body.messages)
    if sum(len(m.content) if isinstance(m.content, str) else sum(len(p.text) for p in m.content or ())
           for m in body.messages) <= _TOKENIZE_INLINE_CHARS:
        return chat_tokens(c.tokenizer, messages)
    return await asyncio.to_thread(chat_tokens, c.tokenizer, messages)


def _client_id(c: RouterApp, body: _Base, request: Request) -> str | None:
    """The client's own id (body ``request_id``, else ``X-Client-Request-Id``, else ``X-Request-Id``)."""
    for param, value in (("request_id", body.request_id),
                         ("X-Client-Request-Id", request.headers.get("x-client-request-id")),
                         ("X-Request-Id", request.headers.get("x-request-id"))):
        if value:
            return check_client_id(value, c.limits, param)
    return None


def _check_model(c: RouterApp, body: _Base) -> str:
    if not body.model:
        return c.served_model
    if body.model not in c.models():
        raise InvalidRequest(f"The model '{body.model[:200]}' does not exist (served: {', '.join(c.models())})",
                             param="model", code="model_not_found", status=404)
    return body.model


def _accepted_model(c: RouterApp, body: _Base) -> str:
    """The model ``body`` is for, once it is served and the body asks for nothing unsupported
    (the checks of both generation routes, in the order the client sees their errors)."""
    model = _check_model(c, body)
    if (bad := _unsupported(body)) is not None:
        raise bad
    return model


async def _completions(c: RouterApp, body: CompletionRequest, request: Request) -> Response:
    model = _accepted_model(c, body)
    tokens = await _prompt_tokens(c, body)
    max_tokens = check_generation(tokens, body.max_tokens, c.limits)
    return await _run(c, body, request, tokens, "completions", model, max_tokens, _client_id(c, body, request))


async def _chat(c: RouterApp, body: ChatRequest, request: Request) -> Response:
    model = _accepted_model(c, body)
    tokens = await _chat_tokens(c, body)
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    wanted = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = check_generation(tokens, wanted, c.limits, param)
    return await _run(c, body, request, tokens, "chat", model, max_tokens, _client_id(c, body, request))


@dataclass(frozen=True)
class _GenerationRoute:
    """One generation route: where, its body, its handler, and what the OpenAPI document says."""

    path: str
    name: str  # the operation's name (its summary and operationId)
    #: The body's bytes decoded (or :class:`InvalidRequest`).
    decode: Callable[[RouterApp, bytes], _Base]
    handle: Callable[[RouterApp, Any, Request], Awaitable[Response]]
    schema: dict
    success: str

    def operation(self) -> dict:
        """The operation as FastAPI would generate it for ``@app.post(path)`` of a function
        ``name`` with the key's security and ``_openapi``'s body and answers."""
        op_id = re.sub(r"\W", "_", f"{self.name}{self.path}") + "_post"
        return {"summary": self.name.replace("_", " ").title(), "operationId": op_id,
                **_openapi(self.schema, self.success), "security": [{api_key_scheme.scheme_name: []}]}


_GENERATION = (
    _GenerationRoute("/v1/completions", "completions", _completion_body, _completions, _COMPLETION_SCHEMA,
                     "the completion, or its SSE stream"),
    _GenerationRoute("/v1/chat/completions", "chat", lambda c, body: _decoded(ChatRequest, body), _chat,
                     _CHAT_SCHEMA, "the chat completion, or its SSE stream"),
)


class _Generation:
    """A generation route as a plain ASGI endpoint (module docstring): the key first (before
    the body is read), then the body, then the handler; the key's concurrency slot is released
    once the answer's last byte is sent, or when it is refused. A refusal raised anywhere here
    reaches the app's exception handlers, as from a FastAPI route."""

    def __init__(self, ctx: RouterApp, route: _GenerationRoute) -> None:
        self.ctx = ctx
        self.route = route

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        c = self.ctx
        request = Request(scope, receive)
        key = await api_key(c.auth, request) if c.auth is not None else None
        try:
            body = self.route.decode(c, await _read_body(request, c.limits))
            response = await self.route.handle(c, body, request)
            await response(scope, receive, send)
        finally:
            if key is not None:
                await c.auth.gate.release(key)


def create_app(ctx: RouterApp) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if ctx.start:
            await ctx.start()
        # Everything made so far (imports, Faust, the restored view: ~128K objects) lives as
        # long as the process: frozen, a later full collection no longer walks it. The full
        # collections during start-up took 80-350 ms here (loaded box); one while serving
        # would be a p99 outlier. (In the HTTP bench's few thousand requests none ran, with or
        # without the freeze: measured.)
        gc.freeze()
        try:
            yield
        finally:
            if ctx.stop:
                await ctx.stop()

    app = FastAPI(title="Switchyard router", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible KV-aware router whose index is a view of the Kafka log.")

    app.state.ctx = ctx

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request: Request, exc: RequestValidationError):
        parts = []
        for e in exc.errors():
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            parts.append(f"{loc or 'body'}: {e.get('msg')}")
        return _error(400, "; ".join(parts) or "invalid request body", "invalid_body")

    @app.exception_handler(InvalidRequest)
    async def _invalid(request: Request, exc: InvalidRequest):
        return _refused(exc)

    @app.exception_handler(KeyRefused)
    async def _key_refused(request: Request, exc: KeyRefused):
        d = exc.denied
        status = d.why.status
        return _error(status, d.message, d.why.value, _error_type(status), d.retry_after_s,
                      headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):  # unknown path, wrong method
        return _error(exc.status_code, str(exc.detail), {404: "not_found", 405: "method_not_allowed"}.get(
            exc.status_code, "invalid_request"), _error_type(exc.status_code), headers=exc.headers)

    # First in the router's list: a request is matched against the routes in order.
    app.router.routes[:0] = [Route(r.path, _Generation(ctx, r), methods=["POST"]) for r in _GENERATION]
    _component_schemas(app)

    @app.get("/v1/models")
    async def models(c: Ctx):
        return {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "switchyard", "created": 0}
                                           for n in c.models()]}

    @app.get("/health")
    async def health(c: Ctx):
        h = c.health()
        body = {"status": "ok" if h.state != "LOADING" else "loading", **h.as_dict(),
                "workers": len(c.router.view.routable()), "router_id": c.router.router_id,
                "applied": c.router.view.applied}
        return JSONResponse(status_code=200 if h.state != "LOADING" else 503, content=body)

    @app.get("/router/view")
    async def view_state(c: Ctx, digest: bool = False):
        """The view's position and, on request, a digest of its whole state (compare with a
        replayed fold of the log: equal digests mean equal views)."""
        v = c.router.view
        out = {"router_id": c.router.router_id, "applied": v.applied, "hashes": len(v.index),
               "positions": {f"{t}:{p}": o for (t, p), o in sorted(v.positions.items())},
               "stale_workers": v.stale_workers(), "health": c.health().as_dict()}
        if digest:
            out["digest"] = v.digest()
        return out

    @app.get("/metrics")
    async def metrics(c: Ctx):
        _refresh_gauges(c)
        return Response(generate_latest(c.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _refresh_gauges(c: RouterApp) -> None:
    m, view = c.metrics, c.router.view
    h = c.health()
    m.view_state.set({"LOADING": 0, "EXACT": 1, "DEGRADED": 2}[h.state])
    m.view_lag_events.set(h.lag_events)
    m.view_lag_seconds.set(0 if h.lag_ms == float("inf") else h.lag_ms / 1000)
    m.index_hashes.set(len(view.index))
    m.stale_workers.set(len(h.stale_workers))
    for role in ("aggregated", "prefill", "decode"):
        m.workers.labels(role=role).set(len(view.routable(role)))


async def _run(c: RouterApp, body: _Base, request: Request, tokens: Sequence[int], endpoint: str, model: str,
               max_tokens: int, client_id: str | None):
    router = c.router
    rid = new_request_id(endpoint)
    headers = {"X-Request-Id": rid, **({"X-Client-Request-Id": client_id} if client_id else {})}
    adm = router.admit(request_id=rid, model=model, tokens=tokens, max_tokens=max_tokens, stream=body.stream,
                       endpoint=endpoint, client_request_id=client_id)
    gen = router.serve(adm)
    # Queue, then pull the first chunk before answering, so refusals, "no worker" and failures
    # before the first token get a real status code (and never a 500).
    try:
        await router.queue(adm)
        first = await gen.__anext__()
    except RouterRejected as e:
        await gen.aclose()
        if not e.recorded:
            router.reject(rid, str(e), e.code, e.status)
        c.metrics.requests.labels(endpoint=endpoint, outcome="failed" if e.recorded else "rejected").inc()
        return _error(e.status, str(e), e.code, _error_type(e.status), e.retry_after_s, headers=headers)
    except StopAsyncIteration:
        first = Chunk(error="worker returned nothing")
    except Exception as e:  # a bug must not become a bare 500: record it, answer 503
        log.exception("request %s failed inside the router", rid)
        await gen.aclose()
        router.fail(rid, f"router error: {type(e).__name__}: {e}", "router_error")
        c.metrics.requests.labels(endpoint=endpoint, outcome="failed").inc()
        return _error(503, f"router error: {type(e).__name__}", "router_error", "service_unavailable", 1,
                      headers=headers)
    if first.error and not body.stream:
        c.metrics.requests.labels(endpoint=endpoint, outcome="failed").inc()
        await gen.aclose()
        return _error(502, first.error, "worker_failed", "upstream_error", headers=headers)
    created = int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_sse(c, gen, first, adm, model, created, endpoint, include_usage),
                                 media_type="text/event-stream", headers=headers)
    text, usage, finish, error = [], None, None, None
    chunk: Chunk | None = first
    while chunk is not None:
        if chunk.error:
            error = chunk.error
            break
        text.append(chunk.text)
        usage = chunk.usage or usage
        finish = chunk.finish_reason or finish
        try:
            chunk = await gen.__anext__()
        except StopAsyncIteration:
            chunk = None
    if error:
        c.metrics.requests.labels(endpoint=endpoint, outcome="failed").inc()
        return _error(502, error, "worker_failed", "upstream_error", headers=headers)
    c.metrics.requests.labels(endpoint=endpoint, outcome="completed").inc()
    usage = usage or {"prompt_tokens": len(tokens), "completion_tokens": len(text), "total_tokens": len(tokens) + len(text)}
    if endpoint == "chat":
        out = {"id": rid, "object": "chat.completion", "created": created, "model": model,
               "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(text)},
                            "finish_reason": finish or "length"}], "usage": usage}
    else:
        out = {"id": rid, "object": "text_completion", "created": created, "model": model,
               "choices": [{"index": 0, "text": "".join(text), "finish_reason": finish or "length", "logprobs": None}],
               "usage": usage}
    return Response(_json(out), media_type="application/json", headers=headers)


async def _sse(c: RouterApp, gen, first: Chunk, adm: Admission, model: str, created: int, endpoint: str,
               include_usage: bool):
    chat = endpoint == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"
    usage = None
    outcome = "completed"
    if chat:
        yield _data({"id": adm.request_id, "object": obj, "created": created, "model": model,
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
    chunk: Chunk | None = first
    try:
        while chunk is not None:
            if chunk.error:
                outcome = "failed"
                yield _data({"error": {"message": chunk.error, "type": "upstream_error", "code": "worker_failed"}})
                break
            usage = chunk.usage or usage
            if chunk.text or chunk.token_ids or chunk.finish_reason:
                choice = ({"index": 0, "delta": {"content": chunk.text}, "finish_reason": chunk.finish_reason} if chat
                          else {"index": 0, "text": chunk.text, "finish_reason": chunk.finish_reason, "logprobs": None})
                yield _data({"id": adm.request_id, "object": obj, "created": created, "model": model, "choices": [choice]})
            try:
                chunk = await gen.__anext__()
            except StopAsyncIteration:
                chunk = None
            except Exception as e:  # after the first token: end the stream with an error event
                log.exception("request %s failed inside the router mid-stream", adm.request_id)
                c.router.fail(adm.request_id, f"router error: {type(e).__name__}: {e}", "router_error")
                chunk = Chunk(error=f"router error: {type(e).__name__}")
        if include_usage and usage and outcome == "completed":
            yield _data({"id": adm.request_id, "object": obj, "created": created, "model": model, "choices": [],
                         "usage": usage})
        yield b"data: [DONE]\n\n"
    finally:
        await gen.aclose()
        c.metrics.requests.labels(endpoint=endpoint, outcome=outcome).inc()


def _data(obj: dict) -> bytes:
    return b"data: " + _json(obj) + b"\n\n"
