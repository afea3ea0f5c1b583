"""The oracle index's snapshot wire format (msgpack): everything needed to continue folding
exactly where an index stands. The product's native index writes the same bytes
(``native/src/index.rs``, ``docs/prefix-index.md``); the tests restore each side from the other's.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Collection

import msgspec

SNAPSHOT_FORMAT = 2


class SlotSnap(msgspec.Struct, array_like=True, frozen=True):
    slot: int
    worker_id: str
    dp_rank: int
    stale: bool
    lost: bool
    #: Per tier in TIER_ORDER: sorted hashes as little-endian u64s.
    tiers: list[bytes]


class WorkerSnap(msgspec.Struct, array_like=True, frozen=True):
    worker_id: str
    epoch: int
    deregistered: bool
    life_epoch: int
    registered_epoch: int


class SeqSnap(msgspec.Struct, array_like=True, frozen=True):
    producer: str
    stream: str
    epoch: int
    last: int


class ProducerSnap(msgspec.Struct, array_like=True, frozen=True):
    producer: str
    slots: list[int]


class Snapshot(msgspec.Struct, frozen=True, kw_only=True):
    format: int
    hash_algo: str
    block_size: int
    width: int
    #: Slot table length and free list, so a restored index numbers new slots identically.
    n_slots: int
    free: list[int]
    slots: list[SlotSnap]
    workers: list[WorkerSnap]
    seq: list[SeqSnap]
    producers: list[ProducerSnap]
    counters: dict[str, int]


def u64_bytes(hashes: Collection[int]) -> bytes:
    """Sorted little-endian u64s (sorted in numpy: ``sorted`` over a few hundred thousand ints
    takes over a second)."""
    import numpy as np

    a = np.fromiter(hashes, dtype="<u8", count=len(hashes))
    a.sort()
    return a.tobytes()


def u64_list(data: bytes) -> array:
    a = array("Q")
    a.frombytes(data)
    if sys.byteorder == "big":
        a.byteswap()
    return a
