"""The OpenAI wire protocol the router speaks: request shapes, their validation and error
wording, and the published schemas (no routes, no request lifecycle).

Errors are OpenAI-style JSON (``{"error": {"message", "type", "param", "code"}}``). The wording
of a body that does not decode is pydantic's (``<param>: Input should be ...``), generated from
msgspec's errors (:func:`decode_body`), so a client sees what an OpenAI-compatible server
built on pydantic would tell it. The routes that use these are in
:mod:`control_plane.router.server`; the lifecycle of an accepted request is
:mod:`control_plane.router.serving`.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
import msgspec.inspect as mi
from fastapi.responses import Response, StreamingResponse

from control_plane.router.errors import InvalidRequest
from control_plane.router.prompt import read_prompt_ids
from common.hashing import HashConfig


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


class GenerationRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
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
    # Accepted only at their neutral value (see ``unsupported``).
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


class CompletionRequest(GenerationRequest, kw_only=True):
    prompt: Annotated[str | list[int | str | list[int]], msgspec.Meta(
        description="Text, or token ids.", extra_json_schema=_PROMPT_SCHEMA)]
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    logprobs: int | None = None


class _IdsCompletionRequest(CompletionRequest, kw_only=True):
    """A completion body with its prompt left as the JSON the client sent, for
    :func:`completion_body` to read natively (not published: the document shows
    :class:`CompletionRequest`)."""

    prompt: msgspec.Raw


class TextPart(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class ChatMessage(msgspec.Struct):  # unknown fields ignored: name, tool_call_id...: not part of the prompt
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


class ChatRequest(GenerationRequest, kw_only=True):
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


def unsupported(body: GenerationRequest) -> InvalidRequest | None:
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

#: A surrogate code point can only reach a decoded string through a JSON escape (raw UTF-8 bytes
#: of one are invalid UTF-8 and fail the decode): ``\uD800``-``\uDFFF``, any case.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
#: An answer's JSON, straight to UTF-8 bytes (what Starlette's JSONResponse sends, without the
#: stdlib encoder's str in between).
json_bytes = msgspec.json.encode


class BodyTooLarge(InvalidRequest):
    def __init__(self, limit: int, drained: bool) -> None:
        super().__init__(f"request body exceeds {limit} bytes", param=None, code="request_too_large", status=413)
        self.drained = drained


class BodyTimeout(InvalidRequest):
    """The body did not arrive within ``RequestLimits.body_timeout_s`` (a slow or stalled
    client): 408, and the connection is closed, since the rest of the body may still come."""

    drained = False

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"the request body did not arrive within {timeout_s:g} s", param=None,
                         code="request_timeout", status=408)


@dataclass(slots=True)
class Answer:
    """A generation route's answer, whichever server carries it: status, headers and a JSON body,
    or (``events``) an SSE stream whose pieces come as they are made. The native server writes
    it to the connection itself (``server._direct``); under another ASGI server the app sends it
    as the Starlette response it stands for (:meth:`response`): the same bytes either way."""

    status: int
    headers: dict[str, str]
    body: bytes = b""
    events: AsyncIterator[bytes] | None = None

    def raw_headers(self) -> list[tuple[bytes, bytes]]:
        """The head as Starlette's ``Response.init_headers`` makes it: the given headers, then the
        body's length (not for a stream) and its media type."""
        raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()]
        if self.events is None:
            raw.append((b"content-length", str(len(self.body)).encode("latin-1")))
            raw.append((b"content-type", b"application/json"))
        else:
            raw.append((b"content-type", b"text/event-stream; charset=utf-8"))
        return raw

    def response(self) -> Response:
        if self.events is None:
            return Response(self.body, self.status, self.headers or None, media_type="application/json")
        return StreamingResponse(self.events, self.status, self.headers or None, media_type="text/event-stream")


def error_response(status: int, message: str, code: str, type_: str = "invalid_request_error",
                   retry_after_s: int | None = None, param: str | None = None,
                   headers: dict[str, str] | None = None) -> Answer:
    """An OpenAI-style refusal (``{"error": {"message", "type", "param", "code"}}``)."""
    headers = dict(headers or {})
    if retry_after_s:
        headers["Retry-After"] = str(retry_after_s)
    return Answer(status, headers, json_bytes(ErrorBody(ErrorDetail(message, type_, param, code))))


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
(COMPLETION_SCHEMA, CHAT_SCHEMA, _ERROR_SCHEMA), SCHEMA_COMPONENTS = msgspec.json.schema_components(
    (CompletionRequest, ChatRequest, ErrorBody), ref_template="#/components/schemas/{name}")


def operation_spec(schema: dict, success: str) -> dict:
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


def error_type(status: int) -> str:
    return {429: "rate_limit_exceeded", 503: "service_unavailable"}.get(status, "invalid_request_error")


def refused(e: InvalidRequest) -> Answer:
    close = {"Connection": "close"} if isinstance(e, (BodyTooLarge, BodyTimeout)) and not e.drained else None
    return error_response(e.status, str(e), e.code, param=e.param, headers=close)



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


def decode_body(model: type[GenerationRequest], body: bytes) -> Any:
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


def completion_body(body: bytes, vocab_size: int, hash_config: HashConfig) -> CompletionRequest:
    """``body`` decoded as :func:`decode_body` decodes it, with a prompt of token ids in the
    narrow form read natively (:mod:`control_plane.router.prompt`: no Python int per id; the
    same prompt, hashes and worker body). Any other body, or one that fails anywhere, is
    decoded the general way, which words its error."""
    try:
        fast = _IDS_BODY.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return decode_body(CompletionRequest, body)
    ids = read_prompt_ids(fast.prompt, vocab_size, hash_config)
    if ids is None or _escapes_surrogate(body):
        return decode_body(CompletionRequest, body)
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


def _invalid_body(e: msgspec.ValidationError, model: type[GenerationRequest]) -> InvalidRequest:
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
