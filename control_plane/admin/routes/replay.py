"""Replay jobs: state at a point, verify a range, what-if under another router config."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from control_plane.admin import queries, services
from control_plane.admin.deps import Ctx, HexId, Limit, Offset, Operator, SessionDep, Viewer
from control_plane.admin.errors import NotFound
from control_plane.admin.routes.common import AUTH, errors, page
from control_plane.admin.shapes import Page, ReplayJobCreate, ReplayJobPublic, ReplayResultPublic

router = APIRouter(prefix="/replay/jobs", tags=["replay"], responses=AUTH)


@router.post("", response_model=ReplayJobPublic, status_code=202, responses=errors(503))
def start_job(body: ReplayJobCreate, s: SessionDep, c: Ctx, who: Operator):
    """Start a replay (state at a point, verify a range, what-if under another router config)
    in the background; poll ``GET /replay/jobs/{id}``."""
    return ReplayJobPublic.model_validate(services.start_replay_job(s, c, who, body), from_attributes=True)


@router.get("", response_model=Page[ReplayJobPublic])
def list_jobs(s: SessionDep, who: Viewer, limit: Limit = 50, offset: Offset = 0):
    rows, total = queries.jobs(s, limit, offset)
    return page(ReplayJobPublic, rows, total, limit, offset)


@router.get("/{job_id}", response_model=ReplayJobPublic, responses=errors(404))
def get_job(job_id: HexId, s: SessionDep, who: Viewer):
    return ReplayJobPublic.model_validate(queries.job(s, job_id), from_attributes=True)


@router.get("/{job_id}/result", response_model=ReplayResultPublic, responses=errors(404))
def get_result(job_id: HexId, s: SessionDep, who: Viewer):
    r = queries.job_result(s, job_id)
    return ReplayResultPublic(job_id=r.job_id, summary=r.summary, detail=r.detail, has_plot=r.plot_png is not None)


@router.get("/{job_id}/plot", response_class=Response, responses={
    **errors(404), 200: {"content": {"image/png": {}}, "description": "The result's figure (PNG)."}})
def get_plot(job_id: HexId, s: SessionDep, who: Viewer):
    r = queries.job_result(s, job_id)
    if r.plot_png is None:
        raise NotFound(f"replay job {job_id} has no figure")
    return Response(content=r.plot_png, media_type="image/png")
