"""asyncio face of the KVBM: the blocking manager on one dedicated thread.

The worker's event loop must not wait on disk fsyncs or S3 round trips. ``AsyncKvbm`` runs every
call on a single-thread executor, so calls run one at a time *in submission order* (the events
they publish keep that order too) and the loop stays free. ``submit_device_evicted`` is the
non-blocking form for a synchronous engine hook: it queues the offload and returns at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from data_plane.kvbm.manager import KvBlockManager
from data_plane.kvbm.results import OnboardResult, RebuildReport
from data_plane.kvbm.stores.base import Buffer
from schemas.types import BlockHash, Tier

T = TypeVar("T")


class AsyncKvbm:
    def __init__(self, manager: KvBlockManager) -> None:
        self.manager = manager
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"kvbm-{manager.settings.worker_id}")

    async def _run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    def submit_device_evicted(self, block_hash: BlockHash, parent_hash: BlockHash | None = None,
                              data: Buffer | None = None) -> concurrent.futures.Future:
        """Queue an offload; returns immediately. ``data`` must be an owned copy (the device
        slot is about to be reused)."""
        return self._pool.submit(self.manager.on_device_evicted, block_hash, parent_hash, data)

    def submit_device_evicted_many(self, evicted: Sequence[tuple[BlockHash, BlockHash | None]]
                                   ) -> concurrent.futures.Future:
        """Queue the offload of one step's evictions as one call (merged events)."""
        return self._pool.submit(self.manager.on_device_evicted_many, list(evicted))

    async def on_device_evicted(self, block_hash: BlockHash, parent_hash: BlockHash | None = None,
                                data: Buffer | None = None) -> Tier | None:
        return await self._run(self.manager.on_device_evicted, block_hash, parent_hash, data)

    async def on_device_stored(self, block_hashes: Sequence[BlockHash],
                               parent_hash: BlockHash | None = None) -> None:
        await self._run(self.manager.on_device_stored, block_hashes, parent_hash)

    async def lookup(self, block_hashes: Sequence[BlockHash]) -> list[Tier]:
        return await self._run(self.manager.lookup, block_hashes)

    async def onboard(self, block_hashes: Sequence[BlockHash], *, pin: bool = True,
                      correlation_id: str | None = None) -> OnboardResult:
        return await self._run(self.manager.onboard, block_hashes, pin=pin,
                               correlation_id=correlation_id)

    async def copy_for_peer(self, block_hashes: Sequence[BlockHash], dest: Sequence[Any],
                            on_device: Any = ()) -> list[Tier]:
        return await self._run(self.manager.copy_for_peer, list(block_hashes), dest, on_device)

    async def store_fetched(self, blocks: Sequence[tuple[BlockHash, BlockHash | None, Any]], *,
                            correlation_id: str | None = None) -> int:
        return await self._run(self.manager.store_fetched, list(blocks), correlation_id=correlation_id)

    async def release(self, block_hashes: Sequence[BlockHash]) -> None:
        await self._run(self.manager.release, block_hashes)

    async def rebuild(self, claimed: Mapping[Tier, Sequence[BlockHash]], *, deep: bool = True,
                      adopt_orphans: bool = False) -> RebuildReport:
        return await self._run(self.manager.rebuild, claimed, deep=deep,
                               adopt_orphans=adopt_orphans)

    async def usage(self) -> dict[str, float]:
        return await self._run(self.manager.usage)

    async def stats(self) -> dict[str, int]:
        return await self._run(self.manager.stats)

    async def drain(self) -> None:
        """Wait until every call submitted so far has finished."""
        await self._run(lambda: None)

    async def aclose(self) -> None:
        await self.drain()
        self._pool.shutdown(wait=True)
        self.manager.close()
