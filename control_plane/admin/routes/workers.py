"""Workers as the log describes them, and the operator's drain request."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query

from control_plane.admin import queries, services
from control_plane.admin.deps import Ctx, FilterStr, Limit, Offset, Operator, SessionDep, Viewer, WorkerIdPath
from control_plane.admin.routes.common import AUTH, errors, page
from control_plane.admin.shapes import ActionAccepted, DrainRequest, Page, WorkerDetail, WorkerPublic
from common.log.reader import LocatedEvent

router = APIRouter(prefix="/workers", tags=["workers"], responses=AUTH)


@router.get("", response_model=Page[WorkerPublic])
def list_workers(s: SessionDep, who: Viewer, limit: Limit = 50, offset: Offset = 0,
                 state: Annotated[Literal["ready", "draining", "gone", "unregistered"] | None, Query()] = None,
                 pool: FilterStr = None,
                 role: Annotated[Literal["prefill", "decode", "aggregated"] | None, Query()] = None):
    """Workers as the log describes them: newest incarnation, last load report, request counters."""
    items, total = queries.workers(s, state=state, pool=pool, role=role, limit=limit, offset=offset)
    return page(WorkerPublic, items, total, limit, offset)


@router.get("/{worker_id}", response_model=WorkerDetail, responses=errors(404))
def get_worker(worker_id: WorkerIdPath, s: SessionDep, c: Ctx, who: Viewer):
    """One worker with its incarnations and, from the prefix index folded from the log, the
    blocks it holds per tier."""
    return queries.worker_detail(s, c.live, worker_id)


@router.post("/{worker_id}/drain", response_model=ActionAccepted, status_code=202, responses=errors(404, 409, 503))
def drain_worker(worker_id: WorkerIdPath, s: SessionDep, c: Ctx, who: Operator, body: DrainRequest | None = None):
    """Ask for a worker to be drained: records ``WorkerDrainRequested`` (operator). The scaler
    owning the worker stops it gracefully; the worker reports ``WorkerDraining`` itself."""
    loc = services.request_drain(s, c, who, worker_id, body.reason if body else "")
    return accepted(loc)


def accepted(loc: LocatedEvent) -> ActionAccepted:
    """Where in the log an operator action was recorded, and as whom."""
    return ActionAccepted(event_id=loc.env.event_id, type=loc.env.type, topic=loc.topic, partition=loc.partition,
                          offset=loc.offset, actor=getattr(loc.env.data, "actor", ""))
