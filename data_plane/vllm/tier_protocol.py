"""The messages between :class:`~data_plane.vllm.connector.SwitchyardKVConnector` (inside
vLLM's engine-core process) and the worker's KVBM (:mod:`data_plane.vllm.tier_server`, inside
the worker process). Pure: msgspec structs and their codec, no sockets.

Why a protocol at all: with ``distributed_executor_backend=uni`` both halves of a vLLM KV
connector (scheduler side and worker side) run in the engine-core process that ``AsyncLLM``
spawns, while the worker's KVBM, its producer (one per worker, so its sequences stay dense)
and its restart logic live in the worker process. The connector therefore owns no tier: it
asks the KVBM, and the KVBM decides, stores, and reports. Bytes travel two ways:

* **loads** read the KVBM's host pool directly: it is a shared-memory file both processes map
  (:class:`~data_plane.vllm.tier_server.SharedRegion`); an :class:`Onboard` reply names the
  pinned host slot of each block, the connector copies the slots into vLLM's blocks, says
  what it now holds (:class:`Loaded`, digests read back from vLLM's tensors) and
  :class:`Release`\\s the lease;
* **saves** carry the bytes as extra frames of a :class:`Store` message (one frame per block,
  copied out of vLLM's KV tensors after the forward pass): the KVBM alone chooses slots and
  evictions, so the connector never writes into the pool.

Framing on the ZMQ DEALER/ROUTER pair: ``[b"", msgpack(message), *block frames]`` from the
connector, ``[b"", msgpack(reply)]`` back (only :class:`Onboard` has a reply).
"""

from __future__ import annotations

from typing import Union

import msgspec


class Onboard(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Bring the longest held prefix of ``hashes`` into the host pool and pin it under
    ``lease`` (scheduler side, ``get_num_new_matched_tokens``). A repeated onboard of a request
    (vLLM asks again when it could not schedule it) names a new lease and releases ``replaces``."""

    call: int
    lease: str
    #: The worker's request id (vLLM's internal id carries a random suffix).
    request_id: str
    hashes: list[int]
    replaces: list[str] = []


class OnboardedBlock(msgspec.Struct, frozen=True, array_like=True):
    block_hash: int
    slot: int
    #: Tier it was served from ("host", "disk", "object").
    tier: str


class Onboarded(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    call: int
    lease: str
    blocks: list[OnboardedBlock]
    #: How many blocks the KVBM believed it held before reading them (``lookup``); more than
    #: ``len(blocks)`` means a copy failed (corrupt, missing, I/O error, host full) and the
    #: request recomputes from there (recorded as ``KvTransferFailed(fallback="recompute")``).
    claimed: int
    stop_reason: str


class Release(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Unpin the host slots of these leases (worker side after its copy; scheduler side when
    the request finishes). Idempotent per lease."""

    leases: list[str]


class Store(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Newly computed full blocks of one engine step, bytes in the frames that follow (one per
    hash, ``bytes_per_block`` each). ``parents[i]`` is the chain parent of ``hashes[i]``."""

    hashes: list[int]
    parents: list[int | None]
    #: xxh3_64 of each block's bytes as vLLM computed them (see :class:`Loaded`).
    digests: list[int] = []


class Loaded(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """A lease's blocks are in vLLM's KV tensors: ``digests[i]`` is the xxh3_64 of block
    ``hashes[i]`` read back *from vLLM's tensors* after the copy. The KVBM compares it with the
    digest of the bytes vLLM computed when the block was saved: equal means vLLM now attends
    over exactly the KV it would have recomputed (end to end: copy out, tiers, disk, copy in)."""

    lease: str
    request_id: str
    hashes: list[int]
    digests: list[int]


class LoadFailed(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """The worker side could not copy a lease's blocks into vLLM (it reported them to vLLM as
    invalid, and vLLM recomputes them): the KVBM records the fallback."""

    lease: str
    request_id: str
    blocks: int
    reason: str


Message = Union[Onboard, Onboarded, Release, Store, Loaded, LoadFailed]

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _ENCODER.encode(msg)


def decode(buf: bytes | memoryview) -> Message:
    """Raises ``msgspec.DecodeError`` / ``msgspec.ValidationError`` on anything else."""
    return _DECODER.decode(buf)
