"""The global prefix index: a pure projection of the KV and worker streams.

It answers one question for the router, fast: *for this prompt's chained block hashes, how long a
prefix does each worker already hold, and in which tiers?*

This pure-Python class is the *oracle*: the executable specification of the index's rules, kept
in the tests. The product's one index is :class:`control_plane.index.native.NativePrefixIndex`
(the Rust core in ``native/``), which follows it line by line and writes the same snapshot
bytes; the differential tests (``tests/unit/test_native_index.py``,
``tests/unit/test_view_interleavings.py``) fold the same events through both and compare.

Its data layout, the sequencing, fencing and staleness rules, why every interleaving gives the same
state, and what it rejects: ``docs/prefix-index.md``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import msgspec

from control_plane.index.errors import IndexRejected
from tests.oracles.index_residency import ALL_IDX, N_TIERS, PackedResidency, WorkerState, bits_of
from control_plane.index.shapes import ApplyOutcome, IndexStats, Match, WorkerRank
from tests.oracles.index_snapshot import (
    SNAPSHOT_FORMAT,
    ProducerSnap,
    SeqSnap,
    SlotSnap,
    Snapshot,
    WorkerSnap,
    u64_bytes,
    u64_list,
)
from common.hashing import HashConfig
from schemas.envelope import Envelope
from schemas.events import (
    AllBlocksCleared,
    BlockMoved,
    BlockRemoved,
    BlockStored,
    Event,
    WorkerDeregistered,
    WorkerRegistered,
)
from schemas.types import PERSISTENT_TIERS, TIER_INDEX, TIER_ORDER, BlockHash, CacheGroup, Tier, WorkerId

logger = logging.getLogger(__name__)

_VOLATILE_IDX = tuple(i for i, t in enumerate(TIER_ORDER) if t not in PERSISTENT_TIERS)


class PrefixIndex(PackedResidency):
    """Per worker (and DP rank), which chained block hashes it holds and in which tiers.

    ``hash_algo`` and ``block_size`` are the index's configuration (use
    :attr:`common.hashing.HashConfig.hash_algo`); events that disagree are rejected.

    Not thread-safe: apply events and query from one thread (or hold one lock around both).
    """

    def __init__(self, hash_algo: str, block_size: int) -> None:
        super().__init__()
        self.hash_algo = hash_algo
        self.block_size = block_size
        #: Per depth: the shared device-only (fresh, stale) Match objects.
        self._device_matches: list[tuple[Match, Match]] = []
        self._workers: dict[WorkerId, WorkerState] = {}
        #: (producer, stream) -> [epoch, last applied seq]
        self._seq: dict[tuple[str, str], list[int]] = {}
        self._counters = dict.fromkeys(
            ("applied", "duplicate", "fenced", "ignored", "rejected", "gaps", "new_epochs",
             "resyncs"),
            0,
        )

    @classmethod
    def for_config(cls, config: HashConfig) -> PrefixIndex:
        """An index accepting exactly the events of producers hashing with ``config``."""
        return cls(config.hash_algo, config.block_size)

    # -- queries -------------------------------------------------------------------------------

    def find_matches(self, hashes: Sequence[BlockHash]) -> dict[WorkerRank, Match]:
        """Matched prefix per worker for a query's chained block hashes (block 0 first; a list
        or tuple, e.g. from :func:`common.hashing.hash_blocks`).

        A worker's match is contiguous from block 0 and stops at its first miss; workers with
        no matched block, and deregistered workers, are absent from the result. The returned
        :class:`Match` objects may be shared between calls (they are immutable).
        """
        cur = self._active
        if not cur:
            return {}
        get = self._map.get
        ends: list[tuple[int, int]] = []
        depth = 0
        slow = 0
        if not self._nondev & cur:
            # Common case (no host/disk/object residency among the candidates): every matched
            # block is on device, so the walk needs no per-tier bookkeeping.
            for h in hashes:
                nxt = cur & get(h, 0)
                if nxt != cur:
                    ends.append((depth, cur ^ nxt))
                    cur = nxt
                    if not cur:
                        break
                depth += 1
        else:
            acc = 0
            for h in hashes:
                v = get(h, 0)
                nxt = cur & v
                if nxt != cur:
                    ends.append((depth, cur ^ nxt))
                    cur = nxt
                    if not cur:
                        break
                acc |= v
                depth += 1
            w = self._w
            # Slots with a non-device block on the walked path need a count per tier.
            slow = ((acc >> (2 * w)) | (acc >> (3 * w)) | (acc >> (4 * w))) & ((1 << w) - 1)
        if cur:
            ends.append((depth, cur))
        stale = self._stale
        slots = self._slots
        out: dict[WorkerRank, Match] = {}
        for d, mask in ends:
            if not d:
                continue
            if d >= len(self._device_matches):
                self._grow_match_cache(d)
            fresh, old = self._device_matches[d]
            while mask:
                low = mask & -mask
                mask ^= low
                s = low.bit_length() - 1
                if slow & low:
                    out[slots[s]] = Match(  # type: ignore[index]
                        d, self._tier_counts(hashes, d, s), stale & low != 0)
                else:
                    out[slots[s]] = old if stale & low else fresh  # type: ignore[index]
        return out

    def _grow_match_cache(self, depth: int) -> None:
        # Matches are immutable: device-only ones are shared, one per (depth, stale).
        for d in range(len(self._device_matches), max(depth + 1, 2 * len(self._device_matches))):
            by = (d, 0, 0, 0)
            self._device_matches.append((Match(d, by, False), Match(d, by, True)))

    def _tier_counts(self, hashes: Sequence[int], depth: int, s: int) -> tuple[int, int, int, int]:
        w = self._w
        m = self._map
        counts = [0] * N_TIERS
        shifts = [w * (1 + t) + s for t in ALL_IDX]
        for i in range(depth):
            v = m[hashes[i]]
            for t in ALL_IDX:
                if (v >> shifts[t]) & 1:
                    counts[t] += 1
                    break
        return counts[0], counts[1], counts[2], counts[3]

    def is_stale(self, worker: WorkerRank) -> bool:
        s = self._slot_of.get(worker)
        return s is not None and bool(self._stale >> s & 1)

    def stale_workers(self) -> list[WorkerRank]:
        return [self._slots[s] for s in bits_of(self._stale)]  # type: ignore[misc]

    def workers(self) -> list[WorkerRank]:
        """Every cache the index has a slot for (including deregistered ones)."""
        return [r for r in self._slots if r is not None]

    def epoch_of(self, worker_id: WorkerId) -> int | None:
        """The newest incarnation of the worker seen on either stream."""
        w = self._workers.get(worker_id)
        return None if w is None else max(w.epoch, w.life_epoch)

    def position(self, producer: str, stream: str) -> tuple[int, int] | None:
        """(epoch, last applied seq) of a producer on a stream, or None if never seen."""
        st = self._seq.get((producer, stream))
        return None if st is None else (st[0], st[1])

    def __len__(self) -> int:
        """Distinct block hashes held by anyone."""
        return len(self._map)

    # -- applying events -----------------------------------------------------------------------

    def apply_envelope(self, env: Envelope[Event]) -> ApplyOutcome:
        return self.apply(env.producer, env.epoch, env.seq, env.data)

    # The byte paths of the router's ``KvIndex`` port (control_plane/router/ports.py): the
    # native index folds records from their bytes; the specification takes none, so every
    # record is decoded and goes through :meth:`apply` (the same fold).

    def apply_bytes(self, value: bytes, suffix: str = "") -> ApplyOutcome | None:
        """None: decode ``value`` and :meth:`apply` it (nothing changed)."""
        return None

    def apply_run(self, values: list, start: int, suffix: str = "", verifier=None
                  ) -> tuple[int, IndexRejected | None]:
        """``(start, None)``: no record taken; each goes through :meth:`apply`."""
        return start, None

    def last_worker(self) -> str:
        """Never asked: :meth:`apply_bytes` folds nothing."""
        raise LookupError("the reference index folds no record from its bytes")

    def apply(self, producer: str, epoch: int, seq: int, payload: Event) -> ApplyOutcome:
        """Fold one decoded event given its envelope's ``producer``, ``epoch`` and ``seq``.

        Pass every event of the ``kv`` and ``workers`` streams (docs/prefix-index.md);
        payloads not about a worker (no ``worker_id``) are ``IGNORED`` without sequencing.
        Raises :class:`IndexRejected` for events the caller must dead-letter.
        """
        worker_id = getattr(payload, "worker_id", None)
        if worker_id is None:
            self._counters["ignored"] += 1
            return ApplyOutcome.IGNORED
        wk = self._workers.get(worker_id)
        if wk is None:
            wk = self._workers[worker_id] = WorkerState()
        kv = payload.STREAM == "kv"
        current = wk.epoch if kv else wk.life_epoch
        if epoch < current:
            self._counters["fenced"] += 1
            return ApplyOutcome.FENCED
        new_epoch = kv and 0 <= current < epoch
        key = (producer, payload.STREAM)
        st = self._seq.get(key)
        gap = False
        if st is None or st[0] < epoch:
            gap = seq != 0
            self._seq[key] = [epoch, seq]
        elif st[0] == epoch:
            last = st[1]
            if seq <= last:
                self._counters["duplicate"] += 1
                return ApplyOutcome.DUPLICATE
            gap = seq != last + 1
            st[1] = seq
        else:
            self._counters["fenced"] += 1
            return ApplyOutcome.FENCED

        # Accepted. Sequencing side effects first: they stand even if the event is rejected.
        dp_rank = getattr(payload, "dp_rank", None)
        # A plain tuple finds the WorkerRank key (equal hash and eq) without building one.
        slot = -1 if dp_rank is None else self._slot_of.get((worker_id, dp_rank), -1)  # type: ignore[call-overload]
        tp = type(payload)
        if not kv:
            wk.life_epoch = epoch
        elif new_epoch:
            wk.epoch = epoch
            # A new incarnation has empty memory: the old one's device/host entries are gone for
            # certain. Persistent tiers (disk, object) stay, unconfirmed until this epoch's
            # registration is folded (at once if it already was), unless events were lost.
            for s in bits_of(wk.slots):
                self._clear(s, ALL_IDX if self._lost >> s & 1 else _VOLATILE_IDX)
            self._lost &= ~wk.slots
            if wk.registered_epoch < epoch:
                self._unsynced |= wk.slots
            else:
                self._unsynced &= ~wk.slots
            self._stale = self._lost | self._unsynced
            self._counters["new_epochs"] += 1
            logger.info("worker %s is in epoch %d: volatile entries dropped, persistent ones "
                        "stale until it registers", worker_id, epoch)
        else:
            wk.epoch = epoch
        if gap and not kv:
            # A lost lifecycle event says nothing about residency: counted, not flagged.
            self._counters["gaps"] += 1
            logger.warning("gap from producer %s on stream %s before seq %d (epoch %d)",
                           producer, payload.STREAM, seq, epoch)
        elif gap:
            if slot < 0 and dp_rank is not None:
                # Whatever this event starts is incomplete too: flag its slot from the start.
                slot = self._slot_for(worker_id, dp_rank, wk)
            lost = self._producer_slots.get(producer, 0) | (1 << slot if slot >= 0 else 0)
            lost = lost or wk.slots
            self._lost |= lost
            self._stale = self._lost | self._unsynced
            self._counters["gaps"] += 1
            logger.warning("gap from producer %s on stream %s before seq %d (epoch %d): "
                           "entries of %s marked stale", producer, payload.STREAM, seq, epoch,
                           worker_id)
        if tp is BlockStored:
            self._check_store(payload)  # type: ignore[arg-type]
        elif tp is WorkerRegistered:
            self._check_config(payload, "WorkerRegistered")
        if slot < 0 and dp_rank is not None:
            slot = self._slot_for(worker_id, dp_rank, wk)
        if slot >= 0:
            pm = self._producer_slots.get(producer, 0)
            if not pm >> slot & 1:
                self._producer_slots[producer] = pm | (1 << slot)

        if tp is BlockStored:
            self._store(slot, TIER_INDEX[payload.tier], payload.block_hashes)  # type: ignore[attr-defined]
        elif tp is BlockRemoved:
            if payload.cache_group is not CacheGroup.FULL_ATTENTION:  # type: ignore[attr-defined]
                return self._ignored()
            self._remove(slot, TIER_INDEX[payload.tier], payload.block_hashes)  # type: ignore[attr-defined]
        elif tp is BlockMoved:
            if payload.cache_group is not CacheGroup.FULL_ATTENTION:  # type: ignore[attr-defined]
                return self._ignored()
            self._move(slot, TIER_INDEX[payload.from_tier], TIER_INDEX[payload.to_tier],  # type: ignore[attr-defined]
                       payload.block_hashes)  # type: ignore[attr-defined]
        elif tp is AllBlocksCleared:
            tier = payload.tier  # type: ignore[attr-defined]
            if tier is None:
                self._clear(slot, ALL_IDX)
                self._resync(1 << slot)
            else:
                self._clear(slot, (TIER_INDEX[tier],))
        elif tp is WorkerRegistered:
            self._registered(wk, epoch)
        elif tp is WorkerDeregistered:
            self._deregistered(wk)
        else:
            return self._ignored()
        if wk.deregistered:
            self._free_settled(wk)
        self._counters["applied"] += 1
        return ApplyOutcome.APPLIED

    def _ignored(self) -> ApplyOutcome:
        self._counters["ignored"] += 1
        return ApplyOutcome.IGNORED

    def _reject(self, reason: str, detail: str) -> None:
        self._counters["rejected"] += 1
        raise IndexRejected(reason, detail)

    def _check_config(self, payload, what: str) -> None:
        if payload.hash_algo != self.hash_algo:
            self._reject("hash_algo", f"{what} from {payload.worker_id} uses hash_algo "
                         f"{payload.hash_algo!r}; this index is {self.hash_algo!r}")
        if payload.block_size != self.block_size:
            self._reject("block_size", f"{what} from {payload.worker_id} has block_size "
                         f"{payload.block_size}; this index is {self.block_size}")

    def _check_store(self, payload: BlockStored) -> None:
        if payload.cache_group is not CacheGroup.FULL_ATTENTION:
            self._reject("cache_group", f"BlockStored from {payload.worker_id} is for cache group "
                         f"{payload.cache_group.value!r}; only full_attention blocks form a "
                         "reusable prefix")
        if payload.hash_algo != self.hash_algo or payload.block_size != self.block_size:
            self._check_config(payload, "BlockStored")

    # -- registrations -------------------------------------------------------------------------

    def _resync(self, mask: int) -> None:
        if self._stale & mask:
            self._counters["resyncs"] += 1
        self._lost &= ~mask
        self._unsynced &= ~mask
        self._stale = self._lost | self._unsynced

    def _registered(self, wk: WorkerState, epoch: int) -> None:
        # Touches no residency: ``workers`` and ``kv`` are separate topics, read in any
        # interleaving, so what a registration may do must commute with every KV event. It
        # confirms the persistent entries of its own (or an older) KV epoch, whichever of the
        # two is folded first, and makes the worker routable.
        if epoch > wk.registered_epoch:
            wk.registered_epoch = epoch
        if wk.registered_epoch >= wk.epoch:
            self._unsynced &= ~wk.slots
            self._stale = self._lost | self._unsynced
        wk.deregistered = False
        self._active |= wk.slots

    def _deregistered(self, wk: WorkerState) -> None:
        # Takes the worker out of ``find_matches``; its residency is the KV stream's business
        # (a draining worker clears its memory tiers there; docs/prefix-index.md).
        wk.deregistered = True
        self._active &= ~wk.slots

    def _free_settled(self, wk: WorkerState) -> None:
        """Free the slots of a deregistered worker that hold nothing and carry no flag: such a
        slot and no slot at all are the same state, so freeing it commutes with every event."""
        flagged = self._lost | self._unsynced
        for s in list(bits_of(wk.slots & ~flagged)):
            if not any(self._sets[s]):
                self._free_slot(s, wk)

    # -- inspection ----------------------------------------------------------------------------

    def stats(self) -> IndexStats:
        blocks: dict[WorkerRank, dict[Tier, int]] = {}
        for s, key in enumerate(self._slots):
            if key is None:
                continue
            per = {TIER_ORDER[t]: len(st) for t, st in enumerate(self._sets[s]) if st}
            if per:
                blocks[key] = per
        return IndexStats(
            distinct_hashes=len(self._map),
            blocks=blocks,
            stale=tuple(self.stale_workers()),
            deregistered=tuple(sorted(w for w, st in self._workers.items() if st.deregistered)),
            counters=dict(self._counters),
        )

    def as_dict(self) -> dict:
        """Plain-data view for tests and oracles (residency keys are
        ``(worker_id, dp_rank, tier value)``, only non-empty sets)."""
        residency = {}
        for s, key in enumerate(self._slots):
            if key is None:
                continue
            for t, st in enumerate(self._sets[s]):
                if st:
                    residency[(key.worker_id, key.dp_rank, TIER_ORDER[t].value)] = frozenset(st)
        return {
            "residency": residency,
            "stale": frozenset((k.worker_id, k.dp_rank) for k in self.stale_workers()),
            "epochs": {w: (st.epoch, st.life_epoch, st.registered_epoch) for w, st in self._workers.items()},
            "deregistered": frozenset(w for w, st in self._workers.items() if st.deregistered),
            "seq": {k: tuple(v) for k, v in self._seq.items()},
        }

    def verify_invariants(self) -> None:
        """Recompute the packed map from the per-slot sets; raise AssertionError on mismatch.

        O(index size): for tests and offline checks, not the hot path.
        """
        w = self._w
        expect: dict[int, int] = {}
        for s, key in enumerate(self._slots):
            sets = self._sets[s]
            if key is None:
                assert not any(sets), f"free slot {s} holds blocks"
                continue
            for t, st in enumerate(sets):
                bits = (1 << s) | (1 << (w * (1 + t) + s))
                for h in st:
                    expect[h] = expect.get(h, 0) | bits
        assert expect == self._map, "packed map disagrees with per-slot sets"
        active = 0
        for wid, wk in self._workers.items():
            for s in bits_of(wk.slots):
                assert self._slots[s] is not None and self._slots[s].worker_id == wid
            if not wk.deregistered:
                active |= wk.slots
        assert active == self._active, "active mask disagrees with worker registrations"
        nondev = 0
        for s, sets in enumerate(self._sets):
            if any(sets[t] for t in range(1, N_TIERS)):
                nondev |= 1 << s
        assert nondev == self._nondev, "non-device mask disagrees with per-slot sets"
        assert self._stale == self._lost | self._unsynced, "stale mask is not lost | unsynced"

    # -- checkpoints ---------------------------------------------------------------------------

    def snapshot(self) -> bytes:
        """Everything needed to continue folding exactly where this index stands (msgpack).

        Deterministic: the same state always encodes to the same bytes.
        """
        slots = []
        for s, key in enumerate(self._slots):
            if key is None:
                continue
            slots.append(SlotSnap(
                slot=s, worker_id=key.worker_id, dp_rank=key.dp_rank,
                stale=bool(self._stale >> s & 1), lost=bool(self._lost >> s & 1),
                tiers=[u64_bytes(st) for st in self._sets[s]],
            ))
        snap = Snapshot(
            format=SNAPSHOT_FORMAT,
            hash_algo=self.hash_algo,
            block_size=self.block_size,
            width=self._w,
            n_slots=len(self._slots),
            free=list(self._free),
            slots=slots,
            workers=[WorkerSnap(w, st.epoch, st.deregistered, st.life_epoch, st.registered_epoch)
                     for w, st in sorted(self._workers.items())],
            seq=[SeqSnap(p, stream, v[0], v[1]) for (p, stream), v in sorted(self._seq.items())],
            producers=[ProducerSnap(p, list(bits_of(m)))
                       for p, m in sorted(self._producer_slots.items())],
            counters=dict(self._counters),
        )
        return msgspec.msgpack.encode(snap)

    @classmethod
    def restore(cls, data: bytes) -> PrefixIndex:
        """Rebuild an index from :meth:`snapshot` bytes."""
        snap = msgspec.msgpack.decode(data, type=Snapshot)
        if snap.format != SNAPSHOT_FORMAT:
            raise ValueError(f"unknown prefix index snapshot format {snap.format}")
        idx = cls(snap.hash_algo, snap.block_size)
        idx._w = snap.width
        n_slots = snap.n_slots
        idx._slots = [None] * n_slots
        idx._sets = [[set() for _ in ALL_IDX] for _ in range(n_slots)]
        for ws in snap.workers:
            wk = idx._workers[WorkerId(ws.worker_id)] = WorkerState(ws.epoch, ws.life_epoch, ws.registered_epoch)
            wk.deregistered = ws.deregistered
        for ss in snap.slots:
            s = ss.slot
            key = WorkerRank(WorkerId(ss.worker_id), ss.dp_rank)
            idx._slots[s] = key
            idx._slot_of[key] = s
            wk = idx._workers[key.worker_id]
            wk.slots |= 1 << s
            if not wk.deregistered:
                idx._active |= 1 << s
            # stale = lost | unsynced; while a slot is lost, whether it is also unsynced can never
            # show (both are cleared or re-decided together), so unsynced = stale and not lost.
            if ss.lost:
                idx._lost |= 1 << s
            elif ss.stale:
                idx._unsynced |= 1 << s
            for t, raw in enumerate(ss.tiers):
                hashes = u64_list(raw)
                if hashes:
                    idx._store(s, t, hashes)  # type: ignore[arg-type]
        idx._stale = idx._lost | idx._unsynced
        idx._free = list(snap.free)
        for sq in snap.seq:
            idx._seq[(sq.producer, sq.stream)] = [sq.epoch, sq.last]
        for ps in snap.producers:
            idx._producer_slots[ps.producer] = sum(1 << s for s in ps.slots)
        idx._counters.update(snap.counters)
        return idx
