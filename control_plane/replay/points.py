"""Points of the log: what ``--at``, ``--from`` and ``--to`` may name, parsed without I/O.

Accepted forms:

* ``start`` / ``end``: the first / the next-to-be-written record of every partition.
* an ISO 8601 time (``2026-05-01T12:00:00Z``; no zone means UTC) or epoch milliseconds
  (``1780000000000``): every record whose timestamp is at or before that instant, per partition.
* ``topic:partition:offset``: up to and including that record in its partition, and for every
  other partition the records whose timestamp is at or before that record's.
* a JSON object ``{"topic:partition": next_offset, ...}`` (the form ``RequestRouted.index_position``
  records): exactly those positions; partitions not named are read whole (``end``) when
  ``default_end`` is asked for, else not at all.
* ``request:<request id>``: the view the router decided that request's last routing on (its
  ``index_position``); resolved by the replay engine, which has to read the request's record.

Record timestamps are the producers' clocks (``CreateTime``): "at or before T" is therefore
"appended before the first record stamped after T" per partition (Kafka's time index), which is
exact when each partition's producers' clocks agree, and otherwise off by their skew.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timezone

from control_plane.replay.errors import BadPoint

#: Epoch-millisecond values below this are taken for a mistake (seconds, or an offset).
_MIN_EPOCH_MS = 10**11
#: 9999-12-31T23:59:59.999Z: the largest time a point may name (Kafka's offset-for-time lookup
#: takes a 64-bit value; 23 digits overflowed it).
_MAX_EPOCH_MS = 253_402_300_799_999
#: Kafka's own bounds on a partition number and an offset.
_MAX_PARTITION = 2**31 - 1
_MAX_OFFSET = 2**63 - 1


@dataclass(frozen=True)
class Point:
    """A parsed point. ``kind`` is one of start, end, time, record, positions, request."""

    kind: str
    ts_ms: int | None = None
    topic: str | None = None
    partition: int | None = None
    offset: int | None = None
    positions: dict[tuple[str, int], int] = field(default_factory=dict)
    request_id: str | None = None
    text: str = ""

    def describe(self) -> str:
        if self.kind == "time":
            iso = datetime.fromtimestamp(self.ts_ms / 1000, tz=timezone.utc).isoformat(timespec="milliseconds")
            return f"time {iso} ({self.ts_ms} ms)"
        if self.kind == "record":
            return f"record {self.topic}:{self.partition}:{self.offset} (inclusive)"
        if self.kind == "positions":
            return f"positions {len(self.positions)} partitions"
        if self.kind == "request":
            return f"routing of request {self.request_id}"
        return self.kind


def parse_point(text: str) -> Point:
    """Parse one point; raises :class:`BadPoint` with the accepted forms when it is none."""
    s = (text or "").strip()
    if not s:
        raise BadPoint("empty point; " + _FORMS)
    low = s.lower()
    if low in ("start", "beginning", "earliest"):
        return Point("start", text=s)
    if low in ("end", "now", "latest"):
        return Point("end", text=s)
    if low.startswith("request:"):
        rid = s.split(":", 1)[1]
        if not rid:
            raise BadPoint("request: needs a request id, e.g. request:cmpl-123")
        return Point("request", request_id=rid, text=s)
    if s.startswith("{"):
        try:
            raw = json.loads(s)
        except json.JSONDecodeError as e:
            raise BadPoint(f"positions JSON does not parse: {e}") from None
        return Point("positions", positions=parse_positions(raw), text=s)
    if _digits(s):
        ms = int(s)
        if ms < _MIN_EPOCH_MS:
            raise BadPoint(f"{s} is too small for epoch milliseconds (did you mean seconds, or "
                           "topic:partition:offset?); " + _FORMS)
        if ms > _MAX_EPOCH_MS:
            raise BadPoint(f"{s[:40]} is past the year 9999 as epoch milliseconds; " + _FORMS)
        return Point("time", ts_ms=ms, text=s)
    try:
        dt = datetime.fromisoformat(s[:-1] + "+00:00" if s.endswith("Z") else s)
    except ValueError:
        parts = s.rsplit(":", 2)
        if len(parts) == 3 and parts[0] and _digits(parts[1]) and _digits(parts[2]):
            _check_position(parts[0], int(parts[1]), int(parts[2]))
            return Point("record", topic=parts[0], partition=int(parts[1]), offset=int(parts[2]), text=s)
        raise BadPoint(f"{s[:80]!r} is not a point of the log; " + _FORMS) from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    try:
        ms = int(dt.timestamp() * 1000)
    except (OverflowError, ValueError):
        raise BadPoint(f"{s[:80]!r} is not a time the log can hold; " + _FORMS) from None
    if ms < 0:
        raise BadPoint(f"{s[:80]!r} is before 1970, older than any log; " + _FORMS)
    return Point("time", ts_ms=ms, text=s)


def _digits(s: str) -> bool:
    """ASCII digits only: ``str.isdigit`` also takes superscripts (``'²'``) that ``int`` refuses."""
    return s.isascii() and s.isdigit()


def _check_position(topic: str, partition: int, offset: int) -> None:
    if partition > _MAX_PARTITION or offset > _MAX_OFFSET:
        raise BadPoint(f"{topic[:80]}:{partition}:{offset} is beyond Kafka's partition (< 2**31) or offset "
                       "(< 2**63) range")


def check_range(frm: Point, to: Point) -> None:
    """Raise :class:`BadPoint` when ``frm`` comes after ``to`` on its face (before reading the
    log: the end before the start, a later time before an earlier one, a later offset of a
    partition before an earlier one, two position maps over a shared partition); a range that
    only resolves reversed (points of different kinds) is checked by the replay engine."""
    why = _backwards(frm, to)
    if why:
        raise BadPoint(f"from ({frm.describe()}) is after to ({to.describe()}): {why}")


def _backwards(a: Point, b: Point) -> str:
    if a.kind == "end" and b.kind != "end":
        return "nothing comes after the end of the log"
    if b.kind == "start" and a.kind != "start":
        return "nothing comes before the start of the log"
    if a.kind == b.kind == "time" and a.ts_ms > b.ts_ms:  # type: ignore[operator]
        return "swap them"
    if a.kind == b.kind == "record" and (a.topic, a.partition) == (b.topic, b.partition) \
            and a.offset > b.offset:  # type: ignore[operator]
        return "swap them"
    if a.kind == b.kind == "positions":
        later = sorted(f"{t}:{p}" for (t, p), off in a.positions.items()
                       if (t, p) in b.positions and off > b.positions[(t, p)])
        if later:
            return f"partitions {', '.join(later[:5])} start past their end"
    return ""


def parse_positions(raw: object) -> dict[tuple[str, int], int]:
    """``{"topic:partition": offset}`` -> ``{(topic, partition): offset}``."""
    if not isinstance(raw, dict):
        raise BadPoint("positions must be a JSON object {\"topic:partition\": next_offset}")
    out: dict[tuple[str, int], int] = {}
    for k, v in raw.items():
        t, _, p = str(k).rpartition(":")
        if not t or not _digits(p) or not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise BadPoint(f"bad position {str(k)[:80]!r}: {str(v)[:40]} (want \"topic:partition\": non-negative offset)")
        _check_position(t, int(p), v)
        out[(t, int(p))] = v
    return out


def format_positions(pos: dict[tuple[str, int], int]) -> dict[str, int]:
    return {f"{t}:{p}": o for (t, p), o in sorted(pos.items())}


_FORMS = ("use start | end | ISO 8601 time | epoch ms | topic:partition:offset | "
          "{\"topic:partition\": offset} | request:<id>")
