"""The in-flight ledger's per-worker accounts in pure Python: the executable specification of
``switchyard_native.InflightAccounts`` (``native/src/inflight.rs``), kept as a differential
oracle. ``InflightLedger(accounts=Accounts())`` runs the product's ledger over them
(``tests/unit/test_native_ledger.py``, ``tests/unit/test_native_decide.py``).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from control_plane.router.ports import InflightLoad
from schemas.types import BlockHash, WorkerId


@dataclass(slots=True)
class _WorkerAccount:
    refs: dict[BlockHash, int] = field(default_factory=dict)
    prefill_tokens: int = 0
    extra_blocks: int = 0
    requests: int = 0


class Accounts:
    """Per worker: the load its in-flight entries add and a refcount per prompt block hash they
    hold: the executable specification of ``switchyard_native.InflightAccounts``.

    An account opens with its worker's first entry and closes with its last; every method
    returns what the native accounts return when they take the input (mutations True).
    """

    __slots__ = ("_workers",)

    def __init__(self) -> None:
        self._workers: dict[WorkerId, _WorkerAccount] = {}

    @classmethod
    def restore(cls, exported: list[tuple[WorkerId, list[tuple[BlockHash, int]], int, int, int]]) -> Accounts:
        """From ``export()``'s rows (either implementation's)."""
        out = cls()
        for worker, refs, prefill_tokens, extra_blocks, requests in exported:
            out._workers[worker] = _WorkerAccount(dict(refs), prefill_tokens, extra_blocks, requests)
        return out

    def export(self) -> list[tuple[WorkerId, list[tuple[BlockHash, int]], int, int, int]]:
        return [(w, list(a.refs.items()), a.prefill_tokens, a.extra_blocks, a.requests)
                for w, a in self._workers.items()]

    def add(self, worker: WorkerId, hashes: Sequence[BlockHash], prefill_tokens: int, extra_blocks: int) -> bool:
        account = self._workers.get(worker)
        if account is None:
            account = self._workers[worker] = _WorkerAccount()
        refs = account.refs
        get = refs.get
        for h in hashes:
            refs[h] = get(h, 0) + 1
        account.prefill_tokens += prefill_tokens
        account.extra_blocks += extra_blocks
        account.requests += 1
        return True

    def remove(self, worker: WorkerId, hashes: Sequence[BlockHash], prefill_tokens: int, extra_blocks: int) -> bool:
        account = self._workers[worker]
        refs = account.refs
        for h in hashes:
            left = refs[h] - 1
            if left:
                refs[h] = left
            else:
                del refs[h]
        account.prefill_tokens -= prefill_tokens
        account.extra_blocks -= extra_blocks
        account.requests -= 1
        if account.requests == 0:
            del self._workers[worker]
        return True

    def prefill_done(self, worker: WorkerId, tokens: int) -> bool:
        self._workers[worker].prefill_tokens -= tokens
        return True

    def load(self, worker: WorkerId) -> InflightLoad | None:
        a = self._workers.get(worker)
        return None if a is None else InflightLoad(a.prefill_tokens, len(a.refs) + a.extra_blocks, a.requests)

    def overlap(self, worker: WorkerId, hashes: tuple[BlockHash, ...]) -> int:
        account = self._workers.get(worker)
        return 0 if account is None else _matched_depth(account.refs, hashes, hashes[::-1])

    def view(self, hashes: tuple[BlockHash, ...]) -> dict[WorkerId, InflightLoad]:
        out: dict[WorkerId, InflightLoad] = {}
        n = len(hashes)
        if n == 0:
            for worker, a in self._workers.items():
                out[worker] = InflightLoad(
                    a.prefill_tokens, len(a.refs) + a.extra_blocks, a.requests
                )
            return out
        # _matched_depth inlined: this loop runs over every busy worker on every decision.
        first = hashes[0]
        backwards = hashes[::-1]
        for worker, a in self._workers.items():
            refs = a.refs
            depth = (
                n - bisect_left(backwards, True, key=refs.__contains__) if first in refs else 0
            )
            out[worker] = InflightLoad(
                a.prefill_tokens, len(refs) + a.extra_blocks, a.requests, depth
            )
        return out

    def __len__(self) -> int:
        return len(self._workers)



def _matched_depth(
    refs: Mapping[BlockHash, int],
    hashes: Sequence[BlockHash],
    reversed_hashes: Sequence[BlockHash],
) -> int:
    """Length of the longest prefix of ``hashes`` whose blocks are all in ``refs``.

    Binary search, O(log n) lookups: valid because ``refs`` is prefix-closed (every entry added
    a whole chain from the root, and a chained hash at position i implies the i blocks before
    it), so membership along ``hashes`` is true up to some depth and false after it. Along
    ``reversed_hashes`` it is false then true, which is the ascending order ``bisect`` needs;
    with ``refs.__contains__`` as the key the whole search runs in C (about twice as fast as a
    Python loop, and this runs for every worker with requests in flight on every decision).
    """
    n = len(hashes)
    if n == 0 or hashes[0] not in refs:
        return 0
    return n - bisect_left(reversed_hashes, True, key=refs.__contains__)
