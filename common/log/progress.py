"""Is a fold still following its log? Pure: the caller feeds it the time, the fold's positions
and the log end it read itself, and it says whether the fold stopped while the log moved.

Issue 36: a foreign member joined a router view's consumer group and was handed its partitions;
the view's consumer crashed and left the group, its applied count stood still, and ``/health``
kept answering ``EXACT lag 0``: the lag was measured against the high watermarks the view's own
consumer had last seen. A view's health must come from the log end read independently (a
watermark query, :func:`control_plane.streaming.log_end`) and from whether the fold advances:

* a fold at the log end is following, however long nothing arrives;
* a fold behind the log end that has not advanced for ``stall_after_s`` has stopped: its view
  is stale while the log moves (:meth:`ProgressWatch.observe` returns why);
* a partition of the log that the fold was never handed is behind by definition: its whole
  length counts (a view that lost partitions to another member of its group stops on them).
"""

from __future__ import annotations

from dataclasses import dataclass

TP = tuple[str, int]


def behind(positions: dict[TP, int], ends: dict[TP, int]) -> int:
    """Records of the log the fold has not applied, over every partition of ``ends``."""
    return sum(max(end - positions.get(tp, 0), 0) for tp, end in ends.items())


@dataclass
class ProgressWatch:
    """Feed it every ``observe``; it keeps only when the fold last moved (or was at the end)."""

    #: How long a fold behind the log end may go without advancing before it counts as stopped.
    stall_after_s: float = 15.0
    _applied: int = -1
    _moved_at: float | None = None

    def observe(self, now_s: float, applied: int, positions: dict[TP, int], ends: dict[TP, int]) -> str | None:
        """Why the fold is stopped, or None. ``applied``: records folded so far (any counter
        that grows with every record folded); ``ends``: the log end read now."""
        lag = behind(positions, ends)
        if self._moved_at is None or applied != self._applied or lag == 0:
            self._applied, self._moved_at = applied, now_s
            return None
        idle = now_s - self._moved_at
        if idle < self.stall_after_s:
            return None
        return (f"the fold stopped: {lag} records behind the log end and nothing applied for {idle:.0f} s "
                f"(applied {applied})")
