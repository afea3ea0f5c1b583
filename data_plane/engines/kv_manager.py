"""Per-request KV bookkeeping over the block pool (vLLM's ``KVCacheManager``). Pure.

Dependencies point one way: scheduler -> this manager -> block pool -> hashing primitives.

* ``get_computed_blocks`` finds the longest cached prefix of a request, capped one token short
  of the whole sequence (vLLM's ``max_cache_hit_length = num_tokens - 1``: the last token must be
  computed to get logits, so a prompt whose length is a multiple of the block size recomputes
  its last block).
* ``allocate_slots`` takes the prefix hits and enough fresh blocks for ``num_new_tokens`` more,
  all or nothing, then caches every block that becomes full *at scheduling time*, like vLLM:
  a request scheduled later in the same step can already hit them.
* ``free`` releases a request's blocks last block first, so its tail is evicted before its head.

Hashes are computed lazily (only as far as a lookup or a cache insert needs) with
:func:`data_plane.engines.blockhash.block_digests` (``hash_block_digests``, natively for sha256),
so they are bit-compatible with what the router computes for the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from data_plane.engines.block_pool import BlockPool, KVCacheBlock
from data_plane.engines.blockhash import block_digests, generated_digests
from data_plane.engines.request import RequestState
from common.hashing import HashConfig
from schemas.types import Tier


class KVCacheManager:
    def __init__(self, pool: BlockPool, hash_config: HashConfig, *, emit_token_ids: bool = False) -> None:
        if hash_config.block_size != pool.block_size:
            raise ValueError(
                f"hash block size {hash_config.block_size} != pool block size {pool.block_size}"
            )
        self.pool = pool
        self.block_size = pool.block_size
        self.hash_config = hash_config
        self.emit_token_ids = emit_token_ids

    def ensure_hashes(self, req: RequestState, num_blocks: int) -> None:
        """Extend ``req.digests``/``req.hashes`` to cover its first ``num_blocks`` full blocks."""
        have = len(req.digests)
        if have >= num_blocks:
            return
        bs = self.block_size
        start, end = have * bs, num_blocks * bs
        parent = req.digests[-1] if have else None
        pl = req.prompt_len
        out = None
        o_start = start - pl if start > pl else 0
        if end > pl and o_start >= len(req.output_prefix) and end - pl <= req.num_output:
            # Generated blocks (the usual case here: prompts come with their digests): their
            # pseudo-tokens are made and hashed natively, after the prompt tokens they share.
            head = list(req.prompt[start:pl]) if start < pl else []
            out = generated_digests(
                head, req.seed, o_start, end - pl, req.vocab_size, self.hash_config, parent=parent
            )
        if out is None:
            out = block_digests(req.tokens(start, end), self.hash_config, parent=parent)
        new, wire = out
        req.digests.extend(new)
        req.hashes.extend(wire)

    def get_computed_blocks(self, req: RequestState) -> list[KVCacheBlock]:
        """Cached blocks of the longest prefix of ``req`` (no reference taken yet)."""
        if not self.pool.enable_caching:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        if max_blocks <= 0:
            return []
        self.ensure_hashes(req, max_blocks)
        get = self.pool.get_cached_block
        hits: list[KVCacheBlock] = []
        for h in req.hashes[:max_blocks]:
            b = get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def blocks_needed(self, req: RequestState, num_new_tokens: int, hits: Sequence[KVCacheBlock] = ()) -> int:
        """Fresh blocks ``allocate_slots`` would take (before counting evictable hits)."""
        total = req.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        return -(-total // self.block_size) - len(req.blocks) - len(hits)

    def can_allocate(self, req: RequestState, num_new_tokens: int, hits: Sequence[KVCacheBlock] = ()) -> bool:
        """Whether :meth:`allocate_slots` with these arguments would succeed (no state change)."""
        need = self.blocks_needed(req, num_new_tokens, hits)
        evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        return need <= self.pool.free_queue.num_free - evictable_hits

    def allocate_slots(
        self, req: RequestState, num_new_tokens: int, hits: Sequence[KVCacheBlock] = (),
        sources: Sequence[Tier] = (),
    ) -> bool:
        """Give ``req`` blocks for ``num_new_tokens`` more tokens after its computed ones and its
        prefix ``hits``. All or nothing; False when the free queue is too short.

        ``sources``: the blocks right after the hits were loaded from these tiers (one per
        block) rather than computed; their ``BlockStored`` say so, one event per run of equal
        source, before the computed blocks' own."""
        pool = self.pool
        bs = self.block_size
        total = req.num_computed_tokens + len(hits) * bs + num_new_tokens
        blocks = req.blocks
        num_new_blocks = -(-total // bs) - len(blocks) - len(hits)
        if hits:
            evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
            if num_new_blocks > pool.free_queue.num_free - evictable_hits:
                return False
            pool.touch(hits)
            blocks.extend(hits)
            # Hits are already cached: they must not be stored again.
            req.num_cached_blocks = len(blocks)
        elif num_new_blocks > pool.free_queue.num_free:
            return False
        if num_new_blocks > 0:
            blocks.extend(pool.allocate(num_new_blocks))
        num_tokens = req.prompt_len + req.num_output
        num_full = (total if total < num_tokens else num_tokens) // bs
        start = req.num_cached_blocks
        if num_full > start and pool.enable_caching:
            self.ensure_hashes(req, num_full)
            i = 0
            while i < len(sources) and start < num_full:
                j = i
                while j < len(sources) and sources[j] is sources[i]:
                    j += 1
                end = min(start + j - i, num_full)
                token_ids = req.tokens(start * bs, end * bs) if self.emit_token_ids else None
                pool.cache_full_blocks(blocks, req.hashes, start, end, token_ids, sources[i])
                start, i = end, j
            if num_full > start:
                token_ids = req.tokens(start * bs, num_full * bs) if self.emit_token_ids else None
                pool.cache_full_blocks(blocks, req.hashes, start, num_full, token_ids)
            req.num_cached_blocks = num_full
        return True

    def free(self, req: RequestState) -> None:
        """Release all of ``req``'s blocks, last block first (they stay cached until evicted)."""
        if req.blocks:
            self.pool.free(reversed(req.blocks))
        req.blocks = []
        req.num_cached_blocks = 0
