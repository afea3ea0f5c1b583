"""The planner's scaling decisions, as the audit projection holds them."""

from __future__ import annotations

from fastapi import APIRouter

from control_plane.admin import queries
from control_plane.admin.deps import FilterStr, Limit, Offset, SessionDep, Viewer
from control_plane.admin.routes.common import AUTH, page
from control_plane.admin.shapes import Page, PlannerDecisionPublic

router = APIRouter(prefix="/planner", tags=["planner"], responses=AUTH)


@router.get("/decisions", response_model=Page[PlannerDecisionPublic])
def planner_decisions(s: SessionDep, who: Viewer, limit: Limit = 50, offset: Offset = 0, pool: FilterStr = None):
    """Scaling decisions, newest first, each with the ScalingApplied that followed it."""
    items, total = queries.planner_decisions(s, pool, limit, offset)
    return page(PlannerDecisionPublic, items, total, limit, offset)
