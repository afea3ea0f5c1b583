"""What every router shares: the documented error responses and the page shape."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from control_plane.admin.errors import ApiError
from control_plane.admin.shapes import ErrorBody, Page

M = TypeVar("M", bound=BaseModel)

#: Why each error status can answer, as the OpenAPI schema tells clients.
_WHY = {400: "The body is not parseable (not JSON, or not UTF-8)", 401: "Missing or invalid bearer token",
        403: "The token's role is too weak", 404: "Not found", 409: "Conflicts with the current state",
        422: "Invalid input", 429: "Too many failed authentications; retry after Retry-After seconds", 503: "The log or the database cannot take the call now"}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` of a route or router: each status with the error body it carries."""
    return {c: {"model": ErrorBody, "description": _WHY[c]} for c in codes}


def error_response(status: int, message: str, code: str, headers: dict | None = None) -> JSONResponse:
    """The one error body of the API: ``{"error": {"message", "code"}}``."""
    return JSONResponse(status_code=status, content={"error": {"message": message, "code": code}}, headers=headers)


async def api_error_response(request: Request, exc: ApiError) -> JSONResponse:
    """The API's answer to an :class:`ApiError` (the app's and the console's handler)."""
    return error_response(exc.status, exc.message, exc.code, exc.headers)


#: What any route behind a token can answer besides its own errors.
AUTH = errors(400, 401, 403, 422, 429)


def page(shape: type[M], rows: Iterable[Any], total: int, limit: int, offset: int) -> Page[M]:
    """One page of ``shape``, from table rows or from shapes already built."""
    return Page[shape](items=[shape.model_validate(r, from_attributes=True) for r in rows],  # type: ignore[valid-type]
                       total=total, limit=limit, offset=offset)
