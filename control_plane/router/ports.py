"""The router's ports: what it needs of the prefix index and of the in-flight accounts, as
``typing.Protocol`` s. The product has one implementation of each, the Rust core (``native/``:
``control_plane.index.native.NativePrefixIndex``, ``switchyard_native.InflightAccounts``); the
pure-Python executable specifications in ``tests/oracles/`` implement the same ports, and the
differential tests fold the same inputs through both (``tests/unit/test_native_index.py``,
``tests/unit/test_native_ledger.py``, ``tests/unit/test_router_ports.py``). Code that holds one
calls it through these ports and never asks which it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import msgspec

from control_plane.index.errors import IndexRejected
from control_plane.index.shapes import ApplyOutcome, IndexStats, Match, WorkerRank
from schemas.events import Event
from schemas.types import BlockHash, WorkerId


class InflightLoad(msgspec.Struct, frozen=True, gc=False):
    """Load the router itself has added to one worker and not yet seen finish."""

    #: Prompt tokens still to be prefilled (requests not yet ``prefill_done``).
    prefill_tokens: int = 0
    #: KV blocks held by in-flight requests; shared prompt blocks counted once.
    decode_blocks: int = 0
    #: Requests in flight.
    requests: int = 0
    #: Leading blocks of the prompt being routed that those requests hold (the speculative
    #: overlap); 0 from ``load_for``, which has no prompt to compare with.
    shared_blocks: int = 0


NO_INFLIGHT = InflightLoad()


class InflightView(Protocol):
    """What a decision reads from the in-flight account: the ledger, or a recorded snapshot
    (any object whose ``view`` returns the same mapping)."""

    def view(self, hashes: Sequence[BlockHash]) -> Mapping[WorkerId, InflightLoad]:
        """Load and speculative overlap for ``hashes`` of every worker with requests in
        flight; workers absent from the mapping have none."""
        ...


@runtime_checkable
class KvIndex(Protocol):
    """The global prefix index (docs/prefix-index.md): a fold of the ``kv`` and ``workers``
    streams answering which worker holds which prefix, in which tier."""

    @property
    def hash_algo(self) -> str: ...

    @property
    def block_size(self) -> int: ...

    def apply(self, producer: str, epoch: int, seq: int, payload: Event) -> ApplyOutcome:
        """Fold one decoded event. Raises :class:`IndexRejected` for one to dead-letter."""
        ...

    def apply_bytes(self, value: bytes, suffix: str = "") -> ApplyOutcome | None:
        """Fold one record from its envelope bytes, sequenced as ``<producer><suffix>``; None:
        not a record this path takes (nothing changed: decode it and :meth:`apply`)."""
        ...

    def apply_run(self, values: list, start: int, suffix: str = "", verifier: Any = None
                  ) -> tuple[int, IndexRejected | None]:
        """Fold ``values[start:]`` for as long as :meth:`apply_bytes` would take each; ``(end,
        rejected)`` (see ``NativePrefixIndex.apply_run``). ``(start, None)``: it took none."""
        ...

    def last_worker(self) -> str:
        """The worker id of the last record :meth:`apply_bytes` or :meth:`apply_run` folded."""
        ...

    def find_matches(self, hashes: Sequence[BlockHash]) -> Mapping[WorkerRank, Match]: ...

    def stale_workers(self) -> list[WorkerRank]: ...

    def stats(self) -> IndexStats: ...

    def snapshot(self) -> bytes:
        """Deterministic bytes (the format: docs/prefix-index.md) :meth:`restore` reads back."""
        ...

    def as_dict(self) -> dict: ...


@runtime_checkable
class InflightAccounts(Protocol):
    """The in-flight ledger's per-worker accounts (control_plane/router/ledger.py): prompt
    blocks and tokens of the requests each worker has been sent and not finished. A mutation
    returns False, changing nothing, when the accounts decline the input (a hash that is not a
    ``u64``, a counter beyond ``i64``); the ledger then raises ``InvalidRoutingInput``."""

    def add(self, worker: WorkerId, hashes: Sequence[BlockHash], prefill_tokens: int, extra_blocks: int) -> bool: ...

    def remove(self, worker: WorkerId, hashes: Sequence[BlockHash], prefill_tokens: int, extra_blocks: int) -> bool: ...

    def prefill_done(self, worker: WorkerId, tokens: int) -> bool: ...

    def load(self, worker: WorkerId) -> InflightLoad | None: ...

    def overlap(self, worker: WorkerId, hashes: tuple[BlockHash, ...]) -> int: ...

    def view(self, hashes: tuple[BlockHash, ...]) -> Mapping[WorkerId, InflightLoad]: ...

    def export(self) -> list[tuple[WorkerId, list[tuple[BlockHash, int]], int, int, int]]: ...

    def __len__(self) -> int: ...
