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

import logging
import time
from collections.abc import Callable

from control_plane.index.errors import IndexRejected
from control_plane.router.health import HealthThresholds, RouterHealth, assess
from control_plane.router.view import EndpointAllowlist, RouterView, rejected_poison
from control_plane.streaming import FoldProcessor
from common.log.fold import Poisoned, RecordFold
from common.log.reader import LogRecord, RecordBatch
from common.log.snapshots import SnapshotStore
from common.settings import BusSettings

log = logging.getLogger(__name__)

STREAMS = ("kv", "workers")


def snapshot_key(view: RouterView) -> str:
    return f"router-view:{view.hash_algo}:{view.block_size}"


class RouterViewProcessor(FoldProcessor):
    """Owns the Faust app; ``view`` is mutated only by the agent, on the event loop."""

    KIND = "router-view"
    STREAMS = STREAMS
    FOLDS_BATCHES = True

    def __init__(
        self,
        bus: BusSettings,
        router_id: str,
        view: RouterView,
        *,
        snapshot_every_s: float = 5.0,
        thresholds: HealthThresholds = HealthThresholds(),
        on_applied: Callable[[object], None] | None = None,
        fetch_min_bytes: int | None = None,
        fetch_wait_ms: int | None = None,
    ) -> None:
        super().__init__(bus, router_id, snapshot_every_s=snapshot_every_s, fetch_min_bytes=fetch_min_bytes,
                         fetch_wait_ms=fetch_wait_ms)
        self.router_id = router_id
        self.view = view
        self.thresholds = thresholds
        self._on_applied = on_applied
        self._fold = RecordFold(view.positions, self._apply_record, self.dead_letter_poison)

    @classmethod
    def load_view(cls, bus: BusSettings, hash_algo: str, block_size: int,
                  allowlist: EndpointAllowlist | None = None) -> RouterView:
        """The newest snapshot's view for this configuration, or an empty one."""
        empty = RouterView(hash_algo, block_size, allowlist)
        data = SnapshotStore(bus).load_latest(snapshot_key(empty))
        if data is None:
            return empty
        view = RouterView.restore(data, allowlist)
        log.info("restored router view from snapshot: %d records applied, positions %s",
                 view.applied, view.positions)
        return view

    # -- the projection ----------------------------------------------------------------------

    @property
    def snapshot_key(self) -> str:
        return snapshot_key(self.view)

    def positions(self) -> dict[tuple[str, int], int]:
        return self.view.positions

    def applied(self) -> int:
        return self.view.applied

    def snapshot_bytes(self) -> bytes:
        return self.view.snapshot()

    def fold_message(self, m) -> None:
        """One record from Faust. Unless someone listens to each record's outcome, it goes
        through the batch fold as a batch of one: a kv record is then verified and folded in the
        native core in one call (the one-record path checks its signature in Python first, which
        was half the fold's CPU)."""
        ts_ms = int((m.timestamp or 0) * 1000)
        if self._on_applied is not None:
            self._apply(m.topic, m.partition, m.offset, m.value, ts_ms)
            return
        self._fold.fold_batch(RecordBatch(m.topic, m.partition, [m.offset], [ts_ms], [None], [m.value]), self._run)
        if not self.caught_up:
            self.check_caught_up()

    def fold_batch(self, batch: RecordBatch) -> None:
        """The same fold as ``fold_message`` of each record, whole runs of kv records at a time
        in the native index (one record at a time when someone listens to each)."""
        self._fold.fold_batch(batch, self._run if self._on_applied is None else None)

    def _run(self, batch: RecordBatch, start: int) -> tuple[int, Poisoned | None]:
        end, rejected = self.view.apply_run(batch, start, self.codec)
        if rejected is None:
            return end, None
        return end, rejected_poison(rejected, self.codec.peek(batch.values[end]).key.encode())

    def _apply(self, topic: str, partition: int, offset: int, value: bytes | None, ts_ms: int) -> None:
        applied = self._fold(LogRecord(topic, partition, offset, ts_ms, None, value))
        if applied is not None and self._on_applied is not None:
            self._on_applied(applied)
        if not self.caught_up:
            self.check_caught_up()

    def _apply_record(self, rec: LogRecord):
        try:
            return self.view.apply_record(rec.value, rec.topic, rec.partition, rec.offset, rec.ts_ms, self.codec)
        except IndexRejected as e:
            raise rejected_poison(e, self.codec.peek(rec.value).key.encode()) from None

    # -- health ------------------------------------------------------------------------------

    def health(self) -> RouterHealth:
        return assess(self.view.positions, self.highwaters(), self.view.last_ts_ms,
                      self.view.stale_workers(), time.time() * 1000, self.caught_up, self.thresholds,
                      self.stopped_reason())
