"""The worker's HTTP face (FastAPI): an OpenAI-compatible completions endpoint plus health,
metrics and the NIXL side channel. Routes only translate HTTP <-> :class:`Worker` calls.

Contract (what the router relies on):

* ``POST /v1/completions``: body ``{model, prompt: str | list[int], max_tokens (16), stream,
  stream_options.include_usage, request_id, kv_transfer_params}``; a string prompt is tokenized
  with :class:`HashTokenizer`. The request id is ``request_id``, else the ``X-Request-Id``
  header, else generated; it is echoed in ``X-Request-Id`` and as the response ``id``.
  Non-streaming: a ``text_completion`` with ``choices[0].token_ids`` (extension), ``usage``
  (``prompt_tokens_details.cached_tokens``) and ``kv_transfer_params`` when there are any.
  Streaming: ``data: <json>\\n\\n`` chunks, one per token, each with ``choices[0].token_ids``
  ``[id]``; the last token's chunk carries ``finish_reason`` (and ``kv_transfer_params``);
  then a usage chunk (``choices: []``) when ``stream_options.include_usage``; then
  ``data: [DONE]\\n\\n``. A failure after the first byte is one ``data: {"error": ...}`` chunk
  and no ``[DONE]``.
* Errors are OpenAI-shaped ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad
  body (never 500), 503 while draining.
* ``GET /v1/models``, ``GET /health`` (200 serving, 503 otherwise), ``GET /metrics``
  (Prometheus, vLLM names), ``GET /kv/metadata`` (this worker's NIXL ``EndpointMetadata``
  bytes), ``GET /debug/state`` (what the worker holds; for tests and operators).
* Every route but ``/health`` and ``/metrics`` (liveness and Prometheus's scrape, read-only)
  requires this worker's bearer (``Authorization: Bearer <token>``, :func:`common.settings.worker_token`:
  an HMAC of the cluster's worker secret with this worker's id); without it they answer 401.
  The routers send it on every call, and a peer worker sends it on its lookups and fetches.
  ``--open-generation`` (benchmarks only) opens ``/v1/completions`` and ``/v1/models`` to a
  third-party router that cannot send it.
* ``/v1/completions`` enforces the router's bounds on one request
  (:class:`common.request_limits.RequestLimits`: body bytes, 413; ``max_tokens``, token ids,
  context, 400), so a caller that reaches the worker directly gets no more than through the
  router; a client that disconnects stops its generation, streamed or not.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

import msgspec
from fastapi import Depends, FastAPI, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from data_plane.workers.peer_fetch import PeerHoldRequest
from data_plane.workers.run import CompletionInput, Run, WorkerError
from data_plane.workers.service import Worker
from common.request_limits import OutOfBounds, RequestLimits, check_generation
from common.tokenizer import HashTokenizer, Tokenizer

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 16


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class CompletionRequest(BaseModel):
    """``POST /v1/completions`` body. Unknown OpenAI fields (temperature, n, ...) are accepted
    and ignored: the simulated engine samples deterministic pseudo-tokens."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | list[Annotated[int, Field(ge=0)]]
    max_tokens: int | None = Field(default=DEFAULT_MAX_TOKENS, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    #: Extension: the request id (else the X-Request-Id header, else generated).
    request_id: str | None = Field(default=None, min_length=1, max_length=200)
    #: Extension (vLLM): disaggregated handoff parameters.
    kv_transfer_params: dict[str, Any] | None = None
    #: Extension: when the router decided to send the request here (s since the epoch, its
    #: clock). The engine takes the requests that reach it during one step in this order, not in
    #: the order they arrived (``EngineRequest.router_order``).
    routed_at_s: float | None = None


def get_worker(request: Request) -> Worker:
    return request.app.state.worker


def get_tokenizer(request: Request) -> Tokenizer:
    return request.app.state.tokenizer


WorkerDep = Annotated[Worker, Depends(get_worker)]
TokenizerDep = Annotated[Tokenizer, Depends(get_tokenizer)]

_credential_scheme = HTTPBearer(auto_error=False, scheme_name="WorkerCredential",
                                description="This worker's bearer (common.settings.worker_token).")


class CredentialRequired(Exception):
    """A route called without this worker's bearer."""


def require_credential(request: Request,
                       creds: Annotated[HTTPAuthorizationCredentials | None, Security(_credential_scheme)]) -> None:
    if request.app.state.open_generation and request.url.path in ("/v1/completions", "/v1/models"):
        return  # --open-generation: a benchmark's third-party router fronts this worker
    expected: str = request.app.state.credential
    given = creds.credentials if creds is not None else ""
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise CredentialRequired()


#: What a private route declares: it needs this worker's bearer.
Private = [Depends(require_credential)]


class _BodyTooLarge(Exception):
    pass


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, at most ``limit`` bytes (the declared length checked before reading any)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _BodyTooLarge()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _BodyTooLarge()
        chunks.append(chunk)
    return b"".join(chunks)


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (its body was read whole before)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def error_body(message: str, kind: str, status: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _usage(run: Run) -> dict[str, Any]:
    return {"prompt_tokens": run.prompt_tokens, "completion_tokens": run.completion_tokens,
            "total_tokens": run.prompt_tokens + run.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": run.cached_tokens}}


def _data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _collect(run: Run, model: str, tokenizer: Tokenizer) -> dict[str, Any]:
    ids: list[int] = []
    it = aiter(run)
    try:
        async for tok in it:
            ids.append(tok.token_id)
    finally:
        await it.aclose()  # type: ignore[attr-defined]
    body: dict[str, Any] = {
        "id": run.request_id, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": tokenizer.decode(ids), "logprobs": None,
                     "finish_reason": run.finish_reason or "length", "token_ids": ids}],
        "usage": _usage(run),
    }
    if run.kv_transfer_params is not None:
        body["kv_transfer_params"] = run.kv_transfer_params
    return body


async def _sse(run: Run, model: str, include_usage: bool, tokenizer: Tokenizer) -> AsyncIterator[str]:
    created = int(time.time())
    it = aiter(run)
    try:
        async for tok in it:
            chunk: dict[str, Any] = {
                "id": run.request_id, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": tokenizer.decode([tok.token_id]), "logprobs": None,
                             "finish_reason": tok.finish_reason, "token_ids": [tok.token_id]}],
            }
            if tok.finish_reason and run.kv_transfer_params is not None:
                chunk["kv_transfer_params"] = run.kv_transfer_params
            yield _data(chunk)
        if include_usage:
            yield _data({"id": run.request_id, "object": "text_completion", "created": created,
                         "model": model, "choices": [], "usage": _usage(run)})
        yield "data: [DONE]\n\n"
    except WorkerError as e:
        yield _data(error_body(str(e), e.kind, e.status))
    except Exception as e:  # noqa: BLE001 - the headers are sent: end the stream with the error, not a torn body
        log.exception("request %s failed mid-stream", run.request_id)
        yield _data(error_body(f"internal error: {type(e).__name__}: {e}", "server_error", 500))
    finally:
        await it.aclose()  # type: ignore[attr-defined]


def create_app(worker: Worker, tokenizer: Tokenizer | None = None, *, credential: str,
               limits: RequestLimits = RequestLimits(), open_generation: bool = False) -> FastAPI:
    """``credential``: the bearer the routes require, this worker's token (never empty: an empty
    one would let every caller in); ``limits``: the bounds on one request (the router's)."""
    if not credential:
        raise ValueError("the worker's routes need a credential (common.settings.worker_token)")
    app = FastAPI(title=f"Switchyard worker {worker.worker_id}", docs_url=None, redoc_url=None)
    app.state.worker = worker
    app.state.tokenizer = tokenizer or HashTokenizer()
    app.state.credential = credential
    app.state.limits = limits
    app.state.open_generation = open_generation

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()

        def where(e: dict) -> str:
            # Field path without FastAPI's "body" root and pydantic's union-member labels.
            return ".".join(str(x) for x in e.get("loc", ()) if x != "body" and not (
                isinstance(x, str) and ("[" in x or x in ("str", "int")))) or "body"

        if errors and errors[0].get("type") == "json_invalid":
            return JSONResponse(error_body(f"body is not valid JSON: {errors[0].get('msg')}",
                                           "invalid_request_error", 400), 400)
        msg = "; ".join(f"{where(e)}: {e.get('msg')}" for e in errors[:5]) or "invalid request body"
        param = where(errors[0]) if errors else None
        return JSONResponse(error_body(msg, "invalid_request_error", 400, param), 400)

    @app.exception_handler(CredentialRequired)
    async def _no_credential(_request: Request, exc: CredentialRequired) -> JSONResponse:
        return JSONResponse(error_body("this endpoint needs this worker's bearer "
                                       "(Authorization: Bearer <common.settings.worker_token(secret, worker id)>)",
                                       "authentication_error", 401), 401, headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(WorkerError)
    async def _worker_error(_request: Request, exc: WorkerError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), exc.kind, exc.status, getattr(exc, "param", None)),
                            exc.status)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error", 500), 500)

    @app.post("/v1/completions", dependencies=Private)
    async def completions(request: Request, worker: WorkerDep, tokenizer: TokenizerDep) -> Response:
        try:
            raw = await _read_body(request, limits.max_body_bytes)
        except _BodyTooLarge:
            return JSONResponse(error_body(f"the body exceeds {limits.max_body_bytes} bytes", "invalid_request_error",
                                           413), 413)
        try:
            body = CompletionRequest.model_validate_json(raw)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        rid = body.request_id or request.headers.get("x-request-id") or f"cmpl-{uuid.uuid4().hex}"
        prompt = tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        try:
            max_tokens = check_generation(prompt, body.max_tokens, limits)
        except OutOfBounds as e:
            return JSONResponse({"error": {"message": str(e), "type": "invalid_request_error", "param": e.param,
                                           "code": e.code}}, 400)
        model = body.model or worker.s.model
        run = worker.open(CompletionInput(request_id=rid, prompt=prompt, max_tokens=max_tokens,
                                          kv_transfer_params=body.kv_transfer_params, routed_at_s=body.routed_at_s))
        headers = {"X-Request-Id": rid}
        if body.stream:
            # Starlette ends the stream when a send finds the client gone; closing the
            # generator closes the run.
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_sse(run, model, include_usage, tokenizer),
                                     media_type="text/event-stream", headers=headers)
        collect = asyncio.ensure_future(_collect(run, model, tokenizer))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait((collect, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():
                collect.cancel()  # the client left: closing the run stops its generation
        if collect.cancelled():
            return Response(status_code=499)  # nobody reads it
        return JSONResponse(collect.result(), headers=headers)

    @app.get("/v1/models", dependencies=Private)
    async def models(worker: WorkerDep) -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": worker.s.model, "object": "model", "created": worker.epoch // 1000,
            "owned_by": "switchyard", **worker.engine.model_info()}]}

    @app.get("/health")
    async def health(worker: WorkerDep) -> JSONResponse:
        ok = worker.state == "serving"
        return JSONResponse({"status": "ok" if ok else worker.state, "worker_id": worker.worker_id,
                             "epoch": worker.epoch}, 200 if ok else 503)

    @app.get("/metrics")
    async def metrics(worker: WorkerDep) -> Response:
        m = worker.metrics
        st = worker.engine.stats()
        m.labels(m.running).set(st.running)
        m.labels(m.waiting).set(st.waiting + worker.pulling)
        m.labels(m.kv_usage).set(st.kv_usage)
        m.labels(m.staging_free).set(worker.plane.slots.free_count)
        m.labels(m.holds).set(len(worker.holds))
        for tier, used in (await worker.kvbm.usage()).items():
            m.labels(m.tier_usage, tier).set(used)
        m.labels(m.tier_usage, "device").set(st.kv_usage)
        onboard = getattr(worker.engine, "onboard_stats", None)  # the simulated engine's loads
        ob = onboard() if onboard is not None else None
        m.set_kv_moves(await worker.kvbm.stats(), ob.loaded if ob else {}, ob.fallbacks if ob else {})
        return Response(m.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/kv/metadata", dependencies=Private)
    async def kv_metadata(worker: WorkerDep) -> Response:
        md = worker.plane.metadata()
        return Response(md.encode(), media_type="application/msgpack",
                        headers={"X-Nixl-Agent": md.agent_name})

    @app.post("/kv/peer-hold", dependencies=Private)
    async def kv_peer_hold(request: Request, worker: WorkerDep) -> JSONResponse:
        """Hold the leading run of the asked blocks this worker has (host or device) in
        staging slots for a peer to READ (``data_plane.workers.peer_fetch``)."""
        try:
            req = msgspec.json.decode(await request.body(), type=PeerHoldRequest)
        except msgspec.DecodeError as e:
            return JSONResponse(error_body(f"peer hold: {e}", "invalid_request_error", 400), 400)
        return JSONResponse(await worker.peer_fetch.hold(req))

    @app.post("/admin/reset_prefix_cache", dependencies=Private)
    async def reset_prefix_cache(worker: WorkerDep) -> JSONResponse:
        """Real engines only (vLLM): empty the device prefix cache; the engine's own
        AllBlocksCleared event tells the index."""
        reset = getattr(worker.engine, "reset_prefix_cache", None)
        if reset is None:
            return JSONResponse(error_body("this engine has no prefix-cache reset", "invalid_request_error", 400), 400)
        return JSONResponse({"reset": await reset()})

    @app.post("/admin/kv_bridge/{action}", dependencies=Private)
    async def kv_bridge(action: str, worker: WorkerDep, from_seq: int | None = None) -> JSONResponse:
        """Real engines only (vLLM): ``stop`` or ``start`` the KV event bridge (``start``
        takes ``from_seq``: a bridge that lost its position fills the gap from vLLM's replay
        endpoint)."""
        fn = getattr(worker.engine, f"{action}_bridge", None) if action in ("stop", "start") else None
        if fn is None:
            return JSONResponse(error_body(f"no KV bridge action {action!r} on this engine",
                                           "invalid_request_error", 400), 400)
        try:
            return JSONResponse({"expected_seq": await (fn(from_seq) if action == "start" else fn())})
        except RuntimeError as e:
            return JSONResponse(error_body(str(e), "invalid_request_error", 409), 409)

    @app.get("/debug/state", dependencies=Private)
    async def debug_state(worker: WorkerDep) -> dict[str, Any]:
        return await worker.debug_state()

    return app
