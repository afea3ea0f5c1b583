"""The router's view, following the real broker's log, equals the oracle fold of the log; a
restart from snapshot + tail gets back to the same view."""

from __future__ import annotations

import pytest

from control_plane.replay.oracle import oracle_view
from control_plane.router.stream import RouterViewProcessor
from control_plane.router.view import RouterView
from control_plane.router.wiring import RouterSettings, view_fetch
from common.log.catalog import Catalog
from common.log.kafka import EventProducer
from common.settings import BusSettings
from schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, WorkerLoadReported, WorkerRegistered
from tests.support.waits import until

pytestmark = pytest.mark.kafka

ALGO, BS = "sha256_cbor", 16


def _register(p: EventProducer, wid: str) -> None:
    p.publish(WorkerRegistered(worker_id=wid, role="aggregated", pool="default", endpoint="http://127.0.0.1:9",
                               capacity={"device": 1000}, block_size=BS, hash_algo=ALGO))


def _traffic(producers: dict[str, EventProducer], rounds: int, base: int) -> None:
    for r in range(rounds):
        for i, (wid, p) in enumerate(producers.items()):
            chain = [base + r * 100 + k for k in range(8)]
            p.publish(BlockStored(worker_id=wid, tier="device", block_hashes=chain, block_size=BS, hash_algo=ALGO))
            if r % 3 == 2:
                p.publish(BlockRemoved(worker_id=wid, tier="device", block_hashes=chain[4:]))
            if r % 5 == 4:
                p.publish(WorkerLoadReported(worker_id=wid, running=r, waiting=i, tier_usage={"device": 0.1}))
        if r == rounds // 2:
            first = next(iter(producers))
            producers[first].publish(AllBlocksCleared(worker_id=first))
    for p in producers.values():
        assert p.flush(30) == 0


def _workers_then_poison(bus: BusSettings, rounds: int) -> dict[str, EventProducer]:
    """Three registered workers, ``rounds`` of traffic, then a record no decoder reads on the kv
    stream (poison: dead-lettered, the fold continues); the producers, by worker id."""
    producers = {w: EventProducer(bus, w) for w in ("w-a", "w-b", "w-c")}
    for w, p in producers.items():
        _register(p, w)
    _traffic(producers, rounds=rounds, base=0)
    producers["w-a"].produce_raw(Catalog(bus.topic_prefix).topic("kv"), b"garbage", b"w-a")
    assert producers["w-a"].flush(10) == 0
    return producers


def oracle(bus: BusSettings, algo: str = ALGO, block_size: int = BS,
           upto: dict[tuple[str, int], int] | None = None) -> RouterView:
    """The oracle fold of the log (control_plane/replay/oracle.py), with this module's defaults."""
    return oracle_view(bus, algo, block_size, upto=upto)


async def test_view_converges_to_oracle_and_restarts_from_snapshot_plus_tail(bus: BusSettings) -> None:
    producers = _workers_then_poison(bus, rounds=30)
    # And a refused event (another hash algorithm): dead-lettered too, the fold continues.
    producers["w-b"].publish(BlockStored(worker_id="w-b", tier="device", block_hashes=[999], block_size=BS,
                                         hash_algo="xxhash"))
    assert producers["w-b"].flush(10) == 0

    view = RouterView(ALGO, BS)
    proc = RouterViewProcessor(bus, "r1", view, snapshot_every_s=3600)
    await proc.start()
    try:
        await proc.sync(60)  # every record produced above is folded
        assert proc.caught_up
        want = oracle(bus)
        assert view.as_dict() == want.as_dict()
        assert proc.dead_lettered == 2
        health = proc.health()
        assert health.state == "EXACT" and health.lag_events == 0, health
        await proc.checkpoint(force=True)
    finally:
        await proc.stop()
    positions_at_snapshot = dict(view.positions)

    # More traffic while the router is down; then restart from the snapshot and replay the tail.
    _traffic(producers, rounds=10, base=10_000)
    restored = RouterViewProcessor.load_view(bus, ALGO, BS)
    assert restored.positions == positions_at_snapshot
    proc2 = RouterViewProcessor(bus, "r1", restored, snapshot_every_s=3600)
    applied_before = restored.applied
    await proc2.start()
    try:
        await proc2.sync(60)
        assert proc2.caught_up
        assert restored.as_dict() == oracle(bus).as_dict()
        # Only the tail was replayed (3 workers x 10 rounds: stores, removes, load reports).
        assert restored.applied - applied_before < 80
    finally:
        await proc2.stop()


async def test_restore_folds_the_tail_before_following_and_the_tail_folds_what_its_budget_left(
        bus: BusSettings) -> None:
    """A restart folds the log tail itself, in batches, before the view follows the log: caught
    up and equal to the oracle with nothing following yet. With no budget for that fold it stops
    after one batch; the followed tail then folds the rest from where it stopped, to the same view."""
    _workers_then_poison(bus, rounds=20)  # the poison is dead-lettered by the batch fold too

    whole = RouterViewProcessor(bus, "r-whole", RouterView(ALGO, BS), snapshot_every_s=3600)
    whole.restore()
    assert not whole.running and whole.caught_up
    assert whole.view.as_dict() == oracle(bus).as_dict()
    assert whole.dead_lettered == 1
    await whole.stop()

    part = RouterViewProcessor(bus, "r-part", RouterView(ALGO, BS), snapshot_every_s=3600)
    part.restore(budget_s=0)
    assert not part.caught_up and 0 < part.view.applied < whole.view.applied
    await part.start()
    try:
        await part.wait_caught_up(60)
        await part.sync(60)
        assert part.view.as_dict() == oracle(bus).as_dict()
        assert part.health().state == "EXACT"
    finally:
        await part.stop()


async def test_view_with_the_routers_fetch_settings_follows_live_traffic(bus: BusSettings) -> None:
    """The router's view fetches with ``fetch.min.bytes`` 64 KB and its default wait (fewer
    fetches per routed request: control_plane/router/wiring.py ``view_fetch``): traffic produced after
    it started, a few records at a time, still all reaches the view, equal to the oracle."""
    producers = {w: EventProducer(bus, w) for w in ("w-a", "w-b")}
    for w, p in producers.items():
        _register(p, w)
    assert all(p.flush(10) == 0 for p in producers.values())
    proc = RouterViewProcessor(bus, "r-fetch", RouterView(ALGO, BS), snapshot_every_s=3600,
                               **view_fetch(RouterSettings.view_fetch_wait_ms))
    await proc.start()
    try:
        await proc.wait_caught_up(60)
        for r in range(5):  # a round at a time, each far below 64 KB: the wait ends each fetch
            _traffic(producers, rounds=1, base=1000 * r)
            await proc.sync(30)
        assert proc.view.as_dict() == oracle(bus).as_dict()
        assert proc.health().state == "EXACT"
    finally:
        await proc.stop()


def test_view_fetch_settings() -> None:
    assert view_fetch(10) == {"fetch_min_bytes": 65536, "fetch_wait_ms": 10}
    assert view_fetch(RouterSettings.view_fetch_wait_ms) == {"fetch_min_bytes": 65536, "fetch_wait_ms": 50}
    assert view_fetch(0) == {"fetch_min_bytes": 1, "fetch_wait_ms": 1500}  # as Faust's consumer had them
    with pytest.raises(ValueError, match="0 \\(answer at once\\) or more"):
        view_fetch(-1)


async def test_a_tail_that_stopped_says_so_and_follows_again_from_the_views_positions(bus: BusSettings) -> None:
    """A fold that raises out of the batch fold (a bug, not poison: poison is dead-lettered
    inside it) stops the tail: ``/health`` says why at once, and the next watch round follows
    the log again from the view's own positions, so no record is skipped: equal to the oracle."""

    class OnceBroken(RouterViewProcessor):
        broken = False

        def fold_batch(self, batch) -> None:
            if not self.broken and self.caught_up:
                self.broken = True
                raise RuntimeError("injected bug in the fold")
            super().fold_batch(batch)

    producers = {w: EventProducer(bus, w) for w in ("w-a", "w-b")}
    for w, p in producers.items():
        _register(p, w)
    _traffic(producers, rounds=3, base=0)
    proc = OnceBroken(bus, "r-broken", RouterView(ALGO, BS), snapshot_every_s=3600)
    proc.watch_every_s = 0  # its rounds are run below
    await proc.start()
    try:
        await proc.wait_caught_up(60)
        _traffic(producers, rounds=3, base=1000)
        await until(lambda: proc.stopped_reason() is not None, timeout=30, what="the tail never stopped")
        assert "injected bug" in proc.stopped_reason()
        assert proc.health().state == "DEGRADED", proc.health()
        await proc.watch()
        assert proc.recoveries == 1 and proc.stopped_reason() is None
        await proc.sync(30)
        assert proc.view.as_dict() == oracle(bus).as_dict()
        assert proc.health().state == "EXACT", proc.health()
    finally:
        await proc.stop()
