"""The router's HTTP front: OpenAI-compatible API, health and metrics (FastAPI).

Routes only parse, call :class:`control_plane.router.proxy.Router` and frame the answer (SSE or
JSON). Errors are OpenAI-style JSON: bad bodies are 400 with a message, no worker is 503.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from pydantic import BaseModel, ConfigDict, Field, field_validator

from control_plane.router.proxy import Admission, Chunk, Router, RouterRejected
from kernel.tokenizer import Tokenizer, chat_tokens

log = logging.getLogger(__name__)


# -- request shapes ---------------------------------------------------------------------------


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(default="", description="Model name; any served model.")
    max_tokens: int | None = Field(default=None, ge=1, le=131072)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    request_id: str | None = Field(default=None, max_length=200)


class CompletionRequest(_Base):
    prompt: str | list[int] | list[str] = Field(description="Text, or token ids.")

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and isinstance(v[0], int) and any(t < 0 for t in v):
            raise ValueError("token ids must be non-negative")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Base):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=131072)


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
        self.stale_workers = Gauge("switchyard_index_stale_workers", "Workers whose entries are stale", registry=r)
        self.workers = Gauge("switchyard_router_workers", "Routable workers by role", ["role"], registry=r)


# -- the app ----------------------------------------------------------------------------------


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


def get_ctx(request: Request) -> RouterApp:
    return request.app.state.ctx


Ctx = Annotated[RouterApp, Depends(get_ctx)]


def _error(status: int, message: str, code: str, type_: str = "invalid_request_error",
           retry_after_s: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s else None
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": type_, "code": code}},
                        headers=headers)


def _error_type(status: int) -> str:
    return {429: "rate_limit_exceeded", 503: "service_unavailable"}.get(status, "invalid_request_error")


def create_app(ctx: RouterApp) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if ctx.start:
            await ctx.start()
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

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request, c: Ctx):
        prompt = body.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], str):
            if len(prompt) != 1:
                return _error(400, "batched string prompts are not supported; send one prompt", "invalid_body")
            prompt = prompt[0]
        tokens = list(prompt) if isinstance(prompt, list) else c.tokenizer.encode(prompt)
        if not tokens:
            return _error(400, "prompt has no tokens", "invalid_body")
        return await _run(c, body, request, tokens, "completions")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request, c: Ctx):
        tokens = chat_tokens(c.tokenizer, [m.model_dump() for m in body.messages])
        if body.max_completion_tokens and not body.max_tokens:
            body.max_tokens = body.max_completion_tokens
        return await _run(c, body, request, tokens, "chat")

    @app.get("/v1/models")
    async def models(c: Ctx):
        names = sorted({c.served_model} | {w.model for w in c.router.view.routable() if w.model})
        return {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "switchyard", "created": 0} for n in names]}

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


async def _run(c: RouterApp, body: _Base, request: Request, tokens: list[int], endpoint: str):
    router = c.router
    rid = body.request_id or request.headers.get("x-request-id") or f"{'chatcmpl' if endpoint == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    model = body.model or c.served_model
    adm = router.admit(request_id=rid, model=model, tokens=tokens, max_tokens=body.max_tokens or 16,
                       stream=body.stream, endpoint=endpoint)
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
        return _error(e.status, str(e), e.code, _error_type(e.status), e.retry_after_s)
    except StopAsyncIteration:
        first = Chunk(error="worker returned nothing")
    except Exception as e:  # a bug must not become a bare 500: record it, answer 503
        log.exception("request %s failed inside the router", rid)
        await gen.aclose()
        router.fail(rid, f"router error: {type(e).__name__}: {e}", "router_error")
        c.metrics.requests.labels(endpoint=endpoint, outcome="failed").inc()
        return _error(503, f"router error: {type(e).__name__}", "router_error", "service_unavailable", 1)
    if first.error and not body.stream:
        c.metrics.requests.labels(endpoint=endpoint, outcome="failed").inc()
        await gen.aclose()
        return _error(502, first.error, "worker_failed", "upstream_error")
    created = int(time.time())
    if body.stream:
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(_sse(c, gen, first, adm, model, created, endpoint, include_usage),
                                 media_type="text/event-stream", headers={"X-Request-Id": rid})
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
        return _error(502, error, "worker_failed", "upstream_error")
    c.metrics.requests.labels(endpoint=endpoint, outcome="completed").inc()
    usage = usage or {"prompt_tokens": len(tokens), "completion_tokens": len(text), "total_tokens": len(tokens) + len(text)}
    if endpoint == "chat":
        return {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(text)},
                             "finish_reason": finish or "length"}], "usage": usage}
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": "".join(text), "finish_reason": finish or "length", "logprobs": None}],
            "usage": usage}


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
        yield "data: [DONE]\n\n"
    finally:
        await gen.aclose()
        c.metrics.requests.labels(endpoint=endpoint, outcome=outcome).inc()


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
