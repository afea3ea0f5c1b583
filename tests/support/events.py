"""Read a whole stream back from the broker (tests only)."""

from __future__ import annotations

from common.log.reader import read_events
from common.settings import BusSettings
from schemas import Envelope
from schemas.events import RequestAdmitted


def read_stream(bus: BusSettings, stream: str) -> list[Envelope]:
    return read_events(bus, stream)


def router_ids(bus: BusSettings) -> dict[str, str]:
    """Client request id -> the router's request id, from ``RequestAdmitted.client_request_id``
    (the router makes its own ids; a client's ``request_id`` is kept there as metadata)."""
    return {e.data.client_request_id: e.data.request_id for e in read_stream(bus, "requests")
            if isinstance(e.data, RequestAdmitted) and e.data.client_request_id}
