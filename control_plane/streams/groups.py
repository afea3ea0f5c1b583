"""Consumer-group plumbing shared by the Faust processors (router view, load view, metrics).

Each processor incarnation is its own consumer group, seeded with the positions of the
snapshot it restored (see ``control_plane/streams/router_view.py`` for why).
"""

from __future__ import annotations

import logging

from confluent_kafka import Consumer, TopicPartition

from control_plane.settings import BusSettings

log = logging.getLogger(__name__)


def _consumer(bus: BusSettings, group: str) -> Consumer:
    return Consumer({"bootstrap.servers": bus.bootstrap, "group.id": group, "enable.auto.commit": False,
                     "logger": logging.getLogger("switchyard.rdkafka")})


def seed_group_offsets(bus: BusSettings, group: str, topics: list[str], positions: dict[tuple[str, int], int]) -> None:
    """Commit ``positions`` (low watermark where absent) as ``group``'s offsets. The group must
    have no active member (true before the processor's Faust app starts)."""
    c = _consumer(bus, group)
    try:
        offsets = []
        for topic in topics:
            md = c.list_topics(topic, timeout=10)
            if topic not in md.topics or md.topics[topic].error is not None:
                raise RuntimeError(f"topic {topic} does not exist; run `switchyard topics apply`")
            for p in md.topics[topic].partitions:
                lo, hi = c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
                pos = positions.get((topic, p), lo)
                offsets.append(TopicPartition(topic, p, min(max(pos, lo), hi)))
        c.commit(offsets=offsets, asynchronous=False)
    finally:
        c.close()


def delete_empty_groups(bus: BusSettings, prefix: str) -> None:
    """Best effort: drop empty groups whose id starts with ``prefix`` (earlier incarnations)."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bus.bootstrap, "logger": logging.getLogger("switchyard.rdkafka")})
    try:
        listed = admin.list_consumer_groups(request_timeout=10).result()
        old = [g.group_id for g in listed.valid if g.group_id.startswith(prefix) and str(g.state).endswith("EMPTY")]
        if old:
            for _gid, fut in admin.delete_consumer_groups(old, request_timeout=10).items():
                try:
                    fut.result()
                except Exception:  # raced with a member joining, or already gone
                    pass
    except Exception as e:
        log.info("could not clean old consumer groups: %s", e)


def log_end(bus: BusSettings, group: str, topics: list[str]) -> dict[tuple[str, int], int]:
    """High watermark of every partition of ``topics``."""
    c = _consumer(bus, f"{group}.probe")
    try:
        out = {}
        for topic in topics:
            for p in c.list_topics(topic, timeout=10).topics[topic].partitions:
                out[(topic, p)] = c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
        return out
    finally:
        c.close()
