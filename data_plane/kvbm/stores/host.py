"""G2: host DRAM as one contiguous numpy buffer cut into fixed-size slots.

One allocation of ``capacity * bytes_per_block`` bytes, so a transfer engine (NIXL) can register
it once as a single DRAM region and address block ``h`` as ``base_address + offset_of(h)``. The
buffer is ordinary pageable memory (this machine has no CUDA for pinned allocations); swapping the
allocator for a pinned one would not change the interface.
"""

from __future__ import annotations

import numpy as np

from data_plane.kvbm.errors import BlockMissing, CapacityExceeded, KvbmConfigError
from data_plane.kvbm.stores.base import Buffer
from schemas.types import BlockHash, Tier


class HostStore:
    tier = Tier.HOST

    def __init__(self, capacity: int, bytes_per_block: int,
                 buffer: np.ndarray | None = None) -> None:
        """``buffer``, when given, is the memory of the pool (a C-contiguous uint8 array of exactly
        ``capacity * bytes_per_block`` bytes, e.g. the head of a larger region the worker
        registers with NIXL once); else the pool allocates its own."""
        if capacity <= 0 or bytes_per_block <= 0:
            raise KvbmConfigError(f"host pool needs capacity > 0 and bytes_per_block > 0, got "
                                  f"{capacity} x {bytes_per_block}")
        self.capacity = capacity
        self.bytes_per_block = bytes_per_block
        if buffer is None:
            buffer = np.zeros(capacity * bytes_per_block, dtype=np.uint8)
        elif (buffer.dtype != np.uint8 or buffer.ndim != 1 or not buffer.flags.c_contiguous
              or buffer.size != capacity * bytes_per_block):
            raise KvbmConfigError(f"host pool buffer must be a contiguous uint8 array of "
                                  f"{capacity * bytes_per_block} bytes")
        #: The whole pool; slot ``s`` is ``buffer[s * bytes_per_block:(s + 1) * bytes_per_block]``.
        self.buffer = buffer
        # Free slots as a stack, lowest slot on top, so a fresh pool fills from the start.
        self._free = list(range(capacity - 1, -1, -1))
        self._slots: dict[BlockHash, int] = {}

    # -- addressing (for registration with a transfer engine) ------------------------------

    @property
    def base_address(self) -> int:
        """Virtual address of the pool's first byte."""
        return int(self.buffer.ctypes.data)

    @property
    def region_size(self) -> int:
        return int(self.buffer.nbytes)

    def slot_of(self, block_hash: BlockHash) -> int:
        try:
            return self._slots[block_hash]
        except KeyError:
            raise BlockMissing(f"block {block_hash:016x} is not in the host pool") from None

    def offset_of(self, block_hash: BlockHash) -> int:
        """Byte offset of the block's slot from ``base_address``."""
        return self.slot_of(block_hash) * self.bytes_per_block

    def view(self, block_hash: BlockHash) -> memoryview:
        """Writable zero-copy view of the block's slot. Valid until the slot is freed: pin the
        block in the manager while the view is in use."""
        off = self.offset_of(block_hash)
        return memoryview(self.buffer[off:off + self.bytes_per_block])

    @property
    def used(self) -> int:
        return len(self._slots)

    # -- BlockStore --------------------------------------------------------------------------

    def put(self, block_hash: BlockHash, data: Buffer) -> None:
        src = np.frombuffer(data, dtype=np.uint8)
        if src.size != self.bytes_per_block:
            raise ValueError(f"block {block_hash:016x}: {src.size} bytes, the pool's blocks are "
                             f"{self.bytes_per_block}")
        slot = self._slots.get(block_hash)
        if slot is None:
            if not self._free:
                raise CapacityExceeded(f"host pool full ({self.capacity} slots)")
            slot = self._free.pop()
        off = slot * self.bytes_per_block
        self.buffer[off:off + self.bytes_per_block] = src
        self._slots[block_hash] = slot

    def get(self, block_hash: BlockHash) -> memoryview:
        return self.view(block_hash).toreadonly()

    def delete(self, block_hash: BlockHash) -> None:
        slot = self._slots.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)

    def scan(self) -> dict[BlockHash, int]:
        return {h: self.bytes_per_block for h in self._slots}

    def close(self) -> None:
        pass
