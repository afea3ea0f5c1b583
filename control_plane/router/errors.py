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


class InvalidRequest(RoutingError, ValueError):
    """A client's request breaks a documented bound or is not supported. The HTTP front answers
    ``status`` with an OpenAI-style error naming ``param``; no worker ever sees the request."""

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_value",
                 status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
        self.status = status
