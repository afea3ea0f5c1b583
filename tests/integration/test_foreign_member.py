"""No foreign member can take a router view's partitions (issue 36, item 1). The view follows
every partition by assignment, in no consumer group (control_plane/streaming.py
``TailProcessor``): a member of any group, even one joined with the router's own credential
under the very group id the view's consumer names, is handed partitions of that group and
takes nothing from the view, which stays EXACT and folds a registration written afterwards."""

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


async def test_a_foreign_member_takes_nothing_from_the_view(bus: BusSettings) -> None:
    _register(EventProducer(bus, "w-a"), "w-a", 18001)
    router = _role(bus, "router")
    view = RouterView(ALGO, BS)
    proc = RouterViewProcessor(router, "r1", view, snapshot_every_s=3600)
    proc.watch_every_s = 0  # its rounds are run below, with the foreign member in its group
    await proc.start()
    stop = asyncio.Event()
    thief = None
    try:
        await proc.sync(60)
        assert "w-a" in view.workers
        every = proc.assigned()
        cat = Catalog(bus.topic_prefix)
        assert every == {(t, p) for (t, p) in (await proc.log_end())}, every
        got: list = []
        thief = asyncio.create_task(steal_group(router, proc.tail_group, [cat.topic(s) for s in ("kv", "workers")],
                                                got, stop))
        await _until(lambda: bool(got) or thief.done(), 60, "the foreign member was never handed a partition")
        if thief.done():
            thief.result()  # raises what stopped it
        _register(EventProducer(bus, "w-b"), "w-b", 18002)
        await proc.sync(60)
        assert "w-b" in view.workers
        for _ in range(2):
            await proc.watch()
        assert proc.assigned() == every
        assert proc.recoveries == 0 and proc.stopped_reason() is None
        assert proc.health().state == "EXACT", proc.health()
    finally:
        stop.set()
        if thief is not None:
            await asyncio.wait_for(thief, 30)
        await proc.stop()
