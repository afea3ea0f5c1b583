"""Faust app keeping the planner's :class:`LoadView` current from the ``requests`` and
``workers`` topics.

The fold is :meth:`LoadView.apply` (pure); this module only moves records into it
(:class:`~control_plane.streaming.FoldProcessor`; the router's view follows its log without
Faust, ``control_plane/router/stream.py``):

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

import logging
from datetime import timedelta
from pathlib import Path

from control_plane.planner.load_view import LoadView, LoadViewConfig
from control_plane.streaming import FoldProcessor
from common.log.fold import RecordFold
from common.log.reader import KafkaLogReader, LogRecord
from common.log.snapshots import SnapshotStore
from common.settings import BusSettings

log = logging.getLogger(__name__)

STREAMS = ("requests", "workers")


def snapshot_key(cfg: LoadViewConfig) -> str:
    """One key per window geometry: any replica's snapshot of the same geometry will do."""
    return f"load-view:v2:{cfg.tumbling_s:g}:{cfg.hop_step_s:g}:{cfg.hopping_s:g}"


class LoadViewProcessor(FoldProcessor):
    """Owns the Faust app; ``view`` is mutated only by the agent, on the event loop."""

    KIND = "load-view"
    STREAMS = STREAMS

    def __init__(self, bus: BusSettings, planner_id: str, view: LoadView, *, snapshot_every_s: float = 10.0,
                 datadir: Path | None = None, counters: bool = True) -> None:
        # The windowed counters table declares its changelog topic, with as many replicas as
        # the catalog's topics get on this cluster (FoldProcessor.start asks the metadata).
        super().__init__(bus, planner_id, snapshot_every_s=snapshot_every_s,
                         datadir=datadir,
                         app_options={"topic_allow_declare": True})
        self.planner_id = planner_id
        self.view = view
        self.requests_topic = self.catalog.topic("requests")
        self.use_counters = counters
        self.counters = None
        self._count_at = 0.0
        self._fold = RecordFold(view.positions, self._apply_record, self.dead_letter_poison)
        # Counts a workers-topic record released (routings folded before their worker's
        # registration): written with the next requests-topic record, whose partition the
        # table's changelog can take.
        self._deferred: list[tuple[str, str, int]] = []

    @classmethod
    def load_view(cls, bus: BusSettings, config: LoadViewConfig) -> LoadView:
        """The newest snapshot's view for this window geometry, or an empty one."""
        data = SnapshotStore(bus).load_latest(snapshot_key(config))
        if data is None:
            return LoadView(config)
        view = LoadView.from_bytes(data, config)
        log.info("restored load view from snapshot: %d records applied", view.applied)
        return view

    # -- the projection ----------------------------------------------------------------------

    @property
    def snapshot_key(self) -> str:
        return snapshot_key(self.view.config)

    def positions(self) -> dict[tuple[str, int], int]:
        return self.view.positions

    def applied(self) -> int:
        return self.view.applied

    def snapshot_bytes(self) -> bytes:
        return self.view.to_bytes()

    def extend(self, app, topic) -> None:
        if not self.use_counters:
            return
        cfg = self.view.config
        with KafkaLogReader(self.bus) as reader:
            parts = len(reader.partitions(self.requests_topic))
        self.counters = (
            app.Table("pool-counters", default=int, partitions=parts)
            .tumbling(cfg.tumbling_s, expires=timedelta(seconds=cfg.retention_s))
            # each increment lands in the window of the event time the fold counted it at
            .relative_to(lambda event: self._count_at))

    def fold_message(self, m) -> None:
        counted = self._apply(m.topic, m.partition, m.offset, m.value)
        if self.counters is None:
            return
        if m.topic != self.requests_topic:
            self._deferred.extend(counted or ())
            return
        for pool, counter, at in (*self._deferred, *(counted or ())):
            self._count_at = at / 1e9
            self.counters[f"{pool}|{counter}|{m.partition}"] += 1
        self._deferred.clear()

    def _apply(self, topic: str, partition: int, offset: int, value: bytes | None):
        counted = self._fold(LogRecord(topic, partition, offset, 0, None, value))
        if not self.caught_up:
            self.check_caught_up()
        return counted

    def _apply_record(self, rec: LogRecord):
        return self.view.apply_record(self.codec.decode(rec.value), rec.topic, rec.partition, rec.offset)

    # -- counters ----------------------------------------------------------------------------

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
