"""An in-memory store for a persistent tier: framed bytes in a dict.

The pure simulation and the unit tests use it in place of disk or S3 (never in an integration
test). It keeps the same framing as the real stores, so flipping a byte (``corrupt``) is caught
the same way, and it can be told to fail its next operations (``fail_next``), or to be down
(``down``: every call raises ``TierUnavailable``, as an object store outage does), to exercise
the manager's error paths without mocks.
"""

from __future__ import annotations

from data_plane.kvbm import frame
from data_plane.kvbm.errors import BlockMissing, StorageError, TierUnavailable
from data_plane.kvbm.stores.base import Buffer
from schemas.types import BlockHash, Tier


class MemoryStore:
    def __init__(self, tier: Tier, bytes_per_block: int) -> None:
        self.tier = tier
        self.bytes_per_block = bytes_per_block
        self._blobs: dict[BlockHash, bytearray] = {}
        self._failures: dict[str, int] = {}
        #: Completed operations in order: ("put" | "delete", hash). Tests read it to check that
        #: a block was written before it was reported.
        self.journal: list[tuple[str, BlockHash]] = []
        #: While True every call fails with TierUnavailable (an outage).
        self.down = False
        #: Calls that reached the store, failed ones included.
        self.calls = 0

    def fail_next(self, op: str, times: int = 1) -> None:
        """Make the next ``times`` calls of ``op`` ("put", "get", "delete") raise StorageError."""
        self._failures[op] = self._failures.get(op, 0) + times

    def _maybe_fail(self, op: str, block_hash: BlockHash) -> None:
        self.calls += 1
        if self.down:
            raise TierUnavailable(f"{self.tier.value} memory store is down ({op} {block_hash:016x})")
        if self._failures.get(op, 0) > 0:
            self._failures[op] -= 1
            raise StorageError(f"injected {op} failure for block {block_hash:016x}")

    def corrupt(self, block_hash: BlockHash, offset: int = -1) -> None:
        """Flip one byte of the stored frame (default: the last payload byte)."""
        self._blobs[block_hash][offset] ^= 0xFF

    def put(self, block_hash: BlockHash, data: Buffer) -> None:
        self._maybe_fail("put", block_hash)
        self._blobs[block_hash] = bytearray(frame.encode(block_hash, data))
        self.journal.append(("put", block_hash))

    def get(self, block_hash: BlockHash) -> memoryview:
        self._maybe_fail("get", block_hash)
        blob = self._blobs.get(block_hash)
        if blob is None:
            raise BlockMissing(f"block {block_hash:016x} not in {self.tier.value} memory store")
        return frame.decode(block_hash, bytes(blob), self.bytes_per_block)

    def delete(self, block_hash: BlockHash) -> None:
        self._maybe_fail("delete", block_hash)
        if self._blobs.pop(block_hash, None) is not None:
            self.journal.append(("delete", block_hash))

    def scan(self) -> dict[BlockHash, int]:
        return {h: len(b) for h, b in self._blobs.items()}

    def close(self) -> None:
        pass
