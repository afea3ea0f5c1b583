"""The one piece of glue between log records and a pure fold. Pure.

Every consumer that folds records into a view (the router view, the load view, replay's
folds) does the same four things around its fold, and they used to be written out in each:

* a record at or behind the fold's position for its partition is skipped: a redelivery, or a
  record a restored snapshot already covers;
* a record without a value, or whose bytes do not decode (:class:`~schemas.SchemaError`), is
  poison;
* a record the fold refuses (it raises :class:`Poisoned`, e.g. the prefix index's
  ``IndexRejected``) is poison;
* a record whose fold raises anything else (a bug, a value out of range) is poison too
  (reason ``apply_failed``): the fold is pure, so applying the same record again would fail the
  same way, and a retry could only stall the view. It is dead-lettered at once;
* poison advances the position past the record (it is never read again: the fold goes on)
  and goes to ``on_poison``, which dead-letters it in a live processor and counts it in a tool.

:meth:`RecordFold.fold_batch` does the same for a batch of one partition's records, letting a
fold's fast path (the native index's run over envelope bytes) take as many at a time as it can;
what the fast path does not take goes through the one-record path above, in order.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from typing import Generic, TypeVar

import msgspec

from common.log.reader import TP, LogRecord, RecordBatch
from schemas import SchemaError

R = TypeVar("R")


class Poisoned(Exception):
    """A record a fold cannot apply. ``reason`` is machine-readable (the dead-letter header);
    ``key`` is the record key to dead-letter it under, when the fold knows a better one."""

    def __init__(self, reason: str, detail: str, key: bytes | None = None) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.key = key


def apply_failed_reason(e: BaseException) -> str:
    """The dead-letter reason of a record whose apply raised ``e`` (not a schema error)."""
    return f"apply_failed:{type(e).__name__}"


class FoldStats(msgspec.Struct, kw_only=True):
    """What a fold did with the records it was given."""

    records: int = 0
    applied: int = 0
    #: Records already covered by the fold's positions (a snapshot, or a re-read).
    skipped: int = 0
    #: Records that were not decodable envelopes or that the fold refused.
    poisoned: int = 0


class RecordFold(Generic[R]):
    """``fold(record)``: skip, apply or poison one record (see the module docstring).

    ``positions`` is the fold's own ``{(topic, partition): next offset}`` map (the fold advances
    it when it applies a record; poison is advanced here). ``apply`` folds one record and returns
    what the caller wants to know about it; it raises ``SchemaError`` or :class:`Poisoned` for a
    record it refuses, and anything it raises otherwise makes the record poison too.
    """

    __slots__ = ("apply", "on_poison", "positions", "stats")

    def __init__(self, positions: dict[TP, int], apply: Callable[[LogRecord], R],
                 on_poison: Callable[[LogRecord, Poisoned], None] | None = None) -> None:
        self.positions = positions
        self.apply = apply
        self.on_poison = on_poison
        self.stats = FoldStats()

    def __call__(self, rec: LogRecord) -> R | None:
        st = self.stats
        st.records += 1
        tp = (rec.topic, rec.partition)
        if rec.offset < self.positions.get(tp, 0):
            st.skipped += 1
            return None
        try:
            if rec.value is None:
                raise Poisoned("no_value", "record has no value")
            out = self.apply(rec)
        except SchemaError as e:
            poison = Poisoned(getattr(e, "reason", "malformed"), str(e))
        except Poisoned as e:
            poison = e
        except Exception as e:  # deterministic: the same record would fail the same way again
            poison = Poisoned(apply_failed_reason(e), f"{type(e).__name__}: {e}")
        else:
            st.applied += 1
            return out
        self._poisoned(rec, poison)
        return None

    def _poisoned(self, rec: LogRecord, poison: Poisoned) -> None:
        tp = (rec.topic, rec.partition)
        if self.positions.get(tp, 0) <= rec.offset:
            self.positions[tp] = rec.offset + 1
        self.stats.poisoned += 1
        if self.on_poison is not None:
            self.on_poison(rec, poison)

    def fold_batch(self, batch: RecordBatch, run: Run | None = None) -> None:
        """Fold one partition's records in offset order, as ``__call__`` would one by one.

        ``run(batch, i) -> (j, poison)`` is the fold's fast path: it folds records ``i..j-1``
        (advancing the positions itself) and stops at the first one it does not take. With
        ``poison`` None, record ``j`` is untouched and goes through ``__call__``; otherwise
        the run consumed it and refused it (it is poison, as if ``apply`` had raised that).
        """
        st = self.stats
        n = len(batch)
        i = bisect_left(batch.offsets, self.positions.get((batch.topic, batch.partition), 0))
        st.records += i
        st.skipped += i
        while i < n:
            if run is not None:
                j, poison = run(batch, i)
                st.records += j - i
                st.applied += j - i
                i = j
                if poison is not None:
                    st.records += 1
                    self._poisoned(batch.record(i), poison)
                    i += 1
                    continue
                if i >= n:
                    break
            self(batch.record(i))
            i += 1


#: A fold's fast path over a batch (:meth:`RecordFold.fold_batch`).
Run = Callable[[RecordBatch, int], "tuple[int, Poisoned | None]"]
