"""The port every tier's storage implements.

A store only keeps bytes; it knows nothing of capacity policy, eviction or events (the manager
decides, the store obeys). Contract, checked by one test suite against every implementation:

* ``put`` returns only once the bytes are durable in that tier (host: copied into the pool;
  disk: written and renamed into place, fsynced first when configured; object: the PUT was
  acknowledged). Until then a reader sees the old state, never a torn block (a block torn by a
  power cut fails its checksum: ``get`` raises :class:`CorruptBlock`).
* ``get`` returns verified payload bytes or raises :class:`BlockMissing` / :class:`CorruptBlock`
  / :class:`StorageError`; it never returns bytes that failed verification.
* ``delete`` is idempotent; ``scan`` lists what is physically there (hash -> stored size), which
  after a crash may differ from what the log claims.

All methods are blocking. They are safe to call from a worker thread (the manager serialises its
own calls); see :mod:`data_plane.kvbm.aio` for the asyncio side.
"""

from __future__ import annotations

from typing import Protocol

from schemas.types import BlockHash, Tier

Buffer = bytes | bytearray | memoryview


class BlockStore(Protocol):
    #: The tier this store serves.
    tier: Tier
    #: Payload size of every block (the frame header, if any, is not counted).
    bytes_per_block: int

    def put(self, block_hash: BlockHash, data: Buffer) -> None:
        """Store the block's payload; durable on return."""

    def get(self, block_hash: BlockHash) -> Buffer:
        """The block's verified payload."""

    def delete(self, block_hash: BlockHash) -> None:
        """Remove the block if present."""

    def scan(self) -> dict[BlockHash, int]:
        """Blocks physically present, with their stored size in bytes."""

    def close(self) -> None:
        """Release resources (connections, file handles)."""
