"""What the prefix index answers with: the native index (:mod:`.native`) and its differential
oracle (``tests/oracles/prefix_index.py``) both return these, and the router's ``KvIndex`` port
(``control_plane/router/ports.py``) is typed with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

import msgspec

from schemas.types import TIER_ORDER, Tier, WorkerId


class ApplyOutcome(str, Enum):
    """What :meth:`~control_plane.index.native.NativePrefixIndex.apply` did with an event."""

    APPLIED = "applied"
    #: Already applied (redelivery): nothing changed.
    DUPLICATE = "duplicate"
    #: From an older epoch than the worker's (or producer's) current one: dropped.
    FENCED = "fenced"
    #: Sequenced, but not something the index folds (other event types, other cache groups).
    IGNORED = "ignored"


class WorkerRank(NamedTuple):
    """One KV cache: a worker process and its data-parallel rank (each rank has its own)."""

    worker_id: WorkerId
    dp_rank: int = 0


class Match(msgspec.Struct, frozen=True, gc=False):
    """How much of a query's prefix one worker holds.

    ``by_tier`` counts the matched blocks by the *fastest* tier holding each one, in
    :data:`schemas.types.TIER_ORDER` (device, host, disk, object); it sums to ``depth``.
    ``stale`` means the worker's entries may be out of date (docs/prefix-index.md).
    (A msgspec struct, not a NamedTuple: five times cheaper to build on the lookup path.)
    """

    depth: int
    by_tier: tuple[int, int, int, int]
    stale: bool = False

    def tier_counts(self) -> dict[Tier, int]:
        return dict(zip(TIER_ORDER, self.by_tier))


@dataclass(frozen=True)
class IndexStats:
    """A summary for metrics and debugging (computed on demand, O(workers))."""

    distinct_hashes: int
    #: Blocks held per cache and tier (only non-zero entries).
    blocks: dict[WorkerRank, dict[Tier, int]]
    stale: tuple[WorkerRank, ...]
    deregistered: tuple[WorkerId, ...]
    #: applied, duplicate, fenced, ignored, rejected, gaps, new_epochs, resyncs.
    counters: dict[str, int]
