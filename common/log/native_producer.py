"""The router's event producer: its envelopes written, signed and produced by the native crate
(``native/src/emit.rs``, ``native/src/py_produce.rs``: librdkafka through the ``rdkafka``
crate, delivery reports served by its own thread, never holding the GIL).

Python keeps what the envelope's meaning needs: the envelope (:class:`EnvelopeFactory`: event
id, per-partition sequence, strictly increasing time), the partition (:func:`partition_of`), the
payload's bytes (:meth:`EventCodec.encode_payload`), which key signs it (:meth:`Signer.key_for`)
and the ack ledger (:func:`report_delivery`). The producer's settings are
:func:`producer_config`'s, the same principal over the same TLS and SCRAM as every client.

Only the router's processes import this module (it needs ``switchyard_native``); the other
producers stay :class:`common.log.kafka.EventProducer`. Delivery reports reach Python where
that producer served its callbacks: after each publish, in :meth:`poll` and in :meth:`flush`.
No per-event callback: a router's caller learns of failures from :attr:`failed` and the log.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

import switchyard_native

from common.log.acks import AckEntry, AckLedger
from common.log.catalog import Catalog
from common.log.kafka import H_PRODUCER, H_TYPE, H_VERSION, EnvelopeProducer, producer_config, report_delivery
from common.log.metadata import partitions_within
from common.settings import BusSettings
from schemas import Envelope, EventCodec
from schemas.events import Event
from schemas.signing import about_of

log = logging.getLogger(__name__)

#: Where librdkafka's own log lines go, as the Python clients' (``common.log.kafka``).
_rdkafka_log = logging.getLogger("switchyard.rdkafka")


def log_level(syslog: int) -> int:
    """A librdkafka (syslog) level as the logging module's, as confluent-kafka maps it."""
    if syslog <= 2:
        return logging.CRITICAL
    return {3: logging.ERROR, 4: logging.WARNING, 5: logging.INFO, 6: logging.INFO}.get(syslog, logging.DEBUG)


def native_config(settings: BusSettings, **extra) -> list[tuple[str, str]]:
    """:func:`producer_config` as librdkafka strings, without the Python logger: the crate
    keeps librdkafka's warnings and worse, and the producer logs them with its delivery reports."""
    return [(k, ("true" if v else "false") if isinstance(v, bool) else str(v))
            for k, v in producer_config(settings, **extra).items() if k != "logger"]


class NativeEventProducer(EnvelopeProducer):
    """Publishes payloads as signed envelopes through the native producer: the
    :class:`~common.log.sink.EventSink` of a router."""

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
        **conf,
    ) -> None:
        super().__init__(settings, producer_id, epoch, catalog=catalog, codec=codec, clock_ns=clock_ns,
                         ack_ledger=ack_ledger)
        self._native = switchyard_native.EventProducer(native_config(settings, **conf), producer_id, self.epoch,
                                                       (H_TYPE, H_VERSION, H_PRODUCER), self.ledger is not None)
        self._report_lock = threading.Lock()
        #: The failed delivery reports served so far.
        self.failed: list[AckEntry] = []

    @property
    def acked(self) -> int:
        return self._native.counts()[0]

    @property
    def unconfirmed(self) -> int:
        """Acknowledged without an offset (implicitly, by a later batch of the partition)."""
        return self._native.counts()[1]

    def publish(self, payload: Event, *, correlation_id: str | None = None,
                causation_id: str | None = None) -> Envelope[Event]:
        topic = self.catalog.topic(payload.STREAM)
        key = payload.key()
        sign_key = self.signer.key_for(payload.TYPE, key, about_of(payload))  # before a seq is spent on it
        with self._lock:
            partition = self._partition(topic, key)
            env = self.factory.wrap(payload, correlation_id=correlation_id, causation_id=causation_id,
                                    key=key, scope=f"{topic}:{partition}")
            data, corr = self.codec.encode_payload(env)
            self._native.produce(topic, partition, env.event_id, env.type, env.version, key, env.seq,
                                 env.occurred_at_ns, corr, causation_id, data, sign_key)
        if self._native.waiting:
            self._serve()
        return env

    def _topic_partitions(self, topic: str) -> list[int]:
        # As EventProducer's: 3 s for a young topic to be listed, 10 s for a busy broker.
        return partitions_within(lambda wait: self._native.partitions(topic, wait), topic, unknown_for=3.0,
                                 transient=ConnectionError)

    def _serve(self) -> int:
        """Hand the delivery reports kept since the last call to the ledger and the log, and
        librdkafka's log lines to the ``switchyard.rdkafka`` logger."""
        with self._report_lock:
            reports = self._native.reports()  # first: it clears `waiting`, which a new line sets again
            for level, facility, message in self._native.logs():
                _rdkafka_log.log(log_level(level), "%s %s: %s", self.producer_id, facility, message)
            for event_id, type_name, key, topic, partition, offset, seq, error in reports:
                entry = AckEntry(event_id, topic, partition, offset, self.producer_id, self.epoch, seq, error)
                report_delivery(self.ledger, entry, type_name, key)
                if error:
                    self.failed.append(entry)
            return len(reports)

    def poll(self) -> int:
        """Serve the delivery reports that arrived (the native thread polls librdkafka itself);
        returns how many."""
        return self._serve()

    def outstanding(self) -> int:
        """Events handed to librdkafka whose delivery report has not been served yet."""
        return self._native.in_flight()

    def statistics(self) -> tuple[int, dict | None]:
        """(how many librdkafka statistics reports arrived, the newest as parsed JSON or None);
        reports come every ``statistics.interval.ms`` when that is set (0, the default: never).
        Its ``brokers.<name>.req.Produce`` counts the produce requests sent."""
        n, raw = self._native.statistics()
        return n, (json.loads(raw) if raw is not None else None)

    def flush(self, timeout: float = 30.0) -> int:
        """Wait for delivery reports; returns how many are still outstanding."""
        left = self._native.flush(timeout)
        self._serve()
        return left

    def close(self, timeout: float = 30.0) -> None:
        left = self.flush(timeout)
        if left:
            log.warning("producer %s closed with %d undelivered events", self.producer_id, left)
        if self.ledger is not None:
            self.ledger.close()
