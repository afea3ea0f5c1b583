"""Ports the data plane talks through. Real adapters live at the edges; the in-memory
implementations here serve the pure simulation and unit tests (never as a stand-in for the real
adapter in an integration test)."""

from __future__ import annotations

from typing import Protocol

from schemas.events import Event


class EventSink(Protocol):
    """Where a component records the facts it produces.

    ``control_plane.bus.kafka.EventProducer`` implements it against Kafka (its ``publish``
    returns the stamped envelope; callers here do not rely on the return value).
    """

    def publish(self, payload: Event, *, correlation_id: str | None = None,
                causation_id: str | None = None): ...


class MemorySink:
    """Keeps published payloads in order, with their correlation ids."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.correlation: list[str | None] = []

    def publish(self, payload: Event, *, correlation_id: str | None = None,
                causation_id: str | None = None) -> None:
        self.events.append(payload)
        self.correlation.append(correlation_id)

    def of_type(self, cls: type[Event]) -> list[Event]:
        return [e for e in self.events if isinstance(e, cls)]

    def clear(self) -> None:
        self.events.clear()
        self.correlation.clear()
