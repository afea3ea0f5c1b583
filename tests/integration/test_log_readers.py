"""One contract for every :class:`common.log.reader.LogReader`: memory, file export, Kafka.

The same records are written once to the real broker (``EventProducer.publish`` for events,
``produce_raw`` for poison), under a unique topic prefix, with a fake clock so every record's
timestamp is known. The oracle is what was sent plus the offsets the broker acked; the Kafka
reader reads the broker, the memory reader holds what the Kafka reader returned, and the file
reader reads an ``export_log`` of the broker. Each contract test runs against all three and
compares with the oracle, so a reader that agrees with the others but not with the log fails too.

The written log (``requests`` has 6 partitions, ``workers`` 3, ``kv`` 6, ``admin`` 1)::

    requests  p0 req-10 x3 | p1 empty | p2 req-3 x3 | p3 req-2 x3 + 2 poison | p4 req-1 x3 | p5 req-5 x3
    workers   p0 w-b x2    | p1 empty | p2 w-a x2
    kv        p0 kv-w3 x1  | p1..p5 empty (trailing)
    admin     empty
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from common.errors import LogReadError
from common.log.admin import apply_topics
from common.log.catalog import Catalog
from common.log.kafka import Ack, EventProducer
from common.log.reader import (
    FileLogReader,
    KafkaLogReader,
    LogReader,
    LogRecord,
    MemoryLogReader,
    ScanStats,
    export_log,
    read_events,
    scan,
    scan_events,
)
from common.settings import BusSettings
from schemas import Envelope
from schemas.events import (
    BlockStored,
    Event,
    PrefillCompleted,
    RequestAdmitted,
    RequestCompleted,
    WorkerLoadReported,
    WorkerRegistered,
)
from schemas.signing import about_of

pytestmark = pytest.mark.kafka

KINDS = ("memory", "file", "kafka")
REQUEST_KEYS = ("req-10", "req-1", "req-2", "req-3", "req-5")  # xxh64 % 6: p0, p4, p3, p2, p5
POISON_KEY = b"req-2"  # partition 3
STEP_MS = 1000


class _Clock:
    """Whole milliseconds one step apart: every record's timestamp is known and distinct, and
    within a partition timestamps grow with offsets (what ``offset_for_time`` relies on)."""

    def __init__(self, base_ms: int) -> None:
        self.base_ms = base_ms
        self.ticks = 0

    def next_ms(self) -> int:
        self.ticks += 1
        return self.base_ms + self.ticks * STEP_MS

    def __call__(self) -> int:  # clock_ns for the producer's envelope factory
        return self.next_ms() * 1_000_000


@dataclass
class Written:
    """What was written, as the broker acknowledged it."""

    bus: BusSettings
    catalog: Catalog
    records: list[LogRecord] = field(default_factory=list)
    #: (topic, partition, offset) -> the published envelope
    envelopes: dict[tuple[str, int, int], Envelope] = field(default_factory=dict)

    def topic(self, stream: str) -> str:
        return self.catalog.topic(stream)

    def of(self, stream: str, partition: int | None = None) -> list[LogRecord]:
        """The oracle: records of ``stream`` (one partition, or partition by partition), in
        offset order."""
        t = self.topic(stream)
        recs = [r for r in self.records if r.topic == t and (partition is None or r.partition == partition)]
        return sorted(recs, key=lambda r: (r.partition, r.offset))

    def bounds(self, stream: str, partition: int) -> tuple[int, int]:
        recs = self.of(stream, partition)
        return (recs[0].offset, recs[-1].offset + 1) if recs else (0, 0)


def _write(bus: BusSettings) -> Written:
    out = Written(bus, Catalog(bus.topic_prefix))
    # Ten minutes back, one second a record: recent enough for retention, never in the future.
    clock = _Clock(base_ms=_now_ms() - 600 * STEP_MS)
    errors: list[str] = []

    def acked(ack: Ack) -> None:
        if ack.error:
            errors.append(ack.error)
            return
        env = ack.envelope
        value = producer.signer.sign(env.type, env.key, producer.codec.encode(env), about_of(env.data))  # as publish
        out.records.append(LogRecord(ack.topic, ack.partition, ack.offset, env.occurred_at_ns // 1_000_000,
                                     env.key.encode(), value))
        out.envelopes[(ack.topic, ack.partition, ack.offset)] = env

    producer = EventProducer(bus, "log-contract", clock_ns=clock, on_ack=acked)

    def raw(stream: str, key: bytes, value: bytes | None) -> None:
        ts = clock.next_ms()

        def delivered(err, msg) -> None:
            if err:
                errors.append(str(err))
            else:
                out.records.append(LogRecord(msg.topic(), msg.partition(), msg.offset(), ts, key, value))

        producer.produce_raw(out.topic(stream), value, key, timestamp=ts, on_delivery=delivered)

    def publish(ev: Event) -> None:
        producer.publish(ev)

    for wid, port in (("w-b", 1), ("w-a", 2)):
        publish(WorkerRegistered(worker_id=wid, role="aggregated", pool="p", endpoint=f"http://127.0.0.1:{port}",
                                 capacity={"device": 100}, block_size=16, hash_algo="sha256"))
    for rid in REQUEST_KEYS:
        publish(RequestAdmitted(request_id=rid, model="m", prompt_tokens=32, max_tokens=4, block_size=16,
                                hash_algo="sha256", block_hashes=[1, 2]))
    publish(BlockStored(worker_id="kv-w3", tier="device", block_hashes=[1, 2], block_size=16, hash_algo="sha256"))
    for rid in REQUEST_KEYS:
        publish(PrefillCompleted(request_id=rid, worker_id="w-a", prompt_tokens=32, duration_ms=5.0))
    raw("requests", POISON_KEY, b"\x00 not an envelope")
    raw("requests", POISON_KEY, None)  # a tombstone: no value at all
    for wid in ("w-b", "w-a"):
        publish(WorkerLoadReported(worker_id=wid, running=1, waiting=0, tier_usage={"device": 0.5}))
    for rid in REQUEST_KEYS:
        publish(RequestCompleted(request_id=rid, worker_id="w-a", prompt_tokens=32, output_tokens=4,
                                 ttft_ms=10.0, e2e_ms=20.0))
    assert producer.flush(30) == 0 and not errors, errors
    assert len(out.records) == 2 + 5 + 1 + 5 + 2 + 2 + 5
    return out


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


@pytest.fixture(scope="module")
def written(kafka_bootstrap: str) -> Written:
    """The log every reader is checked against. Built as the ``bus`` fixture builds its settings
    (a unique prefix, topics from the catalog), but once per module: the three readers must
    read the *same* records, and writing them once keeps the suite fast."""
    bus = BusSettings(bootstrap=kafka_bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:10]}")
    apply_topics(bus)
    return _write(bus)


STREAMS = ("requests", "workers", "kv", "admin")


@pytest.fixture(scope="module")
def readers(written: Written, tmp_path_factory) -> Iterator[dict[str, LogReader]]:
    topics = [written.topic(s) for s in STREAMS]
    kafka = KafkaLogReader(written.bus.bootstrap)
    got = [r for t in topics for r in scan(kafka, t)]
    memory = MemoryLogReader(got, partitions={t: len(kafka.partitions(t)) for t in topics})
    path = tmp_path_factory.mktemp("sylog") / "log.sylog"
    # Two records per frame: reads cross frame boundaries and seek past whole frames.
    assert export_log(kafka, topics, path, frame_records=2) == len(written.records)
    file = FileLogReader(path)
    yield {"memory": memory, "file": file, "kafka": kafka}
    file.close()
    kafka.close()


@pytest.fixture(params=KINDS)
def reader(request, readers: dict[str, LogReader]) -> LogReader:
    return readers[request.param]


# ----------------------------------------------------------------------------------------------
# The port
# ----------------------------------------------------------------------------------------------


def test_the_kafka_reader_returns_what_the_broker_acked(readers, written: Written) -> None:
    """The oracle itself is right: every record read back from the broker is one we wrote, at
    the offset its delivery report gave. (The contract tests below compare every reader with it.)"""
    kafka = readers["kafka"]
    for stream in STREAMS:
        assert list(scan(kafka, written.topic(stream))) == written.of(stream)


def test_partitions_are_the_topics_partitions_numbered_from_zero(reader: LogReader, written: Written) -> None:
    assert reader.partitions(written.topic("requests")) == [0, 1, 2, 3, 4, 5]
    assert reader.partitions(written.topic("workers")) == [0, 1, 2]


@pytest.mark.parametrize("kind", [
    "memory",
    "file",
    "kafka",
])
def test_empty_partitions_and_empty_topics_are_partitions_too(kind: str, readers, written: Written) -> None:
    """``kv`` holds records in partition 0 only, ``admin`` none: both topics exist with all their
    partitions, which read as empty."""
    reader = readers[kind]
    kv, admin = written.topic("kv"), written.topic("admin")
    assert reader.partitions(kv) == [0, 1, 2, 3, 4, 5]
    assert reader.bounds(kv, 5) == (0, 0)
    assert reader.partitions(admin) == [0]
    assert list(scan(reader, admin)) == []


def test_a_missing_topic_raises_log_read_error(reader: LogReader, written: Written) -> None:
    missing = f"{written.bus.topic_prefix}.no-such-stream"
    with pytest.raises(LogReadError):
        reader.partitions(missing)
    with pytest.raises(LogReadError):
        list(scan(reader, missing))
    with pytest.raises(LogReadError):
        list(scan_events(reader, missing))


def test_bounds_are_the_first_offset_and_the_next_one(reader: LogReader, written: Written) -> None:
    for stream, n in (("requests", 6), ("workers", 3)):
        for p in range(n):
            assert reader.bounds(written.topic(stream), p) == written.bounds(stream, p), (stream, p)
    assert reader.bounds(written.topic("requests"), 3) == (0, 5)  # 3 events + 2 poison
    assert reader.bounds(written.topic("requests"), 1) == (0, 0)  # empty


def test_a_whole_partition_reads_in_offset_order_as_written(reader: LogReader, written: Written) -> None:
    for stream, n in (("requests", 6), ("workers", 3), ("kv", 1)):
        t = written.topic(stream)
        for p in range(n):
            lo, hi = reader.bounds(t, p)
            got = list(reader.read(t, p, lo, hi))
            assert got == written.of(stream, p), (stream, p)
            assert [r.offset for r in got] == sorted(r.offset for r in got)


def test_consecutive_ranges_read_as_one(reader: LogReader, written: Written) -> None:
    """A partition read range after range, one record at a time (a replayed view advancing
    decision by decision), interleaved with another partition and an abandoned read, holds the
    same records as one read of it, as records and as batches."""
    t = written.topic("requests")
    lo, hi = reader.bounds(t, 3)
    got = []
    for at in range(lo, hi):
        got += [r for b in reader.read_batches(t, 3, at, at + 1) for r in b.records()]
        if at == lo + 1:
            assert list(reader.read(t, 0, *reader.bounds(t, 0))) == written.of("requests", 0)
        if at == lo + 2:
            next(iter(reader.read(t, 3, at + 1, hi)))  # started, never finished
    assert got == written.of("requests", 3)


# (start, end) as a function of the partition's (lo, hi), and the slice of its records expected.
RANGES = {
    "inner": (lambda lo, hi: (lo + 1, lo + 3), slice(1, 3)),
    "one record": (lambda lo, hi: (lo + 2, lo + 3), slice(2, 3)),
    "empty (start == end)": (lambda lo, hi: (lo + 2, lo + 2), slice(0, 0)),
    "reversed (start > end)": (lambda lo, hi: (lo + 3, lo + 1), slice(0, 0)),
    "from before the low watermark": (lambda lo, hi: (lo - 5, lo + 2), slice(0, 2)),
    "past the end": (lambda lo, hi: (lo + 3, hi + 100), slice(3, None)),
    "at the high watermark": (lambda lo, hi: (hi, hi + 10), slice(0, 0)),
    "beyond the high watermark": (lambda lo, hi: (hi + 5, hi + 10), slice(0, 0)),
    "everything": (lambda lo, hi: (0, 1 << 62), slice(None)),
}


@pytest.mark.parametrize("case", RANGES)
def test_read_a_range(case: str, reader: LogReader, written: Written) -> None:
    """Records with start <= offset < end, of partition 3 (5 records, poison included) and of
    the empty partition 1."""
    bounds_of, expected = RANGES[case]
    t = written.topic("requests")
    recs = written.of("requests", 3)
    assert len(recs) == 5
    start, end = bounds_of(*reader.bounds(t, 3))
    assert list(reader.read(t, 3, start, end)) == recs[expected]
    assert list(reader.read(t, 1, *bounds_of(0, 0))) == []


def test_offset_for_time_is_the_first_record_at_or_after_it(reader: LogReader, written: Written) -> None:
    t = written.topic("requests")
    for p in range(6):
        recs = written.of("requests", p)
        lo, hi = written.bounds("requests", p)
        first_ts = recs[0].ts_ms if recs else written.of("requests")[0].ts_ms
        assert reader.offset_for_time(t, p, 0) == lo, p
        assert reader.offset_for_time(t, p, first_ts - 10 * STEP_MS) == lo, p
        for r in recs:
            assert reader.offset_for_time(t, p, r.ts_ms) == r.offset, (p, r.offset)
            assert reader.offset_for_time(t, p, r.ts_ms - 1) == r.offset, (p, r.offset)  # between two
        last_ts = recs[-1].ts_ms if recs else _now_ms()
        assert reader.offset_for_time(t, p, last_ts + 1) == hi, p  # none is: the high watermark


# ----------------------------------------------------------------------------------------------
# Bounded scans
# ----------------------------------------------------------------------------------------------


def test_scan_reads_every_partition_in_offset_order(reader: LogReader, written: Written) -> None:
    got = list(scan(reader, written.topic("requests")))
    assert got == written.of("requests")
    assert [(r.partition, r.offset) for r in got] == sorted((r.partition, r.offset) for r in got)


def test_scan_since_ms_starts_each_partition_at_that_time(reader: LogReader, written: Written) -> None:
    recs = written.of("requests")
    cut = sorted(r.ts_ms for r in recs)[len(recs) // 2]
    got = list(scan(reader, written.topic("requests"), since_ms=cut))
    assert got == [r for r in recs if r.ts_ms >= cut]
    assert 0 < len(got) < len(recs)
    assert list(scan(reader, written.topic("requests"), since_ms=max(r.ts_ms for r in recs) + 1)) == []
    assert list(scan(reader, written.topic("requests"), since_ms=0)) == recs


def test_scan_upto_stops_each_partition_there_and_skips_the_partitions_it_omits(
        reader: LogReader, written: Written) -> None:
    t = written.topic("requests")
    got = list(scan(reader, t, upto={3: 2, 0: 1, 4: 999}))
    assert got == written.of("requests", 0)[:1] + written.of("requests", 3)[:2] + written.of("requests", 4)
    assert list(scan(reader, t, upto={})) == []
    # With since_ms: from the time, up to the offset.
    p3 = written.of("requests", 3)
    assert list(scan(reader, t, since_ms=p3[1].ts_ms, upto={3: 4})) == p3[1:4]


def test_scan_partitions_reads_only_those_in_the_order_given(reader: LogReader, written: Written) -> None:
    t = written.topic("requests")
    assert list(scan(reader, t, partitions=[3, 1, 0])) == written.of("requests", 3) + written.of("requests", 0)
    assert list(scan(reader, t, partitions=[])) == []
    p0 = written.of("requests", 0)
    assert list(scan(reader, t, partitions=[0], since_ms=p0[1].ts_ms)) == p0[1:]


def test_scan_events_decodes_and_counts_what_does_not_decode(reader: LogReader, written: Written) -> None:
    stats = ScanStats()
    pairs = list(scan_events(reader, written.topic("requests"), stats=stats))
    decodable = [r for r in written.of("requests") if (r.topic, r.partition, r.offset) in written.envelopes]
    assert [rec for rec, _ in pairs] == decodable
    for rec, env in pairs:
        sent = written.envelopes[(rec.topic, rec.partition, rec.offset)]
        assert (env.event_id, env.seq, env.data) == (sent.event_id, sent.seq, sent.data)
    assert (stats.records, stats.undecodable) == (17, 2)  # the garbage value and the tombstone


def test_scan_events_key_keeps_only_that_keys_records(reader: LogReader, written: Written) -> None:
    t = written.topic("requests")
    stats = ScanStats()
    got = [env for _, env in scan_events(reader, t, key=POISON_KEY, stats=stats)]
    assert [type(e.data).__name__ for e in got] == ["RequestAdmitted", "PrefillCompleted", "RequestCompleted"]
    assert {e.key for e in got} == {"req-2"}
    assert (stats.records, stats.undecodable) == (5, 2)  # counts only the key's records
    stats = ScanStats()
    got = list(scan_events(reader, t, key=b"req-10", partitions=[0], stats=stats))
    assert [rec for rec, _ in got] == written.of("requests", 0) and (stats.records, stats.undecodable) == (3, 0)
    # A key on another partition than the ones scanned: nothing.
    assert list(scan_events(reader, t, key=b"req-10", partitions=[3])) == []
    # Bounds pass through: since the poison, up to (not including) the tombstone.
    p3 = written.of("requests", 3)
    stats = ScanStats()
    got = list(scan_events(reader, t, key=POISON_KEY, since_ms=p3[1].ts_ms, upto={3: 3}, stats=stats))
    assert [rec.offset for rec, _ in got] == [p3[1].offset]  # PrefillCompleted; the garbage is counted
    assert (stats.records, stats.undecodable) == (2, 1)


# ----------------------------------------------------------------------------------------------
# Beyond the port: the broker helper, the export's options, the file format
# ----------------------------------------------------------------------------------------------


def test_read_events_reads_a_catalog_stream_from_the_broker(readers, written: Written) -> None:
    envs = read_events(written.bus, "requests")
    expected = [written.envelopes[(r.topic, r.partition, r.offset)] for r in written.of("requests")
                if (r.topic, r.partition, r.offset) in written.envelopes]
    assert [e.event_id for e in envs] == [e.event_id for e in expected] and len(envs) == 15
    assert [e.event_id for e in read_events(written.bus, "requests", key=b"req-5", partitions=[5])] == \
        [e.event_id for e in expected if e.key == "req-5"]
    cut = min(r.ts_ms for r in written.of("requests") if r.value is None)  # after every admission
    assert {type(e.data).__name__ for e in read_events(written.bus, "requests", since_ms=cut)} == {"RequestCompleted"}
    with pytest.raises(LogReadError):
        read_events(BusSettings(bootstrap=written.bus.bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:10]}"),
                    "requests")


def test_a_scan_ends_at_the_high_watermark_of_its_partition_while_producers_write(bus: BusSettings) -> None:
    producer = EventProducer(bus, "scan-end")
    cat = Catalog(bus.topic_prefix)
    topic = cat.topic("planner")  # one partition

    def publish(n: int) -> None:
        for i in range(n):
            producer.produce_raw(topic, f"v{i}".encode(), b"pool")
        assert producer.flush(30) == 0

    publish(3)
    with KafkaLogReader(bus.bootstrap) as reader:
        it = scan(reader, topic)
        first = next(it)
        publish(2)  # written after the scan took the partition's bounds
        assert [first.offset] + [r.offset for r in it] == [0, 1, 2]
        assert [r.offset for r in scan(reader, topic)] == [0, 1, 2, 3, 4]


def test_an_export_of_ranges_holds_only_those_ranges(readers, written: Written, tmp_path: Path) -> None:
    memory = readers["memory"]
    t = written.topic("requests")
    path = tmp_path / "part.sylog"
    n = export_log(memory, [t], path, ranges={(t, 3): (1, 4), (t, 0): (0, 1)}, frame_records=1)
    with_ranges = FileLogReader(path)
    try:
        assert n == 3 + 1 + 3 + 3 + 3
        assert list(scan(with_ranges, t, partitions=[0, 3])) == written.of("requests", 0)[:1] + written.of("requests", 3)[1:4]
        assert with_ranges.bounds(t, 3) == (1, 4)
        assert list(scan(with_ranges, t, partitions=[4])) == written.of("requests", 4)
    finally:
        with_ranges.close()


def test_a_file_that_is_not_an_export_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.sylog"
    path.write_bytes(b"PK\x03\x04 a zip, say")
    with pytest.raises(LogReadError):
        FileLogReader(path)
