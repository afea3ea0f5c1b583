"""Checkpoints of materialized views in the compacted ``snapshots`` topic.

A snapshot is the view's bytes plus the offsets it covers (inside the view's own encoding).
Compaction keeps the newest record per key, so a restarted process reads the topic once, takes
the newest snapshot for its key, and replays only the log tail after those offsets. Any replica
may use any replica's snapshot of the same view: both are folds of the same log.

Snapshots move decisions (a router restores its view from one), so they are signed like
events: by the role that owns the key (``router-view:*`` the routers, ``load-view:*`` the
planner, ``metrics:*`` the processor; ``schemas/signing.py``). A record that does not verify is
dead-lettered ``forged:*`` and the search goes on to the key's older records; with none left
(or after :data:`MAX_REFUSED` refusals), the process folds the log from the start. The store
reads with the process's own principal.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from confluent_kafka import Producer

from common.log.catalog import Catalog
from common.log.kafka import DeadLetters, EventProducer
from common.log.reader import KafkaLogReader, LogRecord
from common.settings import BusSettings
from schemas.signing import ForgedEvent, snapshot_data

log = logging.getLogger(__name__)

#: Snapshots can be tens of MB (a million indexed blocks); the topic allows 64 MiB records.
MAX_SNAPSHOT_BYTES = 60 * 1024 * 1024


class SnapshotStore:
    def __init__(self, bus: BusSettings, catalog: Catalog | None = None, *, owner_id: str = "snapshots") -> None:
        self.bus = bus
        self.catalog = catalog or Catalog(bus.topic_prefix)
        self.topic = self.catalog.topic("snapshots")
        self.owner_id = owner_id
        self._signer = bus.signer(owner_id)
        self._verifier = bus.verifier()
        self._dlq = None
        #: Records refused (dead-lettered) by :meth:`load_latest`: (topic:partition:offset, reason).
        self.refused: list[tuple[str, str]] = []
        self._p = Producer({
            **bus.client_conf(), "enable.idempotence": True, "acks": "all",
            "compression.type": "zstd", "message.max.bytes": MAX_SNAPSHOT_BYTES + 1024 * 1024,
            "logger": logging.getLogger("switchyard.rdkafka"),
        })

    def save(self, key: str, data: bytes, timeout: float = 30.0) -> None:
        if len(data) > MAX_SNAPSHOT_BYTES:
            raise ValueError(f"snapshot {key} is {len(data)} bytes, over the {MAX_SNAPSHOT_BYTES} limit")
        value = self._signer.sign_snapshot(key, data)
        errors: list[str] = []
        self._p.produce(self.topic, value=value, key=key.encode(),
                        on_delivery=lambda err, msg: errors.append(str(err)) if err else None)
        if self._p.flush(timeout) != 0 or errors:
            raise RuntimeError(f"snapshot {key} not written: {errors or 'timeout'}")

    def load_latest(self, key: str, timeout: float = 30.0) -> bytes | None:
        """The newest snapshot stored under ``key``, or None.

        Each partition is read backwards from its last record, in windows growing 4x, until a
        record of ``key`` turns up: a restart reads the newest snapshot, not every uncompacted
        version of every view's snapshot (a 1M-block router view: 1.6 s -> 0.5 s, measured). A
        key maps to one partition; should the topic have been repartitioned, the newest record
        by timestamp wins."""
        refused = 0

        def opened(rec) -> bytes | None:
            nonlocal refused
            if self._verifier is None:
                return snapshot_data(rec.value)
            try:
                return self._verifier.open_snapshot(key, rec.value)
            except ForgedEvent as e:
                self._dead_letter(rec, e)
                refused += 1
                if refused >= MAX_REFUSED:
                    raise _GiveUp from None
                return None

        found = []
        with KafkaLogReader(self.bus, fetch_bytes=MAX_SNAPSHOT_BYTES * 2, timeout_s=timeout) as reader:
            try:
                found = [hit for p in reader.partitions(self.topic)
                         if (hit := newest_of_key(reader, self.topic, p, key.encode(), opened)) is not None]
            except _GiveUp:
                log.warning("snapshot %s: %d records refused in a row; folding the log instead", key, refused)
        if self._dlq is not None and self._dlq.confirm(timeout):
            log.error("snapshot %s: refused records not dead-lettered within %g s", key, timeout)
        return max(found, key=lambda hit: hit[0])[1] if found else None

    def _dead_letter(self, rec, e: ForgedEvent) -> None:
        where = f"{rec.topic}:{rec.partition}:{rec.offset}"
        self.refused = [*self.refused[-99:], (where, e.reason)]
        if self._dlq is None:
            self._dlq = DeadLetters(EventProducer(self.bus, f"dlq:{self.owner_id}", catalog=self.catalog),
                                    self.catalog, f"snapshots:{self.owner_id}")
        # The dead-letter topic takes records of 1 MB: a bigger forged snapshot goes without its bytes.
        value = rec.value if len(rec.value) <= DEAD_LETTER_VALUE_BYTES else None
        self._dlq.send(value, rec.key, e.reason, f"{e} ({len(rec.value)} bytes)", where)


#: Refused records after which a restore stops looking (and folds the log): a flood of forged
#: snapshots costs a restart at most this many reads, not the whole uncompacted topic (the first
#: start after snapshots were signed refused every older unsigned one: 25 s of the demo router's).
MAX_REFUSED = 4


class _GiveUp(Exception):
    pass


#: The largest forged snapshot dead-lettered with its bytes.
DEAD_LETTER_VALUE_BYTES = 900 * 1024


def newest_of_key(reader, topic: str, partition: int, key: bytes,
                  opened: Callable[[LogRecord], bytes | None] = lambda rec: rec.value,
                  window: int = 1) -> tuple[int, bytes] | None:
    """(timestamp ms, view bytes) of the newest record of ``key`` in one partition that is not a
    tombstone and that ``opened`` accepts (it returns the view's bytes, or None to refuse)."""
    lo, end = reader.bounds(topic, partition)
    while end > lo:
        start = max(lo, end - window)
        hits = [rec for rec in reader.read(topic, partition, start, end) if rec.key == key and rec.value is not None]
        for rec in reversed(hits):
            data = opened(rec)
            if data is not None:
                return rec.ts_ms, data
        end, window = start, window * 4
    return None
