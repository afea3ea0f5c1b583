"""Faust app keeping the planner's :class:`LoadView` current from the ``requests`` and
``workers`` topics.

The fold is :meth:`LoadView.apply` (pure); this module only moves records into it, the way
``router_view.py`` does for the router:

* Each planner incarnation is its own consumer group reading every partition
  (``<prefix>.load-view.<planner id>.<start ms>``): every replica, passive or leader, keeps a
  warm view so a takeover decides at once. Empty groups of earlier incarnations are deleted.
* Start-up from a checkpoint: before the app joins its group, the group's offsets are set to the
  positions stored in the newest ``load-view`` snapshot (compacted ``snapshots`` topic), so only
  the tail is replayed. ``caught_up`` turns true once the fold reached the log end seen at
  start-up; the planner does not decide before that.
* Records that cannot be decoded go to the dead-letter topic; the agent continues.

Faust tables where they fit: per-pool tumbling-window counters (arrivals, completions, good,
failures) keyed by the event time the fold counted each increment at. A table update is
written to the changelog partition of the source record, so the key carries the source
partition (``<pool>|<counter>|<partition>``): each key lives in exactly one changelog partition
and recovers exactly. :meth:`LoadViewProcessor.counter_windows` sums the partitions. The
counters mirror what the pure fold counted (:data:`Counted`); they exist for cheap inspection and
metrics, the planner reads the pure view.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import faust
from confluent_kafka import Consumer, TopicPartition

from control_plane.bus.catalog import Catalog
from control_plane.bus.kafka import DeadLetters, EventProducer
from control_plane.planner.load_view import LoadView, LoadViewConfig
from control_plane.router.snapshots import SnapshotStore
from control_plane.settings import BusSettings
from control_plane.streams.groups import delete_empty_groups, log_end, seed_group_offsets
from schemas import EventCodec, SchemaError

log = logging.getLogger(__name__)

STREAMS = ("requests", "workers")


def snapshot_key(cfg: LoadViewConfig) -> str:
    """One key per window geometry: any replica's snapshot of the same geometry will do."""
    return f"load-view:v1:{cfg.tumbling_s:g}:{cfg.hop_step_s:g}:{cfg.hopping_s:g}"


class LoadViewProcessor:
    """Owns the Faust app; ``view`` is mutated only by the agent, on the event loop."""

    def __init__(self, bus: BusSettings, planner_id: str, view: LoadView, *, snapshot_every_s: float = 10.0,
                 datadir: Path | None = None, counters: bool = True) -> None:
        self.bus = bus
        self.planner_id = planner_id
        self.view = view
        self.catalog = Catalog(bus.topic_prefix)
        self.topics = [self.catalog.topic(s) for s in STREAMS]
        self.requests_topic = self.catalog.topic("requests")
        self.group_prefix = f"{bus.topic_prefix}.load-view.{planner_id}."
        self.group = f"{self.group_prefix}{time.time_ns() // 1_000_000}"
        self.codec = EventCodec()
        self.snapshots = SnapshotStore(bus, self.catalog)
        self.snapshot_every_s = snapshot_every_s
        self.datadir = datadir or Path(tempfile.gettempdir()) / "switchyard-faust"
        self.use_counters = counters
        self._dlq = DeadLetters(EventProducer(bus, f"dlq:{self.group}", catalog=self.catalog), self.catalog, self.group)
        self._target: dict[tuple[str, int], int] = {}
        self.caught_up = False
        self.dead_lettered = 0
        self.snapshots_written = 0
        self._last_snapshot_applied = -1
        self.app: faust.App | None = None
        self.counters = None
        self._count_at = 0.0

    @classmethod
    def load_view(cls, bus: BusSettings, config: LoadViewConfig) -> LoadView:
        """The newest snapshot's view for this window geometry, or an empty one."""
        data = SnapshotStore(bus).load_latest(snapshot_key(config))
        if data is None:
            return LoadView(config)
        view = LoadView.from_bytes(data, config)
        log.info("restored load view from snapshot: %d records applied", view.applied)
        return view

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        await asyncio.to_thread(delete_empty_groups, self.bus, self.group_prefix)
        await asyncio.to_thread(seed_group_offsets, self.bus, self.group, self.topics, self.view.positions)
        self._target = await asyncio.to_thread(log_end, self.bus, self.group, self.topics)
        self._check_caught_up()
        self.datadir.mkdir(parents=True, exist_ok=True)
        app = faust.App(
            self.group,
            broker=f"kafka://{self.bus.bootstrap}",
            store="memory://",
            datadir=str(self.datadir / self.group),
            web_enabled=False,
            topic_disable_leader=True,
            topic_replication_factor=1,
            consumer_auto_offset_reset="earliest",
            broker_commit_every=1000,
            broker_commit_interval=5.0,
        )
        topic = app.topic(*self.topics, value_serializer="raw", key_serializer="raw")
        cfg = self.view.config
        if self.use_counters:
            parts = await asyncio.to_thread(self._partitions, self.requests_topic)
            self.counters = (
                app.Table("pool-counters", default=int, partitions=parts)
                .tumbling(cfg.tumbling_s, expires=timedelta(seconds=cfg.retention_s))
                # each increment lands in the window of the event time the fold counted it at
                .relative_to(lambda event: self._count_at))

        # Counts a workers-topic record released (routings folded before their worker's
        # registration): written with the next requests-topic record, whose partition the
        # table's changelog can take.
        deferred: list[tuple[str, str, int]] = []

        @app.agent(topic, name=f"{self.group}.fold")
        async def fold(stream):
            async for event in stream.events():
                m = event.message
                counted = self._apply(m.topic, m.partition, m.offset, m.value)
                if self.counters is None:
                    continue
                if m.topic != self.requests_topic:
                    deferred.extend(counted or ())
                    continue
                for pool, counter, at in (*deferred, *(counted or ())):
                    self._count_at = at / 1e9
                    self.counters[f"{pool}|{counter}|{m.partition}"] += 1
                deferred.clear()

        @app.timer(interval=self.snapshot_every_s)
        async def checkpoint() -> None:
            await self.checkpoint()

        self.app = app
        await app.start()

    async def stop(self) -> None:
        if self.app is not None:
            await self.app.stop()
        self._dlq.producer.close(10)
        # memory:// store: the data dir only holds Faust's bookkeeping of this incarnation
        shutil.rmtree(self.datadir / self.group, ignore_errors=True)

    def _partitions(self, topic: str) -> int:
        c = Consumer({"bootstrap.servers": self.bus.bootstrap, "group.id": f"{self.group}.probe",
                      "logger": logging.getLogger("switchyard.rdkafka")})
        try:
            return len(c.list_topics(topic, timeout=10).topics[topic].partitions)
        finally:
            c.close()

    # -- folding ----------------------------------------------------------------------------

    def _apply(self, topic: str, partition: int, offset: int, value: bytes | None):
        counted = None
        if offset >= self.view.positions.get((topic, partition), 0):
            source = f"{topic}:{partition}:{offset}"
            try:
                if value is None:
                    raise SchemaError("record has no value")
                env = self.codec.decode(value)
            except SchemaError as e:
                self.view.positions[(topic, partition)] = offset + 1
                self.dead_lettered += 1
                self._dlq.send(value, None, getattr(e, "reason", "malformed"), str(e), source)
            else:
                counted = self.view.apply_record(env, topic, partition, offset)
        if not self.caught_up:
            self._check_caught_up()
        return counted

    def _check_caught_up(self) -> None:
        pos = self.view.positions
        if all(pos.get(tp, 0) >= end for tp, end in self._target.items()):
            self.caught_up = True
            log.info("load view caught up with the log (%d records applied)", self.view.applied)

    async def wait_caught_up(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.caught_up:
            if time.monotonic() > deadline:
                raise TimeoutError(f"load view not caught up after {timeout_s:g}s")
            await asyncio.sleep(0.05)

    # -- checkpoints and counters -----------------------------------------------------------

    async def checkpoint(self, force: bool = False) -> bool:
        if not force and self.view.applied == self._last_snapshot_applied:
            return False
        data = self.view.to_bytes()  # taken on the loop: consistent with the positions in it
        applied = self.view.applied
        await asyncio.to_thread(self.snapshots.save, snapshot_key(self.view.config), data)
        self._last_snapshot_applied = applied
        self.snapshots_written += 1
        return True

    def counter_windows(self, pool: str, counter: str) -> dict[int, int]:
        """Window start (ns) -> count of ``counter`` in ``pool``, summed over source partitions,
        from the Faust windowed table."""
        if self.counters is None:
            return {}
        prefix = f"{pool}|{counter}|"
        out: dict[int, int] = {}
        for key, value in self.counters.table.data.items():
            k, window = key
            if isinstance(k, str) and k.startswith(prefix):
                start_ns = int(round(window[0] * 1e9))
                out[start_ns] = out.get(start_ns, 0) + int(value)
        return dict(sorted(out.items()))
