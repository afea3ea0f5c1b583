"""Errors of the simulated engine. One base so the worker can catch any of them."""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error raised by ``data_plane.engines``."""

    reason = "engine_error"


class ProfileError(EngineError, ValueError):
    """A hardware profile that is missing, malformed or self-contradictory."""

    reason = "profile"


class RequestRejected(EngineError, ValueError):
    """A request the engine can never serve (e.g. its prompt exceeds the whole KV cache).

    Raised by ``add_request`` before any state changes, so the caller can answer 400/413.
    """

    reason = "request_rejected"


class UnknownRequest(EngineError, KeyError):
    """``release``/``abort``/``stream`` named a request the engine does not hold."""

    reason = "unknown_request"


class TraceFormatError(EngineError, ValueError):
    """A trace line that cannot be turned into a request."""

    reason = "trace_format"
