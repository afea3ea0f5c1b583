"""Token buckets: the one refill rule for every rate Switchyard limits. Pure (the time is an
input, in seconds of one monotonic clock).

A bucket of ``size`` tokens refills at ``per_s`` tokens a second and never holds more than
``size``. It is kept as the level it had when last touched and the time of that touch; a bucket
never touched is full (so a full bucket may simply be forgotten). A clock that steps back refills
nothing and takes nothing back.

Used by the admin API's limit on failed authentications and the router's per-key rate on one
replica; the router's shared gate runs the same rule in Redis (the Lua script of
:mod:`control_plane.router.shared_gate`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Bucket:
    """A bucket's ``level`` (tokens) at its last touch, time ``at``."""

    level: float
    at: float


def level_at(bucket: Bucket | None, now: float, size: float, per_s: float) -> float:
    """The tokens ``bucket`` holds at ``now`` (``size`` when there is no bucket yet)."""
    if bucket is None:
        return float(size)
    return min(float(size), bucket.level + max(0.0, now - bucket.at) * per_s)


__all__ = ["Bucket", "level_at"]
