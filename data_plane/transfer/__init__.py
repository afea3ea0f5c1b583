"""KV block transfer between worker processes.

* :mod:`~data_plane.transfer.protocol` - the prefill -> decode handoff as pure state
  (``HoldTable``, done notifications, ``Handoff`` params). No I/O.
* :mod:`~data_plane.transfer.metadata` - what an endpoint publishes (``EndpointMetadata``, carried
  in ``WorkerRegistered.transfer``). No I/O.
* :mod:`~data_plane.transfer.endpoint` - the NIXL adapter (``NixlEndpoint``). NIXL itself is
  imported only when an endpoint is built. Synchronous: workers call it from a thread.
"""

from data_plane.transfer.endpoint import NixlEndpoint, TransferResult
from data_plane.transfer.errors import (
    HoldError,
    InvalidTransfer,
    PeerLost,
    TransferError,
    TransferTimeout,
)
from data_plane.transfer.metadata import BlockRegion, EndpointMetadata, PeerName
from data_plane.transfer.protocol import (
    DoneNotif,
    Handoff,
    Hold,
    HoldTable,
    Released,
    ReleaseReason,
    encode_done,
    parse_done,
)

__all__ = [
    "BlockRegion",
    "DoneNotif",
    "EndpointMetadata",
    "Handoff",
    "Hold",
    "HoldError",
    "HoldTable",
    "InvalidTransfer",
    "NixlEndpoint",
    "PeerLost",
    "PeerName",
    "Released",
    "ReleaseReason",
    "TransferError",
    "TransferResult",
    "TransferTimeout",
    "encode_done",
    "parse_done",
]
