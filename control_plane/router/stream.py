"""Keeps a router's :class:`RouterView` current inside the router process.

Every router replica must see *all* partitions of ``kv`` and ``workers`` (each needs the whole
index), so each follows every partition itself, assigned, in no consumer group
(:class:`~control_plane.streaming.TailProcessor`): there is no group for anyone else to join,
and nothing to seed. Start-up from a checkpoint: the newest snapshot's view (its positions
inside it) is restored and the log tail from those positions folded in batches before the
router serves; the tail then follows from there. Nothing is committed: a process killed with
-9 restarts from its snapshot, which is what the view is rebuilt from.

The fold is :meth:`RouterView.apply_run` / :meth:`RouterView.apply_record` (pure), run on the
event loop, where the router's decisions read the view. Records that cannot be decoded or that
the index refuses (another hash algorithm, block size, or a hybrid cache group) go to the
dead-letter topic; the fold continues.
"""

from __future__ import annotations

import logging
import time

from control_plane.index.errors import IndexRejected
from control_plane.router.health import HealthThresholds, RouterHealth, assess
from control_plane.router.view import EndpointAllowlist, RouterView, rejected_poison
from control_plane.streaming import TailProcessor
from common.log.fold import Poisoned, RecordFold
from common.log.reader import LogRecord, RecordBatch
from common.log.snapshots import SnapshotStore
from common.settings import BusSettings

log = logging.getLogger(__name__)

STREAMS = ("kv", "workers")


def snapshot_key(view: RouterView) -> str:
    return f"router-view:{view.hash_algo}:{view.block_size}"


class RouterViewProcessor(TailProcessor):
    """Follows ``kv`` and ``workers`` into ``view``; the view is mutated only on the event loop
    once started (before, by :meth:`restore`, from any thread)."""

    KIND = "router-view"
    STREAMS = STREAMS

    def __init__(
        self,
        bus: BusSettings,
        router_id: str,
        view: RouterView,
        *,
        snapshot_every_s: float = 5.0,
        thresholds: HealthThresholds = HealthThresholds(),
        fetch_min_bytes: int | None = None,
        fetch_wait_ms: int | None = None,
    ) -> None:
        super().__init__(bus, router_id, snapshot_every_s=snapshot_every_s, fetch_min_bytes=fetch_min_bytes,
                         fetch_wait_ms=fetch_wait_ms)
        self.router_id = router_id
        self.view = view
        self.thresholds = thresholds
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

    def fold_batch(self, batch: RecordBatch) -> None:
        """One partition's records in offset order: whole runs of kv records at a time in the
        native index (verified and folded in one call), the rest one by one."""
        self._fold.fold_batch(batch, self._run)

    def _run(self, batch: RecordBatch, start: int) -> tuple[int, Poisoned | None]:
        end, rejected = self.view.apply_run(batch, start, self.codec)
        if rejected is None:
            return end, None
        return end, rejected_poison(rejected, self.codec.peek(batch.values[end]).key.encode())

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
