"""Errors of the transfer context. One base so a worker can catch any transfer failure and turn
it into ``KvTransferFailed`` (and a local recompute) instead of crashing.

The NIXL adapter translates every NIXL exception into one of these; nothing outside
:mod:`data_plane.transfer.endpoint` ever sees a ``nixl`` type.
"""

from __future__ import annotations


class TransferError(Exception):
    """Base of every error raised by :mod:`data_plane.transfer`."""


class TransferTimeout(TransferError):
    """A transfer did not finish within its deadline. Its handle was released (NIXL cancels it),
    so the local destination blocks may hold partial data and must not be used."""


class PeerLost(TransferError):
    """The peer is gone: unreachable when added, or disconnected before or during a transfer.
    The peer is forgotten; a new incarnation must be added again from its new metadata."""


class InvalidTransfer(TransferError, ValueError):
    """A call breaks its contract (block id out of range, length mismatch, unknown peer,
    endpoint closed). Nothing was sent."""


class HoldError(TransferError, ValueError):
    """The hold table was asked something inconsistent (e.g. the same request held twice)."""
