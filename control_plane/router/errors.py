"""Errors of the routing context. One base so callers can catch any of them.

Deciding is a command: it raises when it cannot decide (no eligible worker), and the caller turns
that into a ``RequestRejected``. Config errors are also ``ValueError`` so that msgspec reports
them as validation errors when a config is decoded from JSON.
"""

from __future__ import annotations


class RoutingError(Exception):
    """Base of every error raised by :mod:`control_plane.router`."""


class RouterConfigError(RoutingError, ValueError):
    """A router config is inconsistent. The message says which rule and why it exists."""


class NoEligibleWorker(RoutingError):
    """No candidate may take the request. The message lists why each one was excluded."""


class InvalidRoutingInput(RoutingError, ValueError):
    """An input to a decision breaks its contract (e.g. a worker listed twice)."""
