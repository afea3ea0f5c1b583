"""Reading the log for replay: one port, three adapters (Kafka, a file export, memory).

Replay reads *only* the log. Everything it rebuilds (the router view, the in-flight ledgers,
the load view) is a fold of records read through :class:`LogReader`, partition by partition in
offset order, so the same code runs against the broker, against a file exported from it, and
against records held in memory (tests, mutated copies).

``LogRecord`` keeps the raw value: decoding is the fold's business (a record that does not
decode is skipped and counted, exactly as the live consumers dead-letter it). ``read_batches``
hands out the same records by column (:class:`RecordBatch`, one partition's in offset order),
without a Python object per record, for the batch folds (``RecordFold.fold_batch``).

File export format (``.sylog``), written by :func:`export_log`::

    b"SYLOG1\\n"  then frames:  u32 header length | msgpack header | u32 body length | body

    header = {"t": topic, "p": partition, "first": offset, "last": offset, "n": count}
    body   = msgpack array of [offset, timestamp ms, key | nil, value | nil]

Frames hold one partition's records in offset order (at most ``frame_records`` each), so a
reader seeks straight to the frames of the partition and range it wants.
"""

from __future__ import annotations

import bisect
import logging
import struct
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

import msgspec

from common.errors import LogReadError
from common.log.catalog import Catalog
from common.roles import group_id
from common.settings import BusSettings
from schemas import EventCodec, SchemaError
from schemas.envelope import Envelope
from schemas.events import Event

log = logging.getLogger(__name__)

TP = tuple[str, int]


class LogRecord(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One record of one partition, as the broker stored it."""

    topic: str
    partition: int
    offset: int
    ts_ms: int
    key: bytes | None
    value: bytes | None


class RecordBatch(msgspec.Struct, frozen=True):
    """Records of one partition in offset order, by column: what the batch folds take
    (:meth:`common.log.fold.RecordFold.fold_batch`), without a Python object per record."""

    topic: str
    partition: int
    offsets: list[int]
    ts_ms: list[int]
    keys: list[bytes | None]
    values: list[bytes | None]

    def __len__(self) -> int:
        return len(self.offsets)

    def record(self, i: int) -> LogRecord:
        return LogRecord(self.topic, self.partition, self.offsets[i], self.ts_ms[i], self.keys[i], self.values[i])

    def records(self) -> Iterator[LogRecord]:
        t, p = self.topic, self.partition
        for off, ts, key, value in zip(self.offsets, self.ts_ms, self.keys, self.values):
            yield LogRecord(t, p, off, ts, key, value)

    def slice(self, start: int, stop: int) -> RecordBatch:
        return RecordBatch(self.topic, self.partition, self.offsets[start:stop], self.ts_ms[start:stop],
                           self.keys[start:stop], self.values[start:stop])

    @classmethod
    def of(cls, topic: str, partition: int, records: Sequence[LogRecord]) -> RecordBatch:
        return cls(topic, partition, [r.offset for r in records], [r.ts_ms for r in records],
                   [r.key for r in records], [r.value for r in records])


#: Records per batch where a reader chooses (the batch folds' unit; about 2 MB of kv events).
BATCH_RECORDS = 10000


class LocatedEvent(msgspec.Struct, frozen=True):
    """A decoded event and where it sits in the log (the audit store's rows, replay's folds).
    A struct, not a dataclass: replay makes one per record (0.06 against 0.54 us)."""

    env: Envelope[Event]
    topic: str
    partition: int
    offset: int

    @property
    def at_ns(self) -> int:
        return self.env.occurred_at_ns

    @property
    def position(self) -> str:
        return f"{self.topic}:{self.partition}:{self.offset}"


class LogReader(Protocol):
    """Read-only access to the log: partitions, their bounds, offsets by time, and ranges."""

    def partitions(self, topic: str) -> list[int]:
        """Partition numbers of ``topic`` (raises :class:`LogReadError` if it does not exist)."""
        ...

    def bounds(self, topic: str, partition: int) -> tuple[int, int]:
        """(low watermark, high watermark): the first offset still stored and the next one to
        be written."""
        ...

    def offset_for_time(self, topic: str, partition: int, ts_ms: int) -> int:
        """The first offset whose record timestamp is >= ``ts_ms`` (the high watermark when
        none is)."""
        ...

    def read(self, topic: str, partition: int, start: int, end: int) -> Iterator[LogRecord]:
        """Records with ``start <= offset < end``, in offset order."""
        ...

    def read_batches(self, topic: str, partition: int, start: int, end: int) -> Iterator[RecordBatch]:
        """The same records as :meth:`read`, in batches (as the source holds them)."""
        ...


# ----------------------------------------------------------------------------------------------
# Bounded scans over any reader
# ----------------------------------------------------------------------------------------------


def scan(reader: LogReader, topic: str, *, since_ms: int | None = None, partitions: Iterable[int] | None = None,
         upto: dict[int, int] | None = None) -> Iterator[LogRecord]:
    """Records of ``topic``, partition by partition in offset order: from the first record at or
    after ``since_ms`` (record timestamp; else the low watermark) up to the high watermark as of
    the call, or ``upto[partition]`` (exclusive) when given. The scan ends even while producers
    keep writing. ``partitions``: only these (e.g. the one a key hashes to)."""
    for p in (reader.partitions(topic) if partitions is None else partitions):
        lo, hi = reader.bounds(topic, p)
        if upto is not None:
            hi = min(hi, upto.get(p, lo))
        start = lo if since_ms is None else reader.offset_for_time(topic, p, since_ms)
        if start < hi:
            yield from reader.read(topic, p, start, hi)


class ScanStats(msgspec.Struct):
    records: int = 0
    undecodable: int = 0


def scan_events(reader: LogReader, topic: str, *, codec=None, stats: ScanStats | None = None, key: bytes | None = None,
                **bounds) -> Iterator[tuple[LogRecord, object]]:
    """``scan`` decoded: (record, envelope) pairs. A record that does not decode is skipped and
    counted in ``stats`` (tools read around poison; the live consumers dead-letter it).
    ``key``: only records with that key."""
    codec = codec or EventCodec()
    stats = stats if stats is not None else ScanStats()
    for rec in scan(reader, topic, **bounds):
        if key is not None and rec.key != key:
            continue
        stats.records += 1
        if rec.value is None:
            stats.undecodable += 1
            continue
        try:
            env = codec.decode(rec.value)
        except SchemaError:
            stats.undecodable += 1
            continue
        yield rec, env


def read_events(bus, stream: str, **bounds) -> list:
    """Every decodable envelope of ``stream`` (a catalog stream name) on the broker ``bus`` names,
    within ``scan``'s bounds: the start-up scans and tools (config lookup, orphan scan, test
    oracles) read the log this way."""
    codec = EventCodec(verifier=bus.verifier())  # a forged event is skipped, as the folds refuse it
    with KafkaLogReader(bus) as reader:
        return [env for _, env in scan_events(reader, Catalog(bus.topic_prefix).topic(stream), codec=codec,
                                              **bounds)]


# ----------------------------------------------------------------------------------------------
# In memory
# ----------------------------------------------------------------------------------------------


class _HeldLog:
    """What the memory and file readers share: the log's whole layout is held in the process
    (records, or frame headers), so partitions, bounds and time lookups are answered from it.
    A subclass gives the first and last offset of a partition (:meth:`_extent`) and ``read``."""

    def __init__(self, held: Iterable[TP], where: str, partitions: dict[str, int] | None = None) -> None:
        #: How errors name this log.
        self._where = where
        #: Partitions per topic: the highest one held + 1, at least as many as declared (an
        #: empty partition still counts, or a key would hash to another one).
        self._n = dict(partitions or {})
        for t, p in held:
            self._n[t] = max(self._n.get(t, 0), p + 1)

    def _extent(self, topic: str, partition: int) -> tuple[int, int] | None:
        """(first, last) offset held of the partition; None when it holds nothing."""
        raise NotImplementedError

    def read(self, topic: str, partition: int, start: int, end: int) -> Iterator[LogRecord]:
        raise NotImplementedError

    def read_batches(self, topic: str, partition: int, start: int, end: int) -> Iterator[RecordBatch]:
        chunk: list[LogRecord] = []
        for r in self.read(topic, partition, start, end):
            chunk.append(r)
            if len(chunk) >= BATCH_RECORDS:
                yield RecordBatch.of(topic, partition, chunk)
                chunk = []
        if chunk:
            yield RecordBatch.of(topic, partition, chunk)

    def partitions(self, topic: str) -> list[int]:
        if topic not in self._n:
            raise LogReadError(f"topic {topic} is not in {self._where}")
        return list(range(self._n[topic]))

    def bounds(self, topic: str, partition: int) -> tuple[int, int]:
        ext = self._extent(topic, partition)
        return (0, 0) if ext is None else (ext[0], ext[1] + 1)

    def offset_for_time(self, topic: str, partition: int, ts_ms: int) -> int:
        for r in self.read(topic, partition, 0, 1 << 62):
            if r.ts_ms >= ts_ms:
                return r.offset
        return self.bounds(topic, partition)[1]


class MemoryLogReader(_HeldLog):
    """Records held in memory, per partition (tests; a log with one record altered)."""

    def __init__(self, records: Iterable[LogRecord], partitions: dict[str, int] | None = None) -> None:
        self._parts: dict[TP, list[LogRecord]] = {}
        for r in records:
            self._parts.setdefault((r.topic, r.partition), []).append(r)
        for recs in self._parts.values():
            recs.sort(key=lambda r: r.offset)
        super().__init__(self._parts, "this log", partitions)

    def _extent(self, topic: str, partition: int) -> tuple[int, int] | None:
        recs = self._parts.get((topic, partition))
        return (recs[0].offset, recs[-1].offset) if recs else None

    def read(self, topic: str, partition: int, start: int, end: int) -> Iterator[LogRecord]:
        for r in self._parts.get((topic, partition), ()):
            if r.offset >= end:
                break
            if r.offset >= start:
                yield r

    def records(self) -> list[LogRecord]:
        return [r for recs in self._parts.values() for r in recs]

    def replace(self, topic: str, partition: int, offset: int, value: bytes) -> None:
        """Swap one record's value (a tampered copy of the log, for tests of ``verify``)."""
        recs = self._parts[(topic, partition)]
        for i, r in enumerate(recs):
            if r.offset == offset:
                recs[i] = msgspec.structs.replace(r, value=value)
                return
        raise KeyError(f"{topic}:{partition}:{offset}")


# ----------------------------------------------------------------------------------------------
# Kafka
# ----------------------------------------------------------------------------------------------


class KafkaLogReader:
    """Reads partitions of the broker directly (assign + seek; no consumer group, no commits).

    One confluent-kafka consumer, re-assigned per range. Reading stops at ``end`` or at the
    high watermark, whichever comes first; offsets missing inside a range (compaction,
    transaction markers) are simply absent from the output.
    """

    #: Bytes per fetch (a partition's and the whole response's). Small fetches keep the pipeline
    #: full: librdkafka parses a response whole before it hands out any record or asks for the
    #: next one, so while the broker prepares and encrypts a 64 MB response the reader waits, and
    #: while it parses one the broker waits. 2 MB read best against the stack's C1-only broker
    #: (the sweep: docs/benchmarks.md, "Measurements behind defaults"). librdkafka wants at least
    #: ``message.max.bytes``, 1 MB; a record batch larger than this still comes whole.
    FETCH_BYTES = 2 * 1024 * 1024

    def __init__(self, bus: BusSettings | str, *, fetch_bytes: int = FETCH_BYTES, timeout_s: float = 10.0) -> None:
        """``bus``: the process's settings, whose principal the reader authenticates as (a
        component reads with its own role's credential, confined by its ACLs to what it reads:
        common/log/principals.py); a bootstrap string alone: the credential of the environment
        (the operator's tools: the stack's super user)."""
        from confluent_kafka import Consumer

        if isinstance(bus, str):
            bus = BusSettings.from_env(bootstrap=bus)
        self._timeout = timeout_s
        self._c = Consumer({
            **bus.client_conf(),
            # Never joined (assign + seek), but librdkafka looks its coordinator up: a group
            # under the principal's own prefix, which its ACLs let it describe.
            "group.id": group_id(bus.topic_prefix, bus.username, f"reader-{time.time_ns()}"),
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "auto.offset.reset": "earliest",
            "fetch.max.bytes": fetch_bytes,
            "max.partition.fetch.bytes": fetch_bytes,
            "queued.max.messages.kbytes": 256 * 1024,
            "fetch.wait.max.ms": 10,
            # When the records fetched ahead reach queued.min.messages, librdkafka waits this
            # long before it fetches again (default 1 s), however soon the reader drains them:
            # the reader then sat idle for up to a second per partition (measured:
            # docs/benchmarks.md, "Measurements behind defaults").
            "fetch.queue.backoff.ms": 10,
            "logger": logging.getLogger("switchyard.rdkafka"),
        })
        self._parts: dict[str, list[int]] = {}
        #: Where the last completed read stopped, still assigned: (topic, partition, end), and the
        #: records already fetched past that end. A read starting there goes on from them instead
        #: of assigning anew (which drops what librdkafka prefetched and fetches it again: replay
        #: advancing a view chunk by chunk read each partition's rest once per chunk).
        self._at: tuple[str, int, int] | None = None
        self._left: list = []

    def close(self) -> None:
        self._c.close()

    def __enter__(self) -> KafkaLogReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def partitions(self, topic: str) -> list[int]:
        got = self._parts.get(topic)
        if got is None:
            md = self._c.list_topics(topic, timeout=self._timeout)
            t = md.topics.get(topic)
            if t is not None and t.error is not None and "AUTHORIZATION" in t.error.name():
                raise LogReadError(f"topic {topic}: {t.error.name()} (this principal may not read it: "
                                   "common/log/principals.py)")
            if t is None or t.error is not None or not t.partitions:
                raise LogReadError(f"topic {topic} does not exist (run `switchyard topics apply`?)")
            got = self._parts[topic] = sorted(t.partitions)
        return got

    def _retry(self, what: str, fn):
        """Metadata calls answer "not leader" for a moment after a topic is created or a broker
        restarts, and "unknown partition" while the client's metadata cache has not caught up
        with a partition the broker already listed: retry those for a few seconds, then say
        which call failed."""
        from confluent_kafka import KafkaError, KafkaException

        deadline = time.monotonic() + self._timeout
        while True:
            try:
                return fn()
            except KafkaException as e:
                err = e.args[0]
                transient = err.retriable() or "leader" in str(e).lower() or err.code() == KafkaError._UNKNOWN_PARTITION
                if not transient or time.monotonic() > deadline:
                    raise LogReadError(f"{what}: {e}") from None
                time.sleep(0.1)

    def bounds(self, topic: str, partition: int) -> tuple[int, int]:
        from confluent_kafka import TopicPartition

        return self._retry(f"watermarks of {topic}:{partition}", lambda: self._c.get_watermark_offsets(
            TopicPartition(topic, partition), timeout=self._timeout, cached=False))

    def offset_for_time(self, topic: str, partition: int, ts_ms: int) -> int:
        from confluent_kafka import TopicPartition

        if ts_ms < 0:  # Kafka reads negative times as special values (-1 latest, -2 earliest)
            return self.bounds(topic, partition)[0]
        got = self._retry(f"offset for time {ts_ms} of {topic}:{partition}", lambda: self._c.offsets_for_times(
            [TopicPartition(topic, partition, int(ts_ms))], timeout=self._timeout))
        off = got[0].offset
        if off < 0:  # no record at or after ts_ms
            return self.bounds(topic, partition)[1]
        return off

    def read(self, topic: str, partition: int, start: int, end: int) -> Iterator[LogRecord]:
        for batch in self.read_batches(topic, partition, start, end):
            yield from batch.records()

    def read_batches(self, topic: str, partition: int, start: int, end: int) -> Iterator[RecordBatch]:
        """What the broker hands over per fetch (up to :data:`BATCH_RECORDS`), as columns."""
        from confluent_kafka import KafkaError, TopicPartition

        lo, hi = self.bounds(topic, partition)
        start = max(start, lo)
        end = min(end, hi)
        if end <= start:
            return
        if self._at == (topic, partition, start):
            pending, self._left = self._left, []
        else:
            self._c.assign([TopicPartition(topic, partition, start)])
            pending = []
        self._at = None
        done = False
        try:
            nxt = start
            idle_deadline = time.monotonic() + self._timeout
            while nxt < end:
                if pending:
                    msgs, pending = pending, []
                else:
                    # poll() returns as soon as one record is there; consume(n, 0) then takes what
                    # is already fetched (consume(n, t) alone would wait for n records or t).
                    first = self._c.poll(0.5)
                    msgs = [first] + self._c.consume(BATCH_RECORDS - 1, 0) if first is not None else []
                if not msgs:
                    if time.monotonic() > idle_deadline:
                        raise LogReadError(f"timed out reading {topic}:{partition} at offset {nxt} (want < {end})")
                    continue
                idle_deadline = time.monotonic() + self._timeout
                offsets = [m.offset() for m in msgs]
                ok = True
                for m in msgs:  # errors and strays are rare: one pass to find any, columns when none
                    if m.error() is not None or m.partition() != partition or m.topic() != topic:
                        ok = False
                        break
                if ok and offsets[0] >= nxt and offsets[-1] < end:
                    nxt = offsets[-1] + 1
                    yield RecordBatch(topic, partition, offsets, [m.timestamp()[1] for m in msgs],
                                      [m.key() for m in msgs], [m.value() for m in msgs])
                    continue
                kept = []
                for i, m in enumerate(msgs):
                    err = m.error()
                    if err is not None:
                        if err.code() == KafkaError._PARTITION_EOF:
                            # The end of the partition at or past ``end``: whatever is missing
                            # below it was compacted away or is a transaction marker.
                            if m.partition() == partition and m.topic() == topic and (m.offset() or 0) >= end:
                                nxt = end
                            continue
                        raise LogReadError(f"reading {topic}:{partition}: {err}")
                    if m.partition() != partition or m.topic() != topic:
                        continue  # prefetched for a previous assignment
                    off = m.offset()
                    if off < nxt:
                        continue
                    if off >= end:
                        nxt = end
                        self._left = msgs[i:]  # fetched already: the next read from ``end`` starts here
                        break
                    nxt = off + 1
                    kept.append(LogRecord(topic, partition, off, m.timestamp()[1], m.key(), m.value()))
                if kept:
                    yield RecordBatch.of(topic, partition, kept)
            done = True
        finally:
            if done:
                self._at = (topic, partition, end)
            else:  # closed early or failed: where the consumer stands is unknown
                self._left = []
                self._c.unassign()


def tail_group_id(topic_prefix: str, user: str, name: str) -> str:
    """The group id a :class:`KafkaLogTail` named ``name`` of ``user`` names (never joined)."""
    return group_id(topic_prefix, user, f"tail.{name}")


class KafkaLogTail:
    """Follows partitions of the broker from given offsets, as they grow: assign, no consumer
    group, no commits (the caller's snapshots hold its positions). :meth:`poll` hands out what
    the last fetches brought, one :class:`RecordBatch` per partition in offset order.

    Every partition of ``topics`` is assigned, from ``start[(topic, partition)]`` or its low
    watermark; :attr:`assigned` says which. :attr:`highwater` is the log end per partition as
    the fetches saw it. librdkafka fetches in its own thread; :meth:`poll` waits without the GIL.
    """

    def __init__(self, bus: BusSettings, topics: Sequence[str], start: dict[TP, int], name: str, **conf) -> None:
        """``name``: this tail's part of its group id (never joined, but librdkafka looks the
        coordinator of a ``group.id`` up: it is under the principal's own prefix, which its
        ACLs let it describe); ``conf``: librdkafka settings over the defaults (fetch sizes)."""
        from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

        self._tp = TopicPartition
        #: Errors librdkafka retries by itself (a broker away, a leader moving): logged, not raised.
        self._transient = {KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._MSG_TIMED_OUT,
                           KafkaError.NOT_LEADER_FOR_PARTITION}
        #: The group id the consumer names (never joined: nothing is assigned through it).
        self.group_id = tail_group_id(bus.topic_prefix, bus.username, name)
        self._c = Consumer({
            **bus.client_conf(),
            "group.id": self.group_id,
            "enable.auto.commit": False,
            "enable.partition.eof": False,
            "auto.offset.reset": "earliest",
            # See KafkaLogReader: without it librdkafka idles up to a second before the next
            # fetch once its prefetch queue filled, however soon the records are taken.
            "fetch.queue.backoff.ms": 10,
            "logger": logging.getLogger("switchyard.rdkafka"),
            **conf,
        })
        try:
            md = self._c.list_topics(timeout=10)
            tps = []
            for t in topics:
                if t not in md.topics or md.topics[t].error is not None:
                    raise LogReadError(f"topic {t} does not exist (run `switchyard topics apply`?)")
                for p in sorted(md.topics[t].partitions):
                    tps.append(TopicPartition(t, p, start.get((t, p), OFFSET_BEGINNING)))
            self._c.assign(tps)
        except BaseException:
            self._c.close()
            raise
        self.assigned: frozenset[TP] = frozenset((tp.topic, tp.partition) for tp in tps)
        #: Log end per partition as the last fetches saw it; replaced whole (readable from any thread).
        self.highwater: dict[TP, int] = {}

    def poll(self, max_records: int = BATCH_RECORDS, timeout_s: float = 0.5) -> list[RecordBatch]:
        """What is fetched (up to ``max_records``), waiting up to ``timeout_s`` for a first
        record; one batch per partition. Raises :class:`LogReadError` on an error the consumer
        does not recover from by itself (authorization, an unknown topic)."""
        # poll() returns as soon as one record is there; consume(n, 0) then takes what is
        # already fetched (consume(n, t) alone would wait for n records or t).
        first = self._c.poll(timeout_s)
        if first is None:
            return []
        msgs = [first] + self._c.consume(max_records - 1, 0) if max_records > 1 else [first]
        by: dict[TP, list] = {}
        for m in msgs:
            err = m.error()
            if err is not None:
                if err.fatal() or (not err.retriable() and err.code() not in self._transient):
                    raise LogReadError(f"following {m.topic()}:{m.partition()}: {err}")
                log.warning("following %s:%s: %s", m.topic(), m.partition(), err)
                continue
            by.setdefault((m.topic(), m.partition()), []).append(m)
        out = []
        hw = dict(self.highwater)
        for (t, p), ms in by.items():
            out.append(RecordBatch(t, p, [m.offset() for m in ms], [m.timestamp()[1] for m in ms],
                                   [m.key() for m in ms], [m.value() for m in ms]))
            hw[(t, p)] = self._c.get_watermark_offsets(self._tp(t, p), cached=True)[1]
        self.highwater = hw
        return out

    def close(self) -> None:
        self._c.close()


# ----------------------------------------------------------------------------------------------
# File export
# ----------------------------------------------------------------------------------------------

_MAGIC = b"SYLOG1\n"
_U32 = struct.Struct("<I")


class _FrameHeader(msgspec.Struct, frozen=True):
    t: str
    p: int
    first: int
    last: int
    n: int


_Row = tuple[int, int, bytes | None, bytes | None]


def export_log(reader: LogReader, topics: Sequence[str], path: str | Path, *,
               ranges: dict[TP, tuple[int, int]] | None = None, frame_records: int = 20000,
               progress=None) -> int:
    """Write ``topics`` (every partition, whole or the ``ranges`` given) to a ``.sylog`` file.
    Returns the number of records written."""
    enc = msgspec.msgpack.Encoder()
    n_total = 0
    with open(path, "wb") as f:
        f.write(_MAGIC)
        for topic in topics:
            for p in reader.partitions(topic):
                lo, hi = reader.bounds(topic, p)
                if ranges and (topic, p) in ranges:
                    lo, hi = max(lo, ranges[(topic, p)][0]), min(hi, ranges[(topic, p)][1])
                batch: list[_Row] = []

                def flush(empty_ok: bool = False) -> None:
                    if not batch and not empty_ok:
                        return
                    # An empty frame (n=0) only says the partition exists: a topic's partition
                    # count must survive the export, or a key would hash to another partition.
                    first, last = (batch[0][0], batch[-1][0]) if batch else (-1, -1)
                    head = enc.encode(_FrameHeader(topic, p, first, last, len(batch)))
                    body = enc.encode(batch)
                    f.write(_U32.pack(len(head)))
                    f.write(head)
                    f.write(_U32.pack(len(body)))
                    f.write(body)
                    batch.clear()

                written = n_total
                for r in reader.read(topic, p, lo, hi):
                    batch.append((r.offset, r.ts_ms, r.key, r.value))
                    n_total += 1
                    if progress is not None:
                        progress(1)
                    if len(batch) >= frame_records:
                        flush()
                flush(empty_ok=n_total == written)
    return n_total


class FileLogReader(_HeldLog):
    """Reads a ``.sylog`` export. Frame headers are indexed at open; bodies are read on demand."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._f = open(self.path, "rb")
        if self._f.read(len(_MAGIC)) != _MAGIC:
            raise LogReadError(f"{self.path} is not a Switchyard log export")
        self._frames: dict[TP, list[tuple[int, int, int, int]]] = {}  # (first, last, pos, len)
        hdec = msgspec.msgpack.Decoder(_FrameHeader)
        self._body = msgspec.msgpack.Decoder(list[tuple[int, int, bytes | None, bytes | None]])
        while True:
            raw = self._f.read(4)
            if not raw:
                break
            (hl,) = _U32.unpack(raw)
            h = hdec.decode(self._f.read(hl))
            (bl,) = _U32.unpack(self._f.read(4))
            pos = self._f.tell()
            self._f.seek(bl, 1)
            frames = self._frames.setdefault((h.t, h.p), [])
            if h.n:
                frames.append((h.first, h.last, pos, bl))
        super().__init__(self._frames, str(self.path))

    def close(self) -> None:
        self._f.close()

    def _extent(self, topic: str, partition: int) -> tuple[int, int] | None:
        fr = self._frames.get((topic, partition))
        return (fr[0][0], fr[-1][1]) if fr else None

    def read(self, topic: str, partition: int, start: int, end: int) -> Iterator[LogRecord]:
        for batch in self.read_batches(topic, partition, start, end):
            yield from batch.records()

    def read_batches(self, topic: str, partition: int, start: int, end: int) -> Iterator[RecordBatch]:
        """One batch per frame (its records within the range)."""
        for first, last, pos, bl in self._frames.get((topic, partition), ()):
            if last < start:
                continue
            if first >= end:
                break
            self._f.seek(pos)
            rows = self._body.decode(self._f.read(bl))
            offs = [r[0] for r in rows]
            i, j = bisect.bisect_left(offs, start), bisect.bisect_left(offs, end)
            if i < j:
                rows = rows[i:j]
                yield RecordBatch(topic, partition, offs[i:j], [r[1] for r in rows], [r[2] for r in rows],
                                  [r[3] for r in rows])
