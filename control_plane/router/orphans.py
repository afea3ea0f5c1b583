"""Close the requests an earlier incarnation of this router left open.

A router killed with -9 leaves requests admitted with no terminal event (completed, failed or
rejected). Nobody else can end them, so on start-up a replica reads the recent ``requests``
log (the last ``window_s`` seconds, by timestamp), finds requests that its own earlier
incarnations (same producer id, lower epoch) admitted and never ended, and records
``RequestFailed(code="router_lost")`` for each. The fold is pure (:func:`open_requests`).
"""

from __future__ import annotations

import logging
import time

from confluent_kafka import Consumer, TopicPartition

from control_plane.bus.catalog import Catalog
from control_plane.settings import BusSettings
from schemas import Envelope, EventCodec, SchemaError
from schemas.events import RequestAdmitted, RequestCompleted, RequestFailed, RequestRejected

log = logging.getLogger(__name__)


def open_requests(events: list[Envelope], producer: str, current_epoch: int) -> list[str]:
    """Request ids admitted by ``producer`` in an earlier epoch and never ended. Pure."""
    admitted: dict[str, None] = {}
    ended: set[str] = set()
    for env in events:
        d = env.data
        if isinstance(d, RequestAdmitted) and env.producer == producer and env.epoch < current_epoch:
            admitted[d.request_id] = None
        elif isinstance(d, (RequestCompleted, RequestRejected)) or (isinstance(d, RequestFailed) and not d.retried):
            ended.add(d.request_id)
    return [rid for rid in admitted if rid not in ended]


def read_recent(bus: BusSettings, window_s: float) -> list[Envelope]:
    topic = Catalog(bus.topic_prefix).topic("requests")
    codec = EventCodec()
    c = Consumer({"bootstrap.servers": bus.bootstrap, "group.id": f"orphan-scan-{time.time_ns()}",
                  "enable.auto.commit": False, "fetch.wait.max.ms": 10,
                  "logger": logging.getLogger("switchyard.rdkafka")})
    out: list[Envelope] = []
    try:
        since_ms = int((time.time() - window_s) * 1000)
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        starts = c.offsets_for_times([TopicPartition(topic, p, since_ms) for p in parts], timeout=10)
        for tp in starts:
            lo, hi = c.get_watermark_offsets(TopicPartition(topic, tp.partition), timeout=10)
            start = tp.offset if tp.offset >= 0 else hi
            if start >= hi:
                continue
            c.assign([TopicPartition(topic, tp.partition, start)])
            seen = start
            while seen < hi:
                for m in c.consume(2000, 1.0):
                    if m.error() or m.partition() != tp.partition or m.offset() < seen:
                        continue
                    seen = m.offset() + 1
                    try:
                        out.append(codec.decode(m.value()))
                    except SchemaError:
                        pass
    finally:
        c.close()
    return out


def close_orphans(bus: BusSettings, producer, window_s: float = 900.0) -> list[str]:
    """Emit RequestFailed for this router's orphaned requests; returns their ids."""
    orphans = open_requests(read_recent(bus, window_s), producer.producer_id, producer.epoch)
    for rid in orphans:
        producer.publish(RequestFailed(request_id=rid, reason="the router incarnation serving it died",
                                       code="router_lost"), correlation_id=rid)
    if orphans:
        producer.flush(30)
        log.warning("closed %d requests left open by an earlier incarnation of %s", len(orphans), producer.producer_id)
    return orphans
