"""What the planner core reads from the load view: immutable per-pool records at one instant
(:class:`LoadSnapshot`, built by ``LoadView.snapshot``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from control_plane.planner.windows import WindowStats


class _PerPool(Protocol):
    @property
    def pool(self) -> str: ...


#: A per-pool record (PoolLoad here, the planner's PoolState).
P = TypeVar("P", bound=_PerPool)


@dataclass(frozen=True, slots=True)
class PoolWorker:
    """One worker incarnation as the view knows it."""

    worker_id: str
    pool: str
    role: str
    epoch: int = 0
    #: "starting" | "ready" | "draining" | "gone" | "stale"
    state: str = "ready"
    registered_at_ns: int = 0
    ready_at_ns: int | None = None
    reported_at_ns: int = 0
    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    active_decode_blocks: int = 0
    kv_usage: float = 0.0


@dataclass(frozen=True, slots=True)
class ReplicaCounts:
    starting: int = 0
    ready: int = 0
    draining: int = 0
    stale: int = 0

    @property
    def active(self) -> int:
        """Replicas that are or will be serving (not draining, not lost)."""
        return self.starting + self.ready


@dataclass(frozen=True, slots=True)
class PoolLoad:
    pool: str
    role: str = ""
    replicas: ReplicaCounts = ReplicaCounts()
    workers: tuple[PoolWorker, ...] = ()
    #: Closed tumbling windows, oldest first (empty windows included: zero load is a fact).
    windows: tuple[WindowStats, ...] = ()
    #: The hopping window ending at the last closed step.
    hopping: WindowStats | None = None

    @property
    def last_window(self) -> WindowStats | None:
        return self.windows[-1] if self.windows else None


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """What the planner core reads at ``now_ns``."""

    now_ns: int
    pools: tuple[PoolLoad, ...] = ()
    #: Newest event time folded so far.
    watermark_ns: int = 0

    def pool(self, name: str) -> PoolLoad:
        return pool_entry(self.pools, name, PoolLoad)


def pool_entry(entries: Iterable[P], name: str, empty: Callable[..., P]) -> P:
    """The entry of pool ``name`` among per-pool ``entries``, else ``empty(pool=name)`` (a pool
    nothing is known of yet)."""
    for e in entries:
        if e.pool == name:
            return e
    return empty(pool=name)

