"""The worker-process side of :class:`~data_plane.vllm.connector.SwitchyardKVConnector`: the
worker's own KVBM served to vLLM's engine-core process over a loopback ZMQ socket, with the
host pool in shared memory.

Why the KVBM stays in the worker process (and the connector is only a client): the KVBM's
events must go through the worker's one producer (producer id = worker id, this epoch, dense
per-partition sequences), its persistent tiers are rebuilt from the worker's own history
before the engine starts, and its usage and capacity are what the worker registers and
reports. A second KVBM inside the engine core would need a second producer under the same id,
or a relay of every fact, and a restart path of its own.

Invariants:

* Every residency change is the KVBM's (:mod:`data_plane.kvbm.manager`), so its rule holds
  unchanged: a block is reported in a tier only after its bytes are durably there. A
  :class:`~data_plane.vllm.tier_protocol.Store` is reported ``BlockStored(host)`` after the
  bytes are in the pool (and ``BlockMoved(host->disk)`` after a victim's file is written).
* A host slot named in an :class:`~data_plane.vllm.tier_protocol.Onboarded` reply stays pinned
  (never evicted, never overwritten) until its lease is released, so the engine core reads
  exactly the bytes the KVBM holds for that hash. Leases not released within ``lease_ttl_s``
  (an engine core that died mid-request) are released with a warning.
* A block the KVBM claimed but could not serve (corrupt or missing file, read error, no host
  slot) is dropped from its tier by the KVBM (``BlockRemoved``) and recorded per request as
  ``KvTransferFailed(fallback="recompute")``; vLLM recomputes it (it was never counted).
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np

from data_plane.kvbm.manager import KvBlockManager
from data_plane.vllm import tier_protocol as proto
from common.log.sink import EventSink
from schemas.events import KvTransferFailed
from schemas.types import BlockHash, Tier

log = logging.getLogger(__name__)

#: ``KvTransferFailed.backend`` of a tier load.
BACKEND = "switchyard-kvbm (SwitchyardKVConnector)"


# -- shared host pool ---------------------------------------------------------------------------


class SharedRegion:
    """A file in ``/dev/shm`` (tmpfs) mapped shared: the worker's NIXL region, whose head is the
    KVBM host pool, readable by vLLM's engine-core process at :attr:`path`.

    The file is unlinked once the engine core has mapped it (:meth:`unlink`, after the engine
    started), so nothing is left behind even when the worker is killed; both mappings stay
    valid until their processes exit. Pages are allocated on first touch, like ``np.zeros``.
    """

    def __init__(self, nbytes: int, *, tag: str = "kvbm", directory: str | None = None) -> None:
        if nbytes <= 0:
            raise ValueError("a shared region needs nbytes > 0")
        root = directory or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        self.path = str(Path(root) / f"switchyard-{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}.region")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self._mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.nbytes = nbytes
        #: The whole region (C-contiguous uint8): slot ``s`` of a pool at its head is
        #: ``array[s * bytes_per_block:(s + 1) * bytes_per_block]``.
        self.array = np.frombuffer(self._mm, dtype=np.uint8)
        self._linked = True

    def unlink(self) -> None:
        if self._linked:
            self._linked = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def map_region(path: str, nbytes: int) -> np.ndarray:
    """The engine core's read-only view of a :class:`SharedRegion` (the KVBM alone writes)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise ValueError(f"shared host pool {path} holds {size} bytes, expected {nbytes}")
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    return np.frombuffer(mm, dtype=np.uint8)


# -- the service (no sockets: driven by TierServer and by the unit tests) -----------------------


@dataclass
class _Lease:
    request_id: str
    hashes: list[BlockHash]
    at: float


@dataclass
class TierServiceStats:
    onboards: int = 0
    #: Blocks served to vLLM, by the tier they were found in.
    loaded_by_tier: Counter = field(default_factory=Counter)
    fallbacks: int = 0
    fallback_blocks: int = 0
    stores: int = 0
    blocks_stored: int = 0
    bytes_stored: int = 0
    leases_released: int = 0
    leases_expired: int = 0
    bad_messages: int = 0
    #: Loaded blocks whose bytes in vLLM (read back after the copy) equal what vLLM computed
    #: when they were saved; different; saved before this process knew (a restart's disk).
    loads_verified: int = 0
    loads_mismatched: int = 0
    loads_unverified: int = 0
    #: Blocks saved again (recomputed) with the same bytes as the first time, or not.
    recomputed_same: int = 0
    recomputed_different: int = 0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["loaded_by_tier"] = dict(self.loaded_by_tier)
        return d


class TierService:
    """The KVBM's answers to the connector. Blocking; one caller at a time (the server thread)."""

    def __init__(self, manager: KvBlockManager, sink: EventSink, *, lease_ttl_s: float = 600.0,
                 max_digests: int = 1 << 16, clock: Callable[[], float] = time.monotonic) -> None:
        self.manager = manager
        self._sink = sink
        self.worker_id = manager.settings.worker_id
        self.bytes_per_block = manager.settings.bytes_per_block
        self.lease_ttl_s = lease_ttl_s
        self._clock = clock
        self._leases: dict[str, _Lease] = {}
        #: Digest of each block's bytes as vLLM computed them, newest last (bounded).
        self._digests: OrderedDict[BlockHash, int] = OrderedDict()
        self.max_digests = max_digests
        self.stats = TierServiceStats()

    @property
    def leases(self) -> int:
        return len(self._leases)

    def handle(self, msg: proto.Message, frames: Sequence[memoryview | bytes] = ()) -> proto.Message | None:
        if isinstance(msg, proto.Onboard):
            return self.onboard(msg)
        if isinstance(msg, proto.Release):
            self.release(msg.leases)
        elif isinstance(msg, proto.Store):
            self.store(msg, frames)
        elif isinstance(msg, proto.Loaded):
            self.loaded(msg)
        elif isinstance(msg, proto.LoadFailed):
            self.load_failed(msg)
        else:
            self.stats.bad_messages += 1
            log.warning("tier service: unexpected %s", type(msg).__name__)
        return None

    def onboard(self, msg: proto.Onboard) -> proto.Onboarded:
        t0 = time.monotonic()
        self.release(msg.replaces)
        self._expire()
        hashes = [BlockHash(h) for h in msg.hashes]
        claimed = self.manager.lookup(hashes)
        result = self.manager.onboard(hashes[: len(claimed)], pin=True, correlation_id=msg.request_id)
        if result.pinned:
            self._leases[msg.lease] = _Lease(msg.request_id, list(result.pinned), self._clock())
        blocks = [proto.OnboardedBlock(int(b.block_hash), int(b.host_slot), b.found_in.value)
                  for b in result.blocks if b.host_slot is not None]
        self.stats.onboards += 1
        for b in blocks:
            self.stats.loaded_by_tier[b.tier] += 1
        if len(blocks) < len(claimed):
            first = len(blocks)
            self._fallback(msg.request_id, msg.lease, len(claimed) - first, claimed[first],
                           f"{result.stop_reason}: block {hashes[first]:016x} claimed in "
                           f"{claimed[first].value} could not be read into host "
                           f"({len(claimed) - first} of {len(claimed)} blocks recomputed)",
                           (time.monotonic() - t0) * 1e3)
        return proto.Onboarded(call=msg.call, lease=msg.lease, blocks=blocks, claimed=len(claimed),
                               stop_reason=result.stop_reason)

    def release(self, leases: Sequence[str]) -> None:
        for lease in leases:
            held = self._leases.pop(lease, None)
            if held is not None:
                self.manager.release(held.hashes)
                self.stats.leases_released += 1

    def release_all(self) -> None:
        self.release(list(self._leases))

    def store(self, msg: proto.Store, frames: Sequence[memoryview | bytes]) -> None:
        if len(frames) != len(msg.hashes) or len(msg.parents) != len(msg.hashes):
            self.stats.bad_messages += 1
            log.warning("tier service: store of %d hashes, %d parents, %d frames: ignored",
                        len(msg.hashes), len(msg.parents), len(frames))
            return
        bpb = self.bytes_per_block
        bad = [i for i, f in enumerate(frames) if memoryview(f).nbytes != bpb]
        if bad:
            self.stats.bad_messages += 1
            log.warning("tier service: store frames of %d bytes, blocks are %d: ignored",
                        memoryview(frames[bad[0]]).nbytes, bpb)
            return
        self.manager.on_device_evicted_many(
            [(BlockHash(h), None if p is None else BlockHash(p), f)
             for h, p, f in zip(msg.hashes, msg.parents, frames)])
        for h, d in zip(msg.hashes, msg.digests):
            known = self._digests.get(BlockHash(h))
            if known is not None:
                if known == d:
                    self.stats.recomputed_same += 1
                else:
                    self.stats.recomputed_different += 1
                    log.warning("block %016x recomputed with different bytes than when first saved", h)
            self._remember(BlockHash(h), d)
        self.stats.stores += 1
        self.stats.blocks_stored += len(msg.hashes)
        self.stats.bytes_stored += len(msg.hashes) * bpb

    def _remember(self, h: BlockHash, digest: int) -> None:
        self._digests[h] = digest
        self._digests.move_to_end(h)
        while len(self._digests) > self.max_digests:
            self._digests.popitem(last=False)

    def loaded(self, msg: proto.Loaded) -> None:
        bad = []
        for h, d in zip(msg.hashes, msg.digests):
            known = self._digests.get(BlockHash(h))
            if known is None:
                self.stats.loads_unverified += 1
            elif known == d:
                self.stats.loads_verified += 1
            else:
                self.stats.loads_mismatched += 1
                bad.append(h)
        if bad:
            log.error("request %s: %d loaded blocks differ from what vLLM computed for them (first "
                      "%016x)", msg.request_id, len(bad), bad[0])

    def load_failed(self, msg: proto.LoadFailed) -> None:
        self._fallback(msg.request_id, msg.lease, msg.blocks, Tier.HOST,
                       f"copy into vLLM's blocks failed: {msg.reason}", 0.0)

    def _fallback(self, request_id: str, lease: str, blocks: int, tier: Tier, reason: str,
                  duration_ms: float) -> None:
        self.stats.fallbacks += 1
        self.stats.fallback_blocks += blocks
        log.warning("request %s: %s", request_id, reason)
        self._sink.publish(KvTransferFailed(
            request_id=request_id, transfer_id=lease, src_worker=self.worker_id, dst_worker=self.worker_id,
            blocks=blocks, bytes=blocks * self.bytes_per_block, backend=f"{BACKEND} {tier.value}->device",
            duration_ms=duration_ms, reason=reason[:500], fallback="recompute"), correlation_id=request_id)

    def _expire(self) -> None:
        now = self._clock()
        old = [k for k, v in self._leases.items() if now - v.at > self.lease_ttl_s]
        for k in old:
            log.warning("tier lease %s of request %s not released after %.0f s: releasing it", k,
                        self._leases[k].request_id, self.lease_ttl_s)
            self.stats.leases_expired += 1
        self.release(old)


# -- the socket -----------------------------------------------------------------------------------


class TierServer:
    """A ZMQ ROUTER on 127.0.0.1 (a port picked at bind) driving a :class:`TierService` on its
    own thread. Not asyncio: KVBM calls block on disk and S3 I/O, and the connector's
    scheduler side waits for the onboard reply inside vLLM's scheduling step."""

    def __init__(self, service: TierService, host: str = "127.0.0.1") -> None:
        import zmq

        self.service = service
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvbm-tier-server", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                parts = self._sock.recv_multipart(copy=False)
                # [identity, b"", message, *block frames]
                if len(parts) < 3:
                    self.service.stats.bad_messages += 1
                    continue
                ident = parts[0].bytes
                try:
                    msg = proto.decode(parts[2].buffer)
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    self.service.stats.bad_messages += 1
                    log.warning("tier server: undecodable message: %s", e)
                    continue
                try:
                    reply = self.service.handle(msg, [p.buffer for p in parts[3:]])
                except Exception:
                    # One failed call must not take the tiers away from the engine, nor stall
                    # vLLM's scheduler until its timeout: an onboard that failed is a miss.
                    log.exception("tier server: %s failed", type(msg).__name__)
                    if not isinstance(msg, proto.Onboard):
                        continue
                    reply = proto.Onboarded(call=msg.call, lease=msg.lease, blocks=[], claimed=0,
                                            stop_reason="error")
                if reply is not None:
                    self._sock.send_multipart([ident, b"", proto.encode(reply)])
        except BaseException as e:  # noqa: BLE001 - kept for the worker's debug state
            if not self._stop.is_set():
                self.error = e
                log.exception("tier server stopped")
        finally:
            self._sock.close(0)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self.service.release_all()
