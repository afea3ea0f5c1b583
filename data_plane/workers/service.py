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

Its parts, each with its own module: :mod:`.run` (a request in flight, its errors),
:mod:`.publisher` (the producer, acked publishing), :mod:`.staging` (staging slots and the holds
on them), :mod:`.pull` (the decode side's NIXL READ), :mod:`.real_kv` (requests to an engine whose
connector moves the KV: vLLM), :mod:`.peer_fetch` (peers as a KV tier). The ``Worker`` keeps
the lifecycle, the load reports and which path a request takes.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from data_plane.engines import AsyncEngine, EngineRequest, RequestRejected
from data_plane.kvbm import AsyncKvbm
from data_plane.transfer import Handoff, Hold, InvalidTransfer, TransferResult
from data_plane.workers import pull as decode_pull
from data_plane.workers.handoff import DecodeHandoff, is_prefill_request, parse_decode_params, prefill_params
from data_plane.workers.metrics import WorkerMetrics
from data_plane.workers.peer_fetch import PeerFetch, PeerSource, parse_peer_source
from data_plane.workers.peers import PeerDirectory
from data_plane.workers.publisher import EventPublisher
from data_plane.workers.pull import BACKEND
from data_plane.workers.real_kv import open_real
from data_plane.workers.run import Aborted, BadRequest, CompletionInput, Run, Token, Unavailable, engine_tokens
from data_plane.workers.settings import WorkerSettings
from data_plane.workers.staging import StagingHolds
from data_plane.workers.transfer import NotificationPoller, TransferPlane
from common.hashing import HashConfig, hash_blocks
from schemas.events import (
    AllBlocksCleared,
    Event,
    KvTransferFailed,
    PrefillCompleted,
    WorkerDeregistered,
    WorkerDraining,
    WorkerLoadReported,
)
from schemas.types import RequestPhase, Tier

log = logging.getLogger(__name__)


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
        self.clock = clock
        self.state = "starting"
        self._inflight: dict[str, Run] = {}
        #: Decode pulls in flight (counted as waiting in the load report).
        self.pulling = 0
        self._tasks: list[asyncio.Task] = []
        self.stats = {"pulls_ok": 0, "pulls_failed": 0, "blocks_verified": 0, "holds_consumed": 0,
                      "holds_expired": 0, "holds_released": 0, "quarantined_slots": 0,
                      "staging_waits": 0, "staging_wait_timeouts": 0, "handoffs_without_kv": 0}
        self.events = EventPublisher(producer, ack_timeout_s=settings.ack_timeout_s)
        #: Staging slots and the holds on them.
        self.staged = StagingHolds(plane=plane, engine=engine, metrics=metrics, stats=self.stats,
                                   lease_s=settings.lease_s, staging_wait_s=settings.staging_wait_s,
                                   clock=clock)
        self.holds = self.staged.table
        self._poller = NotificationPoller(plane, self.staged.notified_from_thread,
                                          busy=lambda: len(self.holds) > 0)
        self.last_pull_error = ""
        #: Peers as a KV tier: holding blocks for a peer, fetching a prefix from one.
        self.peer_fetch = PeerFetch(self, timeout_s=settings.transfer_timeout_s)

    # ------------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Serve: engine stepping, notification polling, lease expiry, load reports."""
        self.staged.bind(asyncio.get_running_loop())
        if not getattr(self.engine, "running", False):
            await self.engine.start()
        self._poller.start()
        self.events.start()
        self._tasks = [asyncio.create_task(self._report_load(), name="load-reports"),
                       asyncio.create_task(self.staged.expire_loop(), name="lease-expiry")]
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
        self.staged.release_all()
        await self.engine.stop()
        await self.kvbm.drain()  # offloads queued by the last evictions are reported first
        # This process's memory tiers go with it. Said on the KV stream, where residency lives
        # (the index never infers it from the lifecycle stream: the two are read in any order).
        self.publish(AllBlocksCleared(worker_id=self.worker_id, tier=Tier.DEVICE))
        self.publish(AllBlocksCleared(worker_id=self.worker_id, tier=Tier.HOST))
        self.publish(WorkerDeregistered(worker_id=self.worker_id, reason=reason))
        self.events.stop()
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
        self.events.publish(payload, correlation_id)

    async def publish_acked(self, payload: Event, correlation_id: str | None = None) -> None:
        """Publish and wait until the broker has it (:meth:`EventPublisher.publish_acked`)."""
        await self.events.publish_acked(payload, correlation_id)

    def load_report(self, tier_usage: dict[str, float]) -> WorkerLoadReported:
        st = self.engine.stats()
        return WorkerLoadReported(
            worker_id=self.worker_id, running=st.running, waiting=st.waiting + self.pulling,
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
            return open_real(self, inp)
        try:
            decode = parse_decode_params(params)
            peer = parse_peer_source(params) if decode is None else None
        except InvalidTransfer as e:
            raise BadRequest(str(e), "kv_transfer_params") from None
        if decode is not None and rid in self.holds and decode.handoff.agent_name == self.plane.agent_name:
            # Prefill and decode landed on this same worker: nothing to move. Freeing the hold
            # leaves the prompt's blocks cached on the device, so the run below hits them.
            self.staged.release(rid)
            decode = msgspec.structs.replace(decode, handoff=msgspec.structs.replace(decode.handoff, block_ids=[]),
                                             block_hashes=[])
        if rid in self._inflight or rid in self.holds:
            raise BadRequest(f"request id {rid!r} is already in use on this worker", "request_id")
        run = Run(self, inp)
        try:
            if is_prefill_request(params):
                stream = self.engine.submit(EngineRequest(
                    request_id=rid, prompt=inp.prompt, max_tokens=1, phase=RequestPhase.PREFILL,
                    router_order=inp.routed_at_s))
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
                                    output_prefix=prefix, phase=RequestPhase.AGGREGATED,
                                    router_order=inp.routed_at_s)
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

    async def _generate(self, run: Run, stream, prefix: tuple[int, ...] = ()) -> AsyncIterator[Token]:  # noqa: ANN001
        for i, t in enumerate(prefix):
            yield Token(i, t)
        async for tok in engine_tokens(run, stream, self.metrics):
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

    # -- prefill side of a handoff ----------------------------------------------------------

    async def _prefill(self, run: Run, stream, inp: CompletionInput) -> AsyncIterator[Token]:  # noqa: ANN001
        tokens = [t async for t in engine_tokens(run, stream, self.metrics)]
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
            self.staged.release(run.request_id)
            raise
        for t in tokens:
            yield t

    async def _hold_for_handoff(self, inp: CompletionInput, first_tokens: list[int]) -> dict[str, Any]:
        rid = inp.request_id
        n_full = len(inp.prompt) // self.block_size
        hashes = hash_blocks(inp.prompt[: n_full * self.block_size], self.hash_config) if n_full else []
        now = self.clock()
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
        """Hold ``slots`` for ``request_id`` under a lease (:meth:`StagingHolds.hold`)."""
        return self.staged.hold(request_id, slots)

    async def staging(self, n: int) -> tuple[list[int] | None, float]:
        """``n`` staging slots, waiting while other handoffs hold them
        (:meth:`StagingHolds.allocate`)."""
        return await self.staged.allocate(n)

    def free_slots(self, slots: list[int]) -> None:
        self.staged.free(slots)

    def transfer_params(self, handoff: Handoff, hashes, first_tokens: list[int]) -> dict[str, Any]:  # noqa: ANN001
        """The ``kv_transfer_params`` a reader pulls ``handoff``'s blocks with."""
        host, _, port = self.endpoint_url.removeprefix("http://").rpartition(":")
        return prefill_params(handoff, engine_id=self.worker_id, block_hashes=hashes,
                              remote_host=host, remote_port=int(port), block_size=self.block_size,
                              bytes_per_block=self.plane.bytes_per_block,
                              first_token_ids=first_tokens)

    # -- decode side of a handoff -----------------------------------------------------------

    async def _decode(self, run: Run, inp: CompletionInput, h: DecodeHandoff) -> AsyncIterator[Token]:
        prefix = tuple(h.first_token_ids[: inp.max_tokens])
        transferred = await decode_pull.pull(self, run.request_id, h, inp.prompt)
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

    def pull_blocking(self, h: DecodeHandoff, local: list[int]) -> TransferResult:
        """Metadata, READ, verify, notify (:func:`data_plane.workers.pull.pull_blocking`). Runs
        in a thread."""
        return decode_pull.pull_blocking(self, h, local)

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
