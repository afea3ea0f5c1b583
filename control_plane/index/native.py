"""The prefix index: the Rust core in ``native/``, a :class:`~control_plane.router.ports.KvIndex`.

Its rules (sequencing, fencing, gap, staleness and resync, slot numbering, the snapshot bytes)
are written out in pure Python in the differential oracle ``tests/oracles/prefix_index.py``
(the executable specification): ``apply`` / ``find_matches`` / ``stats`` / ``as_dict`` /
``snapshot`` / ``restore`` behave alike and each restores the other's snapshots. Property tests
(``tests/unit/test_native_index.py``) fold random event sequences through both and require
identical state, matches and snapshots.

Beyond the specification:

* :meth:`NativePrefixIndex.apply_bytes` folds a ``kv`` record straight from its envelope bytes
  (MessagePack decoded in Rust). It takes only the four KV payload types at version 1 and is at
  least as strict as :class:`schemas.EventCodec`; anything else returns ``None`` and the caller
  decodes the record with the Python codec (which raises the schema error a malformed record
  deserves). The rare events that need words (a gap, a new epoch, a rejection) are decoded in
  Python too, so the log lines and :class:`IndexRejected` messages are the specification's.
* :meth:`NativePrefixIndex.apply_run` does the same for a run of one partition's records in one
  call, checking each worker's signature natively on the way (``switchyard_native.NativeVerifier``,
  :meth:`schemas.signing.Verifier.native`): replay and a restarting router fold the log this way.
* Memory: one hash-map bucket per distinct block (16 bytes + a control byte) with its holder
  inline when one cache holds it, a sorted holder list in a pooled chunk otherwise; measured
  per (block, worker) entry by ``switchyard bench index``.
* Speed: the class extends the Rust one, so ``apply_bytes`` and ``find_matches`` are called
  with no Python frame in between, and ``find_matches`` answers with the shapes' objects
  (``WorkerRank`` keys, ``Match`` values, the immutable ones made before reused) in a
  read-only ``Mapping`` made in Rust rather than a dict, which would hash every key again.

Not thread-safe: apply and query from one thread.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import switchyard_native
from control_plane.index.errors import IndexRejected
from control_plane.index.shapes import ApplyOutcome, IndexStats, Match, WorkerRank
from common.hashing import HashConfig
from schemas.envelope import Envelope, EventCodec
from schemas.events import (
    AllBlocksCleared,
    BlockMoved,
    BlockRemoved,
    BlockStored,
    Event,
    WorkerDeregistered,
    WorkerRegistered,
)
from schemas.types import TIER_INDEX, TIER_ORDER, CacheGroup

logger = logging.getLogger(__name__)

#: ``find_matches``'s answer type (read-only, made in Rust) is a Mapping like the oracle's dict.
Mapping.register(switchyard_native.Matches)

_OUTCOMES = (ApplyOutcome.APPLIED, ApplyOutcome.DUPLICATE, ApplyOutcome.FENCED,
             ApplyOutcome.IGNORED)
_REJECTED = {4: "hash_algo", 5: "block_size", 6: "cache_group"}
_NEW_EPOCH = 8
_GAP = 16
_KIND = {BlockStored: 0, BlockRemoved: 1, BlockMoved: 2, AllBlocksCleared: 3,
         WorkerRegistered: 4, WorkerDeregistered: 5}


class NativePrefixIndex(switchyard_native.NativeIndex):
    """Per worker (and DP rank), which chained block hashes it holds and in which tiers.

    The rules: docs/prefix-index.md and the oracle ``tests/oracles/prefix_index.py``. A
    subclass of the Rust class, so the hot paths, :meth:`apply_bytes` and
    :meth:`find_matches`, are its methods, called with no Python frame in between; they answer
    with :mod:`.shapes`' objects (``WorkerRank``, ``Match``, ``ApplyOutcome``) made in Rust from
    the types bound here, immutable instances reused across calls.
    """

    def __init__(self, hash_algo: str, block_size: int, *, snapshot: bytes | None = None) -> None:
        # The Rust core was built by ``__new__`` from the same arguments (restored from
        # ``snapshot`` when given).
        self._bind(WorkerRank, Match, list(_OUTCOMES))
        self._codec: EventCodec | None = None

    @classmethod
    def for_config(cls, config: HashConfig) -> NativePrefixIndex:
        return cls(config.hash_algo, config.block_size)

    # -- queries -------------------------------------------------------------------------------

    # find_matches(hashes) -> Mapping[WorkerRank, Match]: the Rust method (see the class
    # docstring). The oracle's items in its order; not a dict (a dict would hash every
    # WorkerRank on insert), but equal to one, with keys/values/items/get/in/len/iteration.

    def is_stale(self, worker: WorkerRank) -> bool:
        return self._is_stale(worker[0], worker[1])

    def stale_workers(self) -> list[WorkerRank]:
        ranks = self._ranks()
        return [ranks[s] for s in self._stale_slots()]

    def workers(self) -> list[WorkerRank]:
        return [r for r in self._ranks() if r is not None]

    # epoch_of, position, __len__, entries, structure_bytes: the Rust methods.

    # -- applying events -----------------------------------------------------------------------

    def apply_envelope(self, env: Envelope[Event]) -> ApplyOutcome:
        return self.apply(env.producer, env.epoch, env.seq, env.data)

    def apply(self, producer: str, epoch: int, seq: int, payload: Event) -> ApplyOutcome:
        """Fold one decoded event (the oracle's ``PrefixIndex.apply``, rule for rule)."""
        worker_id = getattr(payload, "worker_id", None)
        if worker_id is None:
            self._count_ignored()
            return ApplyOutcome.IGNORED
        tp = type(payload)
        kind = _KIND.get(tp, 6)
        tier = to_tier = -1
        hashes: Sequence[int] = ()
        full = True
        block_size = 0
        hash_algo = ""
        if kind <= 2:
            hashes = payload.block_hashes  # type: ignore[attr-defined]
            full = payload.cache_group is CacheGroup.FULL_ATTENTION  # type: ignore[attr-defined]
            if kind == 2:
                tier = TIER_INDEX[payload.from_tier]  # type: ignore[attr-defined]
                to_tier = TIER_INDEX[payload.to_tier]  # type: ignore[attr-defined]
            else:
                tier = TIER_INDEX[payload.tier]  # type: ignore[attr-defined]
            if kind == 0:
                block_size = payload.block_size  # type: ignore[attr-defined]
                hash_algo = payload.hash_algo  # type: ignore[attr-defined]
        elif kind == 3:
            t = payload.tier  # type: ignore[attr-defined]
            tier = -1 if t is None else TIER_INDEX[t]
        elif kind == 4:
            block_size = payload.block_size  # type: ignore[attr-defined]
            hash_algo = payload.hash_algo  # type: ignore[attr-defined]
        code = self._apply_fields(
            producer, epoch, seq, kind, worker_id, payload.STREAM,
            getattr(payload, "dp_rank", None), tier, to_tier, hashes, full, block_size, hash_algo)
        if code >= _NEW_EPOCH or (code & 7) in _REJECTED:
            self._explain(code, producer, epoch, seq, payload)
        return _OUTCOMES[code & 7]

    # apply_bytes(value, suffix="") -> ApplyOutcome | None: the Rust method. It folds a ``kv``
    # record from its envelope bytes, sequenced as producer ``<envelope producer><suffix>`` (the
    # router view passes ``"@<topic>:<partition>"``). ``None``: not a record this path takes;
    # decode it with the codec and call :meth:`apply` (nothing changed). Raises
    # :class:`IndexRejected` like :meth:`apply` (through :meth:`_explain_record`).
    # last_worker() -> str: the worker id of the last record it folded.

    def apply_run(self, values: list, start: int, suffix: str = "",
                  verifier=None) -> tuple[int, IndexRejected | None]:
        """Fold ``values[start:]`` (one partition's record values, in offset order) as
        :meth:`apply_bytes` would one by one, for as long as each is a ``kv`` record this path
        takes and, given a ``verifier`` (``switchyard_native.NativeVerifier``), one it finds
        signed by its owner. Returns ``(end, rejected)``: the records before ``end`` are
        folded; with ``rejected`` None, record ``end`` (if any) is untouched, for the caller's
        one-record path; otherwise record ``end`` was folded and refused, as ``apply_bytes``
        would have raised ``rejected``."""
        n = len(values)
        i = start
        while i < n:
            i, code = self._apply_run(values, i, suffix, verifier)
            if code is None:
                break
            try:
                self._explain_record(code, values[i], suffix)
            except IndexRejected as e:
                return i, e
            i += 1
        return i, None

    def _explain_record(self, code: int, value: bytes, suffix: str) -> ApplyOutcome:
        """:meth:`apply_bytes`'s words for a record the core flagged (new epoch, gap, rejection)."""
        env = self._decode(value)
        self._explain(code, env.producer + suffix, env.epoch, env.seq, env.data)
        return _OUTCOMES[code & 7]

    def _decode(self, value: bytes) -> Envelope[Event]:
        if self._codec is None:
            self._codec = EventCodec()
        return self._codec.decode(value)

    def _explain(self, code: int, producer: str, epoch: int, seq: int, payload) -> None:
        """The specification's log lines and rejection, for an event the core flagged."""
        if code & _NEW_EPOCH:
            logger.info("worker %s is in epoch %d: volatile entries dropped, persistent ones "
                        "stale until it resyncs", payload.worker_id, epoch)
        if code & _GAP:
            logger.warning("gap from producer %s on stream %s before seq %d (epoch %d): "
                           "entries of %s marked stale", producer, payload.STREAM, seq, epoch,
                           payload.worker_id)
        reason = _REJECTED.get(code & 7)
        if reason is None:
            return
        what = type(payload).TYPE
        if reason == "cache_group":
            detail = (f"BlockStored from {payload.worker_id} is for cache group "
                      f"{payload.cache_group.value!r}; only full_attention blocks form a "
                      "reusable prefix")
        elif reason == "hash_algo":
            detail = (f"{what} from {payload.worker_id} uses hash_algo {payload.hash_algo!r}; "
                      f"this index is {self.hash_algo!r}")
        else:
            detail = (f"{what} from {payload.worker_id} has block_size {payload.block_size}; "
                      f"this index is {self.block_size}")
        raise IndexRejected(reason, detail)

    # -- inspection ----------------------------------------------------------------------------

    def stats(self) -> IndexStats:
        ranks = self._ranks()
        blocks = {}
        for s in self._live_slots():
            per = {TIER_ORDER[t]: c for t, c in enumerate(self._slot_counts(s)) if c}
            if per:
                blocks[ranks[s]] = per
        return IndexStats(
            distinct_hashes=len(self),
            blocks=blocks,
            stale=tuple(self.stale_workers()),
            deregistered=tuple(sorted(w for w, _, d, _, _ in self._worker_states() if d)),
            counters=dict(self._counters()),
        )

    def as_dict(self) -> dict:
        """The specification's plain-data view (equal dicts = equal states)."""
        ranks = self._ranks()
        residency = {}
        for s, t, hashes in self._residency():
            r = ranks[s]
            residency[(r.worker_id, r.dp_rank, TIER_ORDER[t].value)] = frozenset(hashes)
        states = self._worker_states()
        return {
            "residency": residency,
            "stale": frozenset((k.worker_id, k.dp_rank) for k in self.stale_workers()),
            "epochs": {w: (e, life, reg) for w, e, _, life, reg in states},
            "deregistered": frozenset(w for w, _, d, _, _ in states if d),
            "seq": {(p, s): (e, last) for p, s, e, last in self._positions()},
        }

    # verify_invariants() (AssertionError if the core's derived counts and masks disagree with
    # its map), snapshot() -> bytes (the oracle's bytes for the same state): Rust methods.

    # -- checkpoints ---------------------------------------------------------------------------

    @classmethod
    def restore(cls, data: bytes) -> NativePrefixIndex:
        return cls("", 0, snapshot=data)
