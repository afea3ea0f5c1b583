"""The worker's KVBM as the unit tests build it: a manager over the real host pool and in-memory
disk/object stores, its events caught by a memory sink and read back as compact tuples."""

from __future__ import annotations

from typing import Any

from data_plane.kvbm import KvBlockManager, KvbmSettings
from data_plane.kvbm.stores import HostStore, MemoryStore
from common.log.sink import MemorySink
from schemas.events import BlockMoved, BlockRemoved, BlockStored
from schemas.types import Tier

DEVICE, HOST, DISK, OBJECT = Tier.DEVICE, Tier.HOST, Tier.DISK, Tier.OBJECT
BPB = 64
WORKER = "w1"


def kvbm_settings(**fields: Any) -> KvbmSettings:
    """Settings of worker ``WORKER`` with ``BPB``-byte blocks of 16 tokens, content verified;
    ``fields`` add to or override these."""
    base: dict[str, Any] = dict(worker_id=WORKER, bytes_per_block=BPB, block_size=16,
                                hash_algo="xxh3_64:1", verify_synthetic_content=True)
    return KvbmSettings(**(base | fields))


class KvbmKit:
    """A manager over the real host pool and in-memory disk/object stores (one per tier with a
    capacity), with its sink."""

    def __init__(self, settings: KvbmSettings) -> None:
        self.settings = s = settings
        self.sink = MemorySink()
        self.stores = {HOST: HostStore(s.host_capacity, BPB)} if s.host_capacity else {}
        if s.disk_capacity:
            self.stores[DISK] = MemoryStore(DISK, BPB)
        if s.object_capacity:
            self.stores[OBJECT] = MemoryStore(OBJECT, BPB)
        self.kvbm = KvBlockManager(s, self.sink, self.stores)

    def evict(self, *hashes):
        return [self.kvbm.on_device_evicted(h) for h in hashes]

    def events(self):
        """Events since the last call, as compact tuples."""
        out = [compact(e) for e in self.sink.events]
        self.sink.clear()
        return out


def compact(e):
    """A KV event as a tuple: ``("moved", from, to, hashes)``, ``("removed", tier, hashes)``,
    ``("stored", tier, hashes)``, else ``(type name, tier or None)``."""
    if isinstance(e, BlockMoved):
        return ("moved", e.from_tier.value, e.to_tier.value, e.block_hashes)
    if isinstance(e, BlockRemoved):
        return ("removed", e.tier.value, e.block_hashes)
    if isinstance(e, BlockStored):
        return ("stored", e.tier.value, e.block_hashes)
    return (type(e).__name__, getattr(e, "tier", None))
