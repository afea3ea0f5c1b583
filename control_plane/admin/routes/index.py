"""The prefix index and worker registry, folded from the log (:mod:`control_plane.admin.liveview`)."""

from __future__ import annotations

from fastapi import APIRouter

from control_plane.admin import queries
from control_plane.admin.deps import Ctx, Viewer
from control_plane.admin.routes.common import errors
from control_plane.admin.shapes import IndexStats, OverlapQuery, OverlapResult

#: Every index route can answer 503: the process may have no view of the log.
router = APIRouter(prefix="/index", tags=["index"], responses=errors(400, 401, 403, 422, 429, 503))


@router.get("/stats", response_model=IndexStats)
def index_stats(c: Ctx, who: Viewer, digest: bool = False):
    """The prefix index and worker registry folded from the log (newest router snapshot plus
    the tail, caught up on demand): residency per worker and tier, stale workers, positions."""
    return queries.index_stats(c.live, digest)


@router.post("/overlap", response_model=OverlapResult)
def index_overlap(body: OverlapQuery, c: Ctx, who: Viewer):
    """Which workers hold how much of a prompt's prefix, per tier (read-only; POST carries the
    prompt). Text is tokenized like the router's default ``hash`` tokenizer."""
    return queries.overlap(c.live, c.settings.hash_algo, c.settings.block_size, body)
