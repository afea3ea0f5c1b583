"""Acknowledged means kept: a producer's ledger of delivery reports, and the check of the log
against it.

The invariant (what a broker failure must not break): every event whose delivery the broker
acknowledged (``acks=all``, idempotent producer) is on the log, at one offset only, and every
producer's per-partition sequence (``seq`` in the envelope, dense from 0 per incarnation and
partition) has no hole that the producer was not told about. A hole is *explained* when the
ledger holds the failed delivery report of exactly those seqs: the producer knew they were lost
(and the consumers see the gap and repair it). Any other hole, an acknowledged id that is absent,
or an id written twice is a broken promise.

* :class:`AckLedger` is what an :class:`~common.log.kafka.EventProducer` records its delivery
  reports into (``ack_ledger=True``, or ``BusSettings.ack_ledger_dir``): one :class:`AckEntry`
  per report, success or failure, in memory or appended to a JSON-lines file that is flushed per
  entry, so the ledger of a process killed with -9 holds every report it had been served.
* :func:`check_log` is pure: ledger entries and decoded log records in, a :class:`LedgerCheck`
  out. Gaps and redeliveries are found by the consumers' own :class:`SequenceTracker`, so the
  check sees the log exactly as the consumers' dedupe does.
* :func:`check_acks` reads the ledger's topics through a :class:`~common.log.reader.LogReader`
  (the broker, a file export, memory) and calls :func:`check_log`.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

import msgspec

from common.log.reader import LogReader, LogRecord, ScanStats, scan_events
from common.log.sequencing import SequenceTracker, Verdict

#: (topic, partition, offset)
Position = tuple[str, int, int]


class AckEntry(msgspec.Struct, frozen=True, omit_defaults=True):
    """One delivery report. ``offset`` is -1 when the client reported the event acknowledged
    implicitly (by a later batch of its partition) without an offset. ``error`` is set when the
    delivery failed for good: the event is then *not* expected on the log, and its seq explains
    a gap."""

    event_id: str
    topic: str
    partition: int
    offset: int
    producer: str
    epoch: int
    seq: int
    error: str | None = None

    @property
    def acked(self) -> bool:
        return self.error is None


class AckLedger:
    """Append-only list of :class:`AckEntry`, in memory (``path`` None) or in a JSON-lines file.

    Safe to record into from several threads (delivery reports are served by whichever thread
    polls the client). A file is opened for append: a restarted producer adds to it."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self._lock = threading.Lock()
        self._entries: list[AckEntry] = []
        self._enc = msgspec.json.Encoder()
        self._f = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "ab")

    def record(self, entry: AckEntry) -> None:
        with self._lock:
            if self.path is None:
                self._entries.append(entry)
            else:
                # One write and a flush per entry: it is in the OS's hands before the
                # producer's own callback runs, whatever happens to this process next.
                self._f.write(self._enc.encode(entry) + b"\n")
                self._f.flush()

    def entries(self) -> list[AckEntry]:
        with self._lock:
            if self.path is None:
                return list(self._entries)
        return load_ledger(self.path)

    def close(self) -> None:
        """Close the file (``entries`` still reads it). Recording after this is an error."""
        with self._lock:
            if self._f is not None and not self._f.closed:
                self._f.close()

    def __len__(self) -> int:
        return len(self.entries())


def load_ledger(path: str | Path) -> list[AckEntry]:
    """Entries of a ledger file. A torn last line (the writer killed mid-write) is ignored: its
    report was never complete, so nobody was told about it."""
    dec = msgspec.json.Decoder(AckEntry)
    out = []
    lines = Path(path).read_bytes().split(b"\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(dec.decode(line))
        except msgspec.DecodeError:
            if i < len(lines) - 1 and any(rest.strip() for rest in lines[i + 1:]):
                raise
    return out


@dataclass(frozen=True)
class Gap:
    """Seqs ``first..last`` (inclusive) of one producer incarnation on one partition that the
    log does not hold and no failed delivery report explains."""

    topic: str
    partition: int
    producer: str
    epoch: int
    first: int
    last: int


@dataclass(frozen=True)
class LedgerCheck:
    """What :func:`check_log` found. ``ok`` is the invariant of the module docstring."""

    #: Distinct event ids the ledger says were acknowledged.
    acked: int
    #: Delivery reports that were failures (not expected on the log).
    failed: int
    #: Records read (decodable ones; see ``undecodable``).
    records: int
    #: Acknowledged, but not on the log.
    missing: tuple[AckEntry, ...] = ()
    #: Acknowledged and on the log, but the consumers' dedupe never delivers it (every copy
    #: is from an incarnation older than one it had already seen: dropped as a stale epoch).
    undelivered: tuple[AckEntry, ...] = ()
    #: Event ids the log holds at more than one offset -> every position holding it.
    duplicates: dict[str, tuple[Position, ...]] = field(default_factory=dict)
    #: Of ``duplicates``, the ids the consumers' sequence dedupe would also deliver twice (a
    #: copy under a new seq or epoch: the folds would apply it twice).
    survive_dedupe: tuple[str, ...] = ()
    #: Acknowledged at one offset but found at another (the acknowledged write was lost and the
    #: event rewritten later, or the report was wrong).
    moved: tuple[tuple[AckEntry, Position], ...] = ()
    #: Holes in a producer's sequence that no failed delivery explains.
    gaps: tuple[Gap, ...] = ()
    #: Missing seqs that the ledger's failed reports do explain.
    explained_missing_seqs: int = 0
    #: Records the sequence dedupe dropped as redeliveries.
    redelivered: int = 0
    #: Records that did not decode (not checked; counted).
    undecodable: int = 0

    @property
    def ok(self) -> bool:
        return not (self.missing or self.undelivered or self.duplicates or self.moved or self.gaps)

    def summary(self) -> str:
        return (f"{self.acked} acked, {self.failed} failed, {self.records} records: {len(self.missing)} missing, "
                f"{len(self.undelivered)} dropped by the dedupe, "
                f"{len(self.duplicates)} duplicated ({len(self.survive_dedupe)} past dedupe), {len(self.moved)} "
                f"moved, {len(self.gaps)} unexplained gaps ({self.explained_missing_seqs} missing seqs explained "
                f"by failed deliveries), {self.redelivered} redelivered, {self.undecodable} undecodable")


def check_log(entries: Iterable[AckEntry], records: Iterable[tuple[LogRecord, object]]) -> LedgerCheck:
    """Check decoded log records (``(record, envelope)`` pairs in offset order per partition, as
    :func:`~common.log.reader.scan_events` yields them) against ledger entries. Pure.

    Every producer seen in the records is checked for gaps, not only the ledger's: a hole in
    anyone's sequence is a loss the consumers will see."""
    acked: dict[str, AckEntry] = {}
    failed_seqs: dict[tuple[str, int, str, int], set[int]] = {}
    n_failed = 0
    for e in entries:
        if e.acked:
            acked.setdefault(e.event_id, e)
        else:
            n_failed += 1
            failed_seqs.setdefault((e.topic, e.partition, e.producer, e.epoch), set()).add(e.seq)

    tracker = SequenceTracker()
    positions: dict[str, list[Position]] = {}
    delivered: Counter[str] = Counter()
    holes: list[Gap] = []
    # Seqs that arrived after a higher one of the same incarnation: they fill (part of) a hole
    # reported earlier. Within a partition an idempotent producer's seqs are in order, so this
    # stays empty unless something rewrote the log.
    highest: dict[tuple[str, int, str, int], int] = {}
    late: dict[tuple[str, int, str, int], set[int]] = {}
    n = 0
    for rec, env in records:
        n += 1
        positions.setdefault(env.event_id, []).append((rec.topic, rec.partition, rec.offset))
        key = (rec.topic, rec.partition, env.producer, env.epoch)
        obs = tracker.observe(f"{rec.topic}:{rec.partition}", env.producer, env.epoch, env.seq)
        if obs.gap is not None:
            holes.append(Gap(rec.topic, rec.partition, env.producer, env.epoch, *obs.gap))
        if obs.verdict is Verdict.NEW:
            delivered[env.event_id] += 1
            top = highest.get(key)
            if top is not None and env.seq < top:
                late.setdefault(key, set()).add(env.seq)
            highest[key] = env.seq if top is None else max(top, env.seq)

    gaps: list[Gap] = []
    explained = 0
    for g in holes:
        key = (g.topic, g.partition, g.producer, g.epoch)
        failed = failed_seqs.get(key, set())
        explained += sum(1 for s in failed if g.first <= s <= g.last)
        gaps.extend(_unexplained(g, failed | late.get(key, set())))

    missing = tuple(e for i, e in acked.items() if i not in positions)
    undelivered = tuple(e for i, e in acked.items() if i in positions and not delivered[i])
    moved = tuple((e, positions[i][0]) for i, e in acked.items()
                  if i in positions and e.offset >= 0 and (e.topic, e.partition, e.offset) not in positions[i])
    duplicates = {i: tuple(p) for i, p in positions.items() if len(p) > 1}
    return LedgerCheck(
        acked=len(acked), failed=n_failed, records=n, missing=missing, undelivered=undelivered, duplicates=duplicates,
        survive_dedupe=tuple(i for i in duplicates if delivered[i] > 1), moved=moved, gaps=tuple(gaps),
        explained_missing_seqs=explained, redelivered=tracker.duplicates)


def _unexplained(g: Gap, known: set[int]) -> list[Gap]:
    """The runs of ``g``'s seqs not in ``known`` (walks the known seqs, not the range: a hole
    can be huge)."""
    out = []
    lo = g.first
    for s in [*sorted(s for s in known if g.first <= s <= g.last), g.last + 1]:
        if s > lo:
            out.append(Gap(g.topic, g.partition, g.producer, g.epoch, lo, s - 1))
        lo = s + 1
    return out


def check_acks(reader: LogReader, entries: Iterable[AckEntry], *, topics: Iterable[str] | None = None,
               codec=None) -> LedgerCheck:
    """Read ``topics`` (default: every topic the ledger names) to their high watermarks and
    :func:`check_log` the ledger against them."""
    entries = list(entries)
    stats = ScanStats()
    wanted = sorted(set(topics) if topics is not None else {e.topic for e in entries})

    def records():
        for t in wanted:
            yield from scan_events(reader, t, codec=codec, stats=stats)

    result = check_log(entries, records())
    return replace(result, undecodable=stats.undecodable)
