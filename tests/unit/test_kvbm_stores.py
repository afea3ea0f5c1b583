"""One contract for every KVBM block store, run here against the in-memory ones; the
integration tests run the same classes against the real disk directory and S3 server."""

from __future__ import annotations

import numpy as np
import pytest

from data_plane.kvbm import content, frame
from data_plane.kvbm.errors import BlockMissing, CapacityExceeded, CorruptBlock, KvbmConfigError
from data_plane.kvbm.stores import HostStore, MemoryStore
from schemas.types import Tier

BPB = 64
BIG = 2**64 - 1  # the largest u64 hash must round-trip through names and keys


class StoreContract:
    """Subclasses provide a ``store`` fixture."""

    stored_size = frame.framed_size(BPB)

    def test_put_then_get_returns_the_bytes(self, store):
        store.put(1, content.expected_bytes(1, BPB))
        store.put(BIG, content.expected_bytes(BIG, BPB))
        assert bytes(store.get(1)) == content.expected_bytes(1, BPB)
        assert content.verify(BIG, store.get(BIG))

    def test_missing_block_raises(self, store):
        with pytest.raises(BlockMissing):
            store.get(5)

    def test_delete_is_idempotent(self, store):
        store.put(1, content.expected_bytes(1, BPB))
        store.delete(1)
        store.delete(1)
        store.delete(99)
        with pytest.raises(BlockMissing):
            store.get(1)

    def test_put_again_replaces(self, store):
        store.put(1, content.expected_bytes(2, BPB))
        store.put(1, content.expected_bytes(1, BPB))
        assert content.verify(1, store.get(1))
        assert store.scan() == {1: self.stored_size}

    def test_scan_lists_what_is_there(self, store):
        for h in (3, 1, BIG):
            store.put(h, content.expected_bytes(h, BPB))
        store.delete(1)
        assert store.scan() == {3: self.stored_size, BIG: self.stored_size}


class PersistentStoreContract(StoreContract):
    """Stores of the persistent tiers frame their bytes; subclasses provide ``corrupt``."""

    def corrupt(self, store, block_hash):
        raise NotImplementedError

    def test_a_flipped_byte_is_caught(self, store):
        store.put(7, content.expected_bytes(7, BPB))
        self.corrupt(store, 7)
        with pytest.raises(CorruptBlock, match="checksum"):
            store.get(7)


class TestMemoryStore(PersistentStoreContract):
    @pytest.fixture
    def store(self):
        return MemoryStore(Tier.DISK, BPB)

    def corrupt(self, store, block_hash):
        store.corrupt(block_hash)

    def test_injected_failures_are_storage_errors(self, store):
        from data_plane.kvbm.errors import StorageError

        store.fail_next("put", 2)
        for _ in range(2):
            with pytest.raises(StorageError):
                store.put(1, content.expected_bytes(1, BPB))
        store.put(1, content.expected_bytes(1, BPB))


class TestHostStore(StoreContract):
    stored_size = BPB

    @pytest.fixture
    def store(self):
        return HostStore(4, BPB)

    def test_slots_are_offsets_into_one_region(self, store):
        for h in (10, 11, 12):
            store.put(h, content.expected_bytes(h, BPB))
        assert [store.offset_of(h) for h in (10, 11, 12)] == [0, BPB, 2 * BPB]
        store.delete(11)
        store.put(13, content.expected_bytes(13, BPB))
        assert store.offset_of(13) == BPB  # the freed slot is reused
        off = store.offset_of(12)
        assert content.verify(12, store.buffer[off:off + BPB])

    def test_full_pool_and_wrong_sizes_are_refused(self, store):
        for h in range(4):
            store.put(h, content.expected_bytes(h, BPB))
        with pytest.raises(CapacityExceeded):
            store.put(9, content.expected_bytes(9, BPB))
        with pytest.raises(ValueError):
            store.put(0, b"x")
        with pytest.raises(KvbmConfigError):
            HostStore(0, BPB)

    def test_pool_can_live_in_a_caller_owned_region(self):
        """A worker registers one region with NIXL: host pool first, then its transfer staging
        slots. Slot 1 of the pool is bytes BPB..2*BPB of that region."""
        region = np.zeros(6 * BPB, dtype=np.uint8)
        store = HostStore(4, BPB, buffer=region[: 4 * BPB])
        store.put(5, content.expected_bytes(5, BPB))
        store.put(6, content.expected_bytes(6, BPB))
        assert content.verify(6, region[BPB:2 * BPB])
        assert store.base_address == region.ctypes.data
        with pytest.raises(KvbmConfigError):
            HostStore(4, BPB, buffer=region)  # wrong size

    def test_get_is_a_read_only_view(self, store):
        store.put(1, content.expected_bytes(1, BPB))
        view = store.get(1)
        assert view.readonly
        with pytest.raises(TypeError):
            view[0] = 1
