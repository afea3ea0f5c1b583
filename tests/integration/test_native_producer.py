"""The router's native producer against the real broker, as the router's principal (TLS and
SCRAM): its records land where the Python producer put them (key, partition, headers, time),
signed so the verifying readers take them, every one acknowledged and in its ack ledger, and
the ledger check holds; an event this principal may not sign is refused before it is sent."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import Consumer, TopicPartition

from common.log.acks import check_acks
from common.log.kafka import H_PRODUCER, H_TYPE, H_VERSION, partition_of
from common.log.native_producer import NativeEventProducer
from common.log.reader import KafkaLogReader, read_events
from common.settings import BusSettings
from schemas import EventCodec
from schemas.events import BlockRemoved, PrefillCompleted, RequestAdmitted

pytestmark = pytest.mark.kafka


def _records(bus: BusSettings, topic: str, want: int, timeout: float = 30.0) -> tuple[list, int]:
    """Up to ``want`` records of ``topic`` from the beginning, and its partition count."""
    c = Consumer({**bus.client_conf(), "group.id": "native-producer-check", "enable.auto.commit": False})
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        c.assign([TopicPartition(topic, p, 0) for p in parts])
        out, deadline = [], time.monotonic() + timeout
        while len(out) < want and time.monotonic() < deadline:
            out.extend(m for m in c.consume(1000, 0.5) if m.error() is None)
        return out, len(parts)
    finally:
        c.close()


def test_the_routers_events_land_signed_keyed_and_acknowledged(bus: BusSettings) -> None:
    rbus = BusSettings.from_env(role="router", topic_prefix=bus.topic_prefix, bootstrap=bus.bootstrap)
    p = NativeEventProducer(rbus, "router-native-test", ack_ledger=True)
    sent = {}
    for i in range(300):
        rid = f"req-{i}"
        for ev in (RequestAdmitted(request_id=rid, model="m", prompt_tokens=64, max_tokens=4, stream=False,
                                   block_hashes=[i, 2**64 - 1 - i], block_size=32, hash_algo="sha256"),
                   PrefillCompleted(request_id=rid, worker_id="w1", prompt_tokens=64, duration_ms=1.5)):
            env = p.publish(ev, correlation_id=rid)
            sent[env.event_id] = env
    assert p.flush(30) == 0
    assert (p.acked, p.failed, p.outstanding()) == (600, [], 0)

    topic = p.catalog.topic("requests")
    records, n_parts = _records(bus, topic, 600)
    assert len(records) == 600
    codec = EventCodec(verifier=bus.verifier())  # refuses an unsigned or forged record
    for m in records:
        env = codec.decode(m.value())
        want = sent[env.event_id]
        assert env == want
        assert m.key() == want.key.encode() and m.partition() == partition_of(want.key, n_parts)
        assert dict(m.headers()) == {H_TYPE: want.type.encode(), H_VERSION: str(want.version).encode(),
                                     H_PRODUCER: b"router-native-test"}
        assert m.timestamp()[1] == want.occurred_at_ns // 1_000_000
    assert sorted(e.event_id for e in read_events(bus, "requests")) == sorted(sent)

    entries = p.ledger.entries()
    assert len(entries) == 600 and all(e.acked and e.offset >= 0 for e in entries)
    with KafkaLogReader(bus) as reader:
        result = check_acks(reader, entries, codec=codec)
    assert result.ok, result

    # The router's principal signs as the router only: a worker's event is refused here.
    with pytest.raises(PermissionError):
        p.publish(BlockRemoved(worker_id="w9", tier="device", block_hashes=[1]))
    p.close(10)
