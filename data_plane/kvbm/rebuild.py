"""What a restart keeps of one persistent tier: the log's claims sorted against the store's scan.

Pure but for ``check`` (the manager's read-back of one block): :meth:`KvBlockManager.rebuild
<data_plane.kvbm.manager.KvBlockManager.rebuild>` plans every persistent tier first (a storage
error raised while planning leaves the manager empty, so the worker can simply retry), then
applies the plans: deletes, ``BlockRemoved`` / ``BlockStored`` events, residency.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from schemas.types import BlockHash, Tier


@dataclass(frozen=True)
class TierPlan:
    """One tier's blocks by fate, each list in the order it is applied."""

    tier: Tier
    #: Verified and within capacity: resident again, least recent first.
    ok: list[BlockHash]
    #: Claimed, not in the store (every claim of a tier this manager does not manage).
    missing: list[BlockHash]
    #: Claimed, present, failed verification (wrong size or read-back).
    corrupt: list[BlockHash]
    #: Verified but over the tier's capacity (the least recent): deleted.
    excess: list[BlockHash]
    #: In the store, never claimed, verified and adopted (``adopt_orphans``, room left).
    adopt: list[BlockHash]
    #: In the store, never claimed, not adopted: deleted.
    orphans: list[BlockHash]


def plan_tier(tier: Tier, claims: list[BlockHash], present: Mapping[BlockHash, int] | None, size: int,
              capacity: int, check: Callable[[BlockHash], str], adopt_orphans: bool) -> TierPlan:
    """Sort ``claims`` (distinct, least recent first) against ``present`` (the store's scan:
    hash -> stored size; None: the tier is not managed here). A block of the wrong ``size`` is
    corrupt without a read; otherwise ``check`` says "ok", "missing" or "corrupt". Orphans are
    checked in hash order, and adopted only while the verified claims leave room."""
    if present is None:
        return TierPlan(tier, [], claims, [], [], [], [])
    ok: list[BlockHash] = []
    missing: list[BlockHash] = []
    corrupt: list[BlockHash] = []
    for h in claims:
        if h not in present:
            missing.append(h)
        elif present[h] != size:
            corrupt.append(h)
        else:
            {"ok": ok, "missing": missing, "corrupt": corrupt}[check(h)].append(h)
    claimed_set = set(claims)
    room = max(capacity - len(ok), 0)
    adopt: list[BlockHash] = []
    orphans: list[BlockHash] = []
    for h in sorted(present):
        if h in claimed_set:
            continue
        if adopt_orphans and len(adopt) < room and present[h] == size and check(h) == "ok":
            adopt.append(h)
        else:
            orphans.append(h)
    cut = max(len(ok) - capacity, 0)
    return TierPlan(tier, ok[cut:], missing, corrupt, ok[:cut], adopt, orphans)
