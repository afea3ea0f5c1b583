"""A worker's one way onto the log: every event goes through the one producer, so this
incarnation's sequences stay dense per partition.

:meth:`EventPublisher.publish_acked` is for facts a response is about to reveal; the
delivery-report thread is what lets it return within milliseconds.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from data_plane.workers.run import Unavailable
from schemas.events import Event

log = logging.getLogger(__name__)


class EventPublisher:
    """The worker's producer, with acknowledged publishing and its delivery-report thread."""

    def __init__(self, producer, *, ack_timeout_s: float) -> None:  # noqa: ANN001
        self.producer = producer
        self.ack_timeout_s = ack_timeout_s
        self._delivery_stop = threading.Event()
        self._delivery = threading.Thread(target=self._serve_delivery_reports, name="delivery-reports",
                                          daemon=True)

    def start(self) -> None:
        self._delivery.start()

    def stop(self) -> None:
        """Stop serving delivery reports (the producer is flushed by its owner afterwards)."""
        self._delivery_stop.set()
        if self._delivery.is_alive():
            self._delivery.join(5)

    def publish(self, payload: Event, correlation_id: str | None = None) -> None:
        self.producer.publish(payload, correlation_id=correlation_id)

    async def publish_acked(self, payload: Event, correlation_id: str | None = None) -> None:
        """Publish and wait until the broker has it. For facts a response is about to reveal
        (a handoff, a transfer outcome): the client must never learn something the log could
        still lose to a crash. Raises :class:`Unavailable` when the log does not confirm."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def on_ack(ack) -> None:  # noqa: ANN001 - runs in the delivery-report thread
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(ack))

        t0 = time.monotonic()
        self.producer.publish(payload, correlation_id=correlation_id, on_ack=on_ack)
        try:
            ack = await asyncio.wait_for(fut, self.ack_timeout_s)
        except TimeoutError:
            log.error("the event log did not acknowledge %s of %s within %gs (%d events awaiting delivery)",
                      payload.TYPE, correlation_id, self.ack_timeout_s, self.producer.outstanding())
            raise Unavailable(f"the event log did not acknowledge {payload.TYPE} within "
                              f"{self.ack_timeout_s:g}s") from None
        waited = time.monotonic() - t0
        if waited > 1.0:
            log.warning("the event log took %.1fs to acknowledge %s of %s", waited, payload.TYPE, correlation_id)
        if ack.error:
            raise Unavailable(f"the event log refused {payload.TYPE}: {ack.error}")

    def _serve_delivery_reports(self) -> None:
        # librdkafka only runs delivery callbacks inside poll(); serving them here (rather
        # than on the next publish) is what lets publish_acked return within milliseconds.
        while not self._delivery_stop.is_set():
            try:
                self.producer.poll(0.05)
            except Exception:
                log.exception("serving delivery reports failed")
                self._delivery_stop.wait(0.1)
