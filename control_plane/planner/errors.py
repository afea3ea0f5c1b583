"""One exception base for the planner package; adapters translate driver errors into these."""

from __future__ import annotations


class PlannerError(Exception):
    """Base of every error the planner package raises on purpose."""


class PlannerConfigError(PlannerError, ValueError):
    """A planner config that cannot work; the message says which rule failed and why it exists.

    A ``ValueError`` so that ``msgspec`` turns it into a ``ValidationError`` while decoding.
    """


class ProfileLookupError(PlannerError, ValueError):
    """A performance profile that cannot answer a lookup (empty grid, non-positive times)."""


class ScalerError(PlannerError):
    """A scaler could not apply or observe a decision (driver errors are wrapped in this)."""


class StaleFencingToken(ScalerError):
    """A decision carries a fencing token older than the newest the scaler has seen: it comes
    from a planner that lost its lease, and must not be applied."""

    def __init__(self, token: int, newest: int) -> None:
        super().__init__(f"stale fencing token {token} < newest seen {newest}: decision from a "
                         "deposed planner, rejected")
        self.token = token
        self.newest = newest


class LeaseLost(PlannerError):
    """This planner no longer holds the leader lease."""
