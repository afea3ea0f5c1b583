"""The topic catalog: every topic Switchyard uses, in one place.

Each event's ``STREAM`` class attribute names the topic family it goes to; the catalog maps a
stream to a concrete topic name under a prefix (tests use a unique prefix per test).

Keys and ordering:

* ``kv`` is keyed by worker id, so every worker's KV history is one ordered partition stream:
  the prefix index can detect a gap by sequence number and a restarted worker can read back its
  own past events from one partition.
* ``requests`` is keyed by request id: one request's causal chain is ordered.
* ``workers`` by worker id, ``planner`` by pool.

Retention: the log is the source of truth for audit and replay, so the event topics keep days,
not hours. Index snapshots live in a compacted topic keyed by snapshot name: only the newest
snapshot per router index survives compaction, and a restarted router replays just the tail
after the offsets stored in it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DAY_MS = 24 * 3600 * 1000


def replication_for(brokers: int) -> tuple[int, int]:
    """(replication factor, min.insync.replicas) for a cluster of ``brokers``: min(3, brokers)
    replicas, and 2 in sync when there are 3, so that an ``acks=all`` write is acknowledged only
    once it is on two brokers and any one broker can be lost, while the other two keep taking
    writes. Fewer than 3 replicas: 1 in sync (2 of 2 would stop every write on one loss)."""
    rf = max(1, min(3, brokers))
    return rf, 2 if rf >= 3 else 1


@dataclass(frozen=True)
class TopicSpec:
    stream: str
    partitions: int
    key: str
    description: str
    retention_ms: int = 7 * DAY_MS
    cleanup_policy: str = "delete"
    extra: dict[str, str] = field(default_factory=dict)

    def configs(self, replication_factor: int = 1) -> dict[str, str]:
        """Topic configs for a topic with ``replication_factor`` replicas."""
        cfg = {
            "cleanup.policy": self.cleanup_policy,
            "retention.ms": str(self.retention_ms),
            # A record's timestamp is when the producer created it: replay by time depends on it.
            "message.timestamp.type": "CreateTime",
            "min.insync.replicas": str(replication_for(replication_factor)[1]),
        }
        cfg.update(self.extra)
        return cfg


SPECS: tuple[TopicSpec, ...] = (
    TopicSpec("kv", 6, "worker_id", "KV block stored/removed/moved/cleared, per worker in order"),
    TopicSpec("requests", 6, "request_id", "Request admission, routing, transfer and completion"),
    TopicSpec("workers", 3, "worker_id", "Worker registration, load reports, drain, deregistration",
              retention_ms=30 * DAY_MS),
    TopicSpec("planner", 1, "pool", "Scaling decisions and their application", retention_ms=30 * DAY_MS),
    TopicSpec("admin", 1, "entity", "Operator actions and config versions", retention_ms=-1),
    TopicSpec(
        "snapshots", 1, "snapshot name", "Index and load-view checkpoints with consumed offsets",
        retention_ms=-1, cleanup_policy="compact",
        extra={"max.message.bytes": str(64 * 1024 * 1024), "min.cleanable.dirty.ratio": "0.1",
               "segment.ms": str(3600 * 1000)},
    ),
    TopicSpec("deadletter", 1, "original key", "Records no consumer could decode or apply, with the reason",
              retention_ms=30 * DAY_MS),
)


@dataclass(frozen=True)
class Catalog:
    prefix: str = "sy"
    specs: tuple[TopicSpec, ...] = SPECS

    def topic(self, stream: str) -> str:
        if stream not in {s.stream for s in self.specs}:
            raise KeyError(f"no topic for stream {stream!r}; known: {[s.stream for s in self.specs]}")
        return f"{self.prefix}.{stream}"

    def spec(self, stream: str) -> TopicSpec:
        for s in self.specs:
            if s.stream == stream:
                return s
        raise KeyError(stream)

    def stream_of(self, topic: str) -> str:
        head, _, stream = topic.rpartition(".")
        if head != self.prefix:
            raise KeyError(f"topic {topic!r} is not under prefix {self.prefix!r}")
        return stream

    def all_topics(self) -> dict[str, TopicSpec]:
        return {self.topic(s.stream): s for s in self.specs}

    @property
    def deadletter(self) -> str:
        return self.topic("deadletter")
