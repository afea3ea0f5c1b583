"""Replay job arguments checked at submission, so a job that cannot mean anything is refused with
a 422 and the reason instead of queued to fail later. Pure (the time is an input).

What is refused without reading the log: a point that does not parse; a time before
:data:`EARLIEST_MS` (no log here is older: such a value is a unit mistake) or more than
:data:`FUTURE_SLACK_MS` after now (say ``end``); offsets and partitions no broker can hold; a
range whose start is provably after its end (two times, two records of one partition, two
position maps over a shared partition, ``end`` before anything but ``end``, anything before
``start``). Ranges of points of different kinds are ordered only by reading the log, which the
job does.
"""

from __future__ import annotations

from control_plane.replay.errors import BadPoint
from control_plane.replay.points import Point, parse_point

#: 2000-01-01T00:00:00Z in epoch ms.
EARLIEST_MS = 946_684_800_000
#: A point up to a day past now is a clock skew; beyond, a mistake.
FUTURE_SLACK_MS = 86_400_000
_MAX_OFFSET = 2**63 - 1
_MAX_PARTITION = 2**31 - 1


def point(text: str, now_ms: int, name: str) -> Point:
    """``text`` parsed and checked to be plausible; raises :class:`BadPoint` naming ``name``."""
    try:
        p = parse_point(text)
    except BadPoint as e:
        raise BadPoint(f"{name}: {e}") from None
    if p.kind == "time" and not EARLIEST_MS <= p.ts_ms <= now_ms + FUTURE_SLACK_MS:
        raise BadPoint(f"{name}={text!r} ({p.ts_ms} ms) is not a time this log can hold: want one after "
                       "2000-01-01 and at most a day past now (use 'end' for the newest record)")
    if p.kind == "record" and not (p.partition <= _MAX_PARTITION and p.offset <= _MAX_OFFSET):
        raise BadPoint(f"{name}={text!r}: partition or offset out of range")
    if p.kind == "positions" and any(part > _MAX_PARTITION or off > _MAX_OFFSET
                                     for (_, part), off in p.positions.items()):
        raise BadPoint(f"{name}: a position's partition or offset is out of range")
    return p


def check_range(start: Point, end: Point) -> None:
    """Raise :class:`BadPoint` when ``start`` is provably after ``end``."""
    why = _backwards(start, end)
    if why:
        raise BadPoint(f"from ({start.describe()}) is after to ({end.describe()}): {why}")


def _backwards(a: Point, b: Point) -> str:
    if a.kind == "end" and b.kind != "end":
        return "nothing comes after the end of the log"
    if b.kind == "start" and a.kind != "start":
        return "nothing comes before the start of the log"
    if a.kind == b.kind == "time" and a.ts_ms > b.ts_ms:
        return "swap them"
    if a.kind == b.kind == "record" and (a.topic, a.partition) == (b.topic, b.partition) and a.offset > b.offset:
        return "swap them"
    if a.kind == b.kind == "positions":
        later = sorted(f"{t}:{p}" for (t, p), off in a.positions.items()
                       if (t, p) in b.positions and off > b.positions[(t, p)])
        if later:
            return f"partitions {', '.join(later[:5])} start past their end"
    return ""
