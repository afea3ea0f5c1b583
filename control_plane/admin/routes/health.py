"""``/health``: the only route without a token."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from control_plane.admin import queries
from control_plane.admin.deps import Ctx
from control_plane.admin.routes.common import errors
from control_plane.admin.shapes import Health

router = APIRouter()


@router.get("/health", response_model=Health, tags=["health"], responses=errors(503))
def health(c: Ctx) -> Health | JSONResponse:
    """Liveness and readiness (no token): database reachable, audit consumer progress."""
    body = queries.health(c.sessions, c.audit)
    if not body.database:
        # The same body, with a status a load balancer reads as not ready.
        return JSONResponse(status_code=503, content=body.model_dump())
    return body
