"""The admin API (FastAPI): workers, pools, configs, planner decisions, the index, request traces,
replay jobs and tokens.

Routes parse, check the caller's role (``deps``), and call a query (``queries``) or an operator
action (``services``); they never touch tables themselves. Every mutating call is recorded in
the log as an event naming its caller. Errors are JSON ``{"error": {"message", "code"}}``; lists
are paginated with ``limit``/``offset`` and return ``total``. ``/health`` is the only route
without a token; the OpenAPI schema is served at ``/openapi.json``.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal

from fastapi import APIRouter, FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy import text
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from control_plane.api import queries, services
from control_plane.api.context import AdminContext
from control_plane.api.deps import Admin, Ctx, Limit, Offset, Operator, SessionDep, Viewer
from control_plane.api.errors import ApiError, NotFound, Unavailable
from control_plane.api.shapes import (
    ActionAccepted,
    ConfigVersionPublic,
    DrainRequest,
    ErrorBody,
    EventPublic,
    Health,
    IndexStats,
    OverlapQuery,
    OverlapResult,
    Page,
    PinUpdate,
    PlannerConfigUpdate,
    PlannerDecisionPublic,
    PoolPublic,
    PoolUpdate,
    ReplayJobCreate,
    ReplayJobPublic,
    ReplayResultPublic,
    RequestTrace,
    RouterConfigUpdate,
    TokenCreate,
    TokenCreated,
    TokenPublic,
    WhoAmI,
    WorkerDetail,
    WorkerOverlapPublic,
    WorkerPublic,
)

log = logging.getLogger(__name__)

WorkerIdPath = Annotated[str, Path(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f/]+$")]
RequestIdPath = Annotated[str, Path(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f/]+$")]
PoolPath = Annotated[str, Path(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
VersionPath = Annotated[int, Path(ge=1, le=2**31 - 1)]
HexId = Annotated[str, Path(min_length=1, max_length=32, pattern=r"^[0-9a-f]+$")]
FilterStr = Annotated[str | None, Query(max_length=256, pattern=r"^[^\x00-\x1f]*$")]


def _r(*codes: int) -> dict[int | str, dict[str, Any]]:
    text_ = {400: "The body is not parseable (not JSON, or not UTF-8)", 401: "Missing or invalid bearer token", 403: "The token's role is too weak",
             404: "Not found", 409: "Conflicts with the current state", 422: "Invalid input",
             503: "The log or the database cannot take the call now"}
    return {c: {"model": ErrorBody, "description": text_[c]} for c in codes}


AUTH = _r(400, 401, 403, 422)


def _err(status: int, message: str, code: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "code": code}}, headers=headers)


def _accepted(loc) -> ActionAccepted:
    return ActionAccepted(event_id=loc.env.event_id, type=loc.env.type, topic=loc.topic, partition=loc.partition,
                          offset=loc.offset, actor=getattr(loc.env.data, "actor", ""))


def create_app(ctx: AdminContext) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        with ctx.sessions() as s:
            services.fail_interrupted_jobs(s)
        if ctx.audit is not None:
            ctx.audit.start()
        try:
            yield
        finally:
            if ctx.audit is not None:
                ctx.audit.stop()
            for fn in ctx.on_close:
                fn()

    app = FastAPI(title="Switchyard admin API", version="0.1.0", lifespan=lifespan,
                  description="Operate a Switchyard deployment: workers, pools, router and planner configs, the "
                              "prefix index, request traces and replay jobs. The Kafka log is the source of truth; "
                              "every change made here is recorded in it as an event naming the caller.")
    app.state.ctx = ctx

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return _err(exc.status, exc.message, exc.code, headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        parts = []
        for e in exc.errors():
            loc = ".".join(str(x) for x in e.get("loc", ()))
            parts.append(f"{loc}: {e.get('msg')}")
        return _err(422, "; ".join(parts)[:4000] or "invalid request", "invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        code = {400: "invalid_body", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return _err(exc.status_code, str(exc.detail), code)

    @app.exception_handler(OperationalError)
    async def _db_down(request: Request, exc: OperationalError):
        log.warning("database unavailable: %s", exc)
        return _err(503, "the admin database is unavailable", "unavailable")

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return _err(500, f"internal error: {type(exc).__name__}", "internal")

    @app.get("/health", response_model=Health, tags=["health"], responses=_r(503))
    def health(c: Ctx) -> Health | JSONResponse:
        """Liveness and readiness (no token): database reachable, audit consumer progress."""
        db_ok = True
        try:
            with c.sessions() as s:
                s.execute(text("SELECT 1"))
        except Exception:
            db_ok = False
        audit: dict[str, Any] = {"enabled": c.audit is not None}
        if c.audit is not None:
            audit.update(batches=c.audit.batches, events=c.audit.totals.inserted,
                         duplicates=c.audit.totals.duplicates, last_error=c.audit.last_error)
        body = Health(status="ok" if db_ok else "degraded", database=db_ok, audit=audit)
        if not db_ok:
            return JSONResponse(status_code=503, content=body.model_dump())
        return body

    @app.get("/whoami", response_model=WhoAmI, tags=["tokens"], responses=_r(401, 403))
    def whoami(who: Viewer) -> WhoAmI:
        return WhoAmI(token_id=who.token_id, name=who.name, role=who.role.value)

    # -- workers -------------------------------------------------------------------------------
    workers = APIRouter(prefix="/workers", tags=["workers"], responses=AUTH)

    @workers.get("", response_model=Page[WorkerPublic])
    def list_workers(s: SessionDep, who: Viewer, limit: Limit = 50, offset: Offset = 0,
                     state: Annotated[Literal["ready", "draining", "gone", "unregistered"] | None, Query()] = None,
                     pool: FilterStr = None,
                     role: Annotated[Literal["prefill", "decode", "aggregated"] | None, Query()] = None):
        """Workers as the log describes them: newest incarnation, last load report, request counters."""
        items, total = queries.workers(s, state=state, pool=pool, role=role, limit=limit, offset=offset)
        return Page[WorkerPublic](items=items, total=total, limit=limit, offset=offset)

    @workers.get("/{worker_id}", response_model=WorkerDetail, responses=_r(404))
    def get_worker(worker_id: WorkerIdPath, s: SessionDep, c: Ctx, who: Viewer):
        """One worker with its incarnations and, from the prefix index folded from the log, the
        blocks it holds per tier."""
        w, incs = queries.worker(s, worker_id)
        blocks: dict[str, int] = {}
        stale = False
        if c.live is not None:
            with c.live.read() as view:
                blocks = queries.index_blocks(view).get(worker_id, {})
                stale = worker_id in view.stale_workers()
        return WorkerDetail(**w.model_dump(), incarnations=incs, blocks=blocks, stale=stale)

    @workers.post("/{worker_id}/drain", response_model=ActionAccepted, status_code=202, responses=_r(404, 409, 503))
    def drain_worker(worker_id: WorkerIdPath, s: SessionDep, c: Ctx, who: Operator, body: DrainRequest | None = None):
        """Ask for a worker to be drained: records ``WorkerDrainRequested`` (operator). The scaler
        owning the worker stops it gracefully; the worker reports ``WorkerDraining`` itself."""
        loc = services.request_drain(s, c, who, worker_id, body.reason if body else "")
        return _accepted(loc)

    app.include_router(workers)

    # -- pools ---------------------------------------------------------------------------------
    pools = APIRouter(prefix="/pools", tags=["pools"], responses=AUTH)

    @pools.get("", response_model=Page[PoolPublic])
    def list_pools(s: SessionDep, who: Viewer, limit: Limit = 50, offset: Offset = 0):
        items, total = queries.pools(s, limit, offset)
        return Page[PoolPublic](items=items, total=total, limit=limit, offset=offset)

    @pools.get("/{name}", response_model=PoolPublic, responses=_r(404))
    def get_pool(name: PoolPath, s: SessionDep, who: Viewer):
        return queries.pool(s, name)

    @pools.put("/{name}", response_model=PoolPublic, responses=_r(409, 503))
    def put_pool(name: PoolPath, body: PoolUpdate, s: SessionDep, c: Ctx, who: Operator):
        """Set a pool's role, SLO targets, replica bounds and GPU budget (``PoolUpdated``)."""
        return queries.pool_row(s, services.update_pool(s, c, who, name, body))

    @pools.put("/{name}/pin", response_model=PoolPublic, responses=_r(404, 503))
    def pin_pool(name: PoolPath, body: PinUpdate, s: SessionDep, c: Ctx, who: Operator):
        """Hold a pool at a size; the planner stops deciding it (``PoolPinned``)."""
        return queries.pool_row(s, services.pin_pool(s, c, who, name, body))

    @pools.delete("/{name}/pin", response_model=PoolPublic, responses=_r(404, 503))
    def unpin_pool(name: PoolPath, s: SessionDep, c: Ctx, who: Operator):
        """Release a pin: the planner decides the pool's size again (``PoolPinned(replicas=null)``)."""
        return queries.pool_row(s, services.pin_pool(s, c, who, name, None))

    app.include_router(pools)

    # -- configs -------------------------------------------------------------------------------
    for kind in ("router", "planner"):
        app.include_router(_config_router(kind))

    # -- planner -------------------------------------------------------------------------------
    planner = APIRouter(prefix="/planner", tags=["planner"], responses=AUTH)

    @planner.get("/decisions", response_model=Page[PlannerDecisionPublic])
    def planner_decisions(s: SessionDep, who: Viewer, limit: Limit = 50, offset: Offset = 0,
                          pool: FilterStr = None):
        """Scaling decisions, newest first, each with the ScalingApplied that followed it."""
        items, total = queries.planner_decisions(s, pool, limit, offset)
        return Page[PlannerDecisionPublic](items=items, total=total, limit=limit, offset=offset)

    app.include_router(planner)

    # -- index ---------------------------------------------------------------------------------
    index = APIRouter(prefix="/index", tags=["index"], responses=_r(400, 401, 403, 422, 503))

    @index.get("/stats", response_model=IndexStats)
    def index_stats(c: Ctx, who: Viewer, digest: bool = False):
        """The prefix index and worker registry folded from the log (newest router snapshot plus
        the tail, caught up on demand): residency per worker and tier, stale workers, positions."""
        live = _live(c)
        with live.read() as view:
            st = view.index.stats()
            return IndexStats(hash_algo=view.hash_algo, block_size=view.block_size, distinct_hashes=st.distinct_hashes,
                              applied=view.applied, age_ms=live.age_ms, stale_workers=view.stale_workers(),
                              deregistered=list(st.deregistered), blocks=queries.index_blocks(view),
                              counters=st.counters,
                              positions={f"{t}:{p}": o for (t, p), o in sorted(view.positions.items())},
                              digest=view.digest() if digest else None)

    @index.post("/overlap", response_model=OverlapResult)
    def index_overlap(body: OverlapQuery, c: Ctx, who: Viewer):
        """Which workers hold how much of a prompt's prefix, per tier (read-only; POST carries the
        prompt). Text is tokenized like the router's default ``hash`` tokenizer."""
        from control_plane.index.hashing import HashAlgo, HashConfig, hash_blocks
        from control_plane.tokenizer import HashTokenizer

        live = _live(c)
        tokens = body.tokens if body.tokens is not None else HashTokenizer().encode(body.prompt or "")
        cfg = HashConfig(HashAlgo(c.settings.hash_algo), c.settings.block_size)
        hashes = hash_blocks(tokens, cfg)
        rows = []
        with live.read() as view:
            for wid, m in view.matches(hashes).items():
                w = view.workers.get(wid)
                rows.append(WorkerOverlapPublic(
                    worker_id=wid, matched_blocks=m.depth, matched_tokens=m.depth * cfg.block_size,
                    by_tier={t.value: n for t, n in m.tier_counts().items() if n}, stale=m.stale,
                    role=w.role if w else None, state=w.state if w else None))
        rows.sort(key=lambda r: (-r.matched_blocks, r.worker_id))
        return OverlapResult(tokens=len(tokens), blocks=len(hashes), hash_algo=cfg.hash_algo,
                             block_size=cfg.block_size, workers=rows)

    app.include_router(index)

    # -- requests and events -------------------------------------------------------------------
    audit = APIRouter(tags=["audit"], responses=AUTH)

    @audit.get("/requests/{request_id}/trace", response_model=RequestTrace, responses=_r(404))
    def request_trace(request_id: RequestIdPath, s: SessionDep, who: Viewer):
        """The causal chain of one request across topics: admitted, routed (with the score
        table), prefill, KV transfer, completed / failed / rejected; and what is missing."""
        return queries.trace(s, request_id)

    @audit.get("/events", response_model=Page[EventPublic])
    def list_events(s: SessionDep, who: Viewer, limit: Limit = 50, offset: Offset = 0,
                    type: Annotated[str | None, Query(max_length=64, pattern=r"^[A-Za-z]*$")] = None,
                    request_id: FilterStr = None, worker_id: FilterStr = None, pool: FilterStr = None,
                    decision_id: FilterStr = None,
                    since_ns: Annotated[int | None, Query(ge=0, le=2**63 - 1)] = None):
        """The audit projection: every event, newest first, filtered by type, request, worker,
        pool, decision or time."""
        items, total = queries.events(s, type_=type, request_id=request_id, worker_id=worker_id, pool=pool,
                                      decision_id=decision_id, since_ns=since_ns, limit=limit, offset=offset)
        return Page[EventPublic](items=items, total=total, limit=limit, offset=offset)

    app.include_router(audit)

    # -- replay jobs ---------------------------------------------------------------------------
    replay = APIRouter(prefix="/replay/jobs", tags=["replay"], responses=AUTH)

    @replay.post("", response_model=ReplayJobPublic, status_code=202, responses=_r(503))
    def start_job(body: ReplayJobCreate, s: SessionDep, c: Ctx, who: Operator):
        """Start a replay (state at a point, verify a range, what-if under another router config)
        in the background; poll ``GET /replay/jobs/{id}``."""
        return ReplayJobPublic.model_validate(services.start_replay_job(s, c, who, body), from_attributes=True)

    @replay.get("", response_model=Page[ReplayJobPublic])
    def list_jobs(s: SessionDep, who: Viewer, limit: Limit = 50, offset: Offset = 0):
        rows, total = queries.jobs(s, limit, offset)
        return Page[ReplayJobPublic](items=[ReplayJobPublic.model_validate(r, from_attributes=True) for r in rows],
                                     total=total, limit=limit, offset=offset)

    @replay.get("/{job_id}", response_model=ReplayJobPublic, responses=_r(404))
    def get_job(job_id: HexId, s: SessionDep, who: Viewer):
        return ReplayJobPublic.model_validate(queries.job(s, job_id), from_attributes=True)

    @replay.get("/{job_id}/result", response_model=ReplayResultPublic, responses=_r(404))
    def get_result(job_id: HexId, s: SessionDep, who: Viewer):
        r = queries.job_result(s, job_id)
        return ReplayResultPublic(job_id=r.job_id, summary=r.summary, detail=r.detail, has_plot=r.plot_png is not None)

    @replay.get("/{job_id}/plot", response_class=Response, responses={
        **_r(404), 200: {"content": {"image/png": {}}, "description": "The result's figure (PNG)."}})
    def get_plot(job_id: HexId, s: SessionDep, who: Viewer):
        r = queries.job_result(s, job_id)
        if r.plot_png is None:
            raise NotFound(f"replay job {job_id} has no figure")
        return Response(content=r.plot_png, media_type="image/png")

    app.include_router(replay)

    # -- tokens --------------------------------------------------------------------------------
    tokens = APIRouter(prefix="/tokens", tags=["tokens"], responses=AUTH)

    @tokens.get("", response_model=Page[TokenPublic])
    def list_tokens(s: SessionDep, who: Admin, limit: Limit = 50, offset: Offset = 0):
        rows, total = queries.tokens(s, limit, offset)
        return Page[TokenPublic](items=[TokenPublic.model_validate(r, from_attributes=True) for r in rows],
                                 total=total, limit=limit, offset=offset)

    @tokens.post("", response_model=TokenCreated, status_code=201, responses=_r(409, 503))
    def create_token(body: TokenCreate, s: SessionDep, c: Ctx, who: Admin):
        """Issue a token (admin). The response carries the token once; only its hash is kept."""
        row, token = services.create_token(s, c, who, body)
        return TokenCreated(**TokenPublic.model_validate(row, from_attributes=True).model_dump(), token=token)

    @tokens.delete("/{token_id}", response_model=TokenPublic, responses=_r(404, 503))
    def revoke_token(token_id: HexId, s: SessionDep, c: Ctx, who: Admin):
        return TokenPublic.model_validate(services.revoke_token(s, c, who, token_id), from_attributes=True)

    app.include_router(tokens)
    return app


def _live(c: AdminContext):
    if c.live is None:
        raise Unavailable("this admin process has no view of the log (started without a broker)")
    return c.live


def _config_router(kind: str) -> APIRouter:
    r = APIRouter(prefix=f"/{kind}-config", tags=["configs"], responses=AUTH)
    Body = RouterConfigUpdate if kind == "router" else PlannerConfigUpdate
    event = "RouterConfigChanged" if kind == "router" else "PlannerConfigChanged"

    def current(s: SessionDep, who: Viewer):
        return ConfigVersionPublic.model_validate(queries.config_version(s, kind, None), from_attributes=True)

    def versions(s: SessionDep, who: Viewer, limit: Limit = 50, offset: Offset = 0):
        rows, total = queries.config_versions(s, kind, limit, offset)
        return Page[ConfigVersionPublic](items=[ConfigVersionPublic.model_validate(x, from_attributes=True)
                                                for x in rows], total=total, limit=limit, offset=offset)

    def one(version: VersionPath, s: SessionDep, who: Viewer):
        return ConfigVersionPublic.model_validate(queries.config_version(s, kind, version), from_attributes=True)

    def put(body: Body, s: SessionDep, c: Ctx, who: Operator):  # type: ignore[valid-type]
        fn = services.put_router_config if kind == "router" else services.put_planner_config
        return ConfigVersionPublic.model_validate(fn(s, c, who, body), from_attributes=True)

    put.__annotations__["body"] = Body  # a closure variable: give FastAPI the class itself
    current.__doc__ = f"The newest {kind} config version."
    versions.__doc__ = f"Every {kind} config version, newest first."
    put.__doc__ = (f"Record the next {kind} config version ({event}); 409 when ``expected_version`` "
                   "is not the current one, 422 when the config breaks a rule (the message says which).")
    r.add_api_route("", current, methods=["GET"], response_model=ConfigVersionPublic, responses=_r(404),
                    name=f"get_{kind}_config")
    r.add_api_route("/versions", versions, methods=["GET"], response_model=Page[ConfigVersionPublic],
                    name=f"list_{kind}_config_versions")
    r.add_api_route("/versions/{version}", one, methods=["GET"], response_model=ConfigVersionPublic,
                    responses=_r(404), name=f"get_{kind}_config_version")
    r.add_api_route("", put, methods=["PUT"], response_model=ConfigVersionPublic, responses=_r(409, 503),
                    name=f"put_{kind}_config")
    return r
