"""What one endpoint publishes so that peers can move its KV blocks: a compact msgpack struct.

It travels inside ``WorkerRegistered.transfer`` (:class:`schemas.events.TransferInfo`): the
encoded :class:`EndpointMetadata` is the ``agent_metadata`` bytes. Pure: no NIXL import.

Why geometry instead of NIXL's serialized descriptor lists: NIXL serializes descriptor lists
with ``pickle``, and unpickling bytes read from the event log would let any producer run code in
every consumer. Block descriptors of one contiguous region are fully determined by
``(base_addr, block_len, n_blocks)``, so the peer rebuilds them (``base + i * block_len``) from
three integers: smaller, and safe to decode.
"""

from __future__ import annotations

from typing import NewType

import msgspec

from data_plane.transfer.errors import InvalidTransfer
from schemas.events import TransferInfo

#: A NIXL agent name as the peer knows it (``add_remote_agent`` returns it).
PeerName = NewType("PeerName", str)


class BlockRegion(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A contiguous memory region of ``n_blocks`` equal blocks: block ``i`` starts at
    ``base_addr + i * block_len``."""

    base_addr: int
    block_len: int
    n_blocks: int
    #: NIXL memory segment type; only "DRAM" is exercised on this stack.
    mem_type: str = "DRAM"
    #: Device id for VRAM regions; 0 for DRAM.
    dev_id: int = 0

    def __post_init__(self) -> None:
        if self.block_len <= 0 or self.n_blocks <= 0:
            raise InvalidTransfer(
                "a region needs block_len > 0 and n_blocks > 0, "
                f"got {self.block_len}, {self.n_blocks}"
            )
        if self.base_addr <= 0:
            raise InvalidTransfer(f"base_addr must be a real address, got {self.base_addr}")

    @property
    def nbytes(self) -> int:
        return self.block_len * self.n_blocks


class EndpointMetadata(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Everything a peer needs to reach one endpoint's blocks. Evolve additively (new fields
    with defaults): old readers ignore what they do not know."""

    #: The NIXL agent name (unique per worker incarnation, e.g. ``"<worker_id>:<epoch>"``).
    agent_name: str
    #: ``nixl_agent.get_agent_metadata()``: connection info and registered memory (~450 bytes).
    agent_metadata: bytes
    region: BlockRegion
    backend: str = "UCX"

    def encode(self) -> bytes:
        return _ENCODER.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> EndpointMetadata:
        try:
            return _DECODER.decode(data)
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
            raise InvalidTransfer(f"not an endpoint metadata record: {exc}") from exc

    def to_transfer_info(self) -> TransferInfo:
        """The form published in ``WorkerRegistered.transfer``."""
        return TransferInfo(
            backend=self.backend,
            agent_name=self.agent_name,
            agent_metadata=self.encode(),
            bytes_per_block=self.region.block_len,
        )

    @classmethod
    def from_transfer_info(cls, info: TransferInfo) -> EndpointMetadata:
        md = cls.decode(info.agent_metadata)
        if info.agent_name and info.agent_name != md.agent_name:
            raise InvalidTransfer(
                f"TransferInfo names agent {info.agent_name!r} but carries {md.agent_name!r}"
            )
        return md


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(EndpointMetadata)
