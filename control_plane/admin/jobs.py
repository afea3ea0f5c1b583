"""Running a replay job in the background: the same :class:`ReplayEngine` as the CLI, reading the
log through its own reader, reporting progress into the job row and storing the result.

A failed job's row says why in one line (:func:`public_error`), which any viewer reads: never a
traceback, a server path or a driver's message. The traceback goes to the server's log, under
the job id the line names."""

from __future__ import annotations

import logging
import re
import threading
import time

import msgspec

from control_plane.admin.context import AdminContext
from control_plane.admin.db.models import ReplayJob, ReplayResult, utcnow
from control_plane.admin.queries import jsonable
from control_plane.replay import plot
from control_plane.replay.engine import ReplayEngine
from control_plane.replay.errors import ReplayError
from control_plane.router import RouterConfig

log = logging.getLogger(__name__)

#: Mismatches/examples kept in a stored result (the summary counts them all).
MAX_DETAIL_ITEMS = 200


class _JobProgress:
    """Progress bars that write ``stage`` and ``progress`` into the job row, at most once a second."""

    def __init__(self, ctx: AdminContext, job_id: str) -> None:
        self.ctx = ctx
        self.job_id = job_id
        self._last = 0.0
        self._lock = threading.Lock()

    def factory(self, desc: str, total: int | None):
        outer = self

        class Bar:
            n = 0

            def update(self, k: int = 1) -> None:
                self.n += k
                now = time.monotonic()
                if now - outer._last >= 1.0:
                    outer._last = now
                    outer._write(desc, self.n / total if total else 0.0)

            def close(self) -> None:
                outer._write(desc, 1.0)

        return Bar()

    def _write(self, stage: str, progress: float) -> None:
        with self._lock:
            try:
                with self.ctx.sessions.begin() as s:
                    job = s.get(ReplayJob, self.job_id)
                    if job is not None:
                        job.stage = stage[:64]
                        job.progress = max(0.0, min(progress, 1.0))
            except Exception as e:  # progress is best effort; the job goes on
                log.debug("progress of job %s not written: %s", self.job_id, e)


def run_job(ctx: AdminContext, job_id: str) -> None:
    with ctx.sessions.begin() as s:
        job = s.get(ReplayJob, job_id)
        job.status, job.started_at = "running", utcnow()
        kind, params = job.kind, dict(job.params)
    reader = ctx.reader_factory()
    progress = _JobProgress(ctx, job_id)
    try:
        engine = ReplayEngine(reader, ctx.catalog, progress=progress.factory)
        summary, detail, png = _execute(engine, ctx, kind, params)
        with ctx.sessions.begin() as s:
            s.add(ReplayResult(job_id=job_id, summary=jsonable(summary), detail=jsonable(detail), plot_png=png))
            job = s.get(ReplayJob, job_id)
            job.status, job.finished_at, job.progress, job.stage = "succeeded", utcnow(), 1.0, "done"
    except Exception as e:
        log.exception("replay job %s failed", job_id)
        with ctx.sessions.begin() as s:
            job = s.get(ReplayJob, job_id)
            job.status, job.finished_at = "failed", utcnow()
            job.error = public_error(e, job_id)
    finally:
        close = getattr(reader, "close", None)
        if close:
            close()


#: Absolute paths (two components or more), as they appear in messages of the standard library.
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[/\\][\w.@+-]+){2,}[/\\]?")


def public_error(e: BaseException, job_id: str) -> str:
    """One line a viewer may read. The replay package's own errors say what was wrong with the
    job (a point not in the log, a request never routed); their first line is kept, with paths
    cut out. Anything else is a bug or a driver failure, named only by its type."""
    where = f"(details in the admin server's log, job {job_id})"
    if isinstance(e, ReplayError):
        first = (str(e).strip().splitlines() or [""])[0]
        return f"{type(e).__name__}: {_PATH.sub('<path>', first)[:300]} {where}"
    return f"replay failed: internal error ({type(e).__name__}) {where}"


def _execute(engine: ReplayEngine, ctx: AdminContext, kind: str, params: dict):
    s = ctx.settings
    if kind == "state":
        state, _ = engine.state(params["at"], hash_algo=params.get("hash_algo", s.hash_algo),
                                block_size=params.get("block_size", s.block_size))
        v = state["view"]
        summary = {"at": state["at"], "point": state["point"], "applied": v["applied"],
                   "distinct_hashes": v["distinct_hashes"], "digest": v["digest"], "workers": len(v["workers"]),
                   "stale_workers": v["stale_workers"], "snapshot": state["snapshot"], "seconds": state["seconds"]}
        return summary, state, plot.plot_state(state)
    if kind == "verify":
        report = engine.verify(params["from"], params["to"], keep_checks=True)
        detail = {"mismatches": msgspec.to_builtins(report.mismatches[:MAX_DETAIL_ITEMS])}
        return report.summary(), detail, plot.plot_verify(report)
    if kind == "whatif":
        alt = msgspec.convert(params["router_config"], RouterConfig)
        report = engine.whatif(params["from"], params["to"], alt, simulate=params.get("simulate", True))
        detail = {"examples": msgspec.to_builtins(report.examples[:MAX_DETAIL_ITEMS]),
                  "simulation": {k: v for k, v in (report.simulation or {}).items() if k != "ttft_ms"}}
        return report.summary(), detail, plot.plot_whatif(report)
    raise ValueError(f"unknown replay job kind {kind!r}")
