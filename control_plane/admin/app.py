"""The admin API (FastAPI): workers, pools, configs, planner decisions, the index, request traces,
replay jobs, tokens and the router's API keys.

:func:`create_app` assembles the per-resource routers of :mod:`control_plane.admin.routes` with
the lifespan and the exception handlers. Routes parse, check the caller's role (``deps``), and
call a query (``queries``) or an operator action (``services``); they never touch tables
themselves. Every mutating call is recorded in the log as an event naming its caller. Errors are
JSON ``{"error": {"message", "code"}}``; lists are paginated with ``limit``/``offset`` and return
``total``. ``/health`` is the only route without a token; the OpenAPI schema is served at
``/openapi.json``.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from control_plane.admin import services
from control_plane.admin.console import mount
from control_plane.admin.context import AdminContext
from control_plane.admin.errors import ApiError
from control_plane.admin.routes import (
    audit,
    configs,
    health,
    index,
    planner,
    pools,
    replay,
    router_keys,
    tokens,
    workers,
)
from control_plane.admin.routes.common import api_error_response, error_response

log = logging.getLogger(__name__)


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
    for exc_type, handler in _EXCEPTION_HANDLERS:
        app.add_exception_handler(exc_type, handler)
    # In this order, which is the order of the OpenAPI schema's paths.
    for router in (health.router, tokens.caller, workers.router, pools.router, *configs.routers(), planner.router,
                   index.router, audit.router, replay.router, tokens.router, router_keys.router):
        app.include_router(router)

    mount(app)  # the operator console at /console, and GET /doctor
    return app


# -- errors: every one is JSON {"error": {"message", "code"}} -------------------------------------


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    parts = []
    for e in exc.errors():
        loc = ".".join(str(x) for x in e.get("loc", ()))
        parts.append(f"{loc}: {e.get('msg')}")
    return error_response(422, "; ".join(parts)[:4000] or "invalid request", "invalid_request")


async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {400: "invalid_body", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return error_response(exc.status_code, str(exc.detail), code)


async def _db_down(request: Request, exc: OperationalError) -> JSONResponse:
    log.warning("database unavailable: %s", exc)
    return error_response(503, "the admin database is unavailable", "unavailable")


async def _bug(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(500, f"internal error: {type(exc).__name__}", "internal")


_EXCEPTION_HANDLERS = (
    (ApiError, api_error_response),
    (RequestValidationError, _invalid),
    (StarletteHTTPException, _http),
    (OperationalError, _db_down),
    (Exception, _bug),
)
