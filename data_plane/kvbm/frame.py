"""At-rest framing of a block in the persistent tiers (disk, object store).

Layout, little-endian, 32-byte header then the payload::

    magic "SYKV" | version u16 | flags u16 | block_hash u64 | length u64 | xxh3_64(payload) u64

Why a frame when synthetic content can be regenerated: real KV bytes (vLLM) cannot, so the
checksum is what catches a flipped byte on disk or in the bucket; and the hash in the header
catches a file or key that holds another block's bytes. Decoding never returns unverified bytes.
"""

from __future__ import annotations

import struct

import xxhash

from data_plane.kvbm.errors import CorruptBlock
from schemas.types import BlockHash

MAGIC = b"SYKV"
VERSION = 1
_HEADER = struct.Struct("<4sHHQQQ")
HEADER_SIZE = _HEADER.size


def header(block_hash: BlockHash, payload: bytes | bytearray | memoryview) -> bytes:
    """The header that precedes ``payload`` on disk or in the bucket."""
    return _HEADER.pack(MAGIC, VERSION, 0, int(block_hash), memoryview(payload).nbytes,
                        xxhash.xxh3_64_intdigest(payload))


def encode(block_hash: BlockHash, payload: bytes | bytearray | memoryview) -> bytes:
    """Header and payload as one bytes object."""
    return header(block_hash, payload) + bytes(payload)


def framed_size(payload_size: int) -> int:
    return HEADER_SIZE + payload_size


def decode(block_hash: BlockHash, blob: bytes | bytearray | memoryview,
           expected_size: int | None = None) -> memoryview:
    """The verified payload of ``blob``; raises :class:`CorruptBlock` with the reason otherwise."""
    view = memoryview(blob)
    if len(view) < HEADER_SIZE:
        raise CorruptBlock(f"block {block_hash:016x}: {len(view)} bytes, shorter than the header")
    magic, version, _flags, h, length, digest = _HEADER.unpack_from(view)
    if magic != MAGIC or version != VERSION:
        raise CorruptBlock(f"block {block_hash:016x}: bad magic/version {magic!r}/{version}")
    if h != int(block_hash):
        raise CorruptBlock(f"block {block_hash:016x}: frame holds block {h:016x}")
    payload = view[HEADER_SIZE:]
    if len(payload) != length or (expected_size is not None and length != expected_size):
        raise CorruptBlock(f"block {block_hash:016x}: length {len(payload)}, header says {length}"
                           f", expected {expected_size}")
    if xxhash.xxh3_64_intdigest(payload) != digest:
        raise CorruptBlock(f"block {block_hash:016x}: checksum mismatch")
    return payload
