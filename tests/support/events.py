"""Read a whole stream back from the broker (tests only)."""

from __future__ import annotations

from kernel.log.reader import read_events
from kernel.settings import BusSettings
from schemas import Envelope


def read_stream(bus: BusSettings, stream: str) -> list[Envelope]:
    return read_events(bus, stream)
