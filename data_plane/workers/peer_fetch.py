"""Peers as a KV tier: a worker pulls a prefix another worker holds, over NIXL, instead of
recomputing it.

Two sides, both on the worker's event loop:

* **Holder** (:meth:`PeerFetch.hold`, behind ``POST /kv/peer-hold``, the cluster's worker
  credential). It copies the leading run of the asked blocks that it holds in host memory (the
  host slot's bytes) or on its device (the simulated device has no bytes: synthetic content, as
  the prefill handoff's copy-out) into staging slots of its NIXL region, holds them under a
  lease exactly as a prefill handoff holds its blocks, and answers the handoff's
  ``kv_transfer_params`` (the same shape a prefill answers: slot ids, block hashes, agent,
  lease end, side channel). The reader's done notification, or the lease, frees the slots.
* **Reader** (:meth:`PeerFetch.fetch`, before a request whose ``kv_transfer_params`` carry
  ``peer_fetch`` enters the engine). It asks the holder to hold the blocks of the prompt it
  lacks, READs them into its own staging slots, verifies every block against its hash, writes
  them into its KVBM host tier (``BlockStored(host)``), and notifies the holder. The engine's
  admission then onboards them host -> device like any host hit (``BlockStored(device,
  source_tier=host)``), by the same cost rule as every lower tier. The move is recorded as
  ``KvTransferStarted`` / ``KvTransferCompleted`` with ``purpose="peer_fetch"``; a failure
  (holder gone, nothing held, timeout, corrupt bytes, no slots) is ``KvTransferFailed(fallback=
  "recompute")`` and the request runs anyway, recomputing what did not arrive.

The request names its peer in ``kv_transfer_params["peer_fetch"]``::

    {"worker_id": "w-1", "host": "127.0.0.1", "port": 8101, "blocks": 12}

``blocks`` is how many of the prompt's leading blocks the peer is believed to hold (the
router's index); the reader asks for those it does not hold itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, Protocol

import httpx
import msgspec

from data_plane.engines import AsyncEngine
from data_plane.kvbm import AsyncKvbm
from data_plane.transfer import (
    Handoff,
    Hold,
    InvalidTransfer,
    TransferError,
    TransferResult,
    TransferTimeout,
    encode_done,
)
from data_plane.workers.handoff import DecodeHandoff, mismatch, parse_decode_params
from data_plane.workers.metrics import WorkerMetrics
from data_plane.workers.peers import PeerDirectory
from data_plane.workers.transfer import TransferPlane
from common.hashing import HashConfig, hash_blocks
from schemas.events import Event, KvTransferCompleted, KvTransferFailed, KvTransferStarted
from schemas.types import Tier

log = logging.getLogger(__name__)

PURPOSE = "peer_fetch"


class PeerSource(msgspec.Struct, frozen=True, kw_only=True):
    """``kv_transfer_params["peer_fetch"]``: the worker to pull the prompt's prefix from."""

    worker_id: str
    host: str
    port: int
    #: Leading prompt blocks the peer is believed to hold.
    blocks: int

    def __post_init__(self) -> None:
        if not self.worker_id or not self.host or not 0 < self.port < 65536 or self.blocks < 0:
            raise InvalidTransfer(f"peer_fetch: bad source {self!r}")


def parse_peer_source(params: dict[str, Any] | None) -> PeerSource | None:
    """The peer to fetch from, or None when the params ask for no peer fetch. Raises
    :class:`InvalidTransfer` for a malformed one (the sender's bug: a 400)."""
    raw = params.get("peer_fetch") if params else None
    if raw is None:
        return None
    try:
        return msgspec.convert(raw, PeerSource, strict=False)
    except msgspec.ValidationError as e:
        raise InvalidTransfer(f"kv_transfer_params.peer_fetch: {e}") from None


class PeerHoldRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The body of ``POST /kv/peer-hold``."""

    request_id: str
    #: Chained hashes of the blocks wanted, in prompt order (the first one's parent is
    #: ``parent_hash``).
    block_hashes: list[int]
    max_blocks: int = 4096


class PeerFetchHost(Protocol):
    """What peer fetch uses of the worker it runs in (``service.Worker`` is the one
    implementation): its identity and parts, its staging slots and holds, its publisher, and the
    decode pull's blocking steps. Nothing else of the worker is reachable from here."""

    worker_id: str
    state: str
    block_size: int
    hash_config: HashConfig
    engine: AsyncEngine
    kvbm: AsyncKvbm
    plane: TransferPlane
    peers: PeerDirectory
    metrics: WorkerMetrics
    #: The worker's transfer counters (``quarantined_slots`` is shared with the decode pull).
    stats: dict[str, int]

    def publish(self, payload: Event, correlation_id: str | None = None) -> None: ...

    async def publish_acked(self, payload: Event, correlation_id: str | None = None) -> None: ...

    async def staging(self, n: int) -> tuple[list[int] | None, float]: ...

    def free_slots(self, slots: list[int]) -> None: ...

    def hold_slots(self, request_id: str, slots: list[int]) -> Hold: ...

    def transfer_params(self, handoff: Handoff, hashes: list[int], first_tokens: list[int]) -> dict[str, Any]: ...

    def pull_blocking(self, h: DecodeHandoff, local: list[int]) -> TransferResult: ...


class PeerFetch:
    def __init__(self, worker: PeerFetchHost, *, timeout_s: float) -> None:
        self.w = worker
        #: Bound on the holder's answer to ``POST /kv/peer-hold``.
        self.timeout_s = timeout_s
        self.stats = {"peer_holds": 0, "peer_blocks_served": 0, "peer_fetches_ok": 0,
                      "peer_fetches_failed": 0, "peer_blocks_fetched": 0, "peer_bytes_fetched": 0}
        self.last_error = ""

    # -- holder ---------------------------------------------------------------------------------

    async def hold(self, req: PeerHoldRequest) -> dict[str, Any]:
        """Hold the leading run of ``req.block_hashes`` this worker has in host or on the
        device; the params a reader pulls with (no blocks: ``{"blocks": 0, "reason": ...}``)."""
        w = self.w
        if w.state != "serving":
            return {"blocks": 0, "reason": f"worker {w.worker_id} is {w.state}"}
        hashes = req.block_hashes[: max(min(req.max_blocks, w.plane.slots.count), 0)]
        rid = f"peer:{req.request_id}:{uuid.uuid4().hex[:8]}"
        slots = w.plane.slots.allocate(len(hashes)) if hashes else None
        if slots is None:
            # Not enough free slots for all: offer as many as are free (a shorter prefix is
            # still a prefix), never wait (the reader would rather recompute than queue).
            n = min(len(hashes), w.plane.slots.free_count)
            hashes = hashes[:n]
            slots = w.plane.slots.allocate(n) if n else None
        if not slots:
            return {"blocks": 0, "reason": "no free staging slots" if req.block_hashes else "no blocks asked"}
        try:
            cached = getattr(w.engine, "cached_hashes", None)
            found = await w.kvbm.copy_for_peer(hashes, w.plane.slot_rows(slots),
                                               frozenset(cached()) if cached is not None else ())
        except BaseException:
            w.free_slots(slots)
            raise
        if len(found) < len(slots):
            w.free_slots(slots[len(found):])
            slots = slots[: len(found)]
        if not slots:
            return {"blocks": 0, "reason": "none of the blocks is held here"}
        hold = w.hold_slots(rid, slots)
        self.stats["peer_holds"] += 1
        self.stats["peer_blocks_served"] += len(slots)
        handoff = Handoff(request_id=rid, agent_name=w.plane.agent_name, block_ids=slots,
                          expires_at=hold.expires_at)
        params = w.transfer_params(handoff, hashes[: len(slots)], [])
        params["source_tiers"] = [t.value for t in found]
        return params

    # -- reader ---------------------------------------------------------------------------------

    async def fetch(self, request_id: str, src: PeerSource, prompt: list[int]) -> int:
        """Pull the prompt's leading blocks this worker lacks from ``src`` into its host tier.
        Returns the blocks stored (0 after a recorded failure, or when nothing was needed)."""
        w = self.w
        bs = w.block_size
        n_prompt = len(prompt) // bs
        want = min(src.blocks, n_prompt)
        if want <= 0 or src.worker_id == w.worker_id:
            return 0
        hashes = hash_blocks(prompt[: want * bs], w.hash_config)
        cached = getattr(w.engine, "cached_hashes", None)
        on_device = cached() if cached is not None else set()
        tiers = await w.kvbm.lookup(hashes)
        have = 0
        for i, h in enumerate(hashes):
            if h not in on_device and (i >= len(tiers) or tiers[i] not in (Tier.DEVICE, Tier.HOST)):
                break  # missing, or only in a slower local tier: the peer's copy may be cheaper
            have += 1
        if have >= want:
            return 0
        ask = hashes[have:]
        transfer_id = uuid.uuid4().hex
        t0 = time.monotonic()
        common = dict(request_id=request_id, transfer_id=transfer_id, src_worker=src.worker_id,
                      dst_worker=w.worker_id, blocks=len(ask), backend="UCX", purpose=PURPOSE)
        nbytes = len(ask) * w.plane.bytes_per_block
        w.publish(KvTransferStarted(**common, bytes=nbytes), correlation_id=request_id)
        reason: str | None = None
        stored = 0
        try:
            stored, reason = await self._fetch(request_id, src, hashes, have)
        except asyncio.CancelledError:
            w.publish(KvTransferFailed(**common, duration_ms=(time.monotonic() - t0) * 1e3,
                                       reason="request cancelled", fallback="failed"), correlation_id=request_id)
            raise
        except Exception as e:  # the request must still run: recompute
            log.exception("peer fetch of %s from %s failed unexpectedly", request_id, src.worker_id)
            reason = f"{type(e).__name__}: {e}"
        ms = (time.monotonic() - t0) * 1e3
        m = w.metrics
        if reason is None and stored:
            self.stats["peer_fetches_ok"] += 1
            self.stats["peer_blocks_fetched"] += stored
            self.stats["peer_bytes_fetched"] += stored * w.plane.bytes_per_block
            m.labels(m.transfers, "completed").inc()
            m.labels(m.transfer_bytes).inc(stored * w.plane.bytes_per_block)
            await w.publish_acked(KvTransferCompleted(**{**common, "blocks": stored},
                                                      bytes=stored * w.plane.bytes_per_block, duration_ms=ms),
                                  correlation_id=request_id)
            log.info("peer fetch: %d blocks of %s from %s in %.1f ms", stored, request_id, src.worker_id, ms)
            return stored
        reason = reason or "nothing stored"
        self.stats["peer_fetches_failed"] += 1
        self.last_error = reason
        m.labels(m.transfers, "failed").inc()
        await w.publish_acked(KvTransferFailed(**common, duration_ms=ms, reason=reason[:500], fallback="recompute"),
                              correlation_id=request_id)
        log.warning("peer fetch of %s from %s failed (%s): recomputing", request_id, src.worker_id, reason)
        return 0

    async def _fetch(self, request_id: str, src: PeerSource, hashes: list[int], have: int
                     ) -> tuple[int, str | None]:
        w = self.w
        ask = hashes[have:]
        body = msgspec.json.encode(PeerHoldRequest(request_id=request_id, block_hashes=[int(h) for h in ask]))
        headers = {"Content-Type": "application/json", **w.peers.headers(src.worker_id)}
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s) as c:
                r = await c.post(f"http://{src.host}:{src.port}/kv/peer-hold", content=body, headers=headers)
        except httpx.HTTPError as e:
            return 0, f"peer {src.worker_id} unreachable: {type(e).__name__}: {e}"
        if r.status_code != 200:
            return 0, f"peer {src.worker_id} answered {r.status_code}: {r.text[:200]}"
        params = r.json()
        try:
            h = parse_decode_params(params)
        except InvalidTransfer as e:
            return 0, f"peer {src.worker_id} answered bad params: {e}"
        if h is None or not h.blocks:
            return 0, f"peer {src.worker_id} holds none of the blocks: {params.get('reason', '')}"
        why = mismatch(h, ask, block_size=w.block_size, bytes_per_block=w.plane.bytes_per_block)
        if why is not None:
            self._done(h)
            return 0, f"peer {src.worker_id}: {why}"
        local, waited = await w.staging(h.blocks)
        if local is None:
            self._done(h)
            return 0, f"no free staging slots ({h.blocks} needed, waited {waited * 1e3:.0f} ms)"
        quarantine = False
        try:
            try:
                await asyncio.to_thread(w.pull_blocking, h, local)  # the decode pull's steps
            except TransferTimeout as e:
                quarantine = True  # NIXL may still write into these slots: never reuse them
                w.stats["quarantined_slots"] += len(local)
                return 0, f"TransferTimeout: {e}"
            except (TransferError, OSError) as e:
                return 0, f"{type(e).__name__}: {e}"
            rows = w.plane.slot_rows(local)
            parent = hashes[have - 1] if have else None
            blocks = []
            for bh, row in zip(h.block_hashes, rows, strict=True):
                blocks.append((bh, parent, row.copy()))
                parent = bh
            stored = await w.kvbm.store_fetched(blocks, correlation_id=request_id)
            if not stored:
                return 0, "no host slot could take the fetched blocks"
            return stored, None
        finally:
            if not quarantine:
                w.free_slots(local)

    def _done(self, h: DecodeHandoff) -> None:
        try:
            self.w.plane.notify(h.handoff.agent_name, encode_done(h.handoff.request_id))
        except TransferError as e:
            log.warning("done notification to %s failed (its lease frees the blocks): %s",
                        h.handoff.agent_name, e)
