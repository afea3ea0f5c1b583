"""Paged KV block pool with prefix caching, following vLLM v1's ``BlockPool`` semantics. Pure.

vLLM's semantics it follows, and its deliberate differences from vLLM and why: ``docs/engine.md``,
"The block pool".
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from itertools import repeat, starmap
from operator import attrgetter

from schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from schemas.types import BlockHash, Tier, WorkerId

_block_hash = attrgetter("block_hash")
#: Runs an iterator to its end (C speed), keeping nothing: ``deque(it, maxlen=0)``.
_drain = partial(deque, maxlen=0)

#: ``on_evict(block_hash, parent_hash)``: called when the last device copy of a cached block is
#: evicted (after its ``BlockRemoved`` is queued), so a tiered block manager can offload it.
#: ``parent_hash`` is the previous block of the chain (None for a sequence's first block).
EvictHook = Callable[[BlockHash, BlockHash | None], None]


class KVCacheBlock:
    """One physical block. Mutable; owned by the pool, referenced by requests."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "parent_hash", "qtag")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        #: Chained hash once the block is full and cached; None while partial or after eviction.
        self.block_hash: BlockHash | None = None
        self.parent_hash: BlockHash | None = None
        #: The free queue's stamp of this block's live entry (see FreeBlockQueue).
        self.qtag = 0

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """LRU list of free blocks with O(1) ``popleft``, ``remove``, ``append`` and ``appendleft``.

    vLLM keeps a doubly linked list. Here the list is two stacks of ``(stamp, block)`` entries,
    ``front`` (blocks put at the head, the newest one first) then ``main`` (a deque: appended at
    the tail, taken from the left), and a block's ``qtag`` is the stamp of its live entry:
    ``remove`` only clears the block's tag (``touch`` takes a free block out of the middle), and
    the entries it leaves behind, like those of a block queued again since, are skipped when
    reached. So the live entries, in order, are exactly vLLM's list, and taking ``n`` blocks from
    the head is a few calls into C (``pop_many``) instead of ``n`` unlinks.
    """

    __slots__ = ("front", "main", "num_free", "stamp")

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.front: list[tuple[int, KVCacheBlock]] = []
        self.main: deque[tuple[int, KVCacheBlock]] = deque()
        self.num_free = 0
        self.stamp = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVCacheBlock:
        if self.num_free == 0:
            raise IndexError("no free block")
        return self.pop_many(1)[0]

    def pop_many(self, n: int) -> list[KVCacheBlock]:
        """The ``n`` blocks at the head, in order (the caller checked ``n <= num_free``)."""
        out: list[KVCacheBlock] = []
        front = self.front
        while front and len(out) < n:
            s, b = front.pop()
            if b.qtag == s:
                out.append(b)
        need = n - len(out)
        main = self.main
        popleft = main.popleft
        while need > 0:
            # Pop exactly as many entries as blocks still needed (the stale ones among them
            # are dropped: they are behind no live entry), then go again for the shortfall.
            got = [b for s, b in starmap(popleft, repeat((), need)) if b.qtag == s]
            out.extend(got)
            need -= len(got)
        self.num_free -= n
        return out

    def remove(self, b: KVCacheBlock) -> None:
        b.qtag = 0
        self.num_free -= 1

    def appendleft(self, b: KVCacheBlock) -> None:
        s = self.stamp = self.stamp + 1
        b.qtag = s
        self.front.append((s, b))
        self.num_free += 1

    def append(self, b: KVCacheBlock) -> None:
        s = self.stamp = self.stamp + 1
        b.qtag = s
        self.main.append((s, b))
        self.num_free += 1

    def __iter__(self):
        for s, b in reversed(self.front):
            if b.qtag == s:
                yield b
        for s, b in self.main:
            if b.qtag == s:
                yield b


class BlockPool:
    """The device tier of one worker: ``num_blocks`` blocks of ``block_size`` tokens.

    ``hash_algo`` is stamped on every ``BlockStored`` so the prefix index can refuse a producer
    whose hashes would never match its own (see :class:`common.hashing.HashConfig`).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        worker_id: WorkerId,
        hash_algo: str,
        enable_caching: bool = True,
        on_evict: EvictHook | None = None,
        reuse_uncached_first: bool = False,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.worker_id = worker_id
        self.hash_algo = hash_algo
        self.enable_caching = enable_caching
        self.on_evict = on_evict
        self.reuse_uncached_first = reuse_uncached_first
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        #: First copy of each cached hash. Extra copies (rare) live in ``_extra_copies``.
        self._cached: dict[BlockHash, KVCacheBlock] = {}
        self._extra_copies: dict[BlockHash, list[KVCacheBlock]] = {}
        self._events: list[KvEvent] = []

    # ---------------------------------------------------------------------------------- queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request references (cached or not): what an allocation can take."""
        return self.free_queue.num_free

    @property
    def num_active_blocks(self) -> int:
        """Blocks referenced by at least one request."""
        return self.num_blocks - self.free_queue.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests (vLLM's ``kv_cache_usage_perc``)."""
        return 1.0 - self.free_queue.num_free / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Distinct hashes resident on the device (referenced or free)."""
        return len(self._cached)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    def cached_hashes(self) -> set[BlockHash]:
        return set(self._cached)

    def free_order(self) -> list[int]:
        """Block ids of the free queue, head (next to be allocated) first. For tests and tools."""
        return [b.block_id for b in self.free_queue]

    # ------------------------------------------------------------------------------- mutations

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks (a free one leaves the free queue)."""
        fq = self.free_queue
        for b in blocks:
            if b.ref_cnt == 0:
                b.qtag = 0  # FreeBlockQueue.remove
                fq.num_free -= 1
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[KVCacheBlock]:
        """``n`` blocks from the free-queue head, evicting the cached ones. Raises if short."""
        fq = self.free_queue
        if n > fq.num_free:
            raise ValueError(f"cannot allocate {n} blocks, {fq.num_free} free")
        cached = self._cached
        extra = self._extra_copies
        hook = self.on_evict
        if n == 1 and not extra and hook is None:
            # A decoding request's next block: the same as below for one block.
            b = fq.pop_many(1)[0]
            h = b.block_hash
            if h is not None:
                del cached[h]
                b.block_hash = None
                b.parent_hash = None
                self._queue_removed([h])
            b.ref_cnt = 1
            return [b]
        out = fq.pop_many(n)
        if not extra and hook is None:
            # The common case, in bulk: with no duplicated hash every cached block is its
            # hash's only copy, so each evicted block just leaves the map, and the evictions
            # form one burst in allocation order (the same BlockRemoved ``_evict`` builds).
            evicted = [b for b in out if b.block_hash is not None]
            if evicted:
                removed = list(map(_block_hash, evicted))
                _drain(map(cached.__delitem__, removed))
                for b in evicted:
                    b.block_hash = None
                    b.parent_hash = None
                self._queue_removed(removed)
            for b in out:
                b.ref_cnt = 1
            return out
        # General case, block by block: ``_evict`` for a duplicated hash, and the hook called
        # right after each block's BlockRemoved is queued.
        removed: list[BlockHash] = []
        for b in out:
            h = b.block_hash
            if h is not None:
                if extra and h in extra:
                    if removed:
                        self._queue_removed(removed)
                        removed = []
                    self._evict(b)
                else:
                    parent = b.parent_hash
                    b.block_hash = None
                    b.parent_hash = None
                    if cached.get(h) is b:
                        del cached[h]
                        removed.append(h)
                        if hook is not None:
                            self._queue_removed(removed)
                            removed = []
                            hook(h, parent)
            b.ref_cnt = 1
        if removed:
            self._queue_removed(removed)
        return out

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block, in the given order; blocks reaching 0 go to the tail.

        Pass a request's blocks *last first* (vLLM's ``reversed(blocks)``) so its tail is evicted
        before its head. With ``reuse_uncached_first`` a block without a hash (a partial one)
        goes to the *head* instead: the next allocation takes it before evicting anything.
        """
        # FreeBlockQueue.append / appendleft, inline (a finishing request frees ~190 blocks).
        fq = self.free_queue
        stamp = fq.stamp
        freed = 0
        tail = fq.main.append
        head = fq.front.append if self.reuse_uncached_first else tail
        for b in blocks:
            r = b.ref_cnt - 1
            b.ref_cnt = r
            if r == 0:
                stamp += 1
                b.qtag = stamp
                if b.block_hash is None:
                    head((stamp, b))
                else:
                    tail((stamp, b))
                freed += 1
        fq.stamp = stamp
        fq.num_free += freed

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        start: int,
        end: int,
        token_ids: list[int] | None = None,
        source_tier: Tier | None = None,
    ) -> None:
        """Register ``blocks[start:end]`` (now full) under ``block_hashes[start:end]``.

        Queues one ``BlockStored`` for the range, chained from ``block_hashes[start - 1]``.
        ``token_ids``, when given, are the tokens of exactly those blocks. ``source_tier``: the
        blocks were loaded from that tier (onboarded), not computed; the event says so.
        """
        if end <= start or not self.enable_caching:
            return
        cached = self._cached
        parent = block_hashes[start - 1] if start > 0 else None
        if end - start == 1:
            # One block (a decoding request's block just filled): the loop below, unrolled.
            b = blocks[start]
            h = block_hashes[start]
            b.block_hash = h
            b.parent_hash = parent
            self._cache_copy(cached, b, h)
            self._queue_stored([h], parent, token_ids, source_tier)
            return
        p = parent
        hashes = list(block_hashes[start:end])
        new = blocks[start:end]
        for b, h in zip(new, hashes):
            b.block_hash = h
            b.parent_hash = p
            p = h
        if cached.keys().isdisjoint(hashes) and len(set(hashes)) == len(hashes):
            cached.update(zip(hashes, new))  # no hash here yet: every block is a first copy
        else:
            for b, h in zip(new, hashes):
                self._cache_copy(cached, b, h)
        self._queue_stored(hashes, parent, token_ids, source_tier)

    def _cache_copy(self, cached: dict[BlockHash, KVCacheBlock], b: KVCacheBlock, h: BlockHash) -> None:
        """Index ``b`` under ``h``: the first copy of a hash is the cached one, later copies
        (another request computed the same block) are kept aside as extra copies."""
        first = cached.get(h)
        if first is None:
            cached[h] = b
        elif first is not b:
            self._extra_copies.setdefault(h, []).append(b)

    def _queue_stored(self, hashes: list[BlockHash], parent: BlockHash | None,
                      token_ids: list[int] | None, source_tier: Tier | None = None) -> None:
        self._events.append(
            BlockStored(
                worker_id=self.worker_id,
                tier=Tier.DEVICE,
                block_hashes=hashes,
                parent_hash=parent,
                block_size=self.block_size,
                hash_algo=self.hash_algo,
                token_ids=token_ids if token_ids is not None else [],
                source_tier=source_tier,
            )
        )

    def queue_event(self, event: KvEvent) -> None:
        """Queue an event of a tier below (an offload the ``on_evict`` hook made, a copy a load
        placed), so it leaves with the device's own events in the order they happened."""
        self._events.append(event)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, if no request holds a block (else refuse, like vLLM).

        Queues ``AllBlocksCleared(tier=device)``. Returns whether the reset happened.
        """
        if self.free_queue.num_free != self.num_blocks:
            return False
        for b in self.blocks:
            b.block_hash = None
            b.parent_hash = None
        self._cached.clear()
        self._extra_copies.clear()
        self._events.append(AllBlocksCleared(worker_id=self.worker_id, tier=Tier.DEVICE))
        return True

    def take_events(self) -> list[KvEvent]:
        """Drain the queued KV events, oldest first."""
        events, self._events = self._events, []
        return events

    # --------------------------------------------------------------------------------- private

    def _evict(self, b: KVCacheBlock) -> None:
        h = b.block_hash
        parent = b.parent_hash
        b.block_hash = None
        b.parent_hash = None
        assert h is not None
        extra = self._extra_copies.get(h)
        if self._cached.get(h) is b:
            if extra:
                self._cached[h] = extra.pop(0)
                if not extra:
                    del self._extra_copies[h]
                return
            del self._cached[h]
        else:
            # A duplicate copy: the hash stays resident through the first one.
            if extra is not None:
                extra.remove(b)
                if not extra:
                    del self._extra_copies[h]
            return
        self._queue_removed([h])
        if self.on_evict is not None:
            self.on_evict(h, parent)

    def _queue_removed(self, hashes: list[BlockHash]) -> None:
        # One step evicts in bursts (an allocation frees many cached blocks at once): the
        # burst is one BlockRemoved, not one per block. Only the newest queued event is
        # extended, so every block's own events keep their order.
        # (A tier below may have queued its own BlockRemoved: only a device one is extended.)
        last = self._events[-1] if self._events else None
        if type(last) is BlockRemoved and last.tier is Tier.DEVICE:
            last.block_hashes.extend(hashes)
        else:
            self._events.append(BlockRemoved(worker_id=self.worker_id, tier=Tier.DEVICE, block_hashes=hashes))
