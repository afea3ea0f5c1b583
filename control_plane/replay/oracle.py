"""The oracle a router's view is judged by: a straight fold of the log, no snapshot, no
consumer group, no live stream. Used by the chaos checks and the router tests: a live view
and this fold at the same positions must have the same digest."""

from __future__ import annotations

from control_plane.index.errors import IndexRejected
from control_plane.router.view import RouterView
from common.log.catalog import Catalog
from common.log.reader import KafkaLogReader, scan
from common.settings import BusSettings
from schemas import EventCodec, SchemaError


def oracle_view(bus: BusSettings, algo: str, block_size: int,
                upto: dict[tuple[str, int], int] | None = None) -> RouterView:
    """Fold every record of kv and workers (or up to ``upto`` offsets, exclusive), partition by
    partition in offset order; workers first (registrations before stores, as a live fold
    mostly sees). Records the router dead-letters advance the position and change nothing."""
    view = RouterView(algo, block_size)
    codec = EventCodec(verifier=bus.verifier())
    cat = Catalog(bus.topic_prefix)
    with KafkaLogReader(bus) as reader:
        for stream in ("workers", "kv"):
            topic = cat.topic(stream)
            limit = None if upto is None else {p: o for (t, p), o in upto.items() if t == topic}
            for m in scan(reader, topic, upto=limit):
                try:
                    view.apply(codec.decode(m.value), topic, m.partition, m.offset)
                except (SchemaError, IndexRejected):
                    view.positions[(topic, m.partition)] = m.offset + 1
    return view


def parse_positions(positions: dict[str, int]) -> dict[tuple[str, int], int]:
    """``/router/view``'s ``{"topic:partition": offset}`` -> ``{(topic, partition): offset}``."""
    out = {}
    for k, v in positions.items():
        topic, part = k.rsplit(":", 1)
        out[(topic, int(part))] = int(v)
    return out
