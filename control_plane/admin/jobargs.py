"""Replay job arguments checked at submission, so a job that cannot mean anything is refused with
a 422 and the reason instead of queued to fail later. Pure (the time is an input).

What is refused without reading the log: a point that does not parse; a time before
:data:`EARLIEST_MS` (no log here is older: such a value is a unit mistake) or more than
:data:`FUTURE_SLACK_MS` after now (say ``end``); offsets and partitions no broker can hold; a
range whose start is provably after its end (two times, two records of one partition, two
position maps over a shared partition, ``end`` before anything but ``end``, anything before
``start``: :func:`control_plane.replay.points.check_range`, the rule replay applies too). Ranges
of points of different kinds are ordered only by reading the log, which the job does.
"""

from __future__ import annotations

from control_plane.replay.errors import BadPoint
from control_plane.replay.points import Point, check_range, parse_point

__all__ = ["EARLIEST_MS", "FUTURE_SLACK_MS", "check_range", "point"]

#: 2000-01-01T00:00:00Z in epoch ms.
EARLIEST_MS = 946_684_800_000
#: A point up to a day past now is a clock skew; beyond, a mistake.
FUTURE_SLACK_MS = 86_400_000


def point(text: str, now_ms: int, name: str) -> Point:
    """``text`` parsed (which refuses partitions and offsets no broker can hold) and checked to be
    a plausible time; raises :class:`BadPoint` naming ``name``."""
    try:
        p = parse_point(text)
    except BadPoint as e:
        raise BadPoint(f"{name}: {e}") from None
    if p.kind == "time" and not EARLIEST_MS <= p.ts_ms <= now_ms + FUTURE_SLACK_MS:
        raise BadPoint(f"{name}={text!r} ({p.ts_ms} ms) is not a time this log can hold: want one after "
                       "2000-01-01 and at most a day past now (use 'end' for the newest record)")
    return p
