"""Errors of the admin API's service layer; the app turns each into a JSON error response."""

from __future__ import annotations


class ApiError(Exception):
    """Base: ``status`` (HTTP) and ``code`` (machine-readable) travel with the message."""

    status = 400
    code = "bad_request"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code:
            self.code = code


class NotFound(ApiError):
    status, code = 404, "not_found"


class Conflict(ApiError):
    status, code = 409, "conflict"


class Invalid(ApiError):
    status, code = 422, "invalid"


class Unavailable(ApiError):
    """A dependency (the log, the database) cannot take the call now; retry later."""

    status, code = 503, "unavailable"


class Unauthorized(ApiError):
    status, code = 401, "unauthorized"


class Forbidden(ApiError):
    status, code = 403, "forbidden"
