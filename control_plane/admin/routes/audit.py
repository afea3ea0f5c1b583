"""The audit projection: every event of the log, and one request's causal chain."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from control_plane.admin import queries
from control_plane.admin.deps import FilterStr, Limit, Offset, RequestIdPath, SessionDep, Viewer
from control_plane.admin.routes.common import AUTH, errors, page
from control_plane.admin.shapes import EventPublic, Page, RequestTrace

router = APIRouter(tags=["audit"], responses=AUTH)


@router.get("/requests/{request_id}/trace", response_model=RequestTrace, responses=errors(404))
def request_trace(request_id: RequestIdPath, s: SessionDep, who: Viewer):
    """The causal chain of one request across topics: admitted, routed (with the score
    table), prefill, KV transfer, completed / failed / rejected; and what is missing."""
    return queries.trace(s, request_id)


@router.get("/events", response_model=Page[EventPublic])
def list_events(s: SessionDep, who: Viewer, limit: Limit = 50, offset: Offset = 0,
                type: Annotated[str | None, Query(max_length=64, pattern=r"^[A-Za-z]*$")] = None,
                request_id: FilterStr = None, worker_id: FilterStr = None, pool: FilterStr = None,
                decision_id: FilterStr = None,
                since_ns: Annotated[int | None, Query(ge=0, le=2**63 - 1)] = None):
    """The audit projection: every event, newest first, filtered by type, request, worker,
    pool, decision or time."""
    items, total = queries.events(s, type_=type, request_id=request_id, worker_id=worker_id, pool=pool,
                                  decision_id=decision_id, since_ns=since_ns, limit=limit, offset=offset)
    return page(EventPublic, items, total, limit, offset)
