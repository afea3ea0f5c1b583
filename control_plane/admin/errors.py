"""Errors of the admin API's service layer; the app turns each into a JSON error response.

Each kind names its HTTP status and machine-readable code once, in its class line.
"""

from __future__ import annotations

from typing import ClassVar


class ApiError(Exception):
    """Base: ``status`` (HTTP) and ``code`` (machine-readable) travel with the message."""

    status: ClassVar[int] = 400
    code: str = "bad_request"
    #: Response headers the status calls for (a class default, extended per instance).
    headers: dict[str, str] | None = None

    def __init_subclass__(cls, *, status: int | None = None, code: str | None = None, **kw) -> None:
        super().__init_subclass__(**kw)
        if status is not None:
            cls.status = status
        if code is not None:
            cls.code = code

    def __init__(self, message: str, *, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code:
            self.code = code
        if headers:
            self.headers = {**(type(self).headers or {}), **headers}


class NotFound(ApiError, status=404, code="not_found"):
    """No such worker, pool, config version, replay job (or result) or token."""


class Conflict(ApiError, status=409, code="conflict"):
    """The call contradicts the current state (a stale ``expected_version``, a taken name)."""


class Invalid(ApiError, status=422, code="invalid"):
    """Well-formed input that breaks a domain rule; the message says which."""


class Unavailable(ApiError, status=503, code="unavailable"):
    """A dependency (the log, the database) cannot take the call now; retry later."""


class Unauthorized(ApiError, status=401, code="unauthorized"):
    """No valid bearer token (missing, malformed, unknown, wrong secret, revoked or expired; the
    code says ``token_expired`` / ``token_revoked`` to a caller holding the right secret)."""

    headers = {"WWW-Authenticate": "Bearer"}


class Forbidden(ApiError, status=403, code="forbidden"):
    """A valid token whose role is too weak for the call."""


class TooManyRequests(ApiError, status=429, code="rate_limited"):
    """Too many failed authentications from this address or for this token id; ``Retry-After``
    says when to try again."""
