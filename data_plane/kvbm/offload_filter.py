"""Admission to the slower tiers: which blocks are worth writing to disk (or object storage).
Pure: no I/O, no clock.

The rule (Dynamo KVBM's disk offload filter, ``FrequencyFilter``, with its time made logical):

* Every *use* of a block is recorded: an offload of it from the device (the engine computed or
  loaded it for a request) and an onboard of it from a KVBM tier (a request found it there).
  A block's count is 1 at its first use and doubles at each further use, saturating one doubling
  above the highest threshold (so a block that was hot long ago cannot stay admissible for long).
* Counts decay: a count halves once for every ``half_life_uses`` uses (of any block) recorded
  since the block's own last use. The clock is the number of uses recorded, not wall time, so the
  worker, a replay of its calls and the simulation take the same decisions from the same calls,
  and an idle worker forgets nothing. What decides whether a disk copy will be hit is how much
  traffic comes between two uses of a block (its reuse distance), which this clock measures.
* A block is admitted to a filtered tier when its count is at least ``2 ** (min_uses - 1)``:
  with doubling, the count after ``n`` uses none of which decayed is ``2 ** (n - 1)``, so that is
  "used at least ``min_uses`` times, each use within a half-life of the one before". A block used
  once, or used once more after a long gap (its count decayed back to nothing), is refused.
  ``min_uses`` 1 admits everything, seen or not (the filter is off for that tier).
* The table is bounded: at most ``max_entries`` blocks, the least recently used dropped first
  (a dropped block counts as never seen); entries whose count has decayed to nothing are
  dropped as they reach the front.

Who asks: :class:`~data_plane.kvbm.residency.Residency` when it decides a demotion (a victim of
a full tier cascading one tier down) and when a device eviction falls through a full host into
a lower tier, and :class:`~data_plane.engines.tiers.VirtualTiers` when its cascade does the same:
one implementation for the worker's KVBM and the simulation. The first managed tier (where every
device eviction lands) is never filtered: it is the device's victim cache, and there is no faster
managed tier whose one-off blocks it would be protecting itself from.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, replace

from data_plane.kvbm.errors import KvbmConfigError
from schemas.types import TIER_ORDER, BlockHash, Tier

#: Highest accepted ``min_uses`` (counts stay small integers: at most ``2 ** MAX_MIN_USES``).
MAX_MIN_USES = 16


@dataclass(frozen=True)
class AdmissionConfig:
    """Settings of the admission filter (part of :class:`~data_plane.kvbm.settings.KvbmSettings`,
    and what the simulation's tiers take)."""

    #: Uses a block needs before it is written to disk (Dynamo's threshold: 2, a block goes to
    #: disk only once it has been reused). 1 turns the filter off for disk.
    disk_min_uses: int = 2
    #: Uses a block needs before it is written to object storage. 1 (default): every block the
    #: disk tier evicts is demoted, as before; it already passed the disk's filter.
    object_min_uses: int = 1
    #: A block's count halves for every this many uses (of any block) recorded since its own
    #: last use: two uses further apart than this are not a reuse.
    half_life_uses: int = 65_536
    #: Most blocks the filter remembers (about 100 bytes each); least recently used dropped first.
    max_entries: int = 131_072

    def __post_init__(self) -> None:
        for name in ("disk_min_uses", "object_min_uses"):
            v = getattr(self, name)
            if not isinstance(v, int) or not 1 <= v <= MAX_MIN_USES:
                raise KvbmConfigError(f"admission {name} must be an integer in 1..{MAX_MIN_USES} "
                                      f"(1: every block is admitted), got {v!r}")
        for name in ("half_life_uses", "max_entries"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise KvbmConfigError(f"admission {name} must be an integer >= 1, got {v!r}")

    @property
    def min_uses(self) -> dict[Tier, int]:
        return {Tier.DISK: self.disk_min_uses, Tier.OBJECT: self.object_min_uses}

    @property
    def enabled(self) -> bool:
        return any(n > 1 for n in self.min_uses.values())

    def covering(self, capacities: Mapping[Tier, int]) -> AdmissionConfig:
        """This config with ``half_life_uses`` and ``max_entries`` raised, where needed, to the
        blocks of the tiers above each filtered tier (what :meth:`check_capacities` requires):
        the defaults, sized for a host tier of up to 65,536 blocks, then fit any tier sizes."""
        above = _blocks_above_filtered(self, capacities)
        return replace(self, half_life_uses=max(self.half_life_uses, above),
                       max_entries=max(self.max_entries, above))

    def check_capacities(self, capacities: Mapping[Tier, int]) -> None:
        """Refuse a filter that would refuse every block of a configured tier: a victim of the
        tiers above a filtered one was last used at least their capacity's worth of uses ago
        (LRU), so the filter must remember at least that many blocks, and its half-life must be
        at least that long, or every count has decayed or been dropped by the time it is asked."""
        for tier, above in _filtered_tiers(self, capacities):
            for name in ("max_entries", "half_life_uses"):
                if getattr(self, name) < above:
                    raise KvbmConfigError(
                        f"admission {name} ({getattr(self, name)}) is below the {above} blocks of "
                        f"the tiers above {tier.value}: a block those tiers evict would be "
                        f"forgotten or decayed before the filter is asked, so {tier.value} would "
                        f"refuse every block; raise {name} or set {tier.value}_min_uses to 1")


def _filtered_tiers(config: AdmissionConfig, capacities: Mapping[Tier, int]) -> list[tuple[Tier, int]]:
    """Each configured tier the filter guards (not the first: it is never filtered), with the
    blocks of the configured tiers above it."""
    configured = [t for t in TIER_ORDER if t is not Tier.DEVICE and capacities.get(t, 0) > 0]
    return [(tier, sum(capacities[t] for t in configured[:i])) for i, tier in enumerate(configured)
            if i > 0 and config.min_uses.get(tier, 1) > 1]


def _blocks_above_filtered(config: AdmissionConfig, capacities: Mapping[Tier, int]) -> int:
    return max((above for _, above in _filtered_tiers(config, capacities)), default=0)


#: Admits every block: the behaviour before the filter existed.
ADMIT_ALL = AdmissionConfig(disk_min_uses=1, object_min_uses=1)


@dataclass(frozen=True)
class Verdict:
    """The filter's answer for one block and tier, with why."""

    admitted: bool
    tier: Tier
    #: The block's count now (after decay) and the count the tier needs.
    count: int
    needed: int

    @property
    def reason(self) -> str:
        if self.needed <= 1:
            return f"{self.tier.value} admits every block"
        verb = "admitted" if self.admitted else "refused"
        return f"{self.tier.value} admission {verb}: count {self.count}, needs {self.needed}"


class AdmissionFilter:
    """The frequency table and the decision (see the module docstring)."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self._needed = {t: 1 << (n - 1) for t, n in config.min_uses.items()}
        self._cap = 2 * max(self._needed.values())
        #: Uses recorded so far: the filter's clock.
        self.clock = 0
        # block -> (count at its last use, clock at its last use), least recently used first
        self._table: OrderedDict[BlockHash, tuple[int, int]] = OrderedDict()

    def filters(self, tier: Tier) -> bool:
        """Whether the tier refuses any block at all."""
        return self._needed.get(tier, 1) > 1

    def count(self, block_hash: BlockHash) -> int:
        """The block's count now: halved once per half-life since its last use (0: unknown)."""
        entry = self._table.get(block_hash)
        return 0 if entry is None else self._decayed(entry)

    def _decayed(self, entry: tuple[int, int]) -> int:
        c, at = entry
        halvings = (self.clock - at) // self.config.half_life_uses
        return c >> halvings if halvings < c.bit_length() else 0

    def record_use(self, block_hash: BlockHash) -> int:
        """One use of the block (it advances the clock by one); returns its new count."""
        self.clock += 1
        c = self.count(block_hash)
        c = 1 if c == 0 else min(2 * c, self._cap)
        table = self._table
        table[block_hash] = (c, self.clock)
        table.move_to_end(block_hash)
        while len(table) > self.config.max_entries:
            table.popitem(last=False)
        # Drop what has decayed to nothing from the front (oldest uses first): at most a couple
        # per use, so the table shrinks back after a burst without a scan.
        for _ in range(2):
            oldest = next(iter(table.items()))
            if oldest[0] == block_hash or self._decayed(oldest[1]):
                break
            table.popitem(last=False)
        return c

    def check(self, block_hash: BlockHash, tier: Tier) -> Verdict:
        """Whether ``tier`` admits the block now. No state change."""
        needed = self._needed.get(tier, 1)
        if needed <= 1:
            return Verdict(True, tier, self.count(block_hash), needed)
        c = self.count(block_hash)
        return Verdict(c >= needed, tier, c, needed)

    def __len__(self) -> int:
        return len(self._table)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._table
