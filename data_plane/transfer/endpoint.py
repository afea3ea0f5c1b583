"""NIXL adapter: one agent per worker process, moving fixed-size blocks of one registered region.

Block-indexed transfers (``read_blocks`` / ``write_blocks``) use NIXL's *prepped* descriptor
lists: the local and each peer's block descriptors are prepared once, and a transfer only names
block indices. NIXL runs with its progress thread off and this class polls instead (on a 2-core
host that was about 3x faster and far less noisy than the progress thread).

Threading: the API is synchronous and blocks while it polls, so an asyncio worker calls it through
``asyncio.to_thread`` (or a dedicated transfer thread). One re-entrant lock serialises every NIXL
call on the agent (NIXL's own thread-sync mode is off), taken per call, not for a whole transfer,
so another thread can still poll notifications while a READ is in flight.

Progress on the *source* side: with the progress thread off, a READ issued by a peer completes
only while the source agent is driven. A holder must therefore call :meth:`NixlEndpoint.
notifications` regularly while peers read from it; that call both drains done notifications
and progresses the transport. Measured here: with an idle source the bytes arrive but the
reader's READ never reports DONE; a holder sleeping 100 us between polls gives about 190 us per
single 64 KiB READ, 20 us about 110 us (``benchmarks/transfer_bench.py``).

Errors: every NIXL exception is translated into :mod:`data_plane.transfer.errors`. A peer whose
process died shows up as :class:`PeerLost` (a refused connection when added, a disconnect when
posting or polling), a peer that is alive but stuck (e.g. SIGSTOP) as :class:`TransferTimeout`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import msgspec
import numpy as np

from data_plane.transfer.errors import InvalidTransfer, PeerLost, TransferError, TransferTimeout
from data_plane.transfer.metadata import BlockRegion, EndpointMetadata, PeerName

logger = logging.getLogger(__name__)

#: Tight polling for this long after posting, then back off (so a long transfer does not burn a
#: core and starve the worker's other threads of the GIL).
DEFAULT_SPIN_S = 0.002
#: Longest sleep between two polls once backed off.
DEFAULT_MAX_SLEEP_S = 0.0002


class TransferResult(msgspec.Struct, frozen=True, kw_only=True):
    """One finished transfer. ``duration_s`` runs from creating the request to seeing DONE."""

    bytes: int
    blocks: int
    duration_s: float

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (10^9 bytes per second)."""
        return self.bytes / self.duration_s / 1e9 if self.duration_s > 0 else float("inf")


@dataclass
class _Peer:
    name: PeerName
    metadata: EndpointMetadata
    #: Prepped descriptor list of the peer's blocks (``prep_xfer_dlist(peer, ...)``).
    dlist: object
    #: Transfers using ``dlist`` right now; a removed peer's dlist is freed when this drops to 0.
    inflight: int = 0
    removed: bool = False


def _block_descs(region: BlockRegion) -> np.ndarray:
    """Nx3 ``(addr, len, dev_id)`` rows, block ``i`` at ``base + i * block_len``."""
    descs = np.empty((region.n_blocks, 3), dtype=np.uint64)
    descs[:, 0] = region.base_addr + np.arange(region.n_blocks, dtype=np.uint64) * region.block_len
    descs[:, 1] = region.block_len
    descs[:, 2] = region.dev_id
    return descs


def _nixl_api():
    """Import NIXL only when an endpoint is built, so the pure modules never need it."""
    try:
        import nixl._api as api
        import nixl._bindings as bindings
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise TransferError(f"NIXL is not importable: {exc}") from exc
    return api, bindings


class NixlEndpoint:
    """A NIXL agent owning one registered block region.

    ``name`` must be unique among the agents that will ever meet: use one per worker
    incarnation, e.g. ``f"{worker_id}:{epoch}"``, so a restarted worker is a new peer.
    ``keepalive`` is kept referenced for the endpoint's lifetime (the array behind ``region``).
    """

    def __init__(
        self,
        name: str,
        region: BlockRegion,
        *,
        keepalive: object = None,
        backends: Sequence[str] = ("UCX",),
        spin_s: float = DEFAULT_SPIN_S,
        max_sleep_s: float = DEFAULT_MAX_SLEEP_S,
    ) -> None:
        api, self._bindings = _nixl_api()
        self.name = name
        self.region = region
        self._keepalive = keepalive
        self._spin_s = spin_s
        self._max_sleep_s = max_sleep_s
        self._lock = threading.RLock()
        # Signalled when a transfer ends, so close() can wait for in-flight ones to abort.
        self._transfer_ended = threading.Condition(self._lock)
        self._inflight = 0
        self._peers: dict[PeerName, _Peer] = {}
        self._lost: set[PeerName] = set()
        # Handles NIXL refused to release (a transfer it could not cancel); kept referenced so
        # their memory is not reused under a live transfer, retried on close.
        self._stuck: list[object] = []
        self._closed = False
        # UCX listens on every interface unless told otherwise (it found eth0 when a test built
        # an endpoint in-process). Loopback by default; a process that serves other hosts sets
        # UCX_NET_DEVICES itself (the worker wiring sets "all" when it binds off loopback).
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
        with self._nixl_errors("create agent"):
            config = api.nixl_agent_config(
                enable_prog_thread=False, enable_listen_thread=False, backends=list(backends)
            )
            self._agent = api.nixl_agent(name, config)
            missing = [b for b in backends if b not in self._agent.backends]
            if missing:
                raise TransferError(f"NIXL backend(s) {missing} did not load for agent {name!r}")
            self._reg = self._agent.register_memory(
                [(region.base_addr, region.nbytes, region.dev_id, "")], region.mem_type
            )
            self._local = self._agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", _block_descs(region), region.mem_type
            )
            self._metadata = EndpointMetadata(
                agent_name=name,
                agent_metadata=self._agent.get_agent_metadata(),
                region=region,
                backend=backends[0],
            )

    @classmethod
    def from_array(cls, name: str, array: np.ndarray, block_len: int, **kwargs) -> NixlEndpoint:
        """An endpoint over a C-contiguous numpy array cut into ``block_len``-byte blocks."""
        if not array.flags.c_contiguous:
            raise InvalidTransfer("the array must be C-contiguous")
        if block_len <= 0 or array.nbytes % block_len:
            raise InvalidTransfer(f"{array.nbytes} bytes do not split into {block_len}-byte blocks")
        region = BlockRegion(
            base_addr=array.ctypes.data, block_len=block_len, n_blocks=array.nbytes // block_len
        )
        return cls(name, region, keepalive=array, **kwargs)

    # ---------------------------------------------------------------------------------------
    # Peers
    # ---------------------------------------------------------------------------------------

    def metadata(self) -> EndpointMetadata:
        """What peers need to reach this endpoint (``.encode()`` for the wire,
        ``.to_transfer_info()`` for ``WorkerRegistered``)."""
        return self._metadata

    def add_peer(self, metadata: EndpointMetadata | bytes) -> PeerName:
        """Load a peer's metadata and prepare its block descriptors. Idempotent for the same
        metadata; new metadata under a known name replaces the old peer.

        Raises :class:`PeerLost` when the peer cannot be reached (NIXL connects here, holding
        the endpoint's lock meanwhile), and :class:`InvalidTransfer` when its blocks are not the
        size of ours.
        """
        md = (
            metadata
            if isinstance(metadata, EndpointMetadata)
            else EndpointMetadata.decode(metadata)
        )
        if md.region.block_len != self.region.block_len:
            raise InvalidTransfer(
                f"peer {md.agent_name!r} has {md.region.block_len}-byte blocks, ours are "
                f"{self.region.block_len}: block-to-block transfers need equal sizes"
            )
        with self._lock:
            self._check_open()
            name = PeerName(md.agent_name)
            known = self._peers.get(name)
            if known is not None:
                if known.metadata == md:
                    return name
                if known.inflight:
                    raise InvalidTransfer(f"peer {name!r} changed metadata under live transfers")
                self.remove_peer(name)
            try:
                with self._nixl_errors(f"add peer {name!r}"):
                    loaded = self._agent.add_remote_agent(md.agent_metadata)
            except TransferError as exc:
                # NIXL connects while loading: a backend error here is a refused connection.
                if isinstance(exc.__cause__, self._bindings.nixlBackendError):
                    raise PeerLost(f"peer {name!r} is unreachable: {exc}") from exc.__cause__
                raise
            loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
            if loaded != name:
                self._invalidate(PeerName(loaded))
                raise InvalidTransfer(f"metadata for {name!r} describes agent {loaded!r}")
            try:
                with self._nixl_errors(f"prepare peer {name!r}"):
                    dlist = self._agent.prep_xfer_dlist(
                        name, _block_descs(md.region), md.region.mem_type
                    )
            except TransferError:
                self._invalidate(name)
                raise
            self._peers[name] = _Peer(name=name, metadata=md, dlist=dlist)
            self._lost.discard(name)
            return name

    def remove_peer(self, peer: str) -> None:
        """Forget a peer (its worker deregistered). Unknown peers are ignored. Transfers to it
        already in flight in other threads go on; its descriptors are freed after the last."""
        with self._lock:
            known = self._peers.pop(PeerName(peer), None)
            if known is not None:
                known.removed = True
                if known.inflight == 0:
                    self._free_peer(known)

    def peers(self) -> list[PeerName]:
        with self._lock:
            return list(self._peers)

    # ---------------------------------------------------------------------------------------
    # Transfers
    # ---------------------------------------------------------------------------------------

    def read_blocks(
        self,
        peer: str,
        remote_block_ids: Sequence[int] | np.ndarray,
        local_block_ids: Sequence[int] | np.ndarray,
        notif: bytes = b"",
        timeout: float = 10.0,
    ) -> TransferResult:
        """Copy the peer's ``remote_block_ids[i]`` into our ``local_block_ids[i]`` (NIXL READ).

        ``notif`` is delivered to the peer once the data has landed here (the done message of
        :mod:`data_plane.transfer.protocol`). Blocks until DONE; raises :class:`PeerLost`,
        :class:`TransferTimeout` (after ``timeout`` seconds) or :class:`TransferError`.
        """
        return self._transfer("READ", peer, remote_block_ids, local_block_ids, notif, timeout)

    def write_blocks(
        self,
        peer: str,
        remote_block_ids: Sequence[int] | np.ndarray,
        local_block_ids: Sequence[int] | np.ndarray,
        notif: bytes = b"",
        timeout: float = 10.0,
    ) -> TransferResult:
        """Copy our ``local_block_ids[i]`` into the peer's ``remote_block_ids[i]`` (NIXL WRITE).

        Same argument order as :meth:`read_blocks` (remote ids first); the direction is the
        method's. ``notif`` reaches the peer after the data has landed there.
        """
        return self._transfer("WRITE", peer, remote_block_ids, local_block_ids, notif, timeout)

    def notifications(self) -> dict[PeerName, list[bytes]]:
        """Notifications received since the last call, per sending peer. Also drives the
        transport: a holder must call it regularly while peers read from it."""
        with self._lock:
            self._check_open()
            with self._nixl_errors("get notifications"):
                notifs = self._agent.get_new_notifs()
        return {
            PeerName(k.decode() if isinstance(k, bytes) else k): list(v) for k, v in notifs.items()
        }

    def send_notif(self, peer: str, msg: bytes) -> None:
        """Send a standalone notification (not bound to a transfer)."""
        with self._lock:
            known = self._peer(peer)
            try:
                with self._nixl_errors(f"notify {peer!r}"):
                    self._agent.send_notif(known.name, msg)
            except PeerLost:
                self._lose(known.name)
                raise

    def close(self, wait_s: float = 5.0) -> None:
        """Release every handle, forget every peer, deregister the region. Idempotent.

        Transfers in flight in other threads abort at their next poll (TransferError); close
        waits up to ``wait_s`` for them to release their requests first.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not self._transfer_ended.wait_for(lambda: self._inflight == 0, timeout=wait_s):
                logger.warning(
                    "closing %s with %d transfers still in flight", self.name, self._inflight
                )
            for name in list(self._peers):
                self.remove_peer(name)
            for handle in self._stuck:
                self._release_quietly(handle, "stuck transfer")
            self._stuck.clear()
            self._release_quietly(self._local, "local dlist")
            try:
                self._agent.deregister_memory(self._reg)
            except Exception as exc:
                logger.warning("deregistering %s failed: %r", self.name, exc)
            del self._agent
            self._keepalive = None

    def __enter__(self) -> NixlEndpoint:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ---------------------------------------------------------------------------------------
    # Internals
    # ---------------------------------------------------------------------------------------

    def _transfer(self, op, peer, remote_ids, local_ids, notif, timeout) -> TransferResult:
        remote = self._checked_ids(remote_ids, "remote")
        local = self._checked_ids(local_ids, "local")
        if len(remote) != len(local):
            raise InvalidTransfer(f"{len(remote)} remote block ids but {len(local)} local ones")
        if len(remote) == 0:
            raise InvalidTransfer("a transfer needs at least one block")
        if local.max() >= self.region.n_blocks:
            raise InvalidTransfer(
                f"local block id {int(local.max())} out of range for {self.region.n_blocks}"
            )
        with self._lock:
            known = self._peer(peer)
            n_remote = known.metadata.region.n_blocks
            if remote.max() >= n_remote:
                raise InvalidTransfer(
                    f"remote block id {int(remote.max())} out of range for {n_remote}"
                )
            known.inflight += 1
            self._inflight += 1

        start = time.perf_counter()
        deadline = start + timeout
        spin_until = start + self._spin_s
        sleep_s = 1e-5
        handle = None
        lost = False
        what = f"{op} of {len(remote)} blocks with {peer!r}"
        try:
            with self._lock, self._nixl_errors(what):
                handle = self._agent.make_prepped_xfer(
                    op, self._local, local, known.dlist, remote, notif_msg=notif
                )
                state = self._agent.transfer(handle)
            while state == "PROC":
                now = time.perf_counter()
                if now >= deadline:
                    raise TransferTimeout(f"{what} not done after {timeout:.3f}s")
                if now >= spin_until:
                    time.sleep(sleep_s)
                    sleep_s = min(sleep_s * 2, self._max_sleep_s)
                with self._lock, self._nixl_errors(what):
                    if self._closed:
                        raise TransferError(f"{what}: endpoint closed during the transfer")
                    state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(f"{what} failed ({state})")
            duration = time.perf_counter() - start
        except PeerLost:
            lost = True
            raise
        finally:
            with self._lock:
                # The request goes before the peer's descriptor list it points into.
                if handle is not None:
                    self._release_transfer(handle)
                known.inflight -= 1
                self._inflight -= 1
                if known.removed and known.inflight == 0:
                    self._free_peer(known)
                if lost:
                    self._lose(known.name)
                self._transfer_ended.notify_all()
        return TransferResult(
            bytes=len(remote) * self.region.block_len, blocks=len(remote), duration_s=duration
        )

    @staticmethod
    def _checked_ids(ids, side: str) -> np.ndarray:
        arr = np.asarray(ids)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise InvalidTransfer(f"{side} block ids must be a flat sequence of integers")
        if arr.size and arr.min() < 0:
            raise InvalidTransfer(f"negative {side} block id {int(arr.min())}")
        return arr.astype(np.int32, copy=False)

    def _peer(self, peer: str) -> _Peer:
        self._check_open()
        known = self._peers.get(PeerName(peer))
        if known is None:
            if peer in self._lost:
                raise PeerLost(f"peer {peer!r} was lost")
            raise InvalidTransfer(f"unknown peer {peer!r}: add_peer its metadata first")
        return known

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidTransfer(f"endpoint {self.name!r} is closed")

    def _release_transfer(self, handle) -> None:
        with self._lock:
            try:
                handle.release()
            except Exception as exc:
                # NIXL could not cancel an active transfer: keep the handle so the memory
                # under it is not reused before close() retries.
                logger.warning("transfer handle of %s not released: %r", self.name, exc)
                self._stuck.append(handle)

    def _release_quietly(self, handle, what: str) -> None:
        try:
            handle.release()
        except Exception as exc:
            logger.warning("releasing %s of %s failed: %r", what, self.name, exc)

    def _free_peer(self, known: _Peer) -> None:
        self._release_quietly(known.dlist, "peer dlist")
        self._invalidate(known.name)

    def _invalidate(self, name: PeerName) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except Exception as exc:
            logger.debug("removing remote agent %s from %s: %r", name, self.name, exc)

    def _lose(self, name: PeerName) -> None:
        """Forget a peer whose process is gone; later calls naming it raise PeerLost."""
        with self._lock:
            self.remove_peer(name)
            self._lost.add(name)

    def _translate(self, exc: BaseException, what: str) -> TransferError:
        if isinstance(exc, TransferError):
            return exc
        if isinstance(exc, self._bindings.nixlRemoteDisconnectError):
            return PeerLost(f"{what}: peer disconnected ({exc})")
        return TransferError(f"{what}: {type(exc).__name__}: {exc}")

    @contextmanager
    def _nixl_errors(self, what: str) -> Iterator[None]:
        """Translate NIXL's exceptions; anything else (a bug here) propagates untouched."""
        try:
            yield
        except TransferError:
            raise
        except Exception as exc:
            if not _is_nixl_error(exc):
                raise
            raise self._translate(exc, what) from exc


def _is_nixl_error(exc: BaseException) -> bool:
    # The bindings raise their own classes (nixlBackendError, ...); agent creation raises a
    # RuntimeError when no plugin loads.
    return type(exc).__module__.startswith("nixl") or type(exc) is RuntimeError
