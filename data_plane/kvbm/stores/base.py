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

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

from data_plane.kvbm.errors import BlockMissing, StorageError, TierUnavailable
from schemas.types import BlockHash, Tier

Buffer = bytes | bytearray | memoryview

#: Ending of a block's file (disk) or object key (S3): ``<hash as 16 hex digits>.kvb``.
BLOCK_SUFFIX = ".kvb"


def block_name(block_hash: BlockHash) -> str:
    """The file or object name (after the store's prefix) of a block."""
    return f"{block_hash:016x}{BLOCK_SUFFIX}"


def parse_block_name(name: str) -> BlockHash | None:
    """The hash a :func:`block_name` names, or None for anything else found in the store."""
    if len(name) != 16 + len(BLOCK_SUFFIX) or not name.endswith(BLOCK_SUFFIX):
        return None
    try:
        return BlockHash(int(name[:16], 16))
    except ValueError:
        return None


@contextmanager
def driver_errors(doing: str, driver: type[BaseException] | tuple[type[BaseException], ...], *,
                  is_missing: Callable[[BaseException], bool] | None = None, missing: str = "",
                  is_unavailable: Callable[[BaseException], bool] | None = None) -> Iterator[None]:
    """Translate a backend's driver errors (``OSError``, botocore) into this package's, so the
    manager never has to know which backend failed: a ``driver`` error for which ``is_missing``
    holds becomes :class:`BlockMissing` (``missing`` is its message; the driver's traceback
    adds nothing to "not there"), one for which ``is_unavailable`` holds becomes
    :class:`TierUnavailable`, any other ``StorageError("<doing>: <error>")``."""
    try:
        yield
    except driver as e:
        if is_missing is not None and is_missing(e):
            raise BlockMissing(missing) from None
        if is_unavailable is not None and is_unavailable(e):
            raise TierUnavailable(f"{doing}: {e}") from e
        raise StorageError(f"{doing}: {e}") from e


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
