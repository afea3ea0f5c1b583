"""The one wiring function of a worker process, and its main loop.

Start-up, in this order (each step's events go through the one producer, under the new epoch):

1. Bind the HTTP socket (a port in use fails here, before anything is published).
2. Read this worker's own history from the log (:mod:`.history`): the new epoch is above every
   earlier one; its past KV events give the persistent residency the log claims.
3. Build the producer (``producer_id = worker_id``, the new epoch), the NIXL region (host pool +
   staging slots) and its endpoint ``"<worker_id>:<epoch>"``, and the KVBM over that host pool.
4. ``rebuild``: verify every claimed disk/object block; missing or corrupt ones are reported
   ``BlockRemoved``, unclaimed files deleted.
5. ``AllBlocksCleared(device)``, ``AllBlocksCleared(host)``: this incarnation's memory is empty;
   then one ``BlockStored`` per verified disk/object block (parent None), so the new epoch's
   events alone state the whole residency (a fold that fences the old epoch still agrees).
6. ``WorkerRegistered`` (role, pool, endpoint, capacities, block size, hash algorithm, NIXL
   metadata), flushed to the broker; then serve. ``READY <url> epoch=<n>`` goes to stdout.

SIGTERM/SIGINT drain (:meth:`Worker.drain`): ``/health`` turns 503, new requests get 503,
in-flight ones finish, ``WorkerDraining`` then ``WorkerDeregistered``, flush, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
import socket
import sys
import time

import numpy as np

from data_plane.engines import AsyncEngine, EngineCore, default_hash_config, load_profile
from data_plane.kvbm import AsyncKvbm, build_kvbm, claimed_persistent
from data_plane.vllm.serving import VllmServingEngine
from data_plane.workers.history import OwnHistory, next_epoch, read_own_history
from data_plane.workers.metrics import WorkerMetrics
from data_plane.workers.onboard import KvbmTiers
from data_plane.workers.peers import PeerDirectory
from data_plane.workers.service import Worker
from data_plane.workers.settings import WorkerSettings
from data_plane.workers.transfer import TransferPlane
from common.log.kafka import EventProducer
from common.settings import BusSettings, worker_credential, worker_token
from common.tokenizer import HashTokenizer
from schemas.events import AllBlocksCleared, BlockStored, WorkerRegistered
from schemas.types import Tier, WorkerRole

log = logging.getLogger(__name__)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket for the worker's server. The protocol is named (IPPROTO_TCP, not
    0): asyncio turns TCP_NODELAY on for accepted connections only when the listener's proto
    is IPPROTO_TCP, and without it every response waited ~40 ms for a delayed ACK."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _log_offload_error(fut) -> None:  # noqa: ANN001 - concurrent.futures.Future
    exc = fut.exception()
    if exc is not None:
        log.error("offloading an evicted block failed: %r", exc)


async def build_worker(s: WorkerSettings, bus: BusSettings, endpoint_url: str, credential: str | None = None) -> Worker:
    """Steps 2-6 of the module docstring; returns a worker ready to :meth:`Worker.start`.
    ``credential``: the cluster's worker secret, from which its calls to peers derive their
    bearers."""
    wid = s.worker_id
    history = await asyncio.to_thread(read_own_history, bus, wid) if s.read_history else OwnHistory()
    epoch = next_epoch(time.time_ns() // 1_000_000, history.last_epoch)
    producer = EventProducer(bus, wid, epoch)

    if s.engine == "vllm":
        real = VllmServingEngine(s.vllm, worker_id=wid, sink=producer)
        block_size, hash_config = real.block_size, real.hash_config
    else:
        real = None
        profile = load_profile(s.profile)
        overrides = {k: v for k, v in (("block_size", s.block_size), ("num_device_blocks", s.device_blocks))
                     if v is not None}
        if overrides:
            profile = profile.replace(**overrides)
        block_size = profile.block_size
        hash_config = default_hash_config(profile.block_size)

    # vLLM with SwitchyardKVConnector: the tiers hold vLLM's real blocks, of the model's size.
    bpb = real.kv_bytes_per_block if real is not None and real.uses_tiers else s.bytes_per_block
    # Staging sized from the pool: the simulated engine's device blocks (vLLM moves its own KV
    # through its NixlConnector, so its staging only needs the old fixed default).
    device_blocks = profile.num_device_blocks if real is None else 1024
    staging = s.staging_blocks(device_blocks)
    nbytes = s.region_blocks(device_blocks) * bpb
    # Under the switchyard connector the region is shared memory: vLLM's engine core reads the
    # host pool at its head.
    region = real.allocate_region(nbytes) if real is not None else np.zeros(nbytes, dtype=np.uint8)
    manager = build_kvbm(s.kvbm_settings(block_size=block_size, hash_algo=hash_config.hash_algo,
                                         bytes_per_block=bpb),
                         producer, host_buffer=region[: s.host_blocks * bpb] if s.host_blocks else None)
    kvbm = AsyncKvbm(manager)
    # UCX (under NIXL) keeps to loopback unless told otherwise (data_plane/transfer/endpoint.py):
    # a worker bound off loopback serves other hosts, so its transfers may use every interface.
    # An explicit UCX_NET_DEVICES (or vLLM's --vllm-ucx-net-devices, set before this) wins.
    if not _is_loopback(s.host):
        os.environ.setdefault("UCX_NET_DEVICES", "all")
    plane = TransferPlane(f"{wid}:{epoch}", region, bpb, staging_first=s.host_blocks,
                          staging_count=staging)

    report = await kvbm.rebuild(claimed_persistent(history.kv_events, wid))
    for tier in (Tier.DISK, Tier.OBJECT):
        if report.verified.get(tier) or report.removed(tier):
            log.info("rebuilt %s: %d blocks verified, %d removed", tier.value,
                     len(report.verified.get(tier, [])), len(report.removed(tier)))
    producer.publish(AllBlocksCleared(worker_id=wid, tier=Tier.DEVICE))
    producer.publish(AllBlocksCleared(worker_id=wid, tier=Tier.HOST))
    # Re-announce what survived, under the new epoch (stores are idempotent upserts): then this
    # incarnation's own events state its whole residency, and any fold of the log agrees with
    # it, even one that meets the new epoch before the old one's stores and fences them.
    for tier in (Tier.DISK, Tier.OBJECT):
        for h in report.verified.get(tier, []):
            producer.publish(BlockStored(worker_id=wid, tier=tier, block_hashes=[h], block_size=block_size,
                                         hash_algo=hash_config.hash_algo))

    # The engine evicts inside a step, on the loop: gather one step's evictions and hand them to
    # the KVBM as one call once the step is over (one merged event per tier pair, not per block).
    evicted: list[tuple[int, int | None]] = []

    def flush_offloads() -> None:
        batch = evicted[:]
        evicted.clear()
        if batch:
            kvbm.submit_device_evicted_many(batch).add_done_callback(_log_offload_error)

    def offload(block_hash, parent_hash) -> None:  # noqa: ANN001 - the engine's EvictHook
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # stepped outside the loop (never in a serving worker): no batching
            kvbm.submit_device_evicted(block_hash, parent_hash).add_done_callback(_log_offload_error)
            return
        if not evicted:
            loop.call_soon(flush_offloads)
        evicted.append((block_hash, parent_hash))

    if real is not None:
        # Started before registering: nothing is routed here until vLLM serves, and its KV
        # events (bridged under this epoch) come after the clears above. Its connector reaches
        # the KVBM rebuilt above (switchyard connector only).
        real.attach_kvbm(manager, s.host_blocks)
        await real.start()
        engine = real
        device_blocks, engine_name = real.num_blocks, real.name
    else:
        # The engine onboards prefixes the KVBM holds (host, disk, object) when loading them is
        # cheaper than recomputing them (data_plane/engines/tiers.py).
        tiers = KvbmTiers(manager) if manager.capacity() else None
        core = EngineCore(profile, worker_id=wid, role=s.role, hash_config=hash_config, on_evict=offload,
                          tiers=tiers)
        engine = AsyncEngine(core, speedup=s.speedup, sink=producer)
        device_blocks, engine_name = profile.num_device_blocks, profile.name
    peers = PeerDirectory(on_forget=plane.endpoint.remove_peer, credential=credential)
    if s.role is not WorkerRole.PREFILL:
        peers.follow(bus)

    producer.publish(WorkerRegistered(
        worker_id=wid, role=s.role, pool=s.pool, endpoint=endpoint_url, model=s.model,
        capacity={Tier.DEVICE.value: device_blocks, **manager.capacity()},
        block_size=block_size, hash_algo=hash_config.hash_algo,
        transfer=plane.metadata().to_transfer_info()))
    left = await asyncio.to_thread(producer.flush, 30)
    if left:
        raise RuntimeError(f"{left} start-up events not acknowledged by the broker")
    log.info("worker %s epoch %d registered as %s in pool %s at %s (engine %s, %d device blocks of %d "
             "tokens, tiers %s)", wid, epoch, s.role.value, s.pool, endpoint_url, engine_name,
             device_blocks, block_size, manager.capacity())
    return Worker(s, epoch=epoch, endpoint_url=endpoint_url, producer=producer, engine=engine,
                  kvbm=kvbm, plane=plane, peers=peers, hash_config=hash_config,
                  metrics=WorkerMetrics(s.model, wid))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run_worker(s: WorkerSettings, bus: BusSettings) -> int:
    """Run one worker until it is drained by a signal; returns the exit code."""
    return asyncio.run(_main(s, bus))


async def _main(s: WorkerSettings, bus: BusSettings) -> int:
    import uvicorn

    # lazy: start-up time: loads fastapi, pydantic only when called
    from data_plane.workers.app import create_app
    # lazy: start-up time: loads uvicorn only when called
    from common.http_server import server_config

    class _Server(uvicorn.Server):
        # The worker owns SIGTERM/SIGINT: it drains first (503 on /health while in-flight
        # requests finish), then tells the server to exit.
        @contextlib.contextmanager
        def capture_signals(self):
            yield

    try:
        sock = bind_socket(s.host, s.port)
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", s.host, s.port, e)
        return 1
    endpoint_url = f"http://{s.host}:{sock.getsockname()[1]}"
    secret = worker_credential(bus.secrets_dir)
    worker = await build_worker(s, bus, endpoint_url, secret)
    app = create_app(worker, HashTokenizer(), credential=worker_token(secret, s.worker_id), limits=s.limits,
                     open_generation=s.open_generation)
    server = _Server(server_config(app, s.host, sock.getsockname()[1], lifespan="off"))
    loop = asyncio.get_running_loop()
    drain_task: asyncio.Task | None = None

    async def drain_then_exit(sig_name: str) -> None:
        try:
            await worker.drain(sig_name)
        finally:
            server.should_exit = True

    def on_signal(sig: signal.Signals) -> None:
        nonlocal drain_task
        if drain_task is None:
            log.info("%s: draining", sig.name)
            drain_task = asyncio.create_task(drain_then_exit(sig.name))
        elif sig is signal.SIGINT:
            server.force_exit = True
            server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    await worker.start()
    print(f"READY {endpoint_url} epoch={worker.epoch}", flush=True)
    try:
        await server.serve(sockets=[sock])
    finally:
        if drain_task is not None:
            await drain_task
        if worker.state != "stopped":
            await worker.stop("server exited")
    return 0


if __name__ == "__main__":  # pragma: no cover - use `switchyard worker`
    sys.exit("run `switchyard worker --help`")
