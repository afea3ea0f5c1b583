"""A worker's own past, read back from the log at start-up.

The ``kv`` and ``workers`` topics are keyed by worker id, and producers place a key on partition
``xxh64(key) % partitions`` (:class:`common.log.kafka.EventProducer`), so one worker's
whole history sits in one partition of each topic. Reading those two partitions, keeping only
records with this worker's key, gives:

* the highest epoch any earlier incarnation used (the new one must be higher, or the index
  would fence its events as coming from the past);
* its past KV events, which :func:`data_plane.kvbm.claimed_persistent` folds into what the disk
  and object tiers should hold.

``next_epoch`` is pure; :func:`read_own_history` is the Kafka adapter.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import xxhash

from common.log.catalog import Catalog
from common.log.reader import KafkaLogReader, ScanStats, scan_events
from schemas.events import Event

log = logging.getLogger(__name__)


def partition_for(key: str, partitions: int) -> int:
    """The partition a keyed event goes to: the same function as ``EventProducer``'s."""
    return xxhash.xxh64_intdigest(key.encode()) % partitions


def next_epoch(now_ms: int, last_epoch: int | None) -> int:
    """The new incarnation's epoch: the wall clock in ms, but always above every earlier epoch
    of this worker (a clock that stepped back must not fence the new incarnation).

    >>> next_epoch(1_000, None), next_epoch(1_000, 999), next_epoch(1_000, 5_000)
    (1000, 1000, 5001)
    """
    if last_epoch is None or now_ms > last_epoch:
        return now_ms
    return last_epoch + 1


@dataclass
class OwnHistory:
    """What the log says about one worker id."""

    #: Highest epoch seen on any of its records (None: never ran).
    last_epoch: int | None = None
    #: Its KV payloads in log order (every epoch).
    kv_events: list[Event] = field(default_factory=list)
    #: Records read and records skipped because they did not decode.
    records: int = 0
    undecodable: int = 0


def read_own_history(bus, worker_id: str, *, streams: tuple[str, ...] = ("kv", "workers"),
                     timeout_s: float = 30.0) -> OwnHistory:
    """Read every record keyed ``worker_id`` from its partition of each stream, up to the end
    offsets as of the call."""
    catalog = Catalog(bus.topic_prefix)
    out = OwnHistory()
    with KafkaLogReader(bus, timeout_s=timeout_s) as reader:
        for stream in streams:
            topic = catalog.topic(stream)
            p = partition_for(worker_id, len(reader.partitions(topic)))
            stats = ScanStats()
            for _, env in scan_events(reader, topic, partitions=[p], key=worker_id.encode(), stats=stats):
                if env.producer == worker_id:
                    out.last_epoch = env.epoch if out.last_epoch is None else max(out.last_epoch, env.epoch)
                if stream == "kv":
                    out.kv_events.append(env.data)
            out.records += stats.records
            out.undecodable += stats.undecodable
    log.info("history of %s: %d records, last epoch %s, %d kv events", worker_id, out.records,
             out.last_epoch, len(out.kv_events))
    return out
