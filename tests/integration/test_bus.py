"""The event backbone against the real Kafka broker."""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict

import msgspec
import pytest
from confluent_kafka import Consumer, TopicPartition

from common.log.catalog import Catalog
from common.log.kafka import H_DLQ_REASON, H_DLQ_SOURCE, EventConsumer, EventProducer
from common.settings import BusSettings
from schemas import EventCodec
from schemas.events import BlockStored, RequestAdmitted

pytestmark = pytest.mark.kafka


def _stored(worker: str, i: int) -> BlockStored:
    return BlockStored(worker_id=worker, tier="device", block_hashes=[i * 4 + k for k in range(4)],
                       parent_hash=None, block_size=16, hash_algo="sha256_cbor")


def _drain(consumer: EventConsumer, want: int, timeout: float = 60) -> list:
    """Poll until ``want`` distinct events arrived (a duplicate that slipped through must not
    end the wait early and hide a missing event), then a little longer."""
    got = []
    ids: set[str] = set()
    deadline = time.monotonic() + timeout
    while len(ids) < want and time.monotonic() < deadline:
        batch = consumer.poll_batch(5000, 0.5)
        got.extend(batch)
        ids.update(d.envelope.event_id for d in batch)
    # A little longer: anything beyond `want` would be a duplicate that slipped through.
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        got.extend(consumer.poll_batch(5000, 0.2))
    return got


def test_50k_events_from_4_producers_exactly_once_in_key_order(bus: BusSettings) -> None:
    n_producers, per_producer = 4, 12_500
    producers = [EventProducer(bus, f"p{i}") for i in range(n_producers)]
    # Like a router writing many requests: each producer writes many keys over all partitions.
    keys_per_producer = 16

    def send(idx: int) -> None:
        p = producers[idx]
        for i in range(per_producer):
            p.publish(_stored(f"w{idx}-{i % keys_per_producer}", i))
        assert p.flush(60) == 0

    threads = [threading.Thread(target=send, args=(i,)) for i in range(n_producers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Redeliver a slice on purpose (as a producer retry after a timeout would): same envelopes.
    replayer = EventProducer(bus, "replayer")
    c0 = Consumer({**bus.client_conf(), "group.id": "peek", "auto.offset.reset": "earliest"})
    c0.assign([TopicPartition(Catalog(bus.topic_prefix).topic("kv"), 0, 0)])
    dup_values = [m.value() for m in c0.consume(500, 10)]
    c0.close()
    for v in dup_values:
        replayer.produce_raw(Catalog(bus.topic_prefix).topic("kv"), v, EventCodec().decode(v).key.encode())
    assert replayer.flush(30) == 0

    consumer = EventConsumer(bus, ["kv"], group_id="it-50k")
    got = _drain(consumer, n_producers * per_producer, timeout=120)
    consumer.close()

    assert all(p.acked == per_producer and not p.failed for p in producers)
    ids = Counter(d.envelope.event_id for d in got)
    assert len(ids) == n_producers * per_producer, "every event delivered"
    assert max(ids.values()) == 1, "no event delivered twice after dedupe"
    assert consumer.tracker.duplicates >= len(dup_values) > 0
    # Per key, events arrive in the order they were produced (seq is per producer per partition,
    # and a key always maps to one partition).
    last: dict[str, int] = defaultdict(lambda: -1)
    for d in got:
        assert d.envelope.seq > last[d.envelope.key]
        last[d.envelope.key] = d.envelope.seq
    assert consumer.gaps == [], "no false gaps: every partition's sequence is dense"


def test_poison_records_go_to_dead_letter_and_consumer_continues(bus: BusSettings) -> None:
    codec = EventCodec()
    p = EventProducer(bus, "router-1")
    topic = Catalog(bus.topic_prefix).topic("requests")

    def admitted(rid: str) -> RequestAdmitted:
        return RequestAdmitted(request_id=rid, model="m", prompt_tokens=10, max_tokens=5,
                               block_size=16, hash_algo="sha256_cbor")

    p.publish(admitted("r-before"))
    good = codec.encode(p.factory.wrap(admitted("r-x")))
    doc = msgspec.msgpack.decode(good)
    poison = {
        "malformed": b"\x00\xffthis is not msgpack",
        "unknown_type": msgspec.msgpack.encode({**doc, "type": "NoSuchEvent"}),
        "unsupported_version": msgspec.msgpack.encode({**doc, "v": 99}),
        "wrong_field_type": msgspec.msgpack.encode({**doc, "data": {**doc["data"], "prompt_tokens": "ten"}}),
    }
    for value in poison.values():
        # Signed as the router's (requests is a guarded stream), so the codec meets each for
        # its own flaw rather than the verifier refusing it unsigned.
        p.produce_raw(topic, p.signer.sign("RequestAdmitted", "r-x", value) if value[0] >= 0x80 else value, b"r-x")
    p.publish(admitted("r-after"))
    assert p.flush(30) == 0

    consumer = EventConsumer(bus, ["requests"], group_id="it-poison")
    got = _drain(consumer, 2, timeout=30)
    consumer.close()
    assert sorted(d.envelope.data.request_id for d in got) == ["r-after", "r-before"]
    assert consumer.dead_lettered == 4

    dlq = Consumer({**bus.client_conf(), "group.id": "dlq-read", "auto.offset.reset": "earliest"})
    dlq.assign([TopicPartition(Catalog(bus.topic_prefix).deadletter, 0, 0)])
    records = []
    deadline = time.monotonic() + 20
    while len(records) < 4 and time.monotonic() < deadline:
        records.extend(m for m in dlq.consume(10, 1) if not m.error())
    dlq.close()
    reasons = [dict(m.headers())[H_DLQ_REASON].decode() for m in records]
    assert sorted(reasons) == sorted(["malformed", "unknown_type", "unsupported_version", "malformed"])
    assert all(dict(m.headers())[H_DLQ_SOURCE].decode().startswith(topic + ":") for m in records)
    # The original bytes are kept, so nothing is lost: the garbage record is byte-identical.
    assert poison["malformed"] in [m.value() for m in records]


def test_topic_metadata_lists_partitions_and_names_a_missing_topic(bus: BusSettings) -> None:
    from common.log.metadata import topic_partitions

    producer = EventProducer(bus, "meta")
    topic = Catalog(bus.topic_prefix).topic("kv")
    parts = topic_partitions(producer._p, topic)
    assert parts and parts == list(range(len(parts)))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="does not exist.*topics apply"):
        topic_partitions(producer._p, f"{bus.topic_prefix}.no-such-topic", unknown_for=1.0)
    assert time.monotonic() - t0 < 10, "an unknown topic is not waited on for the whole timeout"
