"""A device tier reduced to an LRU of block hashes. Pure.

Workload generators (the index and replay benches) and stand-in workers (tests) need the
``BlockStored``/``BlockRemoved`` a prefix cache would emit, not a whole engine: no reference
counts, no partial blocks, no free queue. :class:`data_plane.engines.block_pool.BlockPool` is the
engine's cache; this is the one rule they all used to write by hand: touching a block makes it the
most recently used, and beyond ``capacity`` the least recently used go first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence


class LruBlocks:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._held: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, block: Hashable) -> bool:
        return block in self._held

    def held_prefix(self, blocks: Sequence[Hashable]) -> int:
        """How many leading ``blocks`` are held (a request's prefix hit)."""
        n = 0
        for b in blocks:
            if b not in self._held:
                break
            n += 1
        return n

    def touch(self, blocks: Iterable[Hashable]) -> tuple[list, list]:
        """Hold ``blocks``, the last one touched the most recently used, then evict down to
        ``capacity``. Returns (the blocks not held before, in touch order; the evicted ones,
        least recently used first). A block both new and evicted is in both lists."""
        held = self._held
        new = []
        for b in blocks:
            if b not in held:
                new.append(b)
                held[b] = None
            held.move_to_end(b)
        evicted = [held.popitem(last=False)[0] for _ in range(max(len(held) - self.capacity, 0))]
        return new, evicted
