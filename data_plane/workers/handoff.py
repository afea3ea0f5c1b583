"""The worker's side of the prefill -> decode handoff, as pure data: staging slots of the NIXL
region and the ``kv_transfer_params`` both ends exchange through the router. No I/O.

``kv_transfer_params`` follow vLLM's NixlConnector (``do_remote_prefill``, ``remote_engine_id``,
``remote_request_id``, ``remote_block_ids``, ``remote_host``/``remote_port``, ``tp_size``), plus
what a pull over our NIXL adapter needs (:meth:`data_plane.transfer.Handoff.to_params`:
``remote_agent``, ``expires_at``) and what makes the bytes checkable and the output seamless:

* ``remote_block_hashes``: the chained hash of each block, in the order of ``remote_block_ids``.
  Block bytes are derived from the hash (:mod:`data_plane.kvbm.content`), so the reader verifies
  every block it read, and checks the handoff is for *its* prompt.
* ``block_size``, ``bytes_per_block``: refused before any READ if they differ from the reader's.
* ``first_token_ids``: the token(s) the prefill produced; the decode continues after them.

The ``remote_block_ids`` are indices of blocks in the holder's registered region (its staging
slots), not engine block ids: the simulated device pool has no bytes to register.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from data_plane.transfer import Handoff, InvalidTransfer

Params = dict[str, Any]


class SlotPool:
    """Free list of the staging slots ``[first, first + count)`` of a region. All or nothing:
    a handoff gets every slot it needs or none (a partial hold could never be read whole)."""

    def __init__(self, first: int, count: int) -> None:
        if first < 0 or count <= 0:
            raise ValueError(f"a slot pool needs first >= 0 and count > 0, got {first}, {count}")
        self.first = first
        self.count = count
        # Lowest slot on top, so transfers use the region front to back.
        self._free = list(range(first + count - 1, first - 1, -1))
        self._used: set[int] = set()

    @property
    def free_count(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` slots, or None when fewer are free."""
        if n < 0:
            raise ValueError("negative slot count")
        if n > len(self._free):
            return None
        out = [self._free.pop() for _ in range(n)]
        self._used.update(out)
        return out

    def free(self, slots: Sequence[int]) -> None:
        """Return slots; freeing one that is not allocated is a bug and raises."""
        for s in slots:
            if s not in self._used:
                raise ValueError(f"slot {s} is not allocated")
            self._used.remove(s)
            self._free.append(s)


def prefill_params(handoff: Handoff, *, engine_id: str, block_hashes: Sequence[int],
                   remote_host: str, remote_port: int, block_size: int, bytes_per_block: int,
                   first_token_ids: Sequence[int]) -> Params:
    """What a prefill worker answers in ``kv_transfer_params`` (and records in
    ``PrefillCompleted``)."""
    if len(block_hashes) != len(handoff.block_ids):
        raise InvalidTransfer(f"{len(block_hashes)} hashes for {len(handoff.block_ids)} blocks")
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        **handoff.to_params(),
        "remote_block_hashes": [int(h) for h in block_hashes],
        "remote_host": remote_host,
        "remote_port": remote_port,
        "tp_size": 1,
        "block_size": block_size,
        "bytes_per_block": bytes_per_block,
        "first_token_ids": [int(t) for t in first_token_ids],
    }


class _PeerParams(msgspec.Struct, frozen=True, kw_only=True):
    """The fields of the params a decode worker reads as sent (same name on the wire)."""

    remote_host: str | None = None
    remote_port: int | None = None
    block_size: int | None = None
    bytes_per_block: int | None = None
    first_token_ids: list[int] = []


class DecodeHandoff(_PeerParams, frozen=True, kw_only=True):
    """A decode worker's reading of the params it was sent."""

    handoff: Handoff
    engine_id: str
    block_hashes: list[int]

    @property
    def blocks(self) -> int:
        return len(self.handoff.block_ids)


class _Extras(_PeerParams, frozen=True, kw_only=True):
    """The params beyond the handoff's block ids, as decoded from the wire."""

    remote_engine_id: str
    remote_block_hashes: list[int]


def is_prefill_request(params: Params | None) -> bool:
    """The router asks this worker to prefill and hold the KV for a decode peer."""
    return bool(params) and params.get("do_remote_decode") is True


def parse_decode_params(params: Params | None) -> DecodeHandoff | None:
    """The handoff to pull, or None when ``params`` ask for none (absent, or
    ``do_remote_prefill`` not true). Raises :class:`InvalidTransfer` when they ask for one but
    are malformed (the caller answers 400: it is the sender's bug, not a transfer failure)."""
    if not params or params.get("do_remote_prefill") is not True:
        return None
    handoff = Handoff.from_params(params)
    try:
        extras = msgspec.convert(params, _Extras, strict=False)
    except msgspec.ValidationError as exc:
        raise InvalidTransfer(f"kv_transfer_params: {exc}") from exc
    if len(extras.remote_block_hashes) != len(handoff.block_ids):
        raise InvalidTransfer(f"kv_transfer_params: {len(extras.remote_block_hashes)} block hashes "
                              f"for {len(handoff.block_ids)} block ids")
    return DecodeHandoff(handoff=handoff, engine_id=extras.remote_engine_id, block_hashes=extras.remote_block_hashes,
                         **{f: getattr(extras, f) for f in _PeerParams.__struct_fields__})


def mismatch(h: DecodeHandoff, prompt_hashes: Sequence[int], *, block_size: int,
             bytes_per_block: int) -> str | None:
    """Why this worker must not read the handoff for this prompt (None: it may). The blocks must
    be the prompt's first full blocks, cut and sized as here."""
    if h.block_size is not None and h.block_size != block_size:
        return f"block size {h.block_size} != ours {block_size}"
    if h.bytes_per_block is not None and h.bytes_per_block != bytes_per_block:
        return f"{h.bytes_per_block}-byte blocks != ours {bytes_per_block}"
    if list(h.block_hashes) != list(prompt_hashes[: len(h.block_hashes)]):
        return "the handoff's blocks are not this prompt's prefix"
    return None
