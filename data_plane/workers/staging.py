"""A worker's staging slots and the holds on them: the NIXL region's slots a handoff's (or a
peer's) blocks are copied into, held under a lease until the reader's done notification or the
lease's end frees them.

Runs on the worker's loop; the notification poller's thread hands done notifications back to it
(:meth:`StagingHolds.notified_from_thread`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from data_plane.engines import AsyncEngine
from data_plane.transfer import Hold, HoldTable, Released, parse_done
from data_plane.workers.metrics import WorkerMetrics
from data_plane.workers.transfer import TransferPlane

log = logging.getLogger(__name__)


class StagingHolds:
    """The staging slots of ``plane`` and the hold table over them.

    ``stats`` is the worker's transfer counters (``staging_waits``, ``holds_<reason>`` ...)."""

    def __init__(self, *, plane: TransferPlane, engine: AsyncEngine, metrics: WorkerMetrics,
                 stats: dict[str, int], lease_s: float, staging_wait_s: float,
                 clock: Callable[[], float]) -> None:
        self.plane = plane
        self.engine = engine
        self.metrics = metrics
        self.stats = stats
        self.lease_s = lease_s
        self.staging_wait_s = staging_wait_s
        self._clock = clock
        self.table = HoldTable()
        #: Request ids in ``table`` (the table has no iterator; release_all() frees them all).
        self._held: set[str] = set()
        #: Set whenever staging slots are freed; a handoff waiting for slots re-tries then.
        self._slots_freed = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop done notifications are handed to."""
        self._loop = loop

    # -- slots ----------------------------------------------------------------------------------

    async def allocate(self, n: int) -> tuple[list[int] | None, float]:
        """``n`` staging slots, waiting (bounded by ``staging_wait_s``) while other handoffs hold
        them; returns the slots (None when none came in time) and the seconds waited. A burst
        of handoffs queues here instead of falling back to recompute."""
        slots = self.plane.slots.allocate(n)
        if slots is not None or n > self.plane.slots.count:
            return slots, 0.0
        self.stats["staging_waits"] += 1
        t0 = time.monotonic()
        deadline = t0 + self.staging_wait_s
        while True:
            self._slots_freed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.stats["staging_wait_timeouts"] += 1
                return None, time.monotonic() - t0
            try:
                await asyncio.wait_for(self._slots_freed.wait(), remaining)
            except TimeoutError:
                pass
            slots = self.plane.slots.allocate(n)
            if slots is not None:
                return slots, time.monotonic() - t0

    def free(self, slots: list[int]) -> None:
        self.plane.slots.free(slots)
        self._slots_freed.set()

    # -- holds ----------------------------------------------------------------------------------

    def hold(self, request_id: str, slots: list[int]) -> Hold:
        """Hold ``slots`` for ``request_id`` under a lease, until its reader's done notification
        or the lease's end frees them."""
        hold = self.table.hold(request_id, slots, self._clock(), self.lease_s)
        self._held.add(request_id)
        return hold

    def release(self, request_id: str) -> None:
        """Free ``request_id``'s hold now, if it has one."""
        rel = self.table.release(request_id, self._clock())
        if rel is not None:
            self._released(rel)

    def release_all(self) -> None:
        for rid in list(self._held):
            self.release(rid)

    def notified_from_thread(self, peer: str, msg: bytes) -> None:
        """A NIXL notification (poller thread): a reader's done frees its hold on the loop."""
        done = parse_done(msg)
        if done is None:
            log.debug("ignoring notification %r from %s", msg, peer)
            return
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._on_done, done.request_id, done.n_consumers)
        except RuntimeError:  # the loop closed under us: the process is exiting
            pass

    def _on_done(self, request_id: str, n_consumers: int) -> None:
        rel = self.table.notify(request_id, n_consumers, self._clock())
        if rel is not None:
            self._released(rel)

    def _released(self, rel: Released) -> None:
        self.engine.release(rel.request_id)
        self.free(rel.block_ids)
        self._held.discard(rel.request_id)
        self.stats[f"holds_{rel.reason.value}"] += 1
        m = self.metrics
        m.labels(m.hold_releases, rel.reason.value).inc()
        m.labels(m.holds).set(len(self.table))
        log.info("handoff %s released (%s) after %.3fs: %d blocks", rel.request_id, rel.reason.value,
                 rel.held_s, len(rel.block_ids))

    async def expire_loop(self) -> None:
        """Free holds whose lease ran out (a task for as long as the worker serves)."""
        while True:
            nxt = self.table.next_expiry()
            delay = 0.5 if nxt is None else min(0.5, max(nxt - self._clock(), 0.0))
            await asyncio.sleep(delay)
            for rel in self.table.expire(self._clock()):
                self._released(rel)
