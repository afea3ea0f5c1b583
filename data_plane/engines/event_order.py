"""The order of events on the virtual clock: which of two events the one-heap loop pops first.

The cluster driver runs every worker on its own timeline and merges them only where the order
matters (hand-offs, buffered notifications, limits). It never builds the one heap of every
event; :class:`EventOrder` answers "did ``x`` come off that heap before ``y``?" from what the
workers' timelines record (boundary times, what woke an idle worker, report times) and the
arrival and timer times. Why that order is the rule: ``docs/engine.md``, "The virtual clock".
"""

from __future__ import annotations

import math
from typing import Any

_INF = math.inf

# Kinds of events at one instant, in the order the one-heap loop pops them. A limit of kind
# C_NONE at ``t`` stops before everything at ``t``.
C_NONE, C_KV, C_REPORT, C_ARRIVAL, C_BEFORE, C_STEP, C_AFTER, C_END = -1, 0, 1, 2, 3, 4, 5, 6
# A step boundary's group: the boundary, then what it pushed for its own instant, in kind order
# (KV delivery if the lag rounds to nothing, hand-offs, releases), then its worker going away.
_G_SELF, _G_KV, _G_HANDOFF, _G_RELEASE, _G_GONE = -3, -2, 0, 1, 9

# Event nodes (what the order comparator walks): ("B", w, b) boundary b of worker w; ("A", i)
# arrival i; ("H", w, b, k) hand-off k of boundary (w, b); ("R", w, b, k) its release k;
# ("K", w, b) the lagged delivery of its KV events; ("G", w, b) worker w gone at it;
# ("P", w, k) load report k of worker w; ("I", w) the start, which scheduled w's first report;
# ("T", j) timer j.


class EventOrder:
    """The comparator over event nodes, reading the live timelines it is given.

    ``workers``: the driver's workers (each with ``times``, ``wake`` and ``report_times``);
    ``timer_at``: (time, kind) of every timer scheduled so far; ``arrival_t``: arrival times,
    set when the run starts. ``release_after_ms`` and ``lag`` place releases and KV deliveries
    relative to the boundary that pushed them.
    """

    __slots__ = ("workers", "timer_at", "arrival_t", "release_after_ms", "lag")

    def __init__(self, workers: list[Any], timer_at: list[tuple[float, int]],
                 release_after_ms: float | None, lag: float) -> None:
        self.workers = workers
        self.timer_at = timer_at
        self.arrival_t: list[float] = []
        self.release_after_ms = release_after_ms
        self.lag = lag

    def release_before(self, rel: tuple, w: int, lc: int, lnode: tuple | None) -> bool:
        """Whether a release at the limit's instant comes before the limit."""
        kind = rel[4]
        if kind != lc:
            return kind < lc
        if kind == C_BEFORE:
            return True  # releases before timers
        return self.before(("R", w, rel[1], rel[2]), lnode)

    def entry_before(self, node: tuple, lc: int, lnode: tuple | None) -> bool:
        """Whether a buffered notification (its event node) comes before the limit."""
        _, c = self._pos(node)
        if c != lc:
            return c < lc
        return c == C_BEFORE or self.before(node, lnode)

    def before(self, x: tuple, y: tuple) -> bool:
        """Whether event ``x`` came off the one heap before event ``y`` (distinct events).

        The heap orders by (time, kind, push order). An event is pushed while the heap
        processes the one that scheduled it, so at equal time and kind, compare what pushed
        them, back until they differ. Step boundaries at one instant pop in push order, each
        followed by what it pushed for that instant (a group, :meth:`_group`). Arrivals were all
        pushed first, in arrival order; timers are compared by the order they were scheduled
        (they are scheduled by events the loop processes in order).
        """
        pos, pusher = self._pos, self._pusher
        while True:
            tx, cx = pos(x)
            ty, cy = pos(y)
            if tx != ty:
                return tx < ty
            if cx != cy:
                return cx < cy
            if cx == C_STEP:
                gx, sx = self._group(x)
                gy, sy = self._group(y)
                if gx == gy:
                    return sx < sy
                x, kx = pusher(gx)
                y, ky = pusher(gy)
            elif cx == C_ARRIVAL or cx == C_AFTER or cx == C_NONE:
                return x[1] < y[1]
            elif cx == C_BEFORE and (x[0] == "T" or y[0] == "T"):
                return y[0] == "T" and (x[0] != "T" or x[1] < y[1])  # releases before timers
            else:
                x, kx = pusher(x)
                y, ky = pusher(y)
            if x == y:
                return kx < ky

    def _pos(self, x: tuple) -> tuple[float, int]:
        """(time, kind) of an event node."""
        tag = x[0]
        if tag == "B" or tag == "H" or tag == "G":
            return self.workers[x[1]].times[x[2]], C_STEP
        if tag == "A":
            return self.arrival_t[x[1]], C_ARRIVAL
        if tag == "R":
            tb = self.workers[x[1]].times[x[2]]
            t = tb + self.release_after_ms
            return t, (C_STEP if t == tb else C_BEFORE)
        if tag == "K":
            tb = self.workers[x[1]].times[x[2]]
            t = tb + self.lag
            return t, (C_STEP if t == tb else C_KV)
        if tag == "P":
            return self.workers[x[1]].report_times[x[2]], C_REPORT
        if tag == "T":
            return self.timer_at[x[1]]
        return -_INF, C_NONE  # "I": the start

    @staticmethod
    def _group(x: tuple) -> tuple[tuple, tuple[int, int]]:
        """A node at its boundary's instant: (the boundary, its place in the group)."""
        tag = x[0]
        if tag == "B":
            return x, (_G_SELF, 0)
        b = ("B", x[1], x[2])
        if tag == "H":
            return b, (_G_HANDOFF, x[3])
        if tag == "R":
            return b, (_G_RELEASE, x[3])
        if tag == "K":
            return b, (_G_KV, 0)
        return b, (_G_GONE, 0)

    def _pusher(self, x: tuple) -> tuple[tuple, int]:
        """(the event that pushed ``x``, the order of ``x`` among its pushes)."""
        tag = x[0]
        if tag == "B":
            w, b = x[1], x[2]
            return self.workers[w].wake.get(b) or (("B", w, b - 1), 0)
        if tag == "P":
            return (("P", x[1], x[2] - 1), 0) if x[2] > 0 else (("I", x[1]), 0)
        if tag == "R":
            return ("B", x[1], x[2]), x[3]
        return ("B", x[1], x[2]), 0  # "K"


class OrderKey:
    """Sort key of one buffered notification in the cluster's delivery of notifications."""

    __slots__ = ("t", "w", "i", "entry", "order")

    def __init__(self, t: float, w: int, i: int, entry: tuple, order: EventOrder) -> None:
        self.t, self.w, self.i, self.entry, self.order = t, w, i, entry, order

    def __lt__(self, other: OrderKey) -> bool:
        if self.t != other.t:
            return self.t < other.t
        if self.w == other.w:
            return self.i < other.i
        return self.order.before(self.entry[1], other.entry[1])
