"""Errors of the index package. One base so adapters can catch (and dead-letter) any of them."""

from __future__ import annotations


class IndexPackageError(Exception):
    """Base of every error raised by ``control_plane.index``."""

    reason = "index_error"


class IndexRejected(IndexPackageError):
    """An event the prefix index must not fold in; the caller dead-letters it.

    ``reason`` is machine-readable: ``"hash_algo"``, ``"block_size"`` or ``"cache_group"``.
    The event's sequence number has been consumed (so the next event is not taken for a gap),
    but nothing else changed.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
