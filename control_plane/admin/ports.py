"""Ports of the admin service: where operator actions are recorded, where replay jobs run.

Each has a real adapter and an in-memory one (the latter for unit tests of the service layer;
integration tests use the real ones).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from control_plane.admin.errors import Unavailable
from common.log.reader import LocatedEvent
from schemas import EnvelopeFactory
from schemas.events import Event


class EventLog(Protocol):
    def record(self, payload: Event, *, correlation_id: str | None = None) -> LocatedEvent:
        """Append ``payload`` durably (acknowledged by the log) and say where it landed; raise
        :class:`Unavailable` when the log cannot take it."""
        ...


class KafkaEventLog:
    """Publishes through an :class:`~common.log.kafka.EventProducer` and waits for the
    broker's acknowledgement (acks=all), so an action the API reports as done is in the log."""

    def __init__(self, producer, timeout_s: float = 15.0) -> None:
        self.producer = producer
        self.timeout_s = timeout_s
        self._lock = threading.Lock()

    def record(self, payload: Event, *, correlation_id: str | None = None) -> LocatedEvent:
        import time

        with self._lock:
            box: dict = {}
            done = threading.Event()

            def on_ack(ack) -> None:
                box["ack"] = ack
                done.set()

            try:
                env = self.producer.publish(payload, correlation_id=correlation_id, on_ack=on_ack)
            except Exception as e:  # topic missing, broker unreachable at metadata time
                raise Unavailable(f"the event log refused {payload.TYPE}: {e}") from None
            deadline = time.monotonic() + self.timeout_s
            while not done.is_set():
                if time.monotonic() > deadline:
                    raise Unavailable(f"{payload.TYPE} not acknowledged by the log within {self.timeout_s:g}s")
                self.producer.poll(0.05)
            ack = box["ack"]
            if ack.error:
                raise Unavailable(f"{payload.TYPE} not recorded: {ack.error}")
            return LocatedEvent(env, ack.topic, ack.partition, ack.offset)

    def close(self) -> None:
        self.producer.close(10)


class MemoryEventLog:
    """Appends to a list, numbering offsets per topic (unit tests of the service layer)."""

    def __init__(self, prefix: str = "mem") -> None:
        import time

        self.prefix = prefix
        self.factory = EnvelopeFactory("admin-mem", 1, time.time_ns)
        self.events: list[LocatedEvent] = []
        self._next: dict[str, int] = {}

    def record(self, payload: Event, *, correlation_id: str | None = None) -> LocatedEvent:
        topic = f"{self.prefix}.{payload.STREAM}"
        env = self.factory.wrap(payload, correlation_id=correlation_id)
        off = self._next.get(topic, 0)
        self._next[topic] = off + 1
        loc = LocatedEvent(env, topic, 0, off)
        self.events.append(loc)
        return loc


class JobRunner(Protocol):
    def submit(self, fn: Callable[[], None]) -> None: ...

    def shutdown(self) -> None: ...


class ThreadJobRunner:
    def __init__(self, workers: int = 1) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="replay-job")

    def submit(self, fn: Callable[[], None]) -> None:
        self._pool.submit(fn)

    def shutdown(self, wait: bool = False) -> None:
        """Drop queued jobs; ``wait`` for the running one to finish."""
        self._pool.shutdown(wait=wait, cancel_futures=True)


class InlineJobRunner:
    """Runs a job in the calling thread (tests; one-shot CLIs)."""

    def submit(self, fn: Callable[[], None]) -> None:
        fn()

    def shutdown(self) -> None:
        pass
