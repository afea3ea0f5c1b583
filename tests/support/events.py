"""Read a whole stream back from the broker (tests only)."""

from __future__ import annotations

from control_plane.bus.catalog import Catalog
from control_plane.bus.reader import iter_records
from control_plane.settings import BusSettings
from schemas import Envelope, EventCodec, SchemaError


def read_stream(bus: BusSettings, stream: str) -> list[Envelope]:
    codec = EventCodec()
    out = []
    for m in iter_records(bus, Catalog(bus.topic_prefix).topic(stream)):
        try:
            out.append(codec.decode(m.value()))
        except SchemaError:
            pass
    return out
