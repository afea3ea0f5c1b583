"""The worker's KVBM as the simulated engine's :class:`~data_plane.engines.tiers.LowerTiers`:
the engine onboards a prefix found in host, disk or object storage instead of recomputing it.

``load`` runs :meth:`KvBlockManager.onboard`, which reads the lower copies (verified: checksum,
and synthetic content when configured), writes them into host slots and reports
``BlockStored(host)``; then it reads each block's bytes out of its host slot, as the copy to the
device would, and checks them again before the engine counts the block as computed. The engine
then caches the blocks on the device with ``BlockStored(device, source_tier=...)``.

Failure rule: the first block that cannot be served (missing, corrupt, unreadable, no host slot)
ends the loaded prefix; the KVBM has already dropped a bad lower copy with ``BlockRemoved``, and
the engine recomputes from there and counts the fallback. Blocking: it runs on the caller's
thread (the engine's loop) under the KVBM's lock; disk and S3 reads happen inline.
"""

from __future__ import annotations

from collections.abc import Sequence

from data_plane.engines.tiers import LoadResult, load_in_chunks
from data_plane.kvbm import content
from data_plane.kvbm.manager import KvBlockManager
from schemas.types import BlockHash, Tier


class KvbmTiers:
    def __init__(self, manager: KvBlockManager) -> None:
        self.manager = manager
        #: Bytes read out of host slots for the device, since start.
        self.bytes_loaded = 0

    def lookup(self, block_hashes: Sequence[BlockHash]) -> list[Tier]:
        out: list[Tier] = []
        for t in self.manager.lookup(block_hashes):
            if t is Tier.DEVICE:
                break  # the engine asked because its pool does not have it: the KVBM is behind
            out.append(t)
        return out

    def load(self, block_hashes: Sequence[BlockHash]) -> LoadResult:
        return load_in_chunks(block_hashes, self.manager.settings.host_capacity, self._load_chunk)

    def _load_chunk(self, block_hashes: Sequence[BlockHash], sources: list[Tier]) -> str:
        m = self.manager
        verify = m.settings.verify_synthetic_content
        with m.onboarded(block_hashes) as r:
            for b in r.blocks:
                if b.host_slot is None:
                    return "not_in_host"
                data = m.read_host(b.block_hash)
                if verify and not content.verify(b.block_hash, data):
                    return "corrupt"
                self.bytes_loaded += data.nbytes
                sources.append(b.found_in)
            return r.stop_reason
