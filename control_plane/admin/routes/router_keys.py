"""``/router-keys``: the router's API keys (admin). Issued and revoked as events on the log
(``RouterKeyIssued``, ``RouterKeyRevoked``), which every router folds into its key table."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from control_plane.admin import queries, services
from control_plane.admin.deps import Admin, Ctx, HexId, Limit, Offset, SessionDep
from control_plane.admin.routes.common import AUTH, errors, page
from control_plane.admin.shapes import Page, RouterKeyCreate, RouterKeyCreated, RouterKeyPublic

router = APIRouter(prefix="/router-keys", tags=["router keys"], responses=AUTH)


@router.get("", response_model=Page[RouterKeyPublic])
def list_router_keys(s: SessionDep, who: Admin, limit: Limit = 50, offset: Offset = 0,
                     include_revoked: Annotated[bool, Query(description="Revoked keys too.")] = False):
    rows, total = queries.router_keys(s, limit, offset, include_revoked)
    return page(RouterKeyPublic, rows, total, limit, offset)


@router.post("", response_model=RouterKeyCreated, status_code=201, responses=errors(409, 503))
def issue_router_key(body: RouterKeyCreate, s: SessionDep, c: Ctx, who: Admin):
    """Issue a router API key (admin; ``RouterKeyIssued``). The response carries the key once;
    the log and the store keep only its salted hash. 409 while a live key has the name."""
    row, key = services.issue_router_key(s, c, who, body)
    return RouterKeyCreated(**RouterKeyPublic.model_validate(row, from_attributes=True).model_dump(), key=key)


@router.delete("/{key_id}", response_model=RouterKeyPublic, responses=errors(404, 503))
def revoke_router_key(key_id: HexId, s: SessionDep, c: Ctx, who: Admin,
                      reason: Annotated[str, Query(max_length=2000, pattern=r"^[^\x00]*$")] = ""):
    """Revoke a router API key (admin; ``RouterKeyRevoked``): the routers refuse it within their
    fold's latency. Revoking a revoked key changes nothing."""
    return RouterKeyPublic.model_validate(services.revoke_router_key(s, c, who, key_id, reason), from_attributes=True)
