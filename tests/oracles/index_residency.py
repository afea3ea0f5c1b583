"""The oracle index's storage (:mod:`tests.oracles.prefix_index`): which slot (worker, DP rank) holds which block hash in which
tier, as one packed int per hash, plus the per-slot sets and masks the folds keep beside it.

Layout (docs/prefix-index.md, "Data layout"): a slot is one bit in each of ``1 + N_TIERS``
planes of width ``_w``; plane 0 says "held in any tier", plane ``1 + t`` "held in tier ``t``".
The event application (sequencing, fencing, staleness) is :mod:`tests.oracles.prefix_index`'s; this module
only changes residency, slots and their masks.
"""

from __future__ import annotations

from collections.abc import Iterable

from control_plane.index.shapes import WorkerRank
from schemas.types import TIER_ORDER, WorkerId

N_TIERS = len(TIER_ORDER)
ALL_IDX = tuple(range(N_TIERS))
_MIN_WIDTH = 8
#: Most distinct map values the intern table keeps (beyond it values are simply not shared).
_INTERN_CAP = 1 << 16


class WorkerState:
    """What the index knows of one worker id: its epochs per stream and its slots."""

    __slots__ = ("epoch", "life_epoch", "registered_epoch", "deregistered", "slots")

    def __init__(self, epoch: int = -1, life_epoch: int = -1, registered_epoch: int = -1) -> None:
        #: Newest epoch seen on the ``kv`` stream (-1: none yet): residency's incarnation.
        self.epoch = epoch
        #: Newest epoch seen on the ``workers`` stream (-1: none yet): the lifecycle's.
        self.life_epoch = life_epoch
        #: Newest epoch a ``WorkerRegistered`` was folded for (-1: none).
        self.registered_epoch = registered_epoch
        #: A ``WorkerDeregistered`` of ``life_epoch`` was folded.
        self.deregistered = False
        #: Low-plane mask of this worker's slots.
        self.slots = 0


def bits_of(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class PackedResidency:
    """Slots, the packed hash -> holders map, the per-slot sets and the slot masks.

    ``_stale``, ``_lost`` and ``_unsynced`` are slot masks the event application sets; freeing
    a slot clears them here so a reused slot starts clean."""

    def __init__(self) -> None:
        self._w = _MIN_WIDTH
        self._map: dict[int, int] = {}
        #: Intern table for map values: most hashes share a handful of holder patterns, so one
        #: int object per pattern instead of one per hash (saves ~32 bytes per hash).
        self._values: dict[int, int] = {}
        self._slots: list[WorkerRank | None] = []
        self._slot_of: dict[WorkerRank, int] = {}
        self._free: list[int] = []
        #: Per slot, per tier index: the hashes held.
        self._sets: list[list[set[int]]] = []
        self._active = 0
        #: ``_lost | _unsynced``, kept up to date: what ``find_matches`` reports as stale.
        self._stale = 0
        #: Slots whose producer's KV sequence had a gap: entries may be missing or wrong.
        self._lost = 0
        #: Slots whose worker began a KV epoch not yet registered: persistent entries unconfirmed.
        self._unsynced = 0
        #: Low-plane mask of slots holding anything outside the device tier.
        self._nondev = 0
        #: producer -> low-plane mask of the slots it has written to
        self._producer_slots: dict[str, int] = {}

    # -- slots ---------------------------------------------------------------------------------

    def _slot_for(self, worker_id: WorkerId, dp_rank: int, wk: WorkerState) -> int:
        key = WorkerRank(worker_id, dp_rank)
        s = self._slot_of.get(key)
        if s is not None:
            return s
        if self._free:
            s = self._free.pop()
            self._slots[s] = key
        else:
            s = len(self._slots)
            if s >= self._w:
                self._relayout(self._w * 2)
            self._slots.append(key)
            self._sets.append([set() for _ in ALL_IDX])
        self._slot_of[key] = s
        bit = 1 << s
        wk.slots |= bit
        if not wk.deregistered:
            self._active |= bit
        return s

    def _free_slot(self, s: int, wk: WorkerState) -> None:
        key = self._slots[s]
        assert key is not None
        del self._slot_of[key]
        self._slots[s] = None
        bit = 1 << s
        wk.slots &= ~bit
        self._active &= ~bit
        self._stale &= ~bit
        self._lost &= ~bit
        self._unsynced &= ~bit
        self._nondev &= ~bit
        for p, m in self._producer_slots.items():
            if m & bit:
                self._producer_slots[p] = m & ~bit
        self._free.append(s)

    def _relayout(self, new_w: int) -> None:
        """Re-pack every value for plane width ``new_w`` (once per doubling of slots)."""
        w = self._w
        low = (1 << w) - 1
        planes = range(1 + N_TIERS)
        m = self._map
        self._values = {}
        moved: dict[int, int] = {}
        for h, v in m.items():
            nv = moved.get(v)
            if nv is None:
                nv = 0
                for p in planes:
                    nv |= ((v >> (p * w)) & low) << (p * new_w)
                nv = moved[v] = self._interned(nv)
            m[h] = nv
        self._w = new_w

    # -- folds ---------------------------------------------------------------------------------

    def _interned(self, v: int) -> int:
        """The shared int object equal to ``v`` (added to the table while it has room)."""
        got = self._values.get(v)
        if got is not None:
            return got
        if len(self._values) < _INTERN_CAP:
            self._values[v] = v
        return v

    def _store(self, s: int, t: int, hashes: Iterable[int]) -> None:
        held = self._sets[s][t]
        # Engines re-send prefix hits as stores: only the blocks new to this (slot, tier) need
        # the Python-level loop; the set difference runs in C.
        new = set(hashes)
        new -= held
        if not new:
            return
        held |= new
        if t:
            self._nondev |= 1 << s
        bits = self._interned((1 << s) | (1 << (self._w * (1 + t) + s)))
        m = self._map
        get = m.get
        iget = self._values.get
        for h in new:
            v = get(h)
            if v is None:
                m[h] = bits
            else:
                v |= bits
                m[h] = iget(v) or self._interned(v)

    def _remove(self, s: int, t: int, hashes: list[int]) -> None:
        held = self._sets[s][t]
        present = held.intersection(hashes)
        if not present:
            return
        held.difference_update(present)
        self._unset(s, t, present)
        if t:
            self._refresh_nondev(s)

    def _refresh_nondev(self, s: int) -> None:
        sets = self._sets[s]
        if any(sets[t] for t in range(1, N_TIERS)):
            self._nondev |= 1 << s
        else:
            self._nondev &= ~(1 << s)

    def _unset(self, s: int, t: int, hashes: Iterable[int]) -> None:
        w = self._w
        tb = 1 << (w * (1 + t) + s)
        anyb = 1 << s
        tiers_of_s = 0
        for k in ALL_IDX:
            tiers_of_s |= 1 << (w * (1 + k) + s)
        m = self._map
        iget = self._values.get
        for h in hashes:
            v = m[h] ^ tb
            if not v & tiers_of_s:
                v ^= anyb
            if v:
                m[h] = iget(v) or self._interned(v)
            else:
                del m[h]

    def _move(self, s: int, f: int, t: int, hashes: list[int]) -> None:
        if f == t:
            self._store(s, t, hashes)
            return
        w = self._w
        keep = ~(1 << (w * (1 + f) + s))
        bits = (1 << s) | (1 << (w * (1 + t) + s))
        m = self._map
        get = m.get
        iget = self._values.get
        for h in hashes:
            v = (get(h, 0) & keep) | bits
            m[h] = iget(v) or self._interned(v)
        sets = self._sets[s]
        sets[f].difference_update(hashes)
        sets[t].update(hashes)
        self._refresh_nondev(s)

    def _clear(self, s: int, tiers: Iterable[int]) -> None:
        sets = self._sets[s]
        for t in tiers:
            held = sets[t]
            if held:
                sets[t] = set()
                self._unset(s, t, held)
        self._refresh_nondev(s)
