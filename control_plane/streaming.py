"""The processors that keep a projection current from the log, with snapshots
(:class:`ProjectionProcessor`), by one of two drivers: :class:`TailProcessor`, librdkafka batches
of every partition it assigns itself, folded on the event loop (the router's view), and
:class:`FoldProcessor`, a Faust app in a consumer group of its own, seeded with the positions of
the snapshot it restored (the planner's load view, the metrics); and :class:`StreamFollower`,
the thread that folds a small stream from its start (the planner's and the router's followers
of the ``admin`` stream).
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from confluent_kafka import Consumer, TopicPartition

from common.log.admin import replication_factor
from common.log.catalog import Catalog
from common.log.fold import apply_failed_reason
from common.log.kafka import DeadLetters, EventConsumer, EventProducer
from common.log.progress import ProgressWatch
from common.log.reader import KafkaLogReader, KafkaLogTail
from common.log.snapshots import SnapshotStore
from common.processes import remove_dead_owned
from common.roles import group_id
from common.settings import BusSettings
from schemas import EventCodec

if TYPE_CHECKING:
    from common.log.fold import Poisoned
    from common.log.reader import LogRecord
    from schemas import Envelope

log = logging.getLogger(__name__)


def _consumer(bus: BusSettings, group: str) -> Consumer:
    return Consumer({**bus.client_conf(), "group.id": group, "enable.auto.commit": False,
                     "logger": logging.getLogger("switchyard.rdkafka")})


def seed_group_offsets(bus: BusSettings, group: str, topics: list[str], positions: dict[tuple[str, int], int]) -> None:
    """Commit ``positions`` (low watermark where absent) as ``group``'s offsets. The group must
    have no active member (true before the processor's Faust app starts)."""
    c = _consumer(bus, group)
    try:
        offsets = []
        for topic in topics:
            md = c.list_topics(topic, timeout=10)
            if topic not in md.topics or md.topics[topic].error is not None:
                raise RuntimeError(f"topic {topic} does not exist; run `switchyard topics apply`")
            for p in md.topics[topic].partitions:
                lo, hi = c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
                pos = positions.get((topic, p), lo)
                offsets.append(TopicPartition(topic, p, min(max(pos, lo), hi)))
        c.commit(offsets=offsets, asynchronous=False)
    finally:
        c.close()


def delete_empty_groups(bus: BusSettings, prefix: str) -> None:
    """Best effort: drop empty groups whose id starts with ``prefix`` (earlier incarnations)."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({**bus.client_conf(), "logger": logging.getLogger("switchyard.rdkafka")})
    try:
        listed = admin.list_consumer_groups(request_timeout=10).result()
        old = [g.group_id for g in listed.valid if g.group_id.startswith(prefix) and str(g.state).endswith("EMPTY")]
        if old:
            for _gid, fut in admin.delete_consumer_groups(old, request_timeout=10).items():
                try:
                    fut.result()
                except Exception:  # raced with a member joining, or already gone
                    pass
    except Exception as e:
        log.info("could not clean old consumer groups: %s", e)


def log_end(bus: BusSettings, group: str, topics: list[str]) -> dict[tuple[str, int], int]:
    """High watermark of every partition of ``topics``."""
    c = _consumer(bus, f"{group}.probe")
    try:
        out = {}
        for topic in topics:
            for p in c.list_topics(topic, timeout=10).topics[topic].partitions:
                out[(topic, p)] = c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
        return out
    finally:
        c.close()


def _table_manager():
    """Faust's table manager, without the fixed 1 s sleep it takes at start for tables declared
    late: every processor declares its tables (:meth:`FoldProcessor.extend`) before the app
    starts, and that second was a third of a router restart's time spent inside Faust."""
    from faust.tables import TableManager

    class EagerTableManager(TableManager):
        async def on_start(self) -> None:
            if not self.should_stop:
                await self._update_channels()
                await self.recovery.start()

    return EagerTableManager


# ----------------------------------------------------------------------------------------------
# The processor every materialized view runs in
# ----------------------------------------------------------------------------------------------


class ProjectionProcessor:
    """A pure projection kept current from some streams of the log, with snapshots: what the
    router's view, the planner's load view and the metrics projection share, whatever follows
    the log for them (:class:`FoldProcessor`: a Faust app in a consumer group;
    :class:`TailProcessor`: librdkafka batches of partitions it assigns itself).

    A subclass says what it folds (``STREAMS``, the fold), what its state is
    (:meth:`positions`, :meth:`applied`, :meth:`snapshot_bytes`, :attr:`snapshot_key`); the
    driver subclass how the log reaches the fold. This class does the rest, once:

    * start-up from a checkpoint: a projection that folds record batches (:meth:`fold_batch`)
      folds the log from its snapshot's positions to the log end itself (:meth:`restore`, from
      any thread before :meth:`start`), read in batches straight from the broker; the driver
      follows from where it stopped;
    * ``caught_up`` turns true once every partition's position reached the log end read at
      start-up; :meth:`sync` waits for the log end read when it is called (after the last
      produce a caller cares about);
    * checkpoints: the projection's bytes are taken on the event loop (consistent with the
      positions inside them) and written from a thread, spaced to at least 20x their encoding
      time so a large view never holds the loop more than ~5% of the time;
    * poison goes to the dead-letter topic (:meth:`dead_letter`) at once (the folds are pure: a
      retry would fail the same way); the fold continues. A checkpoint is written only once
      the dead letters its positions pass are acknowledged;
    * a watch reads the log end every ``watch_every_s`` (a watermark query of its own, not what
      the driver last saw) and says when the fold stopped while the log moved (:attr:`stalled`,
      :mod:`common.log.progress`); the driver judges its own faults (:meth:`_driver_fault`).
      Either way the view's ``/health`` says so and the driver starts again from the
      projection's own positions (:meth:`recover`).
    """

    #: The projection's name in group ids and logs.
    KIND = "view"
    #: Catalog streams folded.
    STREAMS: tuple[str, ...] = ()
    #: True when the projection folds a :class:`~common.log.reader.RecordBatch` (:meth:`fold_batch`:
    #: no tables, no headers), so :meth:`restore` may fold the tail.
    FOLDS_BATCHES = False

    def __init__(self, bus: BusSettings, owner_id: str, *, snapshot_every_s: float = 10.0,
                 watch_every_s: float = 5.0, stall_after_s: float = 15.0,
                 fetch_min_bytes: int | None = None, fetch_wait_ms: int | None = None) -> None:
        import time

        self.bus = bus
        self.owner_id = owner_id
        self.catalog = Catalog(bus.topic_prefix)
        self.topics = [self.catalog.topic(s) for s in self.STREAMS]
        #: This incarnation's name (dead letters' source; a Faust processor's first group).
        self.incarnation = f"{bus.topic_prefix}.{self.KIND}.{owner_id}.{time.time_ns() // 1_000_000}"
        self.codec = EventCodec(verifier=bus.verifier())
        self.snapshots = SnapshotStore(bus, self.catalog, owner_id=owner_id)
        self.snapshot_every_s = snapshot_every_s
        #: The consumer's ``fetch.min.bytes`` and ``fetch.max.wait.ms`` (None: the driver's
        #: default): how long the broker may hold a fetch to fill it. At 1 byte every record the
        #: workers publish ends a fetch and the consumer sends the next one, so the broker serves
        #: a fetch or more per routed request; waiting a few ms serves several requests' records
        #: in one, for that much freshness (benchmarks/router_broker_sources.py).
        self.fetch_min_bytes = fetch_min_bytes
        self.fetch_wait_ms = fetch_wait_ms
        self.watch_every_s = watch_every_s
        self.progress = ProgressWatch(stall_after_s)
        self._watch_task = None
        self._recovery_lock = None
        #: The log end the watch read last (merged into :meth:`highwaters`).
        self._log_end_seen: dict[tuple[str, int], int] = {}
        #: Why the fold is stopped while the log moves (None: following).
        self.stalled: str | None = None
        #: Times the driver started again from the projection's positions (:meth:`recover`).
        self.recoveries = 0
        self._dlq = DeadLetters(EventProducer(bus, f"dlq:{self.incarnation}", catalog=self.catalog), self.catalog,
                                self.incarnation)
        self._target: dict[tuple[str, int], int] = {}
        #: Set by :meth:`restore`: the tail is folded.
        self._restored = False
        self.caught_up = False
        self.dead_lettered = 0
        self.snapshots_written = 0
        self._last_snapshot_applied = -1
        self._next_checkpoint_at = 0.0

    # -- what a subclass provides ------------------------------------------------------------

    @property
    def snapshot_key(self) -> str:
        raise NotImplementedError

    def positions(self) -> dict[tuple[str, int], int]:
        """The projection's next offset per (topic, partition)."""
        raise NotImplementedError

    def applied(self) -> int:
        raise NotImplementedError

    def snapshot_bytes(self) -> bytes:
        raise NotImplementedError

    def fold_batch(self, batch) -> None:
        """Fold one partition's records in offset order."""
        raise NotImplementedError

    async def log_end(self) -> dict[tuple[str, int], int]:
        """The log end every partition must reach before ``caught_up``."""
        import asyncio

        return await asyncio.to_thread(log_end, self.bus, self._probe_group(), self.topics)

    # -- what a driver provides ----------------------------------------------------------------

    def _probe_group(self) -> str:
        """The group id of the log-end probes' consumers (never joined)."""
        raise NotImplementedError

    @property
    def running(self) -> bool:
        """The driver is started (and not stopped)."""
        raise NotImplementedError

    async def _start_driver(self) -> None:
        raise NotImplementedError

    async def _stop_driver(self) -> None:
        raise NotImplementedError

    async def _restart_driver(self) -> None:
        """Follow the log again from the projection's own positions."""
        raise NotImplementedError

    async def _driver_fault(self, ends: dict[tuple[str, int], int]) -> str | None:
        """One watch round's verdict on the driver itself (``ends``: the log end read now): why
        it must start again, or None."""
        return None

    def _driver_highwaters(self) -> dict[tuple[str, int], int]:
        """The log end per partition as the driver last saw it (may be empty)."""
        return {}

    # -- lifecycle ---------------------------------------------------------------------------

    def restore(self, budget_s: float | None = None) -> None:
        """Before :meth:`start`, from any thread (nothing follows the log yet), for a projection
        that folds batches: fold the log from the projection's positions to the log end read
        now, in batches read straight from the broker; ``caught_up`` is measured against that
        log end. (:meth:`start` does it when nobody did.)

        ``budget_s``: stop folding after that long (a process that serves only once this returns
        must open its port before a liveness probe gives up on it); the driver then folds the
        rest, ``caught_up`` turning true when it reaches the same log end."""
        import time

        if not self.FOLDS_BATCHES:
            raise TypeError(f"{type(self).__name__} does not fold record batches")
        self._target = self._fold_to_end(None if budget_s is None else time.monotonic() + budget_s)
        self.check_caught_up()
        self._restored = True

    def _fold_to_end(self, deadline: float | None) -> dict[tuple[str, int], int]:
        import time

        pos = self.positions()
        ends: dict[tuple[str, int], int] = {}
        with KafkaLogReader(self.bus) as reader:
            for topic in self.topics:
                for p in reader.partitions(topic):
                    ends[(topic, p)] = reader.bounds(topic, p)[1]
            for (topic, p), end in ends.items():
                for batch in reader.read_batches(topic, p, pos.get((topic, p), 0), end):
                    self.fold_batch(batch)
                    if deadline is not None and time.monotonic() > deadline:
                        log.warning("%s %s: folding the log tail took its whole budget; the fold goes on "
                                    "while serving (LOADING until then)", self.KIND, self.owner_id)
                        return ends
        log.info("%s %s folded the log to its end in batches (%d records applied)", self.KIND, self.owner_id,
                 self.applied())
        return ends

    async def start(self) -> None:
        import asyncio

        await self._start_driver()
        if self._watch_task is None and self.watch_every_s > 0:
            self._watch_task = asyncio.create_task(self._every(self.watch_every_s, self.watch, "watch"),
                                                   name=f"{self.KIND}-watch")

    async def stop(self) -> None:
        import contextlib

        async with self._lock():  # a recovery under way finishes first
            if self._watch_task is not None:
                self._watch_task.cancel()
                with contextlib.suppress(BaseException):
                    await self._watch_task
                self._watch_task = None
            await self._stop_driver()
        self._dlq.producer.close(10)

    # -- the watch -----------------------------------------------------------------------------

    async def _every(self, interval_s: float, step, what: str) -> None:
        """``await step()`` every ``interval_s`` until cancelled (the watch, a tail's checkpoints)."""
        import asyncio

        while True:
            await asyncio.sleep(interval_s)
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the broker is away: the next round tries again
                log.warning("%s %s: %s failed: %s", self.KIND, self.owner_id, what, e)

    async def watch(self) -> None:
        """One round: read the log end, judge the fold's progress and the driver, and start the
        driver again from the projection's positions when either stopped."""
        import time

        ends = await self.log_end()
        self._log_end_seen = ends
        self.stalled = self.progress.observe(time.monotonic(), self.applied(), self.positions(), ends)
        fault = await self._driver_fault(ends)
        if fault:
            await self.recover(fault)
        elif self.stalled:
            await self.recover(self.stalled)

    async def recover(self, why: str) -> None:
        """Start the driver again, from the projection's own positions: the view goes on from
        where it stopped."""
        async with self._lock():
            if not self.running:  # stopped meanwhile
                return
            log.error("%s %s: %s; following the log again from the view's positions", self.KIND, self.owner_id,
                      why)
            await self._restart_driver()
            self.recoveries += 1
            # The reasons stay until the next round sees the fold follow its whole log again.
            self.progress = ProgressWatch(self.progress.stall_after_s)

    def _lock(self):
        """Serializes a recovery and :meth:`stop` (made on the loop that runs them)."""
        import asyncio

        if self._recovery_lock is None:
            self._recovery_lock = asyncio.Lock()
        return self._recovery_lock

    def stopped_reason(self) -> str | None:
        """Why this view must not be trusted now (its ``/health`` degrades), or None."""
        return self.stalled

    # -- folding -----------------------------------------------------------------------------

    def dead_letter(self, value: bytes | None, key: bytes | None, reason: str, error: str, source: str) -> None:
        self.dead_lettered += 1
        self._dlq.send(value, key, reason, error, source)

    def dead_letter_poison(self, rec: LogRecord, e: Poisoned) -> None:
        """The ``on_poison`` of a subclass's :class:`~common.log.fold.RecordFold`: the record
        goes to the dead-letter topic under the key the fold named (else none), its position as
        the source."""
        self.dead_letter(rec.value, e.key, e.reason, e.detail, f"{rec.topic}:{rec.partition}:{rec.offset}")

    def check_caught_up(self) -> None:
        pos = self.positions()
        if all(pos.get(tp, 0) >= end for tp, end in self._target.items()):
            self.caught_up = True
            log.info("%s %s caught up with the log (%d records applied)", self.KIND, self.owner_id, self.applied())

    async def wait_caught_up(self, timeout_s: float = 60.0) -> None:
        import asyncio
        import time

        deadline = time.monotonic() + timeout_s
        while not self.caught_up:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.KIND} not caught up after {timeout_s:g}s")
            await asyncio.sleep(0.05)

    async def sync(self, timeout_s: float = 60.0) -> dict[tuple[str, int], int]:
        """Wait until the fold has applied every partition up to its end offset read *now*, so
        every record produced before the call is in the view. (``caught_up`` only promises the
        log end read at start-up: a view compared with an oracle of a log that grew since then
        must ``sync`` first.) Returns the end offsets waited for."""
        import asyncio
        import time

        target = await self.log_end()
        deadline = time.monotonic() + timeout_s
        while True:
            pos = self.positions()
            behind = {f"{t}:{p}": (pos.get((t, p), 0), end) for (t, p), end in target.items() if pos.get((t, p), 0) < end}
            if not behind:
                return target
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.KIND} {self.owner_id} not at the log end after {timeout_s:g}s "
                                   f"(position, end): {behind}")
            await asyncio.sleep(0.05)

    # -- checkpoints -------------------------------------------------------------------------

    async def checkpoint(self, force: bool = False) -> bool:
        """Write a snapshot if anything was applied since the last one."""
        import asyncio
        import time

        applied = self.applied()
        if not force and applied == self._last_snapshot_applied:
            return False
        now = time.monotonic()
        if not force and now < self._next_checkpoint_at:
            return False
        data = self.snapshot_bytes()  # taken on the loop: consistent with the positions in it
        self._next_checkpoint_at = now + 20 * (time.monotonic() - now)
        # The snapshot's positions pass every record dead-lettered so far: those dead letters
        # must be on the broker first, or a crash after the save would lose them.
        left = await asyncio.to_thread(self._dlq.confirm, 30.0)
        if left:
            log.warning("%s %s: %d dead letters not acknowledged; checkpoint skipped", self.KIND, self.owner_id, left)
            return False
        await asyncio.to_thread(self.snapshots.save, self.snapshot_key, data)
        self._last_snapshot_applied = applied
        self.snapshots_written += 1
        return True

    def highwaters(self) -> dict[tuple[str, int], int]:
        """The log end per partition: the start-up target, raised by what the driver saw and by
        what the watch read itself (a driver that lost its partitions sees nothing move)."""
        out = dict(self._target)
        for tp, end in self._log_end_seen.items():
            out[tp] = max(out.get(tp, 0), end)
        for tp, hw in self._driver_highwaters().items():
            out[tp] = max(out.get(tp, 0), hw)
        return out


class TailProcessor(ProjectionProcessor):
    """A projection that folds batches, following its streams without a consumer group: a
    thread reads every partition, assigned from the projection's own positions, in librdkafka
    batches (:class:`~common.log.reader.KafkaLogTail`), and hands each poll's batches to
    :meth:`fold_batch` **on the event loop**, waiting for that fold before it polls again.

    So the fold and whatever reads the projection on the loop (a router's decisions) never
    interleave: the projection's Python state (a view's worker registry) and its native index
    are only ever touched from the loop once :meth:`start` ran (:meth:`restore` folds before
    that, from any thread). The thread only waits in librdkafka (without the GIL) and builds
    the batches' columns.

    No group: nobody else can be handed these partitions, and there is no group to seed, to
    clean or to watch. Positions live in the projection's snapshots; nothing is committed. The
    watch starts the tail again from the projection's positions when its thread stopped (a
    fold that raised, a consumer error) or the log gained partitions."""

    FOLDS_BATCHES = True
    #: Records per poll at most (the loop folds a poll's batches in one go).
    POLL_RECORDS = 2000

    def __init__(self, bus: BusSettings, owner_id: str, **kw) -> None:
        super().__init__(bus, owner_id, **kw)
        self._loop = None
        self._thread: threading.Thread | None = None
        self._stop_tail = threading.Event()
        self._tail = None
        self._checkpoints = None
        #: Why the tail's thread stopped by itself (None: it did not).
        self.crashed: str | None = None

    def _probe_group(self) -> str:
        return group_id(self.bus.topic_prefix, self.bus.username, f"{self.KIND}.{self.owner_id}.probe")

    @property
    def running(self) -> bool:
        return self._thread is not None

    async def _start_driver(self) -> None:
        import asyncio

        if not self._restored:
            await asyncio.to_thread(self.restore)
        self._loop = asyncio.get_running_loop()
        conf = {}
        if self.fetch_min_bytes is not None:
            conf["fetch.min.bytes"] = self.fetch_min_bytes
        if self.fetch_wait_ms is not None:
            conf["fetch.wait.max.ms"] = self.fetch_wait_ms
        positions = dict(self.positions())
        self._tail = await asyncio.to_thread(KafkaLogTail, self.bus, self.topics, positions,
                                             f"{self.KIND}.{self.owner_id}", **conf)
        self.crashed = None
        self._stop_tail = threading.Event()
        self._thread = threading.Thread(target=self._follow, args=(self._tail, self._stop_tail),
                                        name=f"{self.KIND}-tail", daemon=True)
        self._thread.start()
        if self._checkpoints is None:
            self._checkpoints = asyncio.create_task(self._every(self.snapshot_every_s, self.checkpoint, "checkpoint"),
                                                    name=f"{self.KIND}-checkpoints")

    async def _stop_driver(self, *, checkpoints: bool = True) -> None:
        import asyncio
        import contextlib

        if checkpoints and self._checkpoints is not None:
            self._checkpoints.cancel()
            with contextlib.suppress(BaseException):
                await self._checkpoints
            self._checkpoints = None
        thread, tail = self._thread, self._tail
        self._thread = self._tail = None
        if thread is not None:
            self._stop_tail.set()
            await asyncio.to_thread(thread.join, 10)
        if tail is not None:
            await asyncio.to_thread(tail.close)

    async def _restart_driver(self) -> None:
        await self._stop_driver(checkpoints=False)
        await self._start_driver()

    async def _driver_fault(self, ends: dict[tuple[str, int], int]) -> str | None:
        if self.crashed:
            return f"its tail stopped ({self.crashed})"
        tail = self._tail
        if tail is not None and set(ends) - tail.assigned:
            return f"the log has partitions the tail was not assigned: {sorted(set(ends) - tail.assigned)}"
        return None

    def _driver_highwaters(self) -> dict[tuple[str, int], int]:
        tail = self._tail
        return tail.highwater if tail is not None else {}

    def stopped_reason(self) -> str | None:
        return f"its tail stopped ({self.crashed})" if self.crashed else self.stalled

    def assigned(self) -> frozenset[tuple[str, int]]:
        """The partitions the tail follows (empty: not following)."""
        tail = self._tail
        return tail.assigned if tail is not None else frozenset()

    @property
    def tail_group(self) -> str | None:
        """The group id the tail's consumer names for its coordinator lookup, never joined."""
        tail = self._tail
        return tail.group_id if tail is not None else None

    def _follow(self, tail, stop: threading.Event) -> None:
        """The tail's thread: poll, have the loop fold what came, wait for it, again."""
        while not stop.is_set():
            try:
                batches = tail.poll(self.POLL_RECORDS, 0.5)
            except Exception as e:  # noqa: BLE001 - said in /health; the watch starts the tail again
                log.exception("%s %s: the tail's poll failed", self.KIND, self.owner_id)
                self.crashed = f"{type(e).__name__}: {e}"[:300]
                return
            if not batches:
                continue
            done = threading.Event()
            try:
                self._loop.call_soon_threadsafe(self._fold_polled, batches, done)
            except RuntimeError:  # the loop is closed: the process is ending
                return
            while not done.wait(0.5):
                if stop.is_set():
                    return
            if self.crashed:
                return

    def _fold_polled(self, batches, done: threading.Event) -> None:
        """On the loop: fold one poll's batches (one per partition)."""
        try:
            for batch in batches:
                self.fold_batch(batch)
            if not self.caught_up:
                self.check_caught_up()
        except Exception as e:  # noqa: BLE001 - a bug in a fold: poison is dead-lettered inside it
            # Where the fold stopped is in the projection's positions: the watch starts the tail
            # again from there, so no record is skipped.
            log.exception("%s %s: folding a batch failed", self.KIND, self.owner_id)
            self.crashed = f"{type(e).__name__}: {e}"[:300]
        finally:
            done.set()


class FoldProcessor(ProjectionProcessor):
    """A projection followed by one Faust app (the planner's load view, the metrics
    projection), which may add agents, tables or timers (:meth:`extend`) and folds a message at
    a time (:meth:`fold_message`); with this driver:

    * each incarnation is its own consumer group (``<prefix>.<kind>.<owner id>.<start ms>``)
      reading every partition, so every replica keeps a whole, warm view; empty groups of
      earlier incarnations are deleted;
    * start-up from a checkpoint: before the app joins its group, the group's offsets are set to
      the positions of the snapshot the projection was restored from (after :meth:`restore`'s
      batch fold of the tail, for a projection that folds batches), so only the tail is
      replayed; offsets Faust commits are never trusted on restart (the snapshot is what the
      view is rebuilt from);
    * the watch also says when the group handed this incarnation fewer than all its partitions:
      another member is in its group (:attr:`foreign`; only a principal of the same role can
      join it, common/log/principals.py); the processor then moves to a fresh group, seeded with
      its own positions: the foreign member keeps the old one.
    """

    def __init__(self, bus: BusSettings, owner_id: str, *, snapshot_every_s: float = 10.0,
                 datadir=None, commit_every_s: float = 5.0, app_options: dict | None = None,
                 watch_every_s: float = 5.0, stall_after_s: float = 15.0,
                 fetch_min_bytes: int | None = None, fetch_wait_ms: int | None = None) -> None:
        super().__init__(bus, owner_id, snapshot_every_s=snapshot_every_s, watch_every_s=watch_every_s,
                         stall_after_s=stall_after_s, fetch_min_bytes=fetch_min_bytes, fetch_wait_ms=fetch_wait_ms)
        self.group_prefix = f"{bus.topic_prefix}.{self.KIND}.{owner_id}."
        self.group = self.incarnation
        self.commit_every_s = commit_every_s
        # Faust's own default is ``<app id>-data`` in the working directory, one per start.
        # Here: one per incarnation under ``datadir``; those of earlier incarnations of this
        # owner, left by a kill -9, go at the next start. Without ``datadir``: under
        # ``<tmp>/switchyard-faust/pid-<pid>``, and a start removes the directories of every
        # process that is gone (a killed test's router has a topic prefix no one starts again).
        self._tmp_root = None if datadir else Path(tempfile.gettempdir()) / "switchyard-faust"
        root = Path(datadir) if datadir else self._tmp_root / f"pid-{os.getpid()}"
        self.datadir = root / self.group
        self.app_options = dict(app_options or {})
        # None: aiokafka's 1 byte and Faust's 1,500 ms (Faust passes neither setting through).
        self._fetch_tuned = fetch_min_bytes is None and fetch_wait_ms is None
        self._root = root
        #: Why another member is taken to be in this incarnation's group (None: none seen).
        self.foreign: str | None = None
        self._short_assignments = 0
        self.app = None

    def fold_message(self, m) -> None:
        """Fold one Faust message (``m.topic``, ``partition``, ``offset``, ``value``, ...)."""
        raise NotImplementedError

    def extend(self, app, topic) -> None:
        """Add agents, tables or timers to the app before it starts (default: none)."""

    def _probe_group(self) -> str:
        return f"{self.group}.probe"

    @property
    def running(self) -> bool:
        return self.app is not None

    # -- lifecycle ---------------------------------------------------------------------------

    def restore(self, budget_s: float | None = None) -> None:
        """:meth:`ProjectionProcessor.restore`, then the group seeded where the fold stopped;
        old groups of this owner are dropped meanwhile. Faust folds what a budget left."""
        cleaner = threading.Thread(target=delete_empty_groups, args=(self.bus, self.group_prefix),
                                   name=f"{self.KIND}-old-groups", daemon=True)
        cleaner.start()
        super().restore(budget_s)
        seed_group_offsets(self.bus, self.group, self.topics, self.positions())
        cleaner.join()

    async def _start_driver(self) -> None:
        await self._start_app()

    async def _stop_driver(self) -> None:
        import shutil

        if self.app is not None:
            await self.app.stop()
            self.app = None
        shutil.rmtree(self.datadir, ignore_errors=True)  # memory:// store: only Faust's bookkeeping
        if self._tmp_root is not None:
            try:
                self.datadir.parent.rmdir()  # this process's, once no other processor uses it
            except OSError:
                pass

    async def _start_app(self) -> None:
        import asyncio
        import shutil

        import faust

        if self.FOLDS_BATCHES and not self._restored:
            await asyncio.to_thread(self.restore)
        elif not self._restored:
            await asyncio.to_thread(delete_empty_groups, self.bus, self.group_prefix)
            await asyncio.to_thread(seed_group_offsets, self.bus, self.group, self.topics, self.positions())
            self._target = await self.log_end()
            self.check_caught_up()
        options = {"store": "memory://", "web_enabled": False, "topic_allow_declare": False,
                   "TableManager": _table_manager(),
                   "topic_disable_leader": True, "consumer_auto_offset_reset": "earliest",
                   "broker_commit_every": 1000, "broker_commit_interval": self.commit_every_s,
                   **self.app_options}
        if options["topic_allow_declare"] and "topic_replication_factor" not in options:
            # Topics the app declares (a table's changelog) as replicated as the catalog's.
            options["topic_replication_factor"] = await asyncio.to_thread(replication_factor, self.bus)
        for old in self.datadir.parent.glob(f"{self.group_prefix}*"):  # left by a kill -9
            shutil.rmtree(old, ignore_errors=True)
        if self._tmp_root is not None:
            remove_dead_owned(self._tmp_root, "pid-")
        self.datadir.mkdir(parents=True, exist_ok=True)
        options["datadir"] = str(self.datadir)
        if self.bus.security_protocol.upper().startswith("SASL"):
            tls = self.bus.ssl_context() if self.bus.security_protocol.upper() == "SASL_SSL" else None
            options["broker_credentials"] = faust.SASLCredentials(
                username=self.bus.username, password=self.bus.secret(), mechanism="SCRAM-SHA-256", ssl_context=tls)
        app = faust.App(self.group, broker=f"kafka://{self.bus.bootstrap}", **options)
        topic = app.topic(*self.topics, value_serializer="raw", key_serializer="raw")
        self.extend(app, topic)

        @app.agent(topic, name=f"{self.group}.fold")
        async def fold(stream):
            async for event in stream.events():
                if not self._fetch_tuned:
                    self._tune_fetch()
                self.fold_message(event.message)
                if not self.caught_up:
                    self.check_caught_up()

        @app.timer(interval=self.snapshot_every_s)
        async def checkpoint() -> None:
            await self.checkpoint()

        self.app = app
        self._fetch_tuned = self.fetch_min_bytes is None and self.fetch_wait_ms is None
        await app.start()
        if not self._fetch_tuned:
            self._tune_fetch()

    def _tune_fetch(self) -> None:
        """Set the fetch settings on the app's aiokafka consumer (Faust passes neither through:
        aiokafka's fetcher reads them at every fetch it builds). Once its consumer exists."""
        try:
            fetcher = self.app.consumer._thread._ensure_consumer()._fetcher
        except Exception:  # not started yet: the first folded record tries again
            return
        if not (hasattr(fetcher, "_fetch_min_bytes") and hasattr(fetcher, "_fetch_max_wait_ms")):
            raise RuntimeError("aiokafka's fetcher no longer holds _fetch_min_bytes/_fetch_max_wait_ms: "
                               "the view's fetch settings cannot be applied")
        if self.fetch_min_bytes is not None:
            fetcher._fetch_min_bytes = self.fetch_min_bytes
        if self.fetch_wait_ms is not None:
            fetcher._fetch_max_wait_ms = self.fetch_wait_ms
        self._fetch_tuned = True


    # -- the watch -----------------------------------------------------------------------------

    async def _driver_fault(self, ends: dict[tuple[str, int], int]) -> str | None:
        crashed = self.crashed()
        if crashed:  # e.g. the fetcher of issue 36, crashed on a foreign member's metadata
            self.foreign = f"its consumer crashed ({crashed})"
            return self.foreign
        mine = self.assigned()
        rebalancing = bool(getattr(self.app, "rebalancing", False))
        short = self.caught_up and (rebalancing or (mine is not None and len(mine) < len(ends)))
        # Twice in a row: a rebalance in progress hands out nothing for a moment. This
        # incarnation is its group's only member, so a rebalance that lasts, or an assignment
        # short of every partition, is another member's doing.
        self._short_assignments = self._short_assignments + 1 if short else 0
        if self._short_assignments >= 2:
            held = "a rebalance that does not end" if rebalancing else f"{len(mine or ())} of {len(ends)} partitions"
            self.foreign = f"group {self.group} gave this incarnation {held}: another member is in its group"
            return self.foreign
        if not short and not self.stalled:
            self.foreign = None
        return None

    def crashed(self) -> str | None:
        """Why the app's consumer or fetcher crashed (they do not restart by themselves), or None."""
        app = self.app
        if app is None:
            return None
        for part in (getattr(app, "_fetcher", None), getattr(app, "consumer", None)):
            try:
                if part is not None and part.crashed:
                    reason = part.crash_reason
                    return f"{type(part).__name__}: {type(reason).__name__}: {reason}"[:300]
            except Exception:  # a consumer not made yet
                continue
        return None

    def assigned(self) -> set[tuple[str, int]] | None:
        """The partitions of :attr:`topics` the group handed this incarnation (None: unknown)."""
        if self.app is None:
            return None
        try:
            return {(tp.topic, tp.partition) for tp in self.app.consumer.assignment() if tp.topic in self.topics}
        except Exception:  # the consumer is not started (or is gone)
            return None

    async def _restart_driver(self) -> None:
        """Leave the group (and whoever else is in it) for a fresh one, seeded with the
        projection's own positions and followed by Faust from there (no batch fold in a
        thread now: the projection is being read on the loop)."""
        import asyncio
        import time

        await self._stop_driver()
        self.group = f"{self.group_prefix}{time.time_ns() // 1_000_000}"
        self.datadir = self._root / self.group
        self._short_assignments = 0
        positions = dict(self.positions())
        await asyncio.to_thread(seed_group_offsets, self.bus, self.group, self.topics, positions)
        self._restored = True
        await self._start_app()

    def stopped_reason(self) -> str | None:
        return self.foreign or self.stalled

    def _driver_highwaters(self) -> dict[tuple[str, int], int]:
        out: dict[tuple[str, int], int] = {}
        if self.app is not None:
            try:
                for tp in self.app.consumer.assignment():
                    hw = self.app.consumer.highwater(tp)
                    if hw is not None and hw >= 0:
                        out[(tp.topic, tp.partition)] = hw
            except Exception:  # consumer not ready yet; fall back to the start-up log end
                pass
        return out


# ----------------------------------------------------------------------------------------------
# A thread folding a small stream from its start
# ----------------------------------------------------------------------------------------------


class StreamFollower:
    """Folds every partition of ``streams`` from its start, in a daemon thread, through
    ``fold(envelope) -> changed``; for streams small enough to read whole at every start (the
    ``admin`` stream: pins, configs, router keys), so there is no snapshot and no group.

    The fold runs under :attr:`lock`: a reader that needs a consistent copy of what it folds into
    takes it too. An event the fold raises on is dead-lettered at once (the folds are in memory
    and pure: a retry would fail the same way) and the follower goes on; undecodable records are
    dead-lettered by the consumer. :meth:`wait_caught_up` returns once every partition reached
    the log end read at :meth:`start`.
    """

    def __init__(self, bus: BusSettings, streams: list[str], name: str,
                 fold: Callable[[Envelope], bool]) -> None:
        self.bus = bus
        self.name = name
        self.fold = fold
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._consumer = EventConsumer(bus, streams, assign_all=True, consumer_name=name)
        self._thread = threading.Thread(target=self._run, name=f"follow-{name}", daemon=True)
        self._target: dict[tuple[str, int], int] = {}
        #: Next offset per partition of what the fold has applied, published under :attr:`lock`
        #: after each batch: the consumer's own positions move when a batch is read, before it
        #: is folded, so a reader trusting them could see the log end and an unfolded table.
        self._applied: dict[tuple[str, int], int] = {}

    def start(self) -> StreamFollower:
        self._target = log_end(self.bus, self._consumer.group_id, self._consumer.topics)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                batch = self._consumer.poll_batch(200, 0.2)
            except Exception:  # keep following; the broker client reconnects by itself
                log.exception("%s: poll failed", self.name)
                self._stop.wait(1.0)
                continue
            read = self._consumer.positions()  # poison the consumer dead-lettered included
            with self.lock:
                for d in batch:
                    self._apply(d)
                self._applied = read

    def _apply(self, d) -> None:
        try:
            changed = self.fold(d.envelope)
        except Exception as e:
            log.exception("%s: event %s:%d:%d not applied", self.name, d.topic, d.partition, d.offset)
            self._consumer.dead_letter(d, apply_failed_reason(e), f"{type(e).__name__}: {e}")
            return
        if changed:
            log.info("%s: %s %s by %s", self.name, d.envelope.type, d.envelope.key,
                     getattr(d.envelope.data, "actor", "?"))

    def positions(self) -> dict[tuple[str, int], int]:
        """Next offset per partition: how far the follower has folded (poison included)."""
        return dict(self._applied)  # replaced whole, after the fold: no lock needed to read it

    @property
    def caught_up(self) -> bool:
        pos = self.positions()
        return all(pos.get(tp, 0) >= end for tp, end in self._target.items())

    def wait_caught_up(self, timeout_s: float = 60.0) -> None:
        import time

        deadline = time.monotonic() + timeout_s
        while not self.caught_up:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise TimeoutError(f"{self.name} not at the log end {self._target} after {timeout_s:g}s: "
                                   f"{self.positions()}")
            self._stop.wait(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._consumer.close()
