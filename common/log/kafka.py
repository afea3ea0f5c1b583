"""Kafka adapters (confluent-kafka / librdkafka): producer, consumer, dead-letter queue.

The producer is idempotent with ``acks=all``: a retried batch after a broker failure (or a
partition leader moving to another broker of a replicated cluster) is written once. With an ack
ledger (``ack_ledger=True`` or ``BusSettings.ack_ledger_dir``) it records every delivery report,
so :func:`common.log.acks.check_acks` can prove afterwards that what was acknowledged was kept. The consumer decodes through :class:`schemas.EventCodec`, drops redeliveries with a
:class:`SequenceTracker`, reports gaps, and sends anything it cannot decode to the dead-letter
topic with the reason, then goes on: one poison record never stops a stream.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import xxhash
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Message, Producer, TopicPartition

from common.log.catalog import Catalog
from common.log.acks import AckEntry, AckLedger
from common.log.metadata import topic_partitions
from common.log.principals import group_id as owned_group
from common.log.sequencing import Observation, SequenceTracker, Verdict
from common.settings import BusSettings
from schemas import Envelope, EnvelopeFactory, EventCodec, SchemaError
from schemas.events import Event
from schemas.signing import about_of

log = logging.getLogger(__name__)
_rdkafka_log = logging.getLogger("switchyard.rdkafka")

H_TYPE = "sy-type"
H_VERSION = "sy-v"
H_PRODUCER = "sy-producer"
H_DLQ_REASON = "sy-dlq-reason"
H_DLQ_ERROR = "sy-dlq-error"
H_DLQ_SOURCE = "sy-dlq-source"  # "topic:partition:offset"
H_DLQ_CONSUMER = "sy-dlq-consumer"


def producer_config(settings: BusSettings, **extra) -> dict:
    conf = {
        **settings.client_conf(),
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": settings.linger_ms,
        "batch.num.messages": 10000,
        "compression.type": "lz4",
        # Keep retrying through a broker restart; the idempotent producer dedupes on the broker.
        "message.timeout.ms": 120000,
        # A hung leader (stopped, not dead: its TCP connections stay up) holds every in-flight
        # request until the socket timeout, 60 s by default, long after the controller has moved
        # the partition (1.5 s in a cluster). 2 s, then retries (safe: idempotent) that look for
        # the new leader every 250 ms at most instead of backing off to 1 s. Measured against a
        # SIGSTOPped leader: produce resumed after 3.1-4.8 s (never within 60 s by default).
        "socket.timeout.ms": 2000,
        "retry.backoff.max.ms": 250,
        "logger": _rdkafka_log,
    }
    conf.update(extra)
    return conf


def ack_ledger_for(settings: BusSettings, producer_id: str, epoch: int,
                   option: AckLedger | bool | None) -> AckLedger | None:
    """A producer's ack ledger: ``option`` itself, True for a new in-memory one, None for one in
    ``settings.ack_ledger_dir`` when that is set, else (False, or no directory) none."""
    if isinstance(option, AckLedger):
        return option
    if option is True:
        return AckLedger()
    if option is None and settings.ack_ledger_dir:
        name = "".join(c if c.isalnum() or c in "-_." else "_" for c in producer_id)
        return AckLedger(Path(settings.ack_ledger_dir) / f"{name}.{epoch}.acks.jsonl")
    return None


def partition_of(key: str, partitions: int) -> int:
    """The partition of an event keyed ``key``: xxh64(key) mod partitions, computed by the
    producer so the envelope's sequence can be numbered per partition (see EnvelopeFactory).
    Not crc32 (librdkafka's "consistent"): crc32 is linear, so ids differing in one character
    ("w0".."w3") can all land on one partition."""
    return xxhash.xxh64_intdigest(key.encode()) % partitions


def report_delivery(ledger: AckLedger | None, entry: AckEntry, type_name: str, key: str) -> None:
    """What a producer does with a delivery report before anyone else hears of it: the ledger
    records it (a report the ledger lacks was never given), a failure is logged as an error and
    an acknowledgement without an offset as a warning."""
    if ledger is not None:
        ledger.record(entry)
    if entry.error:
        log.error("event %s %s seq %d not delivered: %s", type_name, key, entry.seq, entry.error)
    elif entry.offset < 0:
        # "Implicitly acked": a later batch of this partition was acked, not this one. That is
        # proof of delivery only if the broker checked sequence numbers (see
        # common.log.admin.wait_led for the case where it does not).
        log.warning("event %s %s seq %d acked without an offset (implicitly, by a later batch)",
                    type_name, key, entry.seq)


@dataclass(frozen=True)
class Ack:
    envelope: Envelope[Event]
    topic: str
    partition: int
    offset: int
    error: str | None = None


class EnvelopeProducer:
    """What a producer of one incarnation's envelopes holds, whatever client sends them
    (:class:`EventProducer`: confluent-kafka; the router's
    :class:`~common.log.native_producer.NativeEventProducer`: the native crate): the catalog,
    the codec, the envelope factory (per-partition sequence numbers, strictly increasing time),
    the signer, the ack ledger, and the partition of a key. ``publish`` is serialised by
    ``_lock`` so sequence numbers and produce order agree."""

    def __init__(
        self,
        settings: BusSettings,
        producer_id: str,
        epoch: int | None = None,
        *,
        catalog: Catalog | None = None,
        codec: EventCodec | None = None,
        clock_ns: Callable[[], int] = time.time_ns,
        ack_ledger: AckLedger | bool | None = None,
    ) -> None:
        """``ack_ledger``: an :class:`AckLedger` to record every delivery report into, True for
        a new in-memory one, None for one in ``settings.ack_ledger_dir`` when that is set."""
        self.catalog = catalog or Catalog(settings.topic_prefix)
        self.codec = codec or EventCodec()
        # Default incarnation: start time in ms, monotonic across restarts of one producer id.
        self.factory = EnvelopeFactory(producer_id, epoch if epoch is not None else time.time_ns() // 1_000_000, clock_ns)
        #: Signs the events of guarded streams as their owner (schemas/signing.py).
        self.signer = settings.signer(producer_id)
        self.ledger = ack_ledger_for(settings, producer_id, self.epoch, ack_ledger)
        self._lock = threading.Lock()
        self._partitions: dict[str, int] = {}

    @property
    def producer_id(self) -> str:
        return self.factory.producer

    @property
    def epoch(self) -> int:
        return self.factory.epoch

    def _partition(self, topic: str, key: str) -> int:
        """:func:`partition_of` the key among the topic's partitions."""
        n = self._partitions.get(topic)
        if n is None:
            n = self._partitions[topic] = len(self._topic_partitions(topic))
        return partition_of(key, n)

    def _topic_partitions(self, topic: str) -> list[int]:
        """The topic's partitions, asked of the client (:mod:`common.log.metadata`'s patience)."""
        raise NotImplementedError


class EventProducer(EnvelopeProducer):
    """Publishes payloads as enveloped events, numbered per partition for this incarnation,
    through confluent-kafka. Not for concurrent use from several threads without care."""

    def __init__(
        self,
        settings: BusSettings,
        producer_id: str,
        epoch: int | None = None,
        *,
        catalog: Catalog | None = None,
        codec: EventCodec | None = None,
        clock_ns: Callable[[], int] = time.time_ns,
        on_ack: Callable[[Ack], None] | None = None,
        ack_ledger: AckLedger | bool | None = None,
        **conf,
    ) -> None:
        self._p = Producer(producer_config(settings, **conf))
        super().__init__(settings, producer_id, epoch, catalog=catalog, codec=codec, clock_ns=clock_ns,
                         ack_ledger=ack_ledger)
        self._on_ack = on_ack
        self.acked = 0
        self.unconfirmed = 0
        self.failed: list[Ack] = []

    def publish(
        self,
        payload: Event,
        *,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        on_ack: Callable[[Ack], None] | None = None,
    ) -> Envelope[Event]:
        topic = self.catalog.topic(payload.STREAM)
        key = payload.key()
        self.signer.check(payload.TYPE, key, about_of(payload))  # before a sequence number is spent on it
        with self._lock:
            partition = self._partition(topic, key)
            env = self.factory.wrap(payload, correlation_id=correlation_id, causation_id=causation_id,
                                    key=key, scope=f"{topic}:{partition}")
            self._produce(env, topic, partition, on_ack)
        return env

    def _topic_partitions(self, topic: str) -> list[int]:
        # A topic created a moment ago may not be listed yet: 3 s for that, 10 s for a broker
        # that is still starting or dropped the request.
        return topic_partitions(self._p, topic, unknown_for=3.0)

    def _produce(self, env: Envelope[Event], topic: str, partition: int, on_ack) -> None:
        cb = on_ack or self._on_ack

        def delivered(err: KafkaError | None, msg: Message) -> None:
            ack = Ack(env, msg.topic(), msg.partition() if msg.partition() is not None else -1,
                      msg.offset() if msg.offset() is not None else -1, str(err) if err else None)
            report_delivery(self.ledger, AckEntry(env.event_id, ack.topic, partition, ack.offset, env.producer,
                                                  env.epoch, env.seq, ack.error), env.type, env.key)
            if err:
                self.failed.append(ack)
            else:
                self.acked += 1
                if ack.offset < 0:
                    self.unconfirmed += 1
            if cb:
                cb(ack)

        headers = [(H_TYPE, env.type.encode()), (H_VERSION, str(env.version).encode()),
                   (H_PRODUCER, env.producer.encode())]
        value = self.signer.sign(env.type, env.key, self.codec.encode(env), about_of(env.data))
        while True:
            try:
                self._p.produce(topic, value=value, key=env.key.encode(), partition=partition, headers=headers,
                                timestamp=env.occurred_at_ns // 1_000_000, on_delivery=delivered)
                break
            except BufferError:
                # Local queue full: serve delivery reports until there is room (backpressure).
                self._p.poll(0.05)
        self._p.poll(0)

    def produce_raw(self, topic: str, value: bytes | None, key: bytes | None = None,
                    headers: list[tuple[str, bytes]] | None = None, **kw) -> None:
        """Write bytes as they are (dead-lettering, snapshots, tests of poison input). A keyed
        record goes to the same partition ``publish`` would use for that key."""
        with self._lock:
            if key is not None and "partition" not in kw:
                kw["partition"] = self._partition(topic, key.decode())
            while True:
                try:
                    self._p.produce(topic, value=value, key=key, headers=headers or [], **kw)
                    break
                except BufferError:  # local queue full: serve delivery reports until there is room
                    self._p.poll(0.05)
            self._p.poll(0)

    def poll(self, timeout: float = 0) -> int:
        return self._p.poll(timeout)

    def outstanding(self) -> int:
        """Events handed to the client whose delivery report has not been served yet."""
        return len(self._p)

    def flush(self, timeout: float = 30.0) -> int:
        """Wait for delivery reports; returns how many are still outstanding."""
        return self._p.flush(timeout)

    def close(self, timeout: float = 30.0) -> None:
        left = self.flush(timeout)
        if left:
            log.warning("producer %s closed with %d undelivered events", self.producer_id, left)
        if self.ledger is not None:
            self.ledger.close()


class DeadLetters:
    """Writes records nobody could decode or apply to the dead-letter topic: the original bytes
    and key, plus headers saying why, where it came from and who gave up on it.

    The one writer of dead letters: every consumer (the :class:`EventConsumer`s, the stream
    processors, the audit) sends through it, so every dead letter carries the same headers.
    A consumer that commits its position past a dead letter first waits for :meth:`confirm`.
    """

    def __init__(self, producer: EventProducer, catalog: Catalog, consumer_name: str) -> None:
        self.producer = producer
        self.catalog = catalog
        self.consumer_name = consumer_name
        self.sent = 0
        self.failed = 0

    def send(self, value: bytes | None, key: bytes | None, reason: str, error: str, source: str) -> None:
        self.sent += 1
        log.warning("dead-lettering %s (%s): %s", source, reason, error)
        self.producer.produce_raw(
            self.catalog.deadletter, value, key,
            [(H_DLQ_REASON, reason.encode()), (H_DLQ_ERROR, error[:2000].encode()),
             (H_DLQ_SOURCE, source.encode()), (H_DLQ_CONSUMER, self.consumer_name.encode())],
            on_delivery=self._delivered,
        )

    def _delivered(self, err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            self.failed += 1
            log.error("dead letter for %s not delivered: %s", self.consumer_name, err)

    def confirm(self, timeout: float = 10.0) -> int:
        """Wait for the broker to acknowledge the dead letters sent so far; returns how many it
        has not yet."""
        return self.producer.flush(timeout)


@dataclass(frozen=True)
class Delivered:
    envelope: Envelope[Event]
    topic: str
    partition: int
    offset: int
    observation: Observation

    @property
    def position(self) -> str:
        return f"{self.topic}:{self.partition}"


class EventConsumer:
    """Reads enveloped events from catalog streams.

    Two modes:

    * ``group_id`` given: a consumer group member (partitions shared across members; offsets
      committed by :meth:`commit`).
    * ``assign_all=True``: this process reads *every* partition itself (router replicas each
      need the whole index) from ``start_offsets`` or the beginning; nothing is committed, the
      position lives in the process's own snapshots.
    """

    def __init__(
        self,
        settings: BusSettings,
        streams: Iterable[str],
        *,
        group_id: str | None = None,
        assign_all: bool = False,
        start_offsets: dict[tuple[str, int], int] | None = None,
        catalog: Catalog | None = None,
        codec: EventCodec | None = None,
        tracker: SequenceTracker | None = None,
        dead_letters: EventProducer | None = None,
        consumer_name: str = "",
        dedupe: bool = True,
        **conf,
    ) -> None:
        if not group_id and not assign_all:
            raise ValueError("give a group_id, or assign_all=True to read every partition")
        self.catalog = catalog or Catalog(settings.topic_prefix)
        self.codec = codec or EventCodec(verifier=settings.verifier())
        self.tracker = tracker or SequenceTracker()
        self.dedupe = dedupe
        self.name = consumer_name or group_id or "consumer"
        self.topics = [self.catalog.topic(s) for s in streams]
        self._owns_dlq = dead_letters is None
        if dead_letters is None:
            dead_letters = EventProducer(settings, f"dlq:{self.name}", catalog=self.catalog, codec=self.codec)
        self._dlq = DeadLetters(dead_letters, self.catalog, self.name)

        #: An assign-only consumer never joins its group, but librdkafka still looks its
        #: coordinator up: the id is under this principal's own group prefix (principals.py).
        self.group_id = group_id or owned_group(settings.topic_prefix, settings.username, f"assign.{self.name}")
        base = {
            **settings.client_conf(),
            "group.id": self.group_id,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "enable.partition.eof": False,
            # How long the broker holds a fetch while nothing is there. It adds no latency (a
            # fetch returns as soon as one record arrives, fetch.min.bytes=1); shorter only
            # makes every idle consumer cost the broker more requests (at 50 ms, the demo's
            # ~20 consumers kept an idle broker at 16% of a core).
            "fetch.wait.max.ms": 500,
            "logger": _rdkafka_log,
        }
        base.update(conf)
        self._c = Consumer(base)
        self._positions: dict[tuple[str, int], int] = {}  # next offset to read
        self.delivered = 0
        self.dead_lettered = 0
        self.gaps: list[tuple[str, str, tuple[int, int]]] = []
        if assign_all:
            self._assign_all(start_offsets or {})
        else:
            self._c.subscribe(self.topics)

    def _assign_all(self, start: dict[tuple[str, int], int]) -> None:
        md = self._c.list_topics(timeout=10)
        tps = []
        for t in self.topics:
            if t not in md.topics or md.topics[t].error is not None:
                raise RuntimeError(f"topic {t} does not exist; run `switchyard topics apply`")
            for p in sorted(md.topics[t].partitions):
                off = start.get((t, p), OFFSET_BEGINNING)
                tps.append(TopicPartition(t, p, off))
                if off != OFFSET_BEGINNING:
                    self._positions[(t, p)] = off
        self._c.assign(tps)

    # -- reading ----------------------------------------------------------------------------

    def poll_batch(self, max_records: int = 1000, timeout: float = 0.5, linger: float = 0.0) -> list[Delivered]:
        """Up to ``max_records`` events; returns as soon as at least one record is there
        (``consume`` alone would wait for ``max_records`` or the whole timeout), or, with
        ``linger``, that many seconds after the first record (fewer, larger batches)."""
        first = self._c.poll(timeout)
        if first is None:
            return []
        msgs = [first]
        if max_records > 1:
            msgs.extend(self._c.consume(max_records - 1, linger))
        out: list[Delivered] = []
        for m in msgs:
            err = m.error()
            if err is not None:
                if err.code() != KafkaError._PARTITION_EOF:
                    log.warning("consumer %s: %s", self.name, err)
                continue
            d = self._handle(m)
            if d is not None:
                out.append(d)
        return out

    def _handle(self, m: Message) -> Delivered | None:
        topic, part, off = m.topic(), m.partition(), m.offset()
        self._positions[(topic, part)] = off + 1
        value = m.value()
        if value is None:
            self._dead_letter_msg(m, "malformed", "record has no value (tombstone on an event topic)")
            return None
        try:
            env = self.codec.decode(value)
        except SchemaError as e:
            self._dead_letter_msg(m, e.reason, str(e))
            return None
        scope = f"{topic}:{part}"
        obs = self.tracker.observe(scope, env.producer, env.epoch, env.seq)
        if obs.gap is not None:
            self.gaps.append((scope, env.producer, obs.gap))
            log.warning("gap on %s from %s epoch %d: seqs %d..%d missing", scope, env.producer,
                        env.epoch, *obs.gap)
        if self.dedupe and obs.verdict is not Verdict.NEW:
            return None
        self.delivered += 1
        return Delivered(env, topic, part, off, obs)

    # -- dead letters -----------------------------------------------------------------------

    def dead_letter(self, d: Delivered, reason: str, error: str) -> None:
        """Send a decoded event that its handler could not apply to the dead-letter topic."""
        self.dead_lettered += 1
        self._dlq.send(self.codec.encode(d.envelope), d.envelope.key.encode(), reason, error,
                       f"{d.topic}:{d.partition}:{d.offset}")

    def flush_dead_letters(self, timeout: float = 10.0) -> int:
        """Wait until the dead letters sent so far are acknowledged; returns how many are not
        (commit a position past a dead letter only once this is 0)."""
        return self._dlq.confirm(timeout)

    def _dead_letter_msg(self, m: Message, reason: str, error: str) -> None:
        self.dead_lettered += 1
        self._dlq.send(m.value(), m.key(), reason, error, f"{m.topic()}:{m.partition()}:{m.offset()}")

    # -- position ---------------------------------------------------------------------------

    def positions(self) -> dict[tuple[str, int], int]:
        """Next offset to read per (topic, partition), for everything consumed so far."""
        return dict(self._positions)

    def lag(self) -> dict[tuple[str, int], int]:
        """Records behind the end of each assigned partition (a broker round trip)."""
        out = {}
        for tp in self._c.assignment():
            lo, hi = self._c.get_watermark_offsets(tp, timeout=5, cached=False)
            pos = self._positions.get((tp.topic, tp.partition), lo)
            out[(tp.topic, tp.partition)] = max(hi - pos, 0)
        return out

    def commit(self) -> None:
        """Commit the positions read so far (a group member). The dead letters of the records
        they pass over are acknowledged first, so none is lost to a crash."""
        if not self._positions:
            return
        left = self._dlq.confirm(30.0)
        if left:
            raise RuntimeError(f"{left} dead letters not acknowledged; not committing past them")
        self._c.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in self._positions.items()],
                       asynchronous=False)

    def close(self) -> None:
        self._c.close()
        if self._owns_dlq:
            self._dlq.producer.close(10)
