"""Errors of the KV block manager. One base so callers can catch any of them.

Adapters (disk, S3) translate driver errors (``OSError``, botocore) into these, so the manager
never has to know which backend failed.
"""

from __future__ import annotations


class KvbmError(Exception):
    """Base of every error raised by ``data_plane.kvbm``. ``reason`` is machine-readable."""

    reason = "kvbm_error"


class KvbmConfigError(KvbmError, ValueError):
    """Settings that cannot work together (the message says why)."""

    reason = "config"


class BlockMissing(KvbmError, KeyError):
    """The store has no bytes for the block."""

    reason = "missing"

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else self.reason


class CorruptBlock(KvbmError):
    """The stored bytes fail verification (framing, checksum or content)."""

    reason = "corrupt"


class StorageError(KvbmError):
    """The backend failed to read, write or delete (I/O error, network, permissions)."""

    reason = "storage"


class TierFull(StorageError):
    """The backend refused a write for want of space (ENOSPC, EDQUOT): the tier's filesystem is
    full, whatever the tier's own capacity in blocks says. Nothing is lost: the block is not
    reported in that tier, and writes succeed again once space is freed."""

    reason = "full"


class TierUnavailable(StorageError):
    """The backend did not answer, or answered that it cannot serve now (object store: no
    connection, a timeout, a 5xx or a throttling reply). Nothing is lost: a write is not
    reported in that tier (the block is dropped from the tier above, as any failed demotion), a
    read leaves the claim in place and the caller recomputes; both work again once the backend
    answers."""

    reason = "unavailable"


class CapacityExceeded(KvbmError):
    """A store was asked to hold more blocks than it has room for: a bug in the caller, since
    the manager always makes room first."""

    reason = "capacity"
