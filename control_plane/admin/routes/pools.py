"""Pools: SLO targets, replica bounds, GPU budget and pins (operator actions on the ``admin`` stream)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from control_plane.admin import queries, services
from control_plane.admin.deps import Ctx, Limit, Offset, Operator, PoolPath, SessionDep, Viewer
from control_plane.admin.routes.common import AUTH, errors, page
from control_plane.admin.shapes import Page, PinUpdate, PoolPublic, PoolUpdate

router = APIRouter(prefix="/pools", tags=["pools"], responses=AUTH)


@router.get("", response_model=Page[PoolPublic])
def list_pools(s: SessionDep, who: Viewer, limit: Limit = 50, offset: Offset = 0):
    items, total = queries.pools(s, limit, offset)
    return page(PoolPublic, items, total, limit, offset)


@router.get("/{name}", response_model=PoolPublic, responses=errors(404))
def get_pool(name: PoolPath, s: SessionDep, who: Viewer):
    return queries.pool(s, name)


@router.put("/{name}", response_model=PoolPublic, responses=errors(409, 503))
def put_pool(name: PoolPath, body: PoolUpdate, s: SessionDep, c: Ctx, who: Operator):
    """Set a pool's role, SLO targets, replica bounds and GPU budget (``PoolUpdated``)."""
    return queries.pool_row(s, services.update_pool(s, c, who, name, body))


@router.put("/{name}/pin", response_model=PoolPublic, responses=errors(404, 503))
def pin_pool(name: PoolPath, body: PinUpdate, s: SessionDep, c: Ctx, who: Operator):
    """Hold a pool at a size; the planner stops deciding it (``PoolPinned``)."""
    return queries.pool_row(s, services.pin_pool(s, c, who, name, body))


@router.delete("/{name}/pin", response_model=PoolPublic, responses=errors(404, 503))
def unpin_pool(name: PoolPath, s: SessionDep, c: Ctx, who: Operator,
               reason: Annotated[str, Query(max_length=2000, pattern=r"^[^\x00]*$")] = ""):
    """Release a pin: the planner decides the pool's size again (``PoolPinned(replicas=null)``)."""
    return queries.pool_row(s, services.pin_pool(s, c, who, name, None, reason))
