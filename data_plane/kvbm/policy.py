"""Eviction policies: which block of a full tier goes next. Pure (no I/O, no clock).

One policy instance per tier. The manager tells it about membership (``insert``/``remove``) and
use (``touch``); ``victim`` names the next block to evict, skipping those the caller must keep
(pinned blocks, the block being admitted). Order is by events, never by wall-clock time, so a
replay of the same calls picks the same victims.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Protocol

from data_plane.kvbm.errors import KvbmConfigError
from schemas.types import BlockHash

Skip = Callable[[BlockHash], bool]


class EvictionPolicy(Protocol):
    """Keeps the members of one tier in eviction order."""

    #: Short name used in settings and in the reasons of eviction decisions.
    name: str

    def insert(self, block_hash: BlockHash) -> None:
        """A block became a member (counts as its first use)."""

    def touch(self, block_hash: BlockHash) -> None:
        """A member was used (hit, onboarded from, offloaded onto). Unknown hashes are ignored."""

    def remove(self, block_hash: BlockHash) -> None:
        """A block left the tier. Unknown hashes are ignored."""

    def victim(self, skip: Skip | None = None) -> BlockHash | None:
        """The next block to evict, not one for which ``skip`` is true; None if there is none."""

    def order(self) -> Iterator[BlockHash]:
        """Every member, next victim first."""

    def __len__(self) -> int: ...

    def __contains__(self, block_hash: object) -> bool: ...


class LruPolicy:
    """Least recently used first. O(1) per operation."""

    name = "lru"

    def __init__(self) -> None:
        self._od: OrderedDict[BlockHash, None] = OrderedDict()

    def insert(self, block_hash: BlockHash) -> None:
        self._od[block_hash] = None
        self._od.move_to_end(block_hash)

    def touch(self, block_hash: BlockHash) -> None:
        if block_hash in self._od:
            self._od.move_to_end(block_hash)

    def remove(self, block_hash: BlockHash) -> None:
        self._od.pop(block_hash, None)

    def victim(self, skip: Skip | None = None) -> BlockHash | None:
        for h in self._od:
            if skip is None or not skip(h):
                return h
        return None

    def order(self) -> Iterator[BlockHash]:
        return iter(list(self._od))

    def __len__(self) -> int:
        return len(self._od)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._od


class LfuPolicy:
    """Least frequently used first, least recently used among equals.

    Frequency-aware in the spirit of Dynamo's KVBM offload filter: a block reused across requests
    (a shared system prompt) outlives a block seen once, even if the one-off is more recent. Counts
    saturate at ``max_frequency`` so a block that was hot long ago cannot stay forever: once the
    saturated blocks tie, recency decides among them. Operations are O(1) except ``victim``, which
    scans the (at most ``max_frequency``) non-empty buckets in order.
    """

    name = "lfu"

    def __init__(self, max_frequency: int = 8) -> None:
        if max_frequency < 1:
            raise KvbmConfigError("max_frequency must be >= 1")
        self.max_frequency = max_frequency
        self._freq: dict[BlockHash, int] = {}
        # frequency -> members in recency order (oldest first)
        self._buckets: dict[int, OrderedDict[BlockHash, None]] = {}

    def _put(self, block_hash: BlockHash, f: int) -> None:
        self._freq[block_hash] = f
        self._buckets.setdefault(f, OrderedDict())[block_hash] = None

    def _take(self, block_hash: BlockHash) -> int | None:
        f = self._freq.pop(block_hash, None)
        if f is not None:
            bucket = self._buckets[f]
            del bucket[block_hash]
            if not bucket:
                del self._buckets[f]
        return f

    def insert(self, block_hash: BlockHash) -> None:
        f = self._take(block_hash)
        self._put(block_hash, min((f or 0) + 1, self.max_frequency))

    def touch(self, block_hash: BlockHash) -> None:
        f = self._take(block_hash)
        if f is not None:
            self._put(block_hash, min(f + 1, self.max_frequency))

    def remove(self, block_hash: BlockHash) -> None:
        self._take(block_hash)

    def frequency(self, block_hash: BlockHash) -> int:
        return self._freq.get(block_hash, 0)

    def victim(self, skip: Skip | None = None) -> BlockHash | None:
        for f in sorted(self._buckets):
            for h in self._buckets[f]:
                if skip is None or not skip(h):
                    return h
        return None

    def order(self) -> Iterator[BlockHash]:
        return iter([h for f in sorted(self._buckets) for h in self._buckets[f]])

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._freq


#: Policy names accepted by ``KvbmSettings.policy``.
POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LruPolicy, "lfu": LfuPolicy}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise KvbmConfigError(
            f"unknown eviction policy {name!r}; known: {sorted(POLICIES)}") from None
