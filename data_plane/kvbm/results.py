"""What the KV block manager's public calls return: an onboard's matched prefix, block by block,
and a restart's rebuild report. Values only (frozen)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from schemas.types import TIER_ORDER, BlockHash, Tier


@dataclass(frozen=True)
class OnboardedBlock:
    block_hash: BlockHash
    #: Fastest tier the block was in when the call started (where the hit was served from).
    found_in: Tier
    #: Host slot holding the block now (offset = slot * bytes_per_block from the host pool's
    #: base address); None when the block is only on the device.
    host_slot: int | None


@dataclass(frozen=True)
class OnboardResult:
    """The matched prefix of an onboard call, block by block, and why it stopped."""

    blocks: tuple[OnboardedBlock, ...]
    requested: int
    #: "complete" (whole prefix), "miss" (no tier had the next block), "corrupt" (every copy of
    #: the next block failed verification and was removed), "host_full" (no host slot could be
    #: freed: all pinned), "error" (I/O error reading the next block), "no_host_tier".
    stop_reason: str
    #: Hashes pinned in host by this call; pass them to ``release`` when done.
    pinned: tuple[BlockHash, ...] = ()

    @property
    def hashes(self) -> list[BlockHash]:
        return [b.block_hash for b in self.blocks]

    def found_by_tier(self) -> dict[Tier, int]:
        counts = Counter(b.found_in for b in self.blocks)
        return {t: counts[t] for t in TIER_ORDER if counts[t]}


@dataclass(frozen=True)
class RebuildReport:
    """Outcome of :meth:`KvBlockManager.rebuild`, per persistent tier."""

    #: Blocks now served, least recent first.
    verified: dict[Tier, list[BlockHash]] = field(default_factory=dict)
    #: Claimed by the log, not in the store: reported removed.
    missing: dict[Tier, list[BlockHash]] = field(default_factory=dict)
    #: Claimed, present, failed verification: deleted and reported removed.
    corrupt: dict[Tier, list[BlockHash]] = field(default_factory=dict)
    #: Verified but over the tier's (smaller) capacity: deleted and reported removed.
    over_capacity: dict[Tier, list[BlockHash]] = field(default_factory=dict)
    #: In the store, never reported (written just before a crash): deleted, or adopted with
    #: ``BlockStored`` when ``adopt_orphans``.
    orphans_deleted: dict[Tier, list[BlockHash]] = field(default_factory=dict)
    orphans_adopted: dict[Tier, list[BlockHash]] = field(default_factory=dict)

    def removed(self, tier: Tier) -> list[BlockHash]:
        return [*self.missing.get(tier, []), *self.corrupt.get(tier, []),
                *self.over_capacity.get(tier, [])]
