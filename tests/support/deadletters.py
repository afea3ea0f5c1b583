"""Reading what consumers sent to the dead-letter topic, and what a consumer group committed."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from confluent_kafka import Consumer, TopicPartition

from common.log.catalog import Catalog
from common.log.kafka import H_DLQ_CONSUMER, H_DLQ_ERROR, H_DLQ_REASON, H_DLQ_SOURCE
from common.settings import BusSettings


@dataclass(frozen=True)
class DeadLetter:
    reason: str
    error: str
    #: ``topic:partition:offset`` of the record given up on.
    source: str
    consumer: str
    value: bytes | None

    @property
    def source_tp(self) -> tuple[str, int, int]:
        topic, partition, offset = self.source.rsplit(":", 2)
        return topic, int(partition), int(offset)


def dead_letters(bus: BusSettings) -> list[DeadLetter]:
    """Every record on the dead-letter topic now (one pass up to its end)."""
    topic = Catalog(bus.topic_prefix).deadletter
    c = Consumer({**bus.client_conf(), "group.id": f"dlq-read-{uuid.uuid4().hex}",
                  "enable.auto.commit": False})
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        out = []
        for p in parts:
            lo, hi = c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            if hi <= lo:
                continue
            c.assign([TopicPartition(topic, p, lo)])
            seen, deadline = lo, time.monotonic() + 20
            while seen < hi and time.monotonic() < deadline:
                for m in c.consume(100, 1.0):
                    if m.error():
                        continue
                    seen = m.offset() + 1
                    h = {k: v.decode() for k, v in m.headers() or ()}
                    out.append(DeadLetter(h.get(H_DLQ_REASON, ""), h.get(H_DLQ_ERROR, ""), h.get(H_DLQ_SOURCE, ""),
                                          h.get(H_DLQ_CONSUMER, ""), m.value()))
        return out
    finally:
        c.close()


def committed(bus: BusSettings, group: str, topic: str) -> dict[int, int]:
    """Partition -> offset ``group`` committed on ``topic`` (partitions without a commit left out)."""
    c = Consumer({**bus.client_conf(), "group.id": group, "enable.auto.commit": False})
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        got = c.committed([TopicPartition(topic, p) for p in parts], timeout=10)
        return {tp.partition: tp.offset for tp in got if tp.offset >= 0}
    finally:
        c.close()
