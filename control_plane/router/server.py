"""The router's HTTP front: the ASGI app with the OpenAI-compatible routes, health, metrics
and the view (FastAPI).

Routes only check the caller and the body (:mod:`control_plane.router.protocol`) and hand the
request to :mod:`control_plane.router.serving`, which admits, serves and answers it. A request
outside :mod:`control_plane.router.limits` or not understood is a 4xx before it is admitted
(nothing reaches the log or a worker), no worker is 503. Nothing a client sends raises out of
a route: a raised exception would be a 500 and cost the client its keep-alive connection.

API keys (:mod:`control_plane.router.keys`): with :attr:`RouterApp.auth` set, the generation
routes take ``Authorization: Bearer sk-sy_...`` first, before the body is read: a missing,
invalid, revoked or expired key is a 401, a key over its rate or concurrency a 429 (with
``Retry-After``). A request holds its key's concurrency slot until its last byte is sent,
streamed or not. ``/v1/models``, ``/health``, ``/metrics`` and ``/router/view`` take no key.

The two generation routes (:class:`_Generation`) are not FastAPI routes: FastAPI's per-request
dependency solving cost about as much CPU as everything the router does for a 4K-token request
outside the worker call (profiled). The router's own server (``common/native_http.py``) runs
them directly, without the ASGI app (``app.state.direct_routes``): no scope, middleware,
routing, Starlette request or response per request. In the app they stay plain ASGI endpoints
over the same code (another ASGI server, the in-process tests). Either way: the same checks in
the same order (key, body, model...), every refusal answered as the app's exception handlers
answer it, Starlette's 405 for another method, and their operations in the OpenAPI document,
generated from the same Structs (:func:`_component_schemas`).
"""

from __future__ import annotations

import asyncio
import gc
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from control_plane.router.errors import InvalidRequest
from control_plane.router.keys import Denied, RouterKey
from control_plane.router.limits import RequestLimits
from control_plane.router.protocol import (
    Answer,
    CHAT_SCHEMA,
    COMPLETION_SCHEMA,
    SCHEMA_COMPONENTS,
    BodyTimeout,
    BodyTooLarge,
    ChatRequest,
    GenerationRequest,
    completion_body,
    decode_body,
    error_response,
    error_type,
    operation_spec,
    refused,
)
from control_plane.router.serving import Head, RouterApp, RouterAuth, bearer, chat, completions
from common.native_http import Direct


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


async def api_key(auth: RouterAuth, request: Head) -> RouterKey:
    """The caller's key, checked, holding one of its concurrency slots (the caller releases it:
    ``auth.gate.release``); :class:`KeyRefused` when it may not call."""
    got = auth.table.verify(bearer(request), auth.clock_ns())
    if isinstance(got, Denied):
        raise KeyRefused(got)
    over = await auth.gate.admit(got, auth.monotonic())
    if over is not None:
        raise KeyRefused(over)
    return got

#: Beyond the limit, a body is read and dropped up to this many bytes so the client's
#: connection stays usable; a larger one is answered and the connection closed.
_DRAIN_BYTES = 64 * 1024 * 1024


def _component_schemas(app: FastAPI) -> None:
    """The generation routes' operations (FastAPI lists only its own routes), the key's
    security scheme, and the bodies' Structs where ``operation_spec``'s references point."""
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
        for name, sub in SCHEMA_COMPONENTS.items():
            comps.setdefault(name, sub)
        return doc

    app.openapi = openapi  # type: ignore[method-assign]


async def _read_body(request: Head, pieces: AsyncIterator[bytes], limits: RequestLimits) -> bytes:
    """The body's bytes, at most ``limits.max_body_bytes`` (joined once, not grown chunk by chunk),
    within ``limits.body_timeout_s``."""
    limit = limits.max_body_bytes
    declared = request.header("content-length") or ""
    if declared.isdigit() and int(declared) > _DRAIN_BYTES:
        raise BodyTooLarge(limit, drained=False)  # not worth reading: answer and close
    chunks: list[bytes] = []
    seen = 0
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            async for chunk in pieces:
                seen += len(chunk)
                if seen > _DRAIN_BYTES:
                    raise BodyTooLarge(limit, drained=False)
                if seen <= limit and chunk:
                    chunks.append(chunk)
    except TimeoutError:
        raise BodyTimeout(limits.body_timeout_s) from None
    if seen > limit:
        raise BodyTooLarge(limit, drained=True)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


@dataclass(frozen=True)
class _GenerationRoute:
    """One generation route: where, its body, its handler, and what the OpenAPI document says."""

    path: str
    name: str  # the operation's name (its summary and operationId)
    #: The body's bytes decoded (or :class:`InvalidRequest`).
    decode: Callable[[RouterApp, bytes], GenerationRequest]
    handle: Callable[[RouterApp, Any, Head], Awaitable[Answer]]
    schema: dict
    success: str

    def operation(self) -> dict:
        """The operation as FastAPI would generate it for ``@app.post(path)`` of a function
        ``name`` with the key's security and ``operation_spec``'s body and answers."""
        op_id = re.sub(r"\W", "_", f"{self.name}{self.path}") + "_post"
        return {"summary": self.name.replace("_", " ").title(), "operationId": op_id,
                **operation_spec(self.schema, self.success), "security": [{api_key_scheme.scheme_name: []}]}


_GENERATION = (
    _GenerationRoute("/v1/completions", "completions",
                     lambda c, body: completion_body(body, c.limits.vocab_size, c.router.hash_config),
                     completions, COMPLETION_SCHEMA, "the completion, or its SSE stream"),
    _GenerationRoute("/v1/chat/completions", "chat", lambda c, body: decode_body(ChatRequest, body), chat,
                     CHAT_SCHEMA, "the chat completion, or its SSE stream"),
)


class _AsgiHead:
    """An ASGI request's :class:`~control_plane.router.serving.Head`."""

    __slots__ = ("request", "arrived_at")

    def __init__(self, request: Request, arrived_at: float) -> None:
        self.request = request
        self.arrived_at = arrived_at

    def header(self, name: str) -> str | None:
        return self.request.headers.get(name)


def _key_refused(e: KeyRefused) -> Answer:
    d = e.denied
    status = d.why.status
    return error_response(status, d.message, d.why.value, error_type(status), d.retry_after_s,
                          headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)


class _Generation:
    """A generation route (module docstring): the key first (before the body is read), then the
    body, then the handler; the key's concurrency slot is released once the answer's last byte
    is sent, or when it is refused. Every refusal is answered here, as the app's exception
    handlers would. Served two ways, the same code past the first line: by the router's own
    server directly (:meth:`direct`, the product's path), or as an ASGI endpoint of the app
    (:meth:`__call__`: another ASGI server, the in-process tests)."""

    def __init__(self, ctx: RouterApp, route: _GenerationRoute) -> None:
        self.ctx = ctx
        self.route = route

    async def serve(self, request: Head, body: AsyncIterator[bytes],
                    send: Callable[[Answer], Awaitable[None]]) -> None:
        c = self.ctx
        try:
            key = await api_key(c.auth, request) if c.auth is not None else None
        except KeyRefused as e:
            await send(_key_refused(e))
            return
        try:
            try:
                answer = await self.route.handle(c, self.route.decode(c, await _read_body(request, body, c.limits)),
                                                 request)
            except InvalidRequest as e:
                answer = refused(e)
            await send(answer)
        finally:
            if key is not None:
                await c.auth.gate.release(key)

    async def direct(self, d: Direct) -> None:
        """Served by ``common.native_http`` without the ASGI app (its direct routes)."""

        async def send(a: Answer) -> None:
            if a.events is None:
                d.respond(a.status, a.raw_headers(), a.body)
            else:
                await d.stream(a.status, a.raw_headers(), a.events)

        await self.serve(d, d.body(), send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        # When the router first held the request: its TTFT budget counts from here (serving.py).
        head = _AsgiHead(request, time.monotonic())

        async def answer(a: Answer) -> None:
            await a.response()(scope, receive, send)

        await self.serve(head, request.stream(), answer)


def create_app(ctx: RouterApp) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if ctx.start:
            await ctx.start()
        # Everything made so far (imports, the restored view: ~128K objects) lives as
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
        return error_response(400, "; ".join(parts) or "invalid request body", "invalid_body").response()

    @app.exception_handler(InvalidRequest)
    async def _invalid(request: Request, exc: InvalidRequest):
        return refused(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):  # unknown path, wrong method
        return error_response(exc.status_code, str(exc.detail), {404: "not_found", 405: "method_not_allowed"}.get(
            exc.status_code, "invalid_request"), error_type(exc.status_code), headers=exc.headers).response()

    # First in the router's list: a request is matched against the routes in order.
    generation = [_Generation(ctx, r) for r in _GENERATION]
    app.router.routes[:0] = [Route(g.route.path, g, methods=["POST"]) for g in generation]
    # The router's own server runs them without the ASGI app (common/native_http.py).
    app.state.direct_routes = {g.route.path: g.direct for g in generation}
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
                "applied": c.router.view.applied, "loop_lag_ms": round(c.router.loop_lag_ms(), 1)}
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
    queue = c.router.admission
    m.queue_requests.set(len(queue))
    m.queue_oldest_seconds.set(queue.oldest_wait_s(time.monotonic()))
    if c.router.loop_lag is not None:
        m.loop_lag_seconds.set(c.router.loop_lag().smoothed_s)
    calls = c.router.workers.load()
    m.worker_calls.labels(state="in_flight").set(calls.in_flight)
    m.worker_calls.labels(state="ready").set(calls.ready)
    m.worker_connections.labels(state="busy").set(calls.busy_connections)
    m.worker_connections.labels(state="idle").set(calls.idle_connections)