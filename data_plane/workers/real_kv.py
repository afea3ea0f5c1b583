"""Requests to an engine with real KV (vLLM): its KV connector moves the KV.

``kv_transfer_params`` go to the engine unchanged: vLLM's NixlConnector holds the prefill's
blocks and the decode side READs them (its protocol, as vLLM's disaggregated proxy drives it).
The worker records the facts around it: ``PrefillCompleted`` (acked before the params are
revealed), and on the decode side ``KvTransferStarted`` then ``KvTransferCompleted`` or, when
vLLM reports a failed READ or handshake and recomputes (``kv_load_failure_policy=
"recompute"``), ``KvTransferFailed(fallback="recompute")``.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

from data_plane.engines import AsyncEngine, EngineRequest, RequestRejected
from data_plane.workers.metrics import WorkerMetrics
from data_plane.workers.run import BadRequest, CompletionInput, Run, Token, engine_tokens
from schemas.events import Event, KvTransferCompleted, KvTransferFailed, KvTransferStarted, PrefillCompleted
from schemas.types import RequestPhase

log = logging.getLogger(__name__)


class RealKvHost(Protocol):
    """What the real-KV path uses of its worker: identity, engine, metrics, counters, the
    in-flight table and the publisher."""

    worker_id: str
    engine: AsyncEngine
    metrics: WorkerMetrics
    stats: dict[str, int]
    pulling: int
    last_pull_error: str
    _inflight: dict[str, Run]

    def publish(self, payload: Event, correlation_id: str | None = None) -> None: ...

    async def publish_acked(self, payload: Event, correlation_id: str | None = None) -> None: ...


def event_params(params: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``kv_transfer_params`` in the shape ``PrefillCompleted`` declares (scalars and
    lists of ints): per-group block id lists (``[[...], ...]``) keep the first group, as
    :func:`data_plane.vllm.engine.parse_kv_transfer_params` reads them; anything else that is
    not a scalar is recorded as its JSON text. The response keeps vLLM's original object."""
    out: dict[str, Any] = {}
    for k, v in params.items():
        if v is None or isinstance(v, (str, bool, int, float)):
            out[k] = v
        elif isinstance(v, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            out[k] = list(v)
        elif isinstance(v, (list, tuple)) and v and all(isinstance(x, (list, tuple)) for x in v) \
                and all(isinstance(y, int) for y in v[0]):
            out[k] = list(v[0])
        else:
            out[k] = json.dumps(v, default=str)
    return out


def open_real(w: RealKvHost, inp: CompletionInput) -> Run:
    """Start one request on an engine with real KV (the module's docstring says how)."""
    rid = inp.request_id
    params = inp.kv_transfer_params or None
    if params and not w.engine.moves_kv:
        raise BadRequest(f"worker {w.worker_id} runs its engine without a KV connector: "
                         "it cannot take part in a disaggregated handoff", "kv_transfer_params")
    if rid in w._inflight:
        raise BadRequest(f"request id {rid!r} is already in use on this worker", "request_id")
    prefill = bool(params and params.get("do_remote_decode"))
    pull = bool(params and params.get("do_remote_prefill"))
    if pull and not params.get("remote_block_ids"):
        # Nothing to read (prompt shorter than a block, or the prefill had no blocks).
        params, pull = None, False
    req = EngineRequest(request_id=rid, prompt=inp.prompt, max_tokens=1 if prefill else inp.max_tokens,
                        phase=RequestPhase.PREFILL if prefill else RequestPhase.AGGREGATED)
    run = Run(w, inp)
    mark = w.engine.transfer_mark() if pull else None
    try:
        stream = w.engine.submit(req, kv_transfer_params=_engine_params(params))
    except RequestRejected as e:
        raise BadRequest(str(e)) from None
    run.in_engine = True
    if prefill:
        run._gen = _prefill(w, run, stream)
    elif pull:
        run._gen = _decode(w, run, stream, params, mark)
    else:
        run._gen = _settled(w, run, stream, inp.prompt)
    w._inflight[rid] = run
    return run


async def _settled(w: RealKvHost, run: Run, stream, prompt: list[int]) -> AsyncIterator[Token]:  # noqa: ANN001
    """The engine's tokens, the last one held back until the prompt's KV stores are in the
    log (:meth:`VllmServingEngine.settle`): "finished" then implies "routable"."""
    async for tok in engine_tokens(run, stream, w.metrics):
        if tok.finish_reason is not None:
            if not await w.engine.settle(prompt):
                log.debug("request %s: its KV stores were not all in the log within the settle "
                          "window", run.request_id)
        yield tok


def _engine_params(params: dict[str, Any] | None) -> dict[str, Any] | None:
    if not params:
        return None
    # Our additions (who the holder is) stay out of vLLM's connector.
    return {k: v for k, v in params.items() if not k.startswith("switchyard_")}


async def _prefill(w: RealKvHost, run: Run, stream) -> AsyncIterator[Token]:  # noqa: ANN001
    tokens = [t async for t in engine_tokens(run, stream, w.metrics)]
    params = dict(stream.kv_transfer_params or {})
    params["switchyard_worker_id"] = w.worker_id
    params["switchyard_bytes_per_block"] = w.engine.bytes_per_block
    run.kv_transfer_params = params
    await w.publish_acked(PrefillCompleted(
        request_id=run.request_id, worker_id=w.worker_id, prompt_tokens=run.prompt_tokens,
        cached_tokens=run.cached_tokens, duration_ms=(time.monotonic() - run.arrival) * 1e3,
        kv_transfer_params=event_params(params)), correlation_id=run.request_id)
    for t in tokens:
        yield t


async def _decode(w: RealKvHost, run: Run, stream, params: dict[str, Any], mark) -> AsyncIterator[Token]:  # noqa: ANN001
    block_ids = params.get("remote_block_ids") or []
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        block_ids = block_ids[0]
    n = len(block_ids)
    nbytes = n * int(params.get("switchyard_bytes_per_block") or w.engine.bytes_per_block)
    common = dict(request_id=run.request_id, transfer_id=uuid.uuid4().hex,
                  src_worker=str(params.get("switchyard_worker_id") or params.get("remote_engine_id")),
                  dst_worker=w.worker_id, blocks=n, backend="NIXL/UCX (vLLM NixlConnector)")
    w.publish(KvTransferStarted(**common, bytes=nbytes), correlation_id=run.request_id)
    t0 = time.monotonic()
    first = True
    w.pulling += 1
    try:
        async for tok in engine_tokens(run, stream, w.metrics):
            if first:
                first = False
                w.pulling -= 1
                await _record_pull(w, common, nbytes, t0, mark)
            yield tok
    finally:
        if first:
            w.pulling -= 1


async def _record_pull(w: RealKvHost, common: dict[str, Any], nbytes: int, t0: float, mark) -> None:  # noqa: ANN001
    # vLLM's connector stats arrive with the scheduler stats of the step that finished the
    # READ; a step later at most, so the window since the request's submission holds them.
    # With several pulls in flight at once the window is shared: the failure count is then
    # the engine's, not this request's alone (documented in docs/vllm.md).
    duration_ms = (time.monotonic() - t0) * 1e3
    win = w.engine.transfer_since(mark)
    m = w.metrics
    if win.failures:
        w.stats["pulls_failed"] += 1
        m.labels(m.transfers, "failed").inc()
        w.last_pull_error = f"vLLM NixlConnector reported {win.failures} failed transfer(s)/handshake(s)"
        await w.publish_acked(KvTransferFailed(**common, duration_ms=duration_ms, reason=w.last_pull_error,
                                               fallback="recompute"), correlation_id=common["request_id"])
        return
    w.stats["pulls_ok"] += 1
    w.stats["blocks_verified"] += common["blocks"]
    m.labels(m.transfers, "completed").inc()
    m.labels(m.transfer_bytes).inc(nbytes)
    log.info("vLLM pulled %d blocks (%d bytes) of %s from %s: first token after %.1f ms, NIXL reported "
             "%d transfers, %d bytes, %.1f ms", common["blocks"], nbytes, common["request_id"],
             common["src_worker"], duration_ms, win.transfers, win.bytes, win.duration_s * 1e3)
    await w.publish_acked(KvTransferCompleted(**common, bytes=win.bytes or nbytes, duration_ms=(
        win.duration_s * 1e3 if win.transfers else duration_ms)), correlation_id=common["request_id"])
