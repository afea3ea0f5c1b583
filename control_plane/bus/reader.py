"""Read a bounded range of a topic, partition by partition, in offset order.

For start-up scans and tools (config lookup, orphan scan, tests): every partition from a start
(its low watermark, a timestamp, or a given offset) up to the high watermark seen when the scan
began, so the scan ends even while producers keep writing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from confluent_kafka import Consumer, Message, TopicPartition

from control_plane.settings import BusSettings


def iter_records(bus: BusSettings, topic: str, *, since_ms: int | None = None,
                 upto: dict[int, int] | None = None) -> Iterator[Message]:
    """Records of ``topic`` from ``since_ms`` (record timestamp; else the beginning) up to the
    current end of each partition, or ``upto[partition]`` (exclusive) when given."""
    c = Consumer({"bootstrap.servers": bus.bootstrap, "group.id": f"reader-{time.time_ns()}",
                  "enable.auto.commit": False, "fetch.wait.max.ms": 10,
                  "logger": logging.getLogger("switchyard.rdkafka")})
    try:
        parts = sorted(c.list_topics(topic, timeout=10).topics[topic].partitions)
        starts: dict[int, int] = {}
        if since_ms is not None:
            for tp in c.offsets_for_times([TopicPartition(topic, p, since_ms) for p in parts], timeout=10):
                starts[tp.partition] = tp.offset
        for p in parts:
            lo, hi = c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            if upto is not None:
                hi = min(hi, upto.get(p, lo))
            start = starts.get(p, lo)
            if start < 0:  # no record at or after since_ms
                start = hi
            if start >= hi:
                continue
            c.assign([TopicPartition(topic, p, start)])
            seen = start
            while seen < hi:
                for m in c.consume(1000, 1.0):
                    # Skip errors and records prefetched for a previous assignment.
                    if m.error() or m.partition() != p or m.offset() < seen:
                        continue
                    if m.offset() >= hi:
                        break
                    seen = m.offset() + 1
                    yield m
    finally:
        c.close()
