"""The port every component records its facts through, and its in-memory adapter.

``common.log.kafka.EventProducer`` implements :class:`EventSink` against Kafka. The in-memory
:class:`MemorySink` serves the pure simulation and unit tests (never as a stand-in for the real
adapter in an integration test): it stamps envelopes exactly as the producer does (one
incarnation, per-scope sequence numbers, strictly increasing times), so a fold that reads
envelopes (the router's ledger, say) runs unchanged on what it recorded.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from schemas.envelope import Envelope, EnvelopeFactory
from schemas.events import Event


class EventSink(Protocol):
    """Where a component records the facts it produces; ``publish`` returns the stamped
    envelope (callers that only record ignore it)."""

    def publish(self, payload: Event, *, correlation_id: str | None = None,
                causation_id: str | None = None) -> Envelope[Event]: ...


class MemorySink:
    """Keeps published payloads, their envelopes and correlation ids, in order."""

    def __init__(self, producer: str = "memory", epoch: int = 1,
                 clock_ns: Callable[[], int] = time.time_ns) -> None:
        self.factory = EnvelopeFactory(producer, epoch, clock_ns)
        self.envelopes: list[Envelope[Event]] = []

    @property
    def events(self) -> list[Event]:
        return [e.data for e in self.envelopes]

    @property
    def correlation(self) -> list[str | None]:
        return [e.correlation_id for e in self.envelopes]

    def publish(self, payload: Event, *, correlation_id: str | None = None,
                causation_id: str | None = None, **_: object) -> Envelope[Event]:
        env = self.factory.wrap(payload, correlation_id=correlation_id, causation_id=causation_id)
        self.envelopes.append(env)
        return env

    def of_type(self, cls: type[Event]) -> list[Event]:
        return [e.data for e in self.envelopes if isinstance(e.data, cls)]

    def clear(self) -> None:
        self.envelopes.clear()
