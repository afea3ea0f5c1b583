"""Read a whole stream back from the broker (tests only)."""

from __future__ import annotations

from confluent_kafka import Consumer, TopicPartition

from control_plane.bus.catalog import Catalog
from control_plane.settings import BusSettings
from schemas import Envelope, EventCodec


def read_stream(bus: BusSettings, stream: str) -> list[Envelope]:
    codec = EventCodec()
    topic = Catalog(bus.topic_prefix).topic(stream)
    c = Consumer({"bootstrap.servers": bus.bootstrap, "group.id": "test-reader", "enable.auto.commit": False,
                  "fetch.wait.max.ms": 10})
    out = []
    try:
        for p in c.list_topics(topic, timeout=10).topics[topic].partitions:
            lo, hi = c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            if hi <= lo:
                continue
            c.assign([TopicPartition(topic, p, lo)])
            seen = lo
            while seen < hi:
                for m in c.consume(1000, 1.0):
                    if m.error() or m.partition() != p:
                        continue
                    seen = m.offset() + 1
                    try:
                        out.append(codec.decode(m.value()))
                    except Exception:
                        pass
    finally:
        c.close()
    return out
