"""Faust app keeping a router's :class:`RouterView` current inside the router process.

Every router replica must see *all* partitions of ``kv`` and ``workers`` (each needs the whole
index), so each replica is its own consumer group, and each *incarnation* of a replica a new
one: ``<prefix>.router-view.<router id>.<start ms>``. A process killed with -9 leaves its member
in the old group until the session times out, and a group with a member cannot have its offsets
set; the group's offsets are disposable anyway (the snapshot holds the real position). Empty
groups of earlier incarnations of the same replica are deleted at start.

Start-up from a checkpoint, without Faust knowing about it: before the app joins its group, the
group's committed offsets are set to the positions stored in the snapshot (or to the start of
the log when there is none), so the agent resumes exactly where the snapshot's fold stopped and
replays only the tail. Offsets Faust commits while running are never trusted on restart: a
process killed with -9 may have committed past what any snapshot holds, and the snapshot is
what the view is rebuilt from.

The fold itself is :meth:`RouterView.apply` (pure). Records that cannot be decoded or that the
index refuses (another hash algorithm, block size, or a hybrid cache group) go to the
dead-letter topic; the agent continues.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import faust

from control_plane.bus.catalog import Catalog
from control_plane.bus.kafka import DeadLetters, EventProducer
from control_plane.index.errors import IndexRejected
from control_plane.router.health import HealthThresholds, RouterHealth, assess
from control_plane.router.snapshots import SnapshotStore
from control_plane.router.view import RouterView
from control_plane.settings import BusSettings
from control_plane.streams.groups import delete_empty_groups, log_end, seed_group_offsets
from schemas import EventCodec, SchemaError

log = logging.getLogger(__name__)

STREAMS = ("kv", "workers")


def snapshot_key(view: RouterView) -> str:
    return f"router-view:{view.hash_algo}:{view.block_size}"


class RouterViewProcessor:
    """Owns the Faust app; ``view`` is mutated only by the agent, on the event loop."""

    def __init__(
        self,
        bus: BusSettings,
        router_id: str,
        view: RouterView,
        *,
        snapshot_every_s: float = 5.0,
        thresholds: HealthThresholds = HealthThresholds(),
        on_applied: Callable[[object], None] | None = None,
    ) -> None:
        self.bus = bus
        self.router_id = router_id
        self.view = view
        self.catalog = Catalog(bus.topic_prefix)
        self.topics = [self.catalog.topic(s) for s in STREAMS]
        self.group_prefix = f"{bus.topic_prefix}.router-view.{router_id}."
        self.group = f"{self.group_prefix}{time.time_ns() // 1_000_000}"
        self.codec = EventCodec()
        self.snapshots = SnapshotStore(bus, self.catalog)
        self.snapshot_every_s = snapshot_every_s
        self.thresholds = thresholds
        self._dlq = DeadLetters(EventProducer(bus, f"dlq:{self.group}", catalog=self.catalog), self.catalog, self.group)
        self._on_applied = on_applied
        self._target: dict[tuple[str, int], int] = {}
        self.caught_up = False
        self.dead_lettered = 0
        self.snapshots_written = 0
        self.last_snapshot_applied = -1
        self.app: faust.App | None = None

    # -- lifecycle --------------------------------------------------------------------------

    @classmethod
    def load_view(cls, bus: BusSettings, hash_algo: str, block_size: int) -> RouterView:
        """The newest snapshot's view for this configuration, or an empty one."""
        empty = RouterView(hash_algo, block_size)
        data = SnapshotStore(bus).load_latest(snapshot_key(empty))
        if data is None:
            return empty
        view = RouterView.restore(data)
        log.info("restored router view from snapshot: %d records applied, positions %s",
                 view.applied, view.positions)
        return view

    async def start(self) -> None:
        await asyncio.to_thread(delete_empty_groups, self.bus, self.group_prefix)
        await asyncio.to_thread(seed_group_offsets, self.bus, self.group, self.topics, self.view.positions)
        self._target = await asyncio.to_thread(log_end, self.bus, self.group, self.topics)
        self._check_caught_up()
        app = faust.App(
            self.group,
            broker=f"kafka://{self.bus.bootstrap}",
            store="memory://",
            web_enabled=False,
            topic_allow_declare=False,
            topic_disable_leader=True,
            consumer_auto_offset_reset="earliest",
            broker_commit_every=1000,
            broker_commit_interval=5.0,
        )
        topic = app.topic(*self.topics, value_serializer="raw", key_serializer="raw")

        @app.agent(topic, name=f"{self.group}.fold")
        async def fold(stream):
            async for event in stream.events():
                m = event.message
                self._apply(m.topic, m.partition, m.offset, m.value, int((m.timestamp or 0) * 1000))

        @app.timer(interval=self.snapshot_every_s)
        async def checkpoint() -> None:
            await self.checkpoint()

        self.app = app
        await app.start()

    async def stop(self) -> None:
        if self.app is not None:
            await self.app.stop()
        self._dlq.producer.close(10)

    # -- folding ----------------------------------------------------------------------------

    def _apply(self, topic: str, partition: int, offset: int, value: bytes | None, ts_ms: int) -> None:
        self._fold(topic, partition, offset, value, ts_ms)
        if not self.caught_up:
            self._check_caught_up()

    def _fold(self, topic: str, partition: int, offset: int, value: bytes | None, ts_ms: int) -> None:
        if offset < self.view.positions.get((topic, partition), 0):
            return  # Faust redelivered something the snapshot already covers
        source = f"{topic}:{partition}:{offset}"
        try:
            if value is None:
                raise SchemaError("record has no value")
            env = self.codec.decode(value)
        except SchemaError as e:
            self.view.positions[(topic, partition)] = offset + 1
            self._dead_letter(value, None, getattr(e, "reason", "malformed"), str(e), source)
            return
        try:
            applied = self.view.apply(env, topic, partition, offset, ts_ms)
        except IndexRejected as e:
            self._dead_letter(value, env.key.encode(), f"index_rejected:{e.reason}", str(e), source)
            return
        if self._on_applied is not None:
            self._on_applied(applied)

    def _dead_letter(self, value, key, reason: str, error: str, source: str) -> None:
        self.dead_lettered += 1
        self._dlq.send(value, key, reason, error, source)

    def _check_caught_up(self) -> None:
        pos = self.view.positions
        if all(pos.get(tp, 0) >= end for tp, end in self._target.items()):
            self.caught_up = True
            log.info("router view caught up with the log (%d records applied)", self.view.applied)

    # -- checkpoints and health -------------------------------------------------------------

    async def checkpoint(self, force: bool = False) -> bool:
        """Write a snapshot if anything was applied since the last one."""
        if not force and self.view.applied == self.last_snapshot_applied:
            return False
        data = self.view.snapshot()  # taken on the loop: consistent with the positions in it
        applied = self.view.applied
        await asyncio.to_thread(self.snapshots.save, snapshot_key(self.view), data)
        self.last_snapshot_applied = applied
        self.snapshots_written += 1
        return True

    def highwaters(self) -> dict[tuple[str, int], int]:
        out = dict(self._target)
        if self.app is not None:
            try:
                for tp in self.app.consumer.assignment():
                    hw = self.app.consumer.highwater(tp)
                    if hw is not None and hw >= 0:
                        out[(tp.topic, tp.partition)] = max(out.get((tp.topic, tp.partition), 0), hw)
            except Exception:  # consumer not ready yet; fall back to the start-up log end
                pass
        return out

    def health(self) -> RouterHealth:
        return assess(self.view.positions, self.highwaters(), self.view.last_ts_ms,
                      self.view.stale_workers(), time.time() * 1000, self.caught_up, self.thresholds)
