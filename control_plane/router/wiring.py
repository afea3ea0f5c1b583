"""One wiring function for the router process: settings -> running FastAPI app."""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from control_plane.bus.kafka import EventProducer
from control_plane.index.hashing import HashAlgo, HashConfig
from control_plane.router.core import Router
from control_plane.router.health import HealthThresholds
from control_plane.router.service import RouterApp, RouterMetrics, create_app
from control_plane.routing import RouterConfig
from control_plane.settings import BusSettings
from control_plane.streams.router_view import RouterViewProcessor
from control_plane.tokenizer import build_tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterSettings:
    """Everything one router replica needs; built once at start-up."""

    #: Replica id: names its consumer group and appears in every decision it records.
    router_id: str = field(default_factory=lambda: f"router-{socket.gethostname()}-{os.getpid()}")
    host: str = "127.0.0.1"
    port: int = 8000
    #: Routing mode and weights; a JSON/TOML file overrides the defaults (RouterConfig fields).
    mode: str = "kv"
    config_file: Path | None = None
    #: Prefix-hash algorithm and block size the engines use (the index refuses others).
    hash_algo: str = "sha256"
    block_size: int = 64
    tokenizer: str = "hash"
    served_model: str = "switchyard-sim"
    #: Seconds between index checkpoints to the snapshots topic.
    snapshot_every_s: float = 5.0
    max_attempts: int = 3
    read_timeout_s: float = 60.0
    thresholds: HealthThresholds = HealthThresholds()


def load_router_config(s: RouterSettings) -> RouterConfig:
    raw: dict = {"version": 1, "mode": s.mode}
    if s.config_file:
        text = Path(s.config_file).read_bytes()
        raw.update(msgspec.toml.decode(text) if str(s.config_file).endswith(".toml") else msgspec.json.decode(text))
    return msgspec.convert(raw, RouterConfig)


def build_router(s: RouterSettings, bus: BusSettings) -> RouterApp:
    hash_config = HashConfig(HashAlgo(s.hash_algo), s.block_size)
    config = load_router_config(s)
    view = RouterViewProcessor.load_view(bus, hash_config.hash_algo, s.block_size)
    processor = RouterViewProcessor(bus, s.router_id, view, snapshot_every_s=s.snapshot_every_s,
                                    thresholds=s.thresholds)
    producer = EventProducer(bus, s.router_id)
    metrics = RouterMetrics()
    router = Router(router_id=s.router_id, view=view, producer=producer, config=config, hash_config=hash_config,
                    health=processor.health, max_attempts=s.max_attempts, read_timeout_s=s.read_timeout_s,
                    metrics=metrics)

    async def start() -> None:
        import asyncio

        from control_plane.router.orphans import close_orphans

        await asyncio.to_thread(close_orphans, bus, producer)
        await processor.start()
        log.info("router %s serving on %s:%d (mode %s, view at %d records)", s.router_id, s.host, s.port,
                 config.mode, view.applied)

    async def stop() -> None:
        await processor.checkpoint()
        await processor.stop()
        await router.close()
        producer.close(10)

    return RouterApp(router=router, tokenizer=build_tokenizer(s.tokenizer), metrics=metrics,
                     served_model=s.served_model, health=processor.health, start=start, stop=stop)


def run_router(s: RouterSettings, bus: BusSettings) -> None:
    import uvicorn

    app = create_app(build_router(s, bus))
    uvicorn.run(app, host=s.host, port=s.port, loop="asyncio", log_level="warning", access_log=False)
