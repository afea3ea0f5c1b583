"""Deterministic synthetic block content: the bytes of a block are a pure function of its hash.

The simulated engine has no real KV tensors, yet every tier moves real bytes. Deriving the bytes
from the block hash lets any reader, in any process, check that what it read is the block it asked
for without a side table of checksums: ``verify(h, buf)`` regenerates and compares.

The content is a fixed pseudo-random base pattern (numpy's ``SFC64`` seeded once, whose raw
stream numpy guarantees stable across releases) XORed word by word with a 64-bit mix of the
block hash, laid out little-endian explicitly, so the bytes are the same on every machine and
differ between any two hashes in every word. One vector operation per block: generating a
16 KiB block costs microseconds, not the ~50 us of seeding a generator per block, which made
the simulated workers spend most of their CPU synthesising offloaded blocks.

Real engine data (vLLM) is not synthetic: there the at-rest checksum of :mod:`.frame` is the only
check, and ``KvbmSettings.verify_synthetic_content`` must stay off.
"""

from __future__ import annotations

import numpy as np

from schemas.types import BlockHash

#: Mixed into the seed so these streams never coincide with another use of the same hash as a seed.
_DOMAIN = 0x53594B56  # "SYKV"


_BASE: np.ndarray = np.zeros(0, dtype="<u8")


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection on 64-bit words."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def _base(n_words: int) -> np.ndarray:
    global _BASE
    if _BASE.size < n_words:
        # Grown by regeneration from the same seed: a prefix of the stream never changes.
        gen = np.random.SFC64(np.random.SeedSequence(_DOMAIN))
        _BASE = gen.random_raw(max(n_words, 2 * _BASE.size)).astype("<u8", copy=False)
    return _BASE[:n_words]


def _words(block_hash: BlockHash, n: int) -> np.ndarray:
    return _base((n + 7) // 8) ^ np.uint64(_mix64(_DOMAIN ^ int(block_hash)))


def expected_array(block_hash: BlockHash, n: int) -> np.ndarray:
    """The first ``n`` bytes of the block's content as a read-only-by-convention uint8 array."""
    if n < 0:
        raise ValueError(f"negative block size {n}")
    return _words(block_hash, n).view(np.uint8)[:n]


def expected_bytes(block_hash: BlockHash, n: int) -> bytes:
    """The ``n`` content bytes of block ``block_hash``."""
    return expected_array(block_hash, n).tobytes()


def fill(block_hash: BlockHash, out: memoryview | bytearray | np.ndarray) -> None:
    """Write the block's content into ``out`` (its whole length), e.g. a host-pool slot."""
    dst = out.view(np.uint8) if isinstance(out, np.ndarray) else np.frombuffer(out, np.uint8)
    dst[:] = expected_array(block_hash, dst.size)


def verify(block_hash: BlockHash, buf: bytes | bytearray | memoryview | np.ndarray) -> bool:
    """True when ``buf`` is exactly the content of ``block_hash`` (length included)."""
    if isinstance(buf, np.ndarray):
        got = buf.view(np.uint8).reshape(-1)
    else:
        got = np.frombuffer(buf, dtype=np.uint8)
    return bool(np.array_equal(got, expected_array(block_hash, got.size)))
