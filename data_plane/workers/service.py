"""What a worker does with requests, and its lifecycle after start-up (serve, drain, stop).

One asyncio loop owns the engine, the hold table and the staging slots; blocking work runs
elsewhere: NIXL transfers and block fills in worker threads (``asyncio.to_thread``), KVBM I/O on
the KVBM's own thread, notification polling in :class:`NotificationPoller`'s thread (which hands
done notifications back to the loop). Every event goes through the one producer, so this
incarnation's sequences stay dense per partition.

Three kinds of request, chosen by ``kv_transfer_params`` (vLLM NixlConnector protocol):

* none: run prompt and output here (``phase=AGGREGATED``, whatever the registered role);
* ``{"do_remote_decode": true}``: prefill only, hold the prompt's blocks under a lease, copy
  their bytes to staging slots of the NIXL region, publish ``PrefillCompleted`` and answer the
  handoff params (:func:`data_plane.workers.handoff.prefill_params`); the blocks are freed on
  the reader's done notification or when the lease runs out;
* ``{"do_remote_prefill": true, ...}`` (what a prefill answered): pull the blocks by NIXL READ
  (``KvTransferStarted`` -> ``KvTransferCompleted``), verify them, notify the holder and decode
  with the prompt's KV counted as transferred. Any failure is ``KvTransferFailed(fallback=
  "recompute")`` and the prompt is prefilled here: the request still completes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from data_plane.engines import AsyncEngine, EngineRequest, RequestRejected
from data_plane.kvbm import AsyncKvbm
from data_plane.transfer import (
    Handoff,
    Hold,
    HoldTable,
    InvalidTransfer,
    Released,
    TransferError,
    TransferResult,
    TransferTimeout,
    encode_done,
    parse_done,
)
from data_plane.workers.handoff import (
    DecodeHandoff,
    is_prefill_request,
    mismatch,
    parse_decode_params,
    prefill_params,
)
from data_plane.workers.metrics import WorkerMetrics
from data_plane.workers.peer_fetch import PeerFetch, PeerSource, parse_peer_source
from data_plane.workers.peers import PeerDirectory
from data_plane.workers.settings import WorkerSettings
from data_plane.workers.transfer import NotificationPoller, TransferPlane
from kernel.hashing import HashConfig, hash_blocks
from schemas.events import (
    AllBlocksCleared,
    Event,
    KvTransferCompleted,
    KvTransferFailed,
    KvTransferStarted,
    PrefillCompleted,
    WorkerDeregistered,
    WorkerDraining,
    WorkerLoadReported,
)
from schemas.types import RequestPhase, Tier

log = logging.getLogger(__name__)

BACKEND = "UCX"


class WorkerError(Exception):
    """Base of the errors the HTTP layer turns into responses."""

    status = 500
    kind = "server_error"


class BadRequest(WorkerError):
    status = 400
    kind = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class Unavailable(WorkerError):
    status = 503
    kind = "service_unavailable"


class Aborted(Unavailable):
    """The engine dropped the request (worker stopping): answered as any unavailability."""


@dataclass(frozen=True, slots=True)
class CompletionInput:
    request_id: str
    prompt: list[int]
    max_tokens: int
    kv_transfer_params: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Token:
    index: int
    token_id: int
    #: "length" on the last token, else None.
    finish_reason: str | None = None


class Run:
    """One request in flight. Iterate it once for its tokens; ``kv_transfer_params`` and
    ``cached_tokens`` are final once iteration ended. Closing it early aborts the request."""

    def __init__(self, worker: Worker, inp: CompletionInput) -> None:
        self.worker = worker
        self.request_id = inp.request_id
        self.prompt_tokens = len(inp.prompt)
        self.arrival = time.monotonic()
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.kv_transfer_params: dict[str, Any] | None = None
        #: The engine still runs (or holds) this request on our behalf: abort it on close.
        self.in_engine = False
        self._gen: AsyncIterator[Token] | None = None
        self._closed = False

    def __aiter__(self) -> AsyncIterator[Token]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Token]:
        assert self._gen is not None
        m = self.worker.metrics
        last: float | None = None
        try:
            async for tok in self._gen:
                now = time.monotonic()
                if last is None:
                    m.labels(m.ttft).observe(now - self.arrival)
                    m.labels(m.prompt_tokens).inc(self.prompt_tokens)
                else:
                    m.labels(m.itl).observe(now - last)
                last = now
                self.completion_tokens += 1
                m.labels(m.generation_tokens).inc()
                if tok.finish_reason:
                    self.finish_reason = tok.finish_reason
                yield tok
            m.labels(m.e2e).observe(time.monotonic() - self.arrival)
        finally:
            await self._gen.aclose()  # type: ignore[attr-defined]
            self.close()

    def close(self) -> None:
        """Idempotent: abort what the engine still runs for us, leave the in-flight set."""
        if self._closed:
            return
        self._closed = True
        if self.in_engine:
            self.in_engine = False
            self.worker.engine.abort(self.request_id)
        self.worker._inflight.pop(self.request_id, None)


def _event_params(params: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``kv_transfer_params`` in the shape ``PrefillCompleted`` declares (scalars and
    lists of ints): per-group block id lists (``[[...], ...]``) keep the first group, as
    :func:`data_plane.vllm.engine.parse_kv_transfer_params` reads them; anything else that is
    not a scalar is recorded as its JSON text. The response keeps vLLM's original object."""
    import json

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


class Worker:
    """A started worker: engine, KVBM, NIXL region and producer, wired (see ``wiring``)."""

    def __init__(self, settings: WorkerSettings, *, epoch: int, endpoint_url: str, producer,
                 engine: AsyncEngine, kvbm: AsyncKvbm, plane: TransferPlane, peers: PeerDirectory,
                 hash_config: HashConfig, metrics: WorkerMetrics,
                 clock: Callable[[], float] = time.time) -> None:
        self.s = settings
        self.worker_id = settings.worker_id
        self.epoch = epoch
        self.endpoint_url = endpoint_url
        self.producer = producer
        self.engine = engine
        self.kvbm = kvbm
        self.plane = plane
        self.peers = peers
        self.hash_config = hash_config
        self.block_size = hash_config.block_size
        self.metrics = metrics
        self._clock = clock
        self.holds = HoldTable()
        #: Request ids in ``holds`` (the table has no iterator; stop() releases them all).
        self._held: set[str] = set()
        self.state = "starting"
        self._inflight: dict[str, Run] = {}
        self._pulling = 0
        self._tasks: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._poller = NotificationPoller(plane, self._notif_from_thread, busy=lambda: len(self.holds) > 0)
        self._delivery_stop = threading.Event()
        self._delivery = threading.Thread(target=self._serve_delivery_reports, name="delivery-reports",
                                          daemon=True)
        self.stats = {"pulls_ok": 0, "pulls_failed": 0, "blocks_verified": 0, "holds_consumed": 0,
                      "holds_expired": 0, "holds_released": 0, "quarantined_slots": 0,
                      "staging_waits": 0, "staging_wait_timeouts": 0, "handoffs_without_kv": 0}
        #: Set whenever staging slots are freed; a handoff waiting for slots re-tries then.
        self._slots_freed = asyncio.Event()
        self.last_pull_error = ""
        #: Peers as a KV tier: holding blocks for a peer, fetching a prefix from one.
        self.peer_fetch = PeerFetch(self, timeout_s=settings.transfer_timeout_s)

    # ------------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Serve: engine stepping, notification polling, lease expiry, load reports."""
        self._loop = asyncio.get_running_loop()
        if not getattr(self.engine, "running", False):
            await self.engine.start()
        self._poller.start()
        self._delivery.start()
        self._tasks = [asyncio.create_task(self._report_load(), name="load-reports"),
                       asyncio.create_task(self._expire_holds(), name="lease-expiry")]
        self.state = "serving"

    async def drain(self, reason: str = "SIGTERM") -> None:
        """Stop taking requests, finish the ones in flight (and let held blocks be read), then
        deregister and stop. Idempotent."""
        if self.state != "serving":
            return
        self.state = "draining"
        log.info("draining (%s): %d requests in flight, %d handoffs held", reason,
                 len(self._inflight), len(self.holds))
        self.publish(WorkerDraining(worker_id=self.worker_id, reason=reason,
                                    inflight=len(self._inflight) + len(self.holds)))
        deadline = time.monotonic() + self.s.drain_timeout_s
        while (self._inflight or len(self.holds)) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        why = "drained"
        if self._inflight or len(self.holds):
            why = (f"drain timeout after {self.s.drain_timeout_s:g}s: {len(self._inflight)} requests "
                   f"aborted, {len(self.holds)} handoffs dropped")
            log.warning("%s", why)
            for run in list(self._inflight.values()):
                run.close()
        await self.stop(why)

    async def stop(self, reason: str) -> None:
        """Deregister and release everything (no more events after WorkerDeregistered)."""
        if self.state == "stopped":
            return
        self.state = "stopping"
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        now = self._clock()
        for rid in list(self._held):
            rel = self.holds.release(rid, now)
            if rel is not None:
                self._released(rel)
        await self.engine.stop()
        await self.kvbm.drain()  # offloads queued by the last evictions are reported first
        # This process's memory tiers go with it. Said on the KV stream, where residency lives
        # (the index never infers it from the lifecycle stream: the two are read in any order).
        self.publish(AllBlocksCleared(worker_id=self.worker_id, tier=Tier.DEVICE))
        self.publish(AllBlocksCleared(worker_id=self.worker_id, tier=Tier.HOST))
        self.publish(WorkerDeregistered(worker_id=self.worker_id, reason=reason))
        self._delivery_stop.set()
        if self._delivery.is_alive():
            self._delivery.join(5)
        left = await asyncio.to_thread(self.producer.flush, 30)
        if left:
            log.error("%d events not delivered at shutdown", left)
        self._poller.stop()
        self.peers.stop()
        await asyncio.to_thread(self.plane.close)
        await self.kvbm.aclose()
        self.state = "stopped"

    # ------------------------------------------------------------------------------- events

    def publish(self, payload: Event, correlation_id: str | None = None) -> None:
        self.producer.publish(payload, correlation_id=correlation_id)

    async def publish_acked(self, payload: Event, correlation_id: str | None = None) -> None:
        """Publish and wait until the broker has it. For facts a response is about to reveal
        (a handoff, a transfer outcome): the client must never learn something the log could
        still lose to a crash. Raises :class:`Unavailable` when the log does not confirm."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def on_ack(ack) -> None:  # noqa: ANN001 - runs in the delivery-report thread
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(ack))

        t0 = time.monotonic()
        self.producer.publish(payload, correlation_id=correlation_id, on_ack=on_ack)
        try:
            ack = await asyncio.wait_for(fut, self.s.ack_timeout_s)
        except TimeoutError:
            log.error("the event log did not acknowledge %s of %s within %gs (%d events awaiting delivery)",
                      payload.TYPE, correlation_id, self.s.ack_timeout_s, self.producer.outstanding())
            raise Unavailable(f"the event log did not acknowledge {payload.TYPE} within "
                              f"{self.s.ack_timeout_s:g}s") from None
        waited = time.monotonic() - t0
        if waited > 1.0:
            log.warning("the event log took %.1fs to acknowledge %s of %s", waited, payload.TYPE, correlation_id)
        if ack.error:
            raise Unavailable(f"the event log refused {payload.TYPE}: {ack.error}")

    def _serve_delivery_reports(self) -> None:
        # librdkafka only runs delivery callbacks inside poll(); serving them here (rather
        # than on the next publish) is what lets publish_acked return within milliseconds.
        while not self._delivery_stop.is_set():
            try:
                self.producer.poll(0.05)
            except Exception:
                log.exception("serving delivery reports failed")
                self._delivery_stop.wait(0.1)

    def load_report(self, tier_usage: dict[str, float]) -> WorkerLoadReported:
        st = self.engine.stats()
        return WorkerLoadReported(
            worker_id=self.worker_id, running=st.running, waiting=st.waiting + self._pulling,
            tier_usage={Tier.DEVICE.value: st.kv_usage, **tier_usage},
            queued_prefill_tokens=st.queued_prefill_tokens, active_decode_blocks=st.active_blocks)

    async def _report_load(self) -> None:
        while True:
            try:
                usage = await self.kvbm.usage()
                self.publish(self.load_report(usage))
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("load report failed")
            await asyncio.sleep(self.s.load_interval_s)

    # ------------------------------------------------------------------------------ requests

    def open(self, inp: CompletionInput) -> Run:
        """Validate and start one request. Raises :class:`BadRequest` (its fault) or
        :class:`Unavailable` (draining) before anything is sent to the client."""
        if self.state != "serving":
            raise Unavailable(f"worker {self.worker_id} is {self.state}")
        rid = inp.request_id
        if not inp.prompt:
            raise BadRequest("prompt is empty", "prompt")
        params = inp.kv_transfer_params
        if getattr(self.engine, "real_kv", False):
            return self._open_real(inp)
        try:
            decode = parse_decode_params(params)
            peer = parse_peer_source(params) if decode is None else None
        except InvalidTransfer as e:
            raise BadRequest(str(e), "kv_transfer_params") from None
        if decode is not None and rid in self.holds and decode.handoff.agent_name == self.plane.agent_name:
            # Prefill and decode landed on this same worker: nothing to move. Freeing the hold
            # leaves the prompt's blocks cached on the device, so the run below hits them.
            rel = self.holds.release(rid, self._clock())
            if rel is not None:
                self._released(rel)
            decode = msgspec.structs.replace(decode, handoff=msgspec.structs.replace(decode.handoff, block_ids=[]),
                                             block_hashes=[])
        if rid in self._inflight or rid in self.holds:
            raise BadRequest(f"request id {rid!r} is already in use on this worker", "request_id")
        run = Run(self, inp)
        try:
            if is_prefill_request(params):
                stream = self.engine.submit(EngineRequest(
                    request_id=rid, prompt=inp.prompt, max_tokens=1, phase=RequestPhase.PREFILL))
                run._gen = self._prefill(run, stream, inp)
            elif decode is not None and decode.blocks:
                # Checked now so a request that can never run is a 400, not a failure later.
                self.engine.validate(EngineRequest(
                    request_id=rid, prompt=inp.prompt, max_tokens=inp.max_tokens,
                    phase=RequestPhase.AGGREGATED))
                run._gen = self._decode(run, inp, decode)
            else:
                if decode is None and params and params.get("remote_engine_id") and params.get("reason"):
                    # The prefill computed the prompt but could not hold it for us: recomputing
                    # here is the recorded fallback, never a silent one.
                    self.stats["handoffs_without_kv"] += 1
                    self.publish(KvTransferFailed(
                        request_id=rid, transfer_id=uuid.uuid4().hex, src_worker=str(params["remote_engine_id"]),
                        dst_worker=self.worker_id, blocks=0, backend=BACKEND, duration_ms=0.0,
                        reason=f"prefill held no KV: {params['reason']}"[:500], fallback="recompute"),
                        correlation_id=rid)
                prefix = tuple(decode.first_token_ids[: inp.max_tokens - 1]) if decode else ()
                req = EngineRequest(request_id=rid, prompt=inp.prompt, max_tokens=inp.max_tokens,
                                    output_prefix=prefix, phase=RequestPhase.AGGREGATED)
                if peer is not None:
                    self.engine.validate(req)
                    run._gen = self._peer_then_generate(run, req, peer)
                else:
                    stream = self.engine.submit(req)
                    run._gen = self._generate(run, stream, prefix)
        except RequestRejected as e:
            raise BadRequest(str(e)) from None
        run.in_engine = (decode is None and peer is None) or (decode is not None and not decode.blocks) \
            or is_prefill_request(params)
        self._inflight[rid] = run
        return run

    async def _tokens(self, run: Run, stream) -> AsyncIterator[Token]:  # noqa: ANN001
        """The engine's tokens for ``run``, as :class:`Token`; raises :class:`Aborted`."""
        m = self.metrics
        first = True
        async for tok in stream:
            if tok.finish_reason == "abort":
                run.in_engine = False
                raise Aborted(f"request {run.request_id} was aborted by the engine")
            if first:
                first = False
                run.cached_tokens = stream.cached_tokens or 0
                m.labels(m.prefix_queries).inc(run.prompt_tokens)
                m.labels(m.prefix_hits).inc(run.cached_tokens)
            if tok.finished:
                run.in_engine = False
            yield Token(tok.index, tok.token_id, tok.finish_reason)

    async def _generate(self, run: Run, stream, prefix: tuple[int, ...] = ()) -> AsyncIterator[Token]:  # noqa: ANN001
        for i, t in enumerate(prefix):
            yield Token(i, t)
        async for tok in self._tokens(run, stream):
            yield tok

    async def _peer_then_generate(self, run: Run, req: EngineRequest, peer: PeerSource) -> AsyncIterator[Token]:
        """Pull the prompt's prefix from a peer into the host tier, then run the request: the
        engine onboards what arrived and recomputes the rest."""
        await self.peer_fetch.fetch(run.request_id, peer, list(req.prompt))
        try:
            stream = self.engine.submit(req)
        except RequestRejected as e:
            raise Aborted(f"engine refused {run.request_id} after the peer fetch: {e}") from None
        run.in_engine = True
        async for tok in self._generate(run, stream, tuple(req.output_prefix)):
            yield tok

    # -- a real engine (vLLM): its KV connector moves the KV ----------------------------------

    def _open_real(self, inp: CompletionInput) -> Run:
        """Requests to an engine with real KV (vLLM). ``kv_transfer_params`` go to the engine
        unchanged: vLLM's NixlConnector holds the prefill's blocks and the decode side READs
        them (its protocol, as vLLM's disaggregated proxy drives it). This worker records the
        facts around it: ``PrefillCompleted`` (acked before the params are revealed), and on
        the decode side ``KvTransferStarted`` then ``KvTransferCompleted`` or, when vLLM
        reports a failed READ or handshake and recomputes (``kv_load_failure_policy=
        "recompute"``), ``KvTransferFailed(fallback="recompute")``."""
        rid = inp.request_id
        params = inp.kv_transfer_params or None
        if params and not self.engine.moves_kv:
            raise BadRequest(f"worker {self.worker_id} runs its engine without a KV connector: "
                             "it cannot take part in a disaggregated handoff", "kv_transfer_params")
        if rid in self._inflight:
            raise BadRequest(f"request id {rid!r} is already in use on this worker", "request_id")
        prefill = bool(params and params.get("do_remote_decode"))
        pull = bool(params and params.get("do_remote_prefill"))
        if pull and not params.get("remote_block_ids"):
            # Nothing to read (prompt shorter than a block, or the prefill had no blocks).
            params, pull = None, False
        req = EngineRequest(request_id=rid, prompt=inp.prompt, max_tokens=1 if prefill else inp.max_tokens,
                            phase=RequestPhase.PREFILL if prefill else RequestPhase.AGGREGATED)
        run = Run(self, inp)
        mark = self.engine.transfer_mark() if pull else None
        try:
            stream = self.engine.submit(req, kv_transfer_params=self._engine_params(params))
        except RequestRejected as e:
            raise BadRequest(str(e)) from None
        run.in_engine = True
        if prefill:
            run._gen = self._real_prefill(run, stream)
        elif pull:
            run._gen = self._real_decode(run, stream, params, mark)
        else:
            run._gen = self._settled(run, stream, inp.prompt)
        self._inflight[rid] = run
        return run

    async def _settled(self, run: Run, stream, prompt: list[int]) -> AsyncIterator[Token]:  # noqa: ANN001
        """The engine's tokens, the last one held back until the prompt's KV stores are in the
        log (:meth:`VllmServingEngine.settle`): "finished" then implies "routable"."""
        async for tok in self._tokens(run, stream):
            if tok.finish_reason is not None:
                if not await self.engine.settle(prompt):
                    log.debug("request %s: its KV stores were not all in the log within the settle "
                              "window", run.request_id)
            yield tok

    @staticmethod
    def _engine_params(params: dict[str, Any] | None) -> dict[str, Any] | None:
        if not params:
            return None
        # Our additions (who the holder is) stay out of vLLM's connector.
        return {k: v for k, v in params.items() if not k.startswith("switchyard_")}

    async def _real_prefill(self, run: Run, stream) -> AsyncIterator[Token]:  # noqa: ANN001
        tokens = [t async for t in self._tokens(run, stream)]
        params = dict(stream.kv_transfer_params or {})
        params["switchyard_worker_id"] = self.worker_id
        params["switchyard_bytes_per_block"] = self.engine.bytes_per_block
        run.kv_transfer_params = params
        await self.publish_acked(PrefillCompleted(
            request_id=run.request_id, worker_id=self.worker_id, prompt_tokens=run.prompt_tokens,
            cached_tokens=run.cached_tokens, duration_ms=(time.monotonic() - run.arrival) * 1e3,
            kv_transfer_params=_event_params(params)), correlation_id=run.request_id)
        for t in tokens:
            yield t

    async def _real_decode(self, run: Run, stream, params: dict[str, Any], mark) -> AsyncIterator[Token]:  # noqa: ANN001
        block_ids = params.get("remote_block_ids") or []
        if block_ids and isinstance(block_ids[0], (list, tuple)):
            block_ids = block_ids[0]
        n = len(block_ids)
        nbytes = n * int(params.get("switchyard_bytes_per_block") or self.engine.bytes_per_block)
        common = dict(request_id=run.request_id, transfer_id=uuid.uuid4().hex,
                      src_worker=str(params.get("switchyard_worker_id") or params.get("remote_engine_id")),
                      dst_worker=self.worker_id, blocks=n, backend="NIXL/UCX (vLLM NixlConnector)")
        self.publish(KvTransferStarted(**common, bytes=nbytes), correlation_id=run.request_id)
        t0 = time.monotonic()
        first = True
        self._pulling += 1
        try:
            async for tok in self._tokens(run, stream):
                if first:
                    first = False
                    self._pulling -= 1
                    await self._record_real_pull(common, nbytes, t0, mark)
                yield tok
        finally:
            if first:
                self._pulling -= 1

    async def _record_real_pull(self, common: dict[str, Any], nbytes: int, t0: float, mark) -> None:  # noqa: ANN001
        # vLLM's connector stats arrive with the scheduler stats of the step that finished the
        # READ; a step later at most, so the window since the request's submission holds them.
        # With several pulls in flight at once the window is shared: the failure count is then
        # the engine's, not this request's alone (documented in docs/vllm.md).
        duration_ms = (time.monotonic() - t0) * 1e3
        win = self.engine.transfer_since(mark)
        m = self.metrics
        if win.failures:
            self.stats["pulls_failed"] += 1
            m.labels(m.transfers, "failed").inc()
            self.last_pull_error = f"vLLM NixlConnector reported {win.failures} failed transfer(s)/handshake(s)"
            await self.publish_acked(KvTransferFailed(**common, duration_ms=duration_ms, reason=self.last_pull_error,
                                                      fallback="recompute"), correlation_id=common["request_id"])
            return
        self.stats["pulls_ok"] += 1
        self.stats["blocks_verified"] += common["blocks"]
        m.labels(m.transfers, "completed").inc()
        m.labels(m.transfer_bytes).inc(nbytes)
        log.info("vLLM pulled %d blocks (%d bytes) of %s from %s: first token after %.1f ms, NIXL reported "
                 "%d transfers, %d bytes, %.1f ms", common["blocks"], nbytes, common["request_id"],
                 common["src_worker"], duration_ms, win.transfers, win.bytes, win.duration_s * 1e3)
        await self.publish_acked(KvTransferCompleted(**common, bytes=win.bytes or nbytes, duration_ms=(
            win.duration_s * 1e3 if win.transfers else duration_ms)), correlation_id=common["request_id"])

    # -- prefill side of a handoff ----------------------------------------------------------

    async def _prefill(self, run: Run, stream, inp: CompletionInput) -> AsyncIterator[Token]:  # noqa: ANN001
        tokens = [t async for t in self._tokens(run, stream)]
        # The engine now holds the request's blocks; the hold (or its absence) owns them.
        run.in_engine = False
        params = await self._hold_for_handoff(inp, [t.token_id for t in tokens])
        run.kv_transfer_params = params
        try:
            await self.publish_acked(PrefillCompleted(
                request_id=run.request_id, worker_id=self.worker_id, prompt_tokens=run.prompt_tokens,
                cached_tokens=run.cached_tokens, duration_ms=(time.monotonic() - run.arrival) * 1e3,
                kv_transfer_params=params), correlation_id=run.request_id)
        except BaseException:
            # No handoff the log does not know about: free the blocks, answer an error.
            rel = self.holds.release(run.request_id, self._clock())
            if rel is not None:
                self._released(rel)
            raise
        for t in tokens:
            yield t

    async def _hold_for_handoff(self, inp: CompletionInput, first_tokens: list[int]) -> dict[str, Any]:
        rid = inp.request_id
        n_full = len(inp.prompt) // self.block_size
        hashes = hash_blocks(inp.prompt[: n_full * self.block_size], self.hash_config) if n_full else []
        now = self._clock()
        if not hashes:
            # Nothing hashable to move (shorter than a block): the decode side recomputes it.
            self.engine.release(rid)
            return self.transfer_params(Handoff(request_id=rid, agent_name=self.plane.agent_name,
                                        block_ids=[], expires_at=now), [], first_tokens)
        slots, waited = await self.staging(len(hashes))
        if slots is None:
            self.engine.release(rid)
            reason = (f"{len(hashes)} staging slots needed, {self.plane.slots.free_count} of "
                      f"{self.plane.slots.count} free after waiting {waited * 1e3:.0f} ms")
            log.warning("request %s: %s: no handoff, the decode side recomputes", rid, reason)
            return {"do_remote_prefill": False, "do_remote_decode": False,
                    "remote_engine_id": self.worker_id, "first_token_ids": first_tokens,
                    "reason": reason}
        try:
            await asyncio.to_thread(self.plane.fill, slots, hashes)
        except BaseException:
            self.free_slots(slots)
            self.engine.release(rid)
            raise
        hold = self.hold_slots(rid, slots)
        self.metrics.labels(self.metrics.holds).set(len(self.holds))
        handoff = Handoff(request_id=rid, agent_name=self.plane.agent_name, block_ids=slots,
                          expires_at=hold.expires_at)
        return self.transfer_params(handoff, hashes, first_tokens)

    def hold_slots(self, request_id: str, slots: list[int]) -> Hold:
        """Hold ``slots`` for ``request_id`` under a lease, until its reader's done notification
        or the lease's end frees them."""
        hold = self.holds.hold(request_id, slots, self._clock(), self.s.lease_s)
        self._held.add(request_id)
        return hold

    def transfer_params(self, handoff: Handoff, hashes, first_tokens: list[int]) -> dict[str, Any]:  # noqa: ANN001
        """The ``kv_transfer_params`` a reader pulls ``handoff``'s blocks with."""
        host, _, port = self.endpoint_url.removeprefix("http://").rpartition(":")
        return prefill_params(handoff, engine_id=self.worker_id, block_hashes=hashes,
                              remote_host=host, remote_port=int(port), block_size=self.block_size,
                              bytes_per_block=self.plane.bytes_per_block,
                              first_token_ids=first_tokens)

    def _notif_from_thread(self, peer: str, msg: bytes) -> None:
        done = parse_done(msg)
        if done is None:
            log.debug("ignoring notification %r from %s", msg, peer)
            return
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._on_done, done.request_id, done.n_consumers)
        except RuntimeError:  # the loop closed under us: the process is exiting
            pass

    def _on_done(self, request_id: str, n_consumers: int) -> None:
        rel = self.holds.notify(request_id, n_consumers, self._clock())
        if rel is not None:
            self._released(rel)

    async def staging(self, n: int) -> tuple[list[int] | None, float]:
        """``n`` staging slots, waiting (bounded by ``staging_wait_s``) while other handoffs hold
        them; returns the slots (None when none came in time) and the seconds waited. A burst
        of handoffs queues here instead of falling back to recompute."""
        slots = self.plane.slots.allocate(n)
        if slots is not None or n > self.plane.slots.count:
            return slots, 0.0
        self.stats["staging_waits"] += 1
        t0 = time.monotonic()
        deadline = t0 + self.s.staging_wait_s
        while True:
            self._slots_freed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.stats["staging_wait_timeouts"] += 1
                return None, time.monotonic() - t0
            try:
                await asyncio.wait_for(self._slots_freed.wait(), remaining)
            except TimeoutError:
                pass
            slots = self.plane.slots.allocate(n)
            if slots is not None:
                return slots, time.monotonic() - t0

    def free_slots(self, slots: list[int]) -> None:
        self.plane.slots.free(slots)
        self._slots_freed.set()

    def _released(self, rel: Released) -> None:
        self.engine.release(rel.request_id)
        self.free_slots(rel.block_ids)
        self._held.discard(rel.request_id)
        self.stats[f"holds_{rel.reason.value}"] += 1
        m = self.metrics
        m.labels(m.hold_releases, rel.reason.value).inc()
        m.labels(m.holds).set(len(self.holds))
        log.info("handoff %s released (%s) after %.3fs: %d blocks", rel.request_id, rel.reason.value,
                 rel.held_s, len(rel.block_ids))

    async def _expire_holds(self) -> None:
        while True:
            nxt = self.holds.next_expiry()
            delay = 0.5 if nxt is None else min(0.5, max(nxt - self._clock(), 0.0))
            await asyncio.sleep(delay)
            for rel in self.holds.expire(self._clock()):
                self._released(rel)

    # -- decode side of a handoff -----------------------------------------------------------

    async def _decode(self, run: Run, inp: CompletionInput, h: DecodeHandoff) -> AsyncIterator[Token]:
        prefix = tuple(h.first_token_ids[: inp.max_tokens])
        transferred = await self._pull(run.request_id, h, inp.prompt)
        if len(prefix) >= inp.max_tokens:
            for i, t in enumerate(prefix):
                yield Token(i, t, "length" if i == len(prefix) - 1 else None)
            return
        phase = RequestPhase.DECODE if transferred else RequestPhase.AGGREGATED
        try:
            stream = self.engine.submit(EngineRequest(
                request_id=run.request_id, prompt=inp.prompt, max_tokens=inp.max_tokens,
                output_prefix=prefix, phase=phase))
        except RequestRejected as e:
            raise Aborted(f"engine refused {run.request_id} after the transfer: {e}") from None
        run.in_engine = True
        async for tok in self._generate(run, stream, prefix):
            yield tok

    async def _pull(self, request_id: str, h: DecodeHandoff, prompt: list[int]) -> bool:
        """Pull the handoff's blocks into staging, verify them, notify the holder. True when the
        prompt's KV arrived; False (after ``KvTransferFailed``) when it must be recomputed."""
        n = h.blocks
        nbytes = n * self.plane.bytes_per_block
        common = dict(request_id=request_id, transfer_id=uuid.uuid4().hex, src_worker=h.engine_id,
                      dst_worker=self.worker_id, blocks=n, backend=BACKEND)
        self.publish(KvTransferStarted(**common, bytes=nbytes), correlation_id=request_id)
        t0 = time.monotonic()
        n_prompt_blocks = len(prompt) // self.block_size
        prompt_hashes = hash_blocks(prompt[: min(n, n_prompt_blocks) * self.block_size], self.hash_config)
        reason = mismatch(h, prompt_hashes, block_size=self.block_size,
                          bytes_per_block=self.plane.bytes_per_block)
        if reason is None and n > n_prompt_blocks:
            reason = f"{n} blocks offered for a prompt of {n_prompt_blocks} full blocks"
        local: list[int] | None = None
        result: TransferResult | None = None
        self._pulling += 1
        try:
            if reason is None:
                local, waited = await self.staging(n)
                if local is None:
                    reason = (f"no free staging slots ({n} needed, {self.plane.slots.free_count} free "
                              f"after waiting {waited * 1e3:.0f} ms)")
            if reason is None:
                assert local is not None
                job = asyncio.ensure_future(asyncio.to_thread(self.pull_blocking, h, local))
                try:
                    result = await asyncio.shield(job)
                except asyncio.CancelledError:
                    # The client left; the READ may still be landing in our slots: free them
                    # only once it is over.
                    slots, local = local, None
                    job.add_done_callback(lambda _f: self.free_slots(slots))
                    self.publish(KvTransferFailed(**common, duration_ms=(time.monotonic() - t0) * 1e3,
                                                  reason="request cancelled", fallback="failed"),
                                 correlation_id=request_id)
                    raise
                except TransferTimeout as e:
                    # NIXL may still write into these slots: never reuse them.
                    self.stats["quarantined_slots"] += len(local)
                    local = None
                    reason = f"TransferTimeout: {e}"
                except (TransferError, OSError) as e:
                    reason = f"{type(e).__name__}: {e}"
                except Exception as e:  # the request must still complete: recompute
                    log.exception("pull of %s failed unexpectedly", request_id)
                    reason = f"{type(e).__name__}: {e}"
        finally:
            self._pulling -= 1
            if local is not None:
                self.free_slots(local)
        duration_ms = (time.monotonic() - t0) * 1e3
        m = self.metrics
        if reason is None:
            assert result is not None
            self.stats["pulls_ok"] += 1
            self.stats["blocks_verified"] += n
            m.labels(m.transfers, "completed").inc()
            m.labels(m.transfer_bytes).inc(nbytes)
            await self.publish_acked(KvTransferCompleted(**common, bytes=nbytes, duration_ms=duration_ms),
                                     correlation_id=request_id)
            log.info("pulled %d blocks (%d bytes) of %s from %s in %.1f ms (READ %.2f GB/s)", n, nbytes,
                     request_id, h.engine_id, duration_ms, result.gbps)
            return True
        self.stats["pulls_failed"] += 1
        self.last_pull_error = reason
        m.labels(m.transfers, "failed").inc()
        await self.publish_acked(KvTransferFailed(**common, duration_ms=duration_ms, reason=reason,
                                                  fallback="recompute"), correlation_id=request_id)
        log.warning("pull of %s from %s failed (%s): recomputing the prompt", request_id, h.engine_id, reason)
        return False

    def pull_blocking(self, h: DecodeHandoff, local: list[int]) -> TransferResult:
        """Metadata, READ, verify, notify. Runs in a thread."""
        ho = h.handoff
        if not ho.readable(self._clock(), self.s.lease_margin_s):
            raise TransferError(f"the holder's lease ends at {ho.expires_at:.3f}: too late to start a READ")
        md = self.peers.lookup(ho.agent_name, h.remote_host, h.remote_port, self.s.transfer_timeout_s)
        result = self.plane.read(md, ho.block_ids, local, self.s.transfer_timeout_s)
        bad = self.plane.corrupt(local, h.block_hashes)
        try:
            # Done either way: we will not read these blocks again, so the holder may free them.
            self.plane.notify(ho.agent_name, encode_done(ho.request_id))
        except TransferError as e:
            log.warning("done notification to %s failed (its lease will free the blocks): %s",
                        ho.agent_name, e)
        if bad:
            raise TransferError(f"{len(bad)} of {h.blocks} blocks failed verification "
                                f"(first: block {bad[0]})")
        return result

    # ------------------------------------------------------------------------------- queries

    def inflight(self) -> int:
        return len(self._inflight)

    async def debug_state(self) -> dict[str, Any]:
        """What the worker really holds and does (tests compare it with the log)."""
        residency = await asyncio.get_running_loop().run_in_executor(None, self.kvbm.manager.residency)
        st = self.engine.stats()
        return {
            "worker_id": self.worker_id, "epoch": self.epoch, "state": self.state,
            "agent_name": self.plane.agent_name,
            "inflight": len(self._inflight), "holds": len(self.holds),
            "staging_free": self.plane.slots.free_count, "staging_total": self.plane.slots.count,
            "device_cached": sorted(self.engine.cached_hashes()),
            "tiers": {t.value: [int(h) for h in hs] for t, hs in residency.items() if t is not Tier.DEVICE},
            "engine": {"running": st.running, "waiting": st.waiting, "held": st.held,
                       "free_blocks": st.free_blocks, "kv_usage": st.kv_usage},
            "transfers": dict(self.stats), "last_pull_error": self.last_pull_error,
            "peer_fetch": {**self.peer_fetch.stats, "last_error": self.peer_fetch.last_error},
            "peers": {"from_log": self.peers.from_log, "from_side_channel": self.peers.from_side_channel},
            **({"vllm": self.engine.debug()} if hasattr(self.engine, "debug") else {}),
            "events_acked": self.producer.acked, "events_failed": len(self.producer.failed),
        }
