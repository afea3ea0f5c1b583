"""The lifecycle of one generation request, past its protocol checks: its model, its tokens,
then admit, queue, route and proxy (:class:`~control_plane.router.proxy.Router`), and the
answer, JSON or SSE; and what the routes need (:class:`RouterApp`, its metrics and keys).

The end of a request is recorded once, by :meth:`Router.end <control_plane.router.proxy.Router.end>`:
completed or failed for good by the router's attempts, a client gone mid-stream, or here: a
refusal before the first token (``RequestRejected``, unless the last attempt's
``RequestFailed`` ended it already) and an error inside the router (``RequestFailed``,
``router_error``). Nothing a client sends raises out of here: a refusal or a failure is an
OpenAI-style error with a real status code, never a 500.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from control_plane.router.errors import InvalidRequest
from control_plane.router.keys import KeyTable
from control_plane.router.limits import RequestLimits, check_client_id, check_generation, new_request_id
from control_plane.router.prompt import tokenize_prompt
from control_plane.router.sessions import SESSION_ID_MAX_LEN
from control_plane.router.protocol import (
    Answer,
    ChatRequest,
    CompletionRequest,
    GenerationRequest,
    error_response,
    error_type,
    json_bytes,
    unsupported,
)
from control_plane.router.proxy import Admission, Chunk, Relayed, Router, RouterRejected
from control_plane.router.shared_gate import WAITING_REJECTIONS, Gate, LocalGate
from common.tokenizer import Tokenizer, chat_tokens

log = logging.getLogger(__name__)


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
        self.rejections = Counter("switchyard_router_rejections_total",
                                  "Requests refused before their first token, by the reason code recorded in "
                                  "RequestRejected (queue_full, queue_timeout, ttft_budget, router_overloaded...)",
                                  ["code"], registry=r)
        self.loop_lag_seconds = Gauge("switchyard_router_event_loop_lag_seconds",
                                      "This router's event-loop lag, smoothed (time constant 0.5 s): what admission "
                                      "compares with RouterConfig.max_loop_lag_ms", registry=r)
        self.loop_lag_sample_seconds = Histogram(
            "switchyard_router_event_loop_sample_lag_seconds",
            "How late each 50 ms probe callback ran on this router's event loop",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5), registry=r)
        self.events_queued = Gauge("switchyard_router_events_queued",
                                   "This router's events handed to its producer and not yet acknowledged by the "
                                   "broker (librdkafka's rd_kafka_outq_len: waiting to be sent, in flight, or "
                                   "their delivery report not served)", registry=r)
        self.worker_calls = Gauge("switchyard_router_worker_calls",
                                  "This router's calls to workers: in_flight (begun, not over: waiting for a "
                                  "connection or an answer, being read or drained), ready (news from the worker "
                                  "its event loop has not taken yet: a slow loop, not slow workers)",
                                  ["state"], registry=r)
        self.worker_connections = Gauge("switchyard_router_worker_connections",
                                        "This router's connections to workers: busy (carrying a call), idle "
                                        "(in the pool for the next call; one the worker closed is found out "
                                        "when taken)", ["state"], registry=r)
        self.queue_requests = Gauge("switchyard_router_admission_queue_requests",
                                    "Requests waiting in this router's admission queue", registry=r)
        self.queue_oldest_seconds = Gauge("switchyard_router_admission_queue_oldest_seconds",
                                          "How long the head of the admission queue has waited (0: empty)",
                                          registry=r)
        self.key_gate_fallbacks = Counter("switchyard_router_key_gate_fallbacks_total",
                                          "API-key limit calls this replica counted alone: Redis (the shared "
                                          "limits) unreachable", ["op"], registry=r)
        self.waiting_rejected = Counter("switchyard_router_waiting_entries_rejected_total",
                                        "Entries of the replicas' shared waiting count (admission rule 4) not "
                                        "counted: malformed, written in the future, or over the most requests a "
                                        "replica serves at once", ["reason"], registry=r)
        for why in WAITING_REJECTIONS:
            self.waiting_rejected.labels(why)


# -- what the routes need ---------------------------------------------------------------------


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


# -- a request's lifecycle -------------------------------------------------------------------


class Head(Protocol):
    """What the routes read of a generation request besides its body, whichever server carries it
    (``server.py``: the native server's request, or an ASGI scope's)."""

    #: When the router first held the request (monotonic): its TTFT budget counts from here.
    arrived_at: float

    def header(self, name: str) -> str | None:
        """Header ``name`` (lowercase), or None."""


#: A text prompt longer than this is tokenized off the event loop.
_TOKENIZE_INLINE_CHARS = 64 * 1024


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


def _client_id(c: RouterApp, body: GenerationRequest, request: Head) -> str | None:
    """The client's own id (body ``request_id``, else ``X-Client-Request-Id``, else ``X-Request-Id``)."""
    for param, value in (("request_id", body.request_id),
                         ("X-Client-Request-Id", request.header("x-client-request-id")),
                         ("X-Request-Id", request.header("x-request-id"))):
        if value:
            return check_client_id(value, c.limits, param)
    return None


def _check_model(c: RouterApp, body: GenerationRequest) -> str:
    if not body.model:
        return c.served_model
    if body.model not in c.models():
        raise InvalidRequest(f"The model '{body.model[:200]}' does not exist (served: {', '.join(c.models())})",
                             param="model", code="model_not_found", status=404)
    return body.model


def _accepted_model(c: RouterApp, body: GenerationRequest) -> str:
    """The model ``body`` is for, once it is served and the body asks for nothing unsupported
    (the checks of both generation routes, in the order the client sees their errors)."""
    model = _check_model(c, body)
    if (bad := unsupported(body)) is not None:
        raise bad
    return model


#: A request's own TTFT budget in ms (issue 39 step 5): it can only tighten the router's
#: ``RouterConfig.ttft_slo_ms``; a request predicted over it is refused at once (429).
TTFT_BUDGET_HEADER = "x-ttft-budget-ms"


#: The client's session (``docs/sessions.md``): its turns get a bounded affinity to the worker of
#: the previous one. The OpenAI ``user`` field names it too, for a key that opts in.
SESSION_HEADER = "x-session-id"


def bearer(request: Head) -> str | None:
    """The ``Authorization: Bearer`` credential, as ``api_key_scheme`` (FastAPI's ``HTTPBearer``)
    reads it; None when there is none."""
    authorization = request.header("authorization")
    if not authorization:
        return None
    scheme, _, param = authorization.partition(" ")
    param = param.strip()
    return param if scheme and param and scheme.lower() == "bearer" else None


def _session(c: RouterApp, body: GenerationRequest, request: Head) -> str:
    """The request's session id: the ``x-session-id`` header, else ``user`` when the caller's key
    opts in (``RouterKeyIssued.session_from_user``), else "". Refuses (400) an id that is empty,
    longer than ``SESSION_ID_MAX_LEN`` or not printable ASCII: it is recorded on the log."""
    raw = request.header(SESSION_HEADER)
    if raw is not None:
        if not (0 < len(raw) <= SESSION_ID_MAX_LEN and raw.isascii() and raw.isprintable()):
            raise InvalidRequest(f"{SESSION_HEADER} must be 1 to {SESSION_ID_MAX_LEN} printable ASCII characters",
                                 param=SESSION_HEADER, code="invalid_session_id")
        return raw
    if body.user and c.auth is not None:
        if c.auth.table.session_from_user(bearer(request)):
            return body.user
    return ""


def _ttft_budget(raw: str) -> float | None:
    """The header's budget, or None when it is not a finite number > 0."""
    try:
        v = float(raw)
    except ValueError:
        return None
    return v if math.isfinite(v) and v > 0 else None


async def completions(c: RouterApp, body: CompletionRequest, request: Head) -> Answer:
    model = _accepted_model(c, body)
    tokens = await _prompt_tokens(c, body)
    max_tokens = check_generation(tokens, body.max_tokens, c.limits)
    return await _run(c, body, request, tokens, "completions", model, max_tokens, _client_id(c, body, request))


async def chat(c: RouterApp, body: ChatRequest, request: Head) -> Answer:
    model = _accepted_model(c, body)
    tokens = await _chat_tokens(c, body)
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    wanted = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = check_generation(tokens, wanted, c.limits, param)
    return await _run(c, body, request, tokens, "chat", model, max_tokens, _client_id(c, body, request))


async def _run(c: RouterApp, body: GenerationRequest, request: Head, tokens: Sequence[int], endpoint: str,
               model: str, max_tokens: int, client_id: str | None) -> Answer:
    """Admit, queue and serve one request, and answer it: JSON, or an SSE stream once its
    first chunk is in (so that refusals, "no worker" and failures before the first token get
    a real status code)."""
    router = c.router
    raw_budget = request.header(TTFT_BUDGET_HEADER)
    budget = _ttft_budget(raw_budget) if raw_budget is not None else None
    if budget is None and raw_budget is not None:
        return error_response(400, f"{TTFT_BUDGET_HEADER} must be a number of milliseconds > 0, got {raw_budget!r}",
                              "invalid_ttft_budget", param=TTFT_BUDGET_HEADER)
    session = _session(c, body, request)
    rid = new_request_id(endpoint)
    headers = {"X-Request-Id": rid, **({"X-Client-Request-Id": client_id} if client_id else {})}
    adm = router.admit(request_id=rid, model=model, tokens=tokens, max_tokens=max_tokens, stream=body.stream,
                       endpoint=endpoint, client_request_id=client_id)
    adm.ttft_budget_ms = budget
    adm.session = session
    adm.arrived_at = request.arrived_at
    gen = router.serve(adm)
    # Queue, then pull the first chunk before answering, so refusals, "no worker" and failures
    # before the first token get a real status code (and never a 500).
    try:
        await router.queue(adm)
        first = await gen.__anext__()
    except RouterRejected as e:
        await gen.aclose()
        # Rejected, unless its last attempt failed for good (then that RequestFailed is its end).
        outcome = "rejected" if router.reject(adm, str(e), e.code, e.status, e.admission) else "failed"
        c.metrics.requests.labels(endpoint=endpoint, outcome=outcome).inc()
        if outcome == "rejected":
            c.metrics.rejections.labels(code=e.code).inc()
        return error_response(e.status, str(e), e.code, error_type(e.status), e.retry_after_s, headers=headers)
    except StopAsyncIteration:
        first = Chunk(error="worker returned nothing")
    except Exception as e:  # a bug must not become a bare 500: record it, answer 503
        log.exception("request %s failed inside the router", rid)
        await gen.aclose()
        router.fail(adm, f"router error: {type(e).__name__}: {e}", "router_error")
        c.metrics.requests.labels(endpoint=endpoint, outcome="failed").inc()
        return error_response(503, f"router error: {type(e).__name__}", "router_error", "service_unavailable",
                              1, headers=headers)
    if first.error and not body.stream:
        c.metrics.requests.labels(endpoint=endpoint, outcome="failed").inc()
        await gen.aclose()
        return error_response(502, first.error, "worker_failed", "upstream_error", headers=headers)
    created = int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return Answer(200, headers, events=_sse(c, gen, first, adm, model, created, endpoint, include_usage))
    # Not streamed: the crate read the worker's answer to its end (``Relayed``, proxy.py); the
    # request ends (is recorded) once the router's attempts are over.
    whole: Relayed = first
    async for extra in gen:
        if extra.error:
            c.metrics.requests.labels(endpoint=endpoint, outcome="failed").inc()
            return error_response(502, extra.error, "worker_failed", "upstream_error", headers=headers)
    c.metrics.requests.labels(endpoint=endpoint, outcome="completed").inc()
    n = whole.chunks
    usage = whole.usage or {"prompt_tokens": len(tokens), "completion_tokens": n, "total_tokens": len(tokens) + n}
    finish = whole.finish_reason or "length"
    if endpoint == "chat":
        out = {"id": rid, "object": "chat.completion", "created": created, "model": model,
               "choices": [{"index": 0, "message": {"role": "assistant", "content": whole.text},
                            "finish_reason": finish}], "usage": usage}
    else:
        out = {"id": rid, "object": "text_completion", "created": created, "model": model,
               "choices": [{"index": 0, "text": whole.text, "finish_reason": finish, "logprobs": None}],
               "usage": usage}
    return Answer(200, headers, json_bytes(out))


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
                c.router.fail(adm, f"router error: {type(e).__name__}: {e}", "router_error")
                chunk = Chunk(error=f"router error: {type(e).__name__}")
        if include_usage and usage and outcome == "completed":
            yield _data({"id": adm.request_id, "object": obj, "created": created, "model": model, "choices": [],
                         "usage": usage})
        yield b"data: [DONE]\n\n"
    finally:
        await gen.aclose()
        c.metrics.requests.labels(endpoint=endpoint, outcome=outcome).inc()


def _data(obj: dict) -> bytes:
    return b"data: " + json_bytes(obj) + b"\n\n"