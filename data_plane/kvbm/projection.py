"""Residency claimed by the log: a pure fold over one worker's KV events.

On restart the worker reads its own past events back from Kafka and folds them here; the result is
what the log *says* each tier holds, which :meth:`KvBlockManager.rebuild` then checks against the
bytes actually on disk and in the bucket.
"""

from __future__ import annotations

from collections.abc import Iterable

from schemas.events import (
    AllBlocksCleared,
    BlockMoved,
    BlockRemoved,
    BlockStored,
    Event,
    WorkerRegistered,
)
from schemas.types import PERSISTENT_TIERS, TIER_ORDER, BlockHash, CacheGroup, Tier, WorkerId

VOLATILE_TIERS: tuple[Tier, ...] = tuple(t for t in TIER_ORDER if t not in PERSISTENT_TIERS)


def fold_residency(events: Iterable[Event], worker_id: WorkerId, *,
                   dp_rank: int = 0) -> dict[Tier, list[BlockHash]]:
    """Blocks per tier after ``events`` (in log order), least recently reported first.

    Folds ``BlockStored``/``BlockRemoved``/``BlockMoved``/``AllBlocksCleared`` of this worker and
    rank in the full-attention group (the only group the KVBM manages; other groups reuse the same
    hashes). ``WorkerRegistered`` empties the volatile tiers: a new incarnation starts with empty
    device and host memory. Other events are ignored.
    """
    tiers: dict[Tier, dict[BlockHash, None]] = {t: {} for t in TIER_ORDER}
    for ev in events:
        if getattr(ev, "worker_id", None) != worker_id:
            continue
        tp = type(ev)
        if tp is WorkerRegistered:
            for t in VOLATILE_TIERS:
                tiers[t].clear()
            continue
        if tp not in (BlockStored, BlockRemoved, BlockMoved, AllBlocksCleared):
            continue
        if ev.dp_rank != dp_rank:  # type: ignore[attr-defined]
            continue
        if tp is AllBlocksCleared:
            for t in ([ev.tier] if ev.tier is not None else TIER_ORDER):  # type: ignore[attr-defined]
                tiers[t].clear()
            continue
        if ev.cache_group is not CacheGroup.FULL_ATTENTION:  # type: ignore[attr-defined]
            continue
        if tp is BlockStored:
            d = tiers[ev.tier]  # type: ignore[attr-defined]
            for h in ev.block_hashes:  # type: ignore[attr-defined]
                d.pop(h, None)
                d[h] = None
        elif tp is BlockRemoved:
            d = tiers[ev.tier]  # type: ignore[attr-defined]
            for h in ev.block_hashes:  # type: ignore[attr-defined]
                d.pop(h, None)
        else:  # BlockMoved
            src, dst = tiers[ev.from_tier], tiers[ev.to_tier]  # type: ignore[attr-defined]
            for h in ev.block_hashes:  # type: ignore[attr-defined]
                src.pop(h, None)
                dst.pop(h, None)
                dst[h] = None
    return {t: list(d) for t, d in tiers.items()}


def claimed_persistent(events: Iterable[Event], worker_id: WorkerId, *,
                       dp_rank: int = 0) -> dict[Tier, list[BlockHash]]:
    """:func:`fold_residency` restricted to the tiers that survive a restart (disk, object)."""
    folded = fold_residency(events, worker_id, dp_rank=dp_rank)
    return {t: folded[t] for t in TIER_ORDER if t in PERSISTENT_TIERS}
