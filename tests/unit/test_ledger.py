"""The ack ledger and its check against the log: pure, over a log held in memory.

Each test builds one producer's log with ``_log(**overrides)``: seqs 0..n-1 on one partition,
the ledger acknowledging each at its offset, then breaks one promise and checks that the report
names exactly that.
"""

from __future__ import annotations

import msgspec
import pytest

from common.log.acks import AckEntry, AckLedger, Gap, check_acks, check_log, load_ledger
from common.log.reader import LogRecord, MemoryLogReader
from schemas import EnvelopeFactory, EventCodec
from schemas.events import BlockStored

TOPIC = "t.kv"
CODEC = EventCodec()


def _payload(i: int) -> BlockStored:
    return BlockStored(worker_id="w0", tier="device", block_hashes=[i], block_size=16, hash_algo="sha256_cbor")


def _log(n: int = 6, *, producer: str = "p", epoch: int = 1, partition: int = 0):
    """(envelopes, records, ledger entries) of one producer writing seqs 0..n-1, all acked."""
    f = EnvelopeFactory(producer, epoch, lambda: 1_000_000)
    envs = [f.wrap(_payload(i), scope=f"{TOPIC}:{partition}") for i in range(n)]
    records = [LogRecord(TOPIC, partition, off, 1, b"w0", CODEC.encode(e)) for off, e in enumerate(envs)]
    acks = [AckEntry(e.event_id, TOPIC, partition, off, producer, epoch, e.seq) for off, e in enumerate(envs)]
    return envs, records, acks


def _check(records, acks):
    reader = MemoryLogReader(records, partitions={TOPIC: 1})
    return check_acks(reader, acks)


def test_an_intact_log_keeps_every_promise() -> None:
    _, records, acks = _log()
    r = _check(records, acks)
    assert r.ok, r.summary()
    assert (r.acked, r.records, r.redelivered) == (6, 6, 0)


def test_an_acked_event_absent_from_the_log_is_missing_and_its_seq_a_gap() -> None:
    """Offset 2 (seq 2) lost: missing, and seqs 2..2 an unexplained hole (1 then 3)."""
    _, records, acks = _log()
    del records[2]
    r = _check(records, acks)
    assert [m.seq for m in r.missing] == [2]
    assert r.gaps == (Gap(TOPIC, 0, "p", 1, 2, 2),)
    assert not r.ok


def test_a_failed_delivery_explains_its_gap() -> None:
    """Seq 3 failed for good and the producer was told: no loss of an acknowledged event."""
    _, records, acks = _log()
    del records[3]
    acks[3] = msgspec.structs.replace(acks[3], offset=-1, error="KafkaError{code=MSG_TIMED_OUT}")
    r = _check(records, acks)
    assert r.ok, r.summary()
    assert (r.failed, r.explained_missing_seqs) == (1, 1)


def test_a_record_written_twice_is_a_duplicate_the_dedupe_drops() -> None:
    """A retried batch written again at offset 6 (same producer, epoch, seq): a duplicate on the
    log (the idempotent producer must prevent it), but the consumers' dedupe drops it."""
    envs, records, acks = _log()
    records.append(LogRecord(TOPIC, 0, 6, 1, b"w0", CODEC.encode(envs[4])))
    r = _check(records, acks)
    assert r.duplicates == {envs[4].event_id: ((TOPIC, 0, 4), (TOPIC, 0, 6))}
    assert r.survive_dedupe == () and r.redelivered == 1
    assert not r.ok


def test_an_event_republished_under_a_new_seq_survives_dedupe() -> None:
    """The same event id sent again as seq 6: the folds would apply it twice."""
    envs, records, acks = _log()
    again = msgspec.structs.replace(envs[1], seq=6)
    records.append(LogRecord(TOPIC, 0, 6, 1, b"w0", CODEC.encode(again)))
    r = _check(records, acks)
    assert r.survive_dedupe == (envs[1].event_id,)


def test_an_acked_offset_holding_another_event_is_moved() -> None:
    """The ack said offset 5; the log has the event only at offset 7 (the acknowledged write
    was truncated away and the event rewritten later)."""
    envs, records, acks = _log()
    records[5] = LogRecord(TOPIC, 0, 7, 1, b"w0", CODEC.encode(envs[5]))
    r = _check(records, acks)
    assert [(e.seq, pos) for e, pos in r.moved] == [(5, (TOPIC, 0, 7))]


def test_gaps_are_per_producer_incarnation_and_partition() -> None:
    """Two producers interleaved on one partition, and a restart (epoch 2) starting again at 0:
    no gap. A hole in the second producer's stream is reported against it alone."""
    _, a, acks_a = _log(4, producer="a")
    _, b, acks_b = _log(4, producer="b")
    _, a2, acks_a2 = _log(3, producer="a", epoch=2)
    merged = [x for pair in zip(a, b) for x in pair] + a2
    merged = [msgspec.structs.replace(r, offset=i) for i, r in enumerate(merged)]
    acks = [msgspec.structs.replace(e, offset=-1) for e in acks_a + acks_b + acks_a2]
    assert _check(merged, acks).ok
    del merged[5]  # b's seq 2
    r = _check(merged, acks)
    assert r.gaps == (Gap(TOPIC, 0, "b", 1, 2, 2),)


def test_an_acked_write_of_a_stale_incarnation_is_undelivered() -> None:
    """Epoch 1 writes after epoch 2 began on the same partition (a zombie): on the log, and
    acknowledged, but every consumer drops it as a stale epoch."""
    _, new, acks_new = _log(2, epoch=2)
    _, old, acks_old = _log(1, epoch=1)
    merged = [msgspec.structs.replace(r, offset=i) for i, r in enumerate(new + old)]
    acks = [msgspec.structs.replace(e, offset=-1) for e in acks_new + acks_old]
    r = _check(merged, acks)
    assert [e.epoch for e in r.undelivered] == [1]
    assert not r.ok


def test_a_huge_hole_is_reported_without_walking_it() -> None:
    """A seq far ahead (seq 10**12 after 0..5): one gap 6..10**12-1, found at once."""
    envs, records, acks = _log()
    far = msgspec.structs.replace(envs[5], seq=10**12, event_id="far")
    records.append(LogRecord(TOPIC, 0, 6, 1, b"w0", CODEC.encode(far)))
    assert _check(records, acks).gaps == (Gap(TOPIC, 0, "p", 1, 6, 10**12 - 1),)


@pytest.mark.parametrize("on_file", [False, True])
def test_the_ledger_keeps_entries_in_memory_or_in_a_file(tmp_path, on_file: bool) -> None:
    _, records, acks = _log(3)
    path = tmp_path / "p.acks.jsonl" if on_file else None
    ledger = AckLedger(path)
    for a in acks:
        ledger.record(a)
    ledger.close()
    assert ledger.entries() == acks
    if on_file:
        # A writer killed mid-line leaves a torn tail: ignored, the rest reads back.
        with open(path, "ab") as f:
            f.write(b'{"event_id": "abc", "to')
        assert load_ledger(path) == acks
        assert check_log(load_ledger(path), ((r, CODEC.decode(r.value)) for r in records)).ok


def test_a_ledger_dir_gives_every_producer_incarnation_its_own_file(tmp_path) -> None:
    """``SWITCHYARD_ACK_LEDGER_DIR``: one file per producer id and epoch, the id made a safe name.
    (The client is built but never connects: nothing is produced.)"""
    from common.log.kafka import EventProducer
    from common.settings import BusSettings

    bus = BusSettings.from_env({"SWITCHYARD_KAFKA_PORT": "1", "SWITCHYARD_ACK_LEDGER_DIR": str(tmp_path)})
    p = EventProducer(bus, "dlq:router/1", epoch=7)
    assert p.ledger is not None and p.ledger.path == tmp_path / "dlq_router_1.7.acks.jsonl"
    assert EventProducer(bus, "q", epoch=1, ack_ledger=False).ledger is None
    assert EventProducer(BusSettings(bootstrap="127.0.0.1:1"), "q", epoch=1).ledger is None
