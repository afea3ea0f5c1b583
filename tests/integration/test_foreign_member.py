"""A view survives a foreign member in its consumer group (issue 36, item 1). Another principal of
the same role (the only kind the broker lets into a router view's group: common/log/principals.py)
joins the router view's group and holds partitions. The view's watch sees the short assignment,
says so in its health, and moves to a fresh group seeded with its own positions; a registration
written afterwards is folded."""

from __future__ import annotations

import asyncio

import pytest

from control_plane.router.stream import RouterViewProcessor
from ops.security.probes_bus import steal_group
from control_plane.router.view import RouterView
from common.log.catalog import Catalog
from common.log.kafka import EventProducer
from common.settings import BusSettings
from schemas.events import WorkerRegistered

pytestmark = pytest.mark.kafka

ALGO, BS = "sha256_cbor", 16


def _role(bus: BusSettings, role: str) -> BusSettings:
    return BusSettings.from_env({}, role=role, bootstrap=bus.bootstrap, topic_prefix=bus.topic_prefix,
                                secrets_dir=bus.secrets_dir)


def _register(p: EventProducer, wid: str, port: int) -> None:
    p.publish(WorkerRegistered(worker_id=wid, role="aggregated", pool="default", endpoint=f"http://127.0.0.1:{port}",
                               block_size=BS, hash_algo=ALGO))
    assert p.flush(30) == 0


async def _until(cond, timeout_s: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        assert loop.time() < deadline, what
        await asyncio.sleep(0.1)


async def test_a_foreign_member_is_detected_and_the_view_recovers(bus: BusSettings) -> None:
    _register(EventProducer(bus, "w-a"), "w-a", 18001)
    router = _role(bus, "router")
    view = RouterView(ALGO, BS)
    proc = RouterViewProcessor(router, "r1", view, snapshot_every_s=3600)
    proc.watch_every_s = 1.0
    proc.progress.stall_after_s = 5.0
    await proc.start()
    stop = asyncio.Event()
    thief = None
    try:
        await proc.sync(60)
        assert "w-a" in view.workers
        first_group = proc.group
        cat = Catalog(bus.topic_prefix)
        got: list = []
        thief = asyncio.create_task(steal_group(router, first_group, [cat.topic(s) for s in ("kv", "workers")], got, stop))
        await _until(lambda: proc.recoveries > 0, 60, "the view never noticed the foreign member")
        assert got, "the foreign member was never handed a partition"
        assert proc.group != first_group
        said = proc.health()  # until the next round sees the fresh group follow the whole log
        assert said.state == "DEGRADED" and any("group" in r or "crashed" in r or "stopped" in r
                                                for r in said.reasons), said
        _register(EventProducer(bus, "w-b"), "w-b", 18002)
        await proc.sync(60)
        assert "w-b" in view.workers
        await _until(lambda: proc.stopped_reason() is None, 30, "the view still says it is stopped")
        assert proc.health().state == "EXACT", proc.health()
    finally:
        stop.set()
        if thief is not None:
            await asyncio.wait_for(thief, 30)
        await proc.stop()
