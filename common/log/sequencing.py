"""Per-producer sequence tracking: drop duplicates, detect gaps and new incarnations. Pure.

A producer numbers the events it sends to one ordered substream (a topic partition: the
``scope``) 0, 1, 2, ... within one incarnation (epoch). For each ``(scope, producer)`` the
tracker keeps the epoch, a *watermark* W (every
seq <= W has been seen) and the set of seen seqs above W. Then:

* ``seq <= W`` or already in the set: a redelivery -> ``DUPLICATE`` (drop it).
* ``seq == W + 1``: in order -> ``NEW``; the watermark advances over any buffered seqs.
* ``seq > W + 1``: ``NEW`` with ``gap = (W + 1, seq - 1)``: those seqs never arrived. Within
  one partition that is real loss (a send that failed for good, or data removed by retention)
  and the consumer must repair it (e.g. mark the worker stale and resync).
* a higher epoch: the producer restarted -> ``NEW`` with ``new_epoch=True``; state resets.
* a lower epoch: a fenced, stale incarnation -> ``STALE_EPOCH`` (drop it).

Memory is bounded: if more than ``max_pending`` seqs wait above a hole, the hole is declared lost
(``lost`` is counted) and the watermark jumps over it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import msgspec


class Verdict(str, Enum):
    NEW = "new"
    DUPLICATE = "duplicate"
    STALE_EPOCH = "stale_epoch"


@dataclass(frozen=True)
class Observation:
    verdict: Verdict
    #: Inclusive range of seqs skipped by this event, when it opened a hole.
    gap: tuple[int, int] | None = None
    new_epoch: bool = False
    previous_epoch: int | None = None

    @property
    def accepted(self) -> bool:
        return self.verdict is Verdict.NEW


@dataclass
class _ProducerState:
    epoch: int
    watermark: int = -1
    pending: set[int] = field(default_factory=set)


class _Snapshot(msgspec.Struct, array_like=True):
    scope: str
    producer: str
    epoch: int
    watermark: int
    pending: list[int]


class SequenceTracker:
    def __init__(self, max_pending: int = 100_000) -> None:
        self._state: dict[tuple[str, str], _ProducerState] = {}
        self.max_pending = max_pending
        self.duplicates = 0
        self.gaps = 0
        self.lost = 0
        self.stale = 0

    def observe(self, scope: str, producer: str, epoch: int, seq: int) -> Observation:
        key = (scope, producer)
        st = self._state.get(key)
        if st is None:
            st = self._state[key] = _ProducerState(epoch=epoch)
            return self._advance(st, seq, first=True)
        if epoch < st.epoch:
            self.stale += 1
            return Observation(Verdict.STALE_EPOCH, previous_epoch=st.epoch)
        if epoch > st.epoch:
            prev = st.epoch
            self._state[key] = st = _ProducerState(epoch=epoch)
            obs = self._advance(st, seq, first=False)
            return Observation(obs.verdict, gap=obs.gap, new_epoch=True, previous_epoch=prev)
        if seq <= st.watermark or seq in st.pending:
            self.duplicates += 1
            return Observation(Verdict.DUPLICATE)
        return self._advance(st, seq, first=False)

    def _advance(self, st: _ProducerState, seq: int, first: bool) -> Observation:
        gap = None
        if seq == st.watermark + 1:
            st.watermark = seq
            while st.watermark + 1 in st.pending:
                st.watermark += 1
                st.pending.discard(st.watermark)
        else:
            # The first event seen from a producer may legitimately start mid-stream (we joined
            # late, or retention removed the head); only later holes are gaps.
            if first:
                st.watermark = seq
                return Observation(Verdict.NEW)
            lo = st.watermark + 1
            # Report only the part of the hole this event newly exposes.
            highest = max(st.pending) if st.pending else st.watermark
            if seq > highest + 1:
                gap = (max(lo, highest + 1), seq - 1)
                self.gaps += 1
            st.pending.add(seq)
            if len(st.pending) > self.max_pending:
                self._declare_lost(st)
        return Observation(Verdict.NEW, gap=gap)

    def _declare_lost(self, st: _ProducerState) -> None:
        first_seen = min(st.pending)
        self.lost += first_seen - st.watermark - 1
        st.watermark = first_seen
        st.pending.discard(first_seen)
        while st.watermark + 1 in st.pending:
            st.watermark += 1
            st.pending.discard(st.watermark)

    def outstanding_gaps(self) -> dict[tuple[str, str], list[tuple[int, int]]]:
        """Holes still open per (scope, producer), as inclusive ranges."""
        out: dict[tuple[str, str], list[tuple[int, int]]] = {}
        for key, st in self._state.items():
            if not st.pending:
                continue
            holes = []
            prev = st.watermark
            for s in sorted(st.pending):
                if s > prev + 1:
                    holes.append((prev + 1, s - 1))
                prev = s
            out[key] = holes
        return out

    def position(self, scope: str, producer: str) -> tuple[int, int] | None:
        """(epoch, watermark) for a producer, or None if never seen."""
        st = self._state.get((scope, producer))
        return (st.epoch, st.watermark) if st else None

    # -- checkpointing (so dedupe survives a consumer restart) ------------------------------

    def snapshot(self) -> bytes:
        rows = [
            _Snapshot(k[0], k[1], st.epoch, st.watermark, sorted(st.pending))
            for k, st in self._state.items()
        ]
        return msgspec.msgpack.encode(rows)

    @classmethod
    def restore(cls, data: bytes, max_pending: int = 100_000) -> SequenceTracker:
        t = cls(max_pending=max_pending)
        for r in msgspec.msgpack.decode(data, type=list[_Snapshot]):
            t._state[(r.scope, r.producer)] = _ProducerState(r.epoch, r.watermark, set(r.pending))
        return t
