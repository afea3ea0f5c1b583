"""G3: one file per block under the worker's data directory.

A file is ``<hash as 16 hex digits>.kvb`` holding a :mod:`frame` (header with checksum, then the
payload). Writes go to a temporary name in the same directory, are fsynced, renamed into place
and the directory is fsynced: a block's file either does not exist or is complete, and it exists
before the manager reports the block in G3. Leftover temporaries of a crashed process are removed
when the store opens. One worker process per directory.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import uuid
from pathlib import Path

from data_plane.kvbm import frame
from data_plane.kvbm.errors import StorageError, TierFull
from data_plane.kvbm.stores.base import Buffer, block_name, driver_errors, parse_block_name
from schemas.types import BlockHash, Tier

logger = logging.getLogger(__name__)

_TMP_SUFFIX = ".tmp"
#: A write refused for want of space (the filesystem, or the user's quota, is full).
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


def _absent(e: BaseException) -> bool:
    return isinstance(e, FileNotFoundError)


class DiskStore:
    tier = Tier.DISK

    def __init__(self, root: Path, bytes_per_block: int, *, fsync: bool = True) -> None:
        self.root = Path(root)
        self.bytes_per_block = bytes_per_block
        self.fsync = fsync
        with driver_errors(f"cannot open disk tier at {self.root}", OSError):
            self.root.mkdir(parents=True, exist_ok=True)
            for entry in os.scandir(self.root):
                if entry.name.endswith(_TMP_SUFFIX):
                    logger.info("removing leftover temporary %s", entry.path)
                    os.unlink(entry.path)

    def path_of(self, block_hash: BlockHash) -> Path:
        return self.root / block_name(block_hash)

    def put(self, block_hash: BlockHash, data: Buffer) -> None:
        final = self.path_of(block_hash)
        tmp = self.root / f".{block_hash:016x}.{uuid.uuid4().hex[:8]}{_TMP_SUFFIX}"
        try:
            with open(tmp, "xb") as f:
                f.write(frame.header(block_hash, data))
                f.write(data)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, final)
            if self.fsync:
                self._fsync_dir()
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            error = TierFull if e.errno in _NO_SPACE else StorageError
            raise error(f"writing block {block_hash:016x} to {final}: {e}") from e

    def _fsync_dir(self) -> None:
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def get(self, block_hash: BlockHash) -> memoryview:
        path = self.path_of(block_hash)
        with driver_errors(f"reading block {block_hash:016x} from {path}", OSError,
                           is_missing=_absent, missing=f"block {block_hash:016x}: no file {path}"):
            blob = path.read_bytes()
        return frame.decode(block_hash, blob, self.bytes_per_block)

    def delete(self, block_hash: BlockHash) -> None:
        with driver_errors(f"deleting block {block_hash:016x}", OSError), \
                contextlib.suppress(FileNotFoundError):
            os.unlink(self.path_of(block_hash))

    def scan(self) -> dict[BlockHash, int]:
        found: dict[BlockHash, int] = {}
        with driver_errors(f"scanning {self.root}", OSError):
            for entry in os.scandir(self.root):
                h = parse_block_name(entry.name)
                if h is not None:
                    found[h] = entry.stat().st_size
        return found

    def close(self) -> None:
        pass
