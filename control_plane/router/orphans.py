"""Close the requests an earlier incarnation of this router left open.

A router killed with -9 leaves requests admitted with no terminal event (completed, failed or
rejected). Nobody else can end them, so on start-up a replica reads the recent ``requests``
log (the last ``window_s`` seconds, by timestamp), finds requests that its own earlier
incarnations (same producer id, lower epoch) admitted and never ended, and records
``RequestFailed(code="router_lost")`` for each. The fold is pure (:func:`open_requests`).
"""

from __future__ import annotations

import logging
import time

from common.log.reader import read_events
from common.settings import BusSettings
from schemas import Envelope
from schemas.events import RequestAdmitted, RequestCompleted, RequestFailed, RequestRejected

log = logging.getLogger(__name__)


def open_requests(events: list[Envelope], producer: str, current_epoch: int) -> list[str]:
    """Request ids admitted by ``producer`` in an earlier epoch and never ended. Pure."""
    admitted: dict[str, None] = {}
    ended: set[str] = set()
    for env in events:
        d = env.data
        if isinstance(d, RequestAdmitted) and env.producer == producer and env.epoch < current_epoch:
            admitted[d.request_id] = None
        elif isinstance(d, (RequestCompleted, RequestRejected)) or (isinstance(d, RequestFailed) and not d.retried):
            ended.add(d.request_id)
    return [rid for rid in admitted if rid not in ended]


def read_recent(bus: BusSettings, window_s: float) -> list[Envelope]:
    return read_events(bus, "requests", since_ms=int((time.time() - window_s) * 1000))


def close_orphans(bus: BusSettings, producer, window_s: float = 900.0) -> list[str]:
    """Emit RequestFailed for this router's orphaned requests; returns their ids."""
    orphans = open_requests(read_recent(bus, window_s), producer.producer_id, producer.epoch)
    for rid in orphans:
        producer.publish(RequestFailed(request_id=rid, reason="the router incarnation serving it died",
                                       code="router_lost"), correlation_id=rid)
    if orphans:
        producer.flush(30)
        log.warning("closed %d requests left open by an earlier incarnation of %s", len(orphans), producer.producer_id)
    return orphans
