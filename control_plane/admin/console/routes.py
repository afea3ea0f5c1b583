"""The console's routes (see the package docstring). Each page reads through the admin API's
queries (:mod:`control_plane.admin.queries`) and actions (:mod:`control_plane.admin.services`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote

import msgspec
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from control_plane.admin import queries, services
from control_plane.admin.auth import Principal, Role
from control_plane.admin.console import doctor, views
from control_plane.admin.console import dashboards as dash
from control_plane.admin.context import AdminContext
from control_plane.admin.db.models import AuditEvent, RouterConfigVersion, Worker
from control_plane.admin.deps import Ctx, Viewer, current_principal
from control_plane.admin.errors import ApiError, NotFound
from control_plane.admin.routes.common import AUTH, api_error_response, errors
from control_plane.admin.shapes import PinUpdate
from control_plane.replay.engine import ConfigBook
from control_plane.router import RouterConfig
from common.stack_settings import StackSettings
from common.settings import worker_credential
from schemas.types import RoutingMode

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
COOKIE = "sy_console"
#: No inline script or style anywhere: scripts and styles come from /console/static only.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                    "Referrer-Policy": "no-referrer", "Cache-Control": "no-store"}
#: How long one fleet event stream stays open (the browser's EventSource reconnects).
STREAM_S = 300.0
STREAM_EVERY_S = 1.0

templates = Jinja2Templates(directory=str(HERE / "templates"))
templates.env.filters["ns_time"] = lambda ns: (datetime.fromtimestamp(ns / 1e9, timezone.utc)
                                               .strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z") if ns else "-"
templates.env.filters["num"] = lambda x, d=2: "-" if x is None else (f"{x:,.{d}f}" if isinstance(x, float) else f"{x:,}")

router = APIRouter(prefix="/console", include_in_schema=False)
api = APIRouter(tags=["doctor"], responses={**AUTH, **errors(503)})


class LoginRequired(Exception):
    def __init__(self, why: str = "") -> None:
        self.why = why


class PageError(Exception):
    def __init__(self, status: int, message: str) -> None:
        self.status, self.message = status, message


def _ctx(request: Request) -> AdminContext:
    return request.app.state.ctx


def user(request: Request) -> Principal:
    """The console caller: the cookie's token, authenticated by the API's own dependency."""
    token = request.cookies.get(COOKIE)
    if not token:
        raise LoginRequired()
    try:
        return current_principal(request, _ctx(request), HTTPAuthorizationCredentials(scheme="Bearer",
                                                                                       credentials=token))
    except ApiError as e:
        raise LoginRequired(e.message) from None


def operator(request: Request) -> Principal:
    who = user(request)
    if not who.role.allows(Role.OPERATOR):
        raise PageError(403, f"{who.name} is {who.role.value}; this needs operator")
    return who


def page(request: Request, template: str, who: Principal | None, status: int = 200, **data: Any) -> HTMLResponse:
    return templates.TemplateResponse(request, template, {"who": who, "nav": template.split(".")[0], **data},
                                      status_code=status, headers=SECURITY_HEADERS)


async def _form(request: Request) -> dict[str, str]:
    body = (await request.body()).decode("utf-8", "replace")
    return {k: v[0] for k, v in parse_qs(body, keep_blank_values=True).items()}


# -- login ----------------------------------------------------------------------------------------


@router.get("")
def home() -> RedirectResponse:
    return RedirectResponse("/console/fleet", 303)


@router.get("/login")
def login_page(request: Request, why: str = "") -> HTMLResponse:
    return page(request, "login.html", None, why=why)


@router.post("/login")
async def login(request: Request) -> Response:
    token = (await _form(request)).get("token", "").strip()
    try:
        who = current_principal(request, _ctx(request), HTTPAuthorizationCredentials(scheme="Bearer",
                                                                                     credentials=token))
    except ApiError as e:
        return page(request, "login.html", None, status=e.status, why=e.message)
    r = RedirectResponse("/console/fleet", 303)
    r.set_cookie(COOKIE, token, httponly=True, samesite="strict", path="/console",
                 secure=request.url.scheme == "https")
    log.info("console login: %s (%s)", who.name, who.role.value)
    return r


@router.post("/logout")
def logout() -> RedirectResponse:
    r = RedirectResponse("/console/login", 303)
    r.delete_cookie(COOKIE, path="/console")
    return r


# -- fleet ----------------------------------------------------------------------------------------


def fleet_groups(ctx: AdminContext) -> tuple[dict[tuple[str, str], list[dict]], dict]:
    """Workers grouped by (pool, role), each with the index's blocks per tier and stale flag."""
    with ctx.sessions() as s:
        rows, _ = queries.workers(s, state=None, pool=None, role=None, limit=500, offset=0)
    blocks: dict[str, dict[str, int]] = {}
    stale: set[str] = set()
    view_info: dict[str, Any] = {"available": ctx.live is not None}
    if ctx.live is not None:
        with ctx.live.read() as view:
            blocks = queries.index_blocks(view)
            stale = set(view.stale_workers())
            view_info.update(applied=view.applied, age_ms=round(ctx.live.age_ms))
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    now_ns = time.time_ns()
    for w in rows:
        d = w.model_dump()
        d["blocks"] = blocks.get(w.worker_id, {})
        d["stale"] = w.worker_id in stale
        d["report_age_s"] = (now_ns - w.reported_at_ns) / 1e9 if w.reported_at_ns else None
        groups[(w.pool, w.role)].append(d)
    return dict(sorted(groups.items())), view_info


@router.get("/fleet")
def fleet(request: Request) -> HTMLResponse:
    who = user(request)
    groups, info = fleet_groups(_ctx(request))
    return page(request, "fleet.html", who, groups=groups, view=info)


@router.get("/fleet/stream")
async def fleet_stream(request: Request) -> Response:
    """Server-sent events: the fleet table's body, re-rendered when the log changes it."""
    user(request)
    ctx = _ctx(request)
    tpl = templates.get_template("fleet_rows.html")

    async def events():
        last = None
        deadline = time.monotonic() + STREAM_S
        yield "retry: 2000\n\n"
        while time.monotonic() < deadline and not await request.is_disconnected():
            groups, info = await run_in_threadpool(fleet_groups, ctx)
            html = " ".join(tpl.render(groups=groups, view=info).split())
            if html != last:
                last = html
                yield f"event: fleet\ndata: {html}\n\n"
            await asyncio.sleep(STREAM_EVERY_S)

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={**SECURITY_HEADERS, "X-Accel-Buffering": "no"})


# -- requests -------------------------------------------------------------------------------------


def _parse_time(text: str) -> int | None:
    """An ISO 8601 time or epoch milliseconds, as epoch ns; None when empty."""
    text = text.strip()
    if not text:
        return None
    if text.isdigit():
        return int(text) * 1_000_000
    dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return int(dt.timestamp() * 1e9)


@router.get("/requests")
def request_search(request: Request, q: str = "", since: str = "", until: str = "") -> Response:
    who = user(request)
    q = q.strip()[:256]
    ctx = _ctx(request)
    if q:
        with ctx.sessions() as s:
            try:
                t = queries.trace(s, q)
            except NotFound as e:
                return page(request, "requests.html", who, status=404, q=q, since=since, until=until, error=e.message,
                            found=[])
        return RedirectResponse(f"/console/requests/{quote(t.request_id, safe='')}", 303)
    try:
        lo, hi = _parse_time(since), _parse_time(until)
    except ValueError as e:
        return page(request, "requests.html", who, status=422, q=q, since=since, until=until,
                    error=f"not a time (ISO 8601 or epoch ms): {e}", found=[])
    with ctx.sessions() as s:
        stmt = select(AuditEvent).where(AuditEvent.type == "RequestAdmitted")
        if lo is not None:
            stmt = stmt.where(AuditEvent.occurred_at_ns >= lo)
        if hi is not None:
            stmt = stmt.where(AuditEvent.occurred_at_ns <= hi)
        rows = s.scalars(stmt.order_by(AuditEvent.occurred_at_ns.desc()).limit(100)).all()
        found = [{"request_id": r.request_id, "at_ns": r.occurred_at_ns,
                  "client_request_id": r.payload.get("client_request_id", ""),
                  "prompt_tokens": r.payload.get("prompt_tokens")} for r in rows]
    return page(request, "requests.html", who, q=q, since=since, until=until, error="", found=found)


def _configs(ctx: AdminContext) -> dict[int, RouterConfig]:
    out = {}
    with ctx.sessions() as s:
        for row in s.scalars(select(RouterConfigVersion)):
            try:
                out[row.version] = msgspec.convert({**row.config, "version": row.version}, RouterConfig)
            except (msgspec.ValidationError, ValueError):
                log.warning("router config v%s in the store does not load", row.version)
    return out


def config_of(configs: dict[int, RouterConfig], version: int | None, mode: str | None) -> tuple[RouterConfig, bool]:
    """The config a decision was made under, or the router's default for its mode (assumed), as
    ``switchyard replay`` does (:class:`control_plane.replay.engine.ConfigBook`)."""
    return ConfigBook(configs).get(version or 0, RoutingMode(mode or "kv"))


def _request_view(ctx: AdminContext, rid: str) -> dict[str, Any]:
    with ctx.sessions() as s:
        t = queries.trace(s, rid)
    evs = [e.model_dump() for e in t.events]
    configs = _configs(ctx)
    decisions = []
    by_id = {e["event_id"]: e for e in evs}
    admitted = next((e for e in evs if e["type"] == "RequestAdmitted"), None)
    for n, r in enumerate(t.routing):
        ev = by_id[r["event_id"]]
        rec = views.decision_record(ev, admitted)
        cfg, assumed = config_of(configs, r.get("config_version"), r.get("mode"))
        decisions.append({"n": n, "routing": r, "rows": views.score_rows(rec.routed, cfg), "config": cfg,
                          "assumed": assumed, "config_json": views.config_json(cfg)})
    return {"trace": t, "events": evs, "decisions": decisions, "ledger": views.cache_ledger(evs),
            "admitted": admitted}


@router.get("/requests/{rid}")
def request_page(request: Request, rid: str) -> HTMLResponse:
    who = user(request)
    data = _request_view(_ctx(request), rid)
    return page(request, "request.html", who, **data, verdict=None, whatif=None, active=None)


async def _decision_action(request: Request, rid: str, what: str) -> HTMLResponse:
    who = operator(request)
    form = await _form(request)
    ctx = _ctx(request)
    data = await run_in_threadpool(_request_view, ctx, rid)
    try:
        n = int(form.get("n", "0"))
        d = data["decisions"][n]
    except (ValueError, IndexError):
        raise PageError(422, f"request {rid} has no decision {form.get('n')!r}") from None
    rec = views.decision_record(next(e for e in data["events"] if e["event_id"] == d["routing"]["event_id"]),
                                data["admitted"])
    verdict = whatif = None
    status = 200
    if what == "verify":
        verdict = views.verify_decision(rec, d["config"])
    else:
        text = form.get("config", "")[:20_000]
        try:
            alt = views.parse_router_config(text, d["config"].version)
        except ValueError as e:
            whatif = {"error": str(e), "text": text}
            status = 422
        else:
            whatif = {"outcome": views.whatif_decision(rec, d["config"], alt), "text": text, "error": ""}
    return page(request, "request.html", who, status=status, **data, verdict=verdict, whatif=whatif, active=n)


@router.post("/requests/{rid}/verify")
async def request_verify(request: Request, rid: str) -> HTMLResponse:
    return await _decision_action(request, rid, "verify")


@router.post("/requests/{rid}/whatif")
async def request_whatif(request: Request, rid: str) -> HTMLResponse:
    return await _decision_action(request, rid, "whatif")


# -- planner --------------------------------------------------------------------------------------


def pool_load(workers: list[dict]) -> dict[str, dict[str, Any]]:
    """Per pool: ready workers, their load (running, waiting, queued prefill tokens, active
    decode blocks) against their capacity (device blocks, device usage). Pure."""
    out: dict[str, dict[str, Any]] = {}
    for w in workers:
        if w["state"] != "ready":
            continue
        p = out.setdefault(w["pool"], {"ready": 0, "running": 0, "waiting": 0, "queued_prefill_tokens": 0,
                                       "active_decode_blocks": 0, "device_blocks": 0, "usage": []})
        p["ready"] += 1
        for k in ("running", "waiting", "queued_prefill_tokens", "active_decode_blocks"):
            p[k] += w[k] or 0
        p["device_blocks"] += int((w["capacity"] or {}).get("device", 0))
        p["usage"].append(float((w["tier_usage"] or {}).get("device", 0.0)))
    for p in out.values():
        u = p.pop("usage")
        p["device_usage"] = sum(u) / len(u) if u else 0.0
    return out


def replica_lines(decisions: list, width: int = 600, height: int = 80) -> dict[str, dict[str, Any]]:
    """Per pool, the replicas each decision asked for over time, as SVG polyline points (steps:
    a decision holds until the next). Pure."""
    out: dict[str, dict[str, Any]] = {}
    if not decisions:
        return out
    t0 = min(d.occurred_at_ns for d in decisions)
    t1 = max(d.occurred_at_ns for d in decisions)
    span = max(t1 - t0, 1)
    top = max(max(d.to_replicas, d.from_replicas) for d in decisions) or 1
    by_pool: dict[str, list] = defaultdict(list)
    for d in sorted(decisions, key=lambda d: d.occurred_at_ns):
        by_pool[d.pool].append(d)
    for pool, ds in sorted(by_pool.items()):
        pts, y_prev = [], None
        for d in ds:
            x = (d.occurred_at_ns - t0) / span * width
            y = height - d.to_replicas / top * (height - 4) - 2
            if y_prev is not None:
                pts.append(f"{x:.1f},{y_prev:.1f}")
            pts.append(f"{x:.1f},{y:.1f}")
            y_prev = y
        pts.append(f"{width:.1f},{y_prev:.1f}")
        out[pool] = {"points": " ".join(pts), "last": ds[-1].to_replicas, "n": len(ds), "top": top}
    return out


@router.get("/planner")
def planner(request: Request, msg: str = "") -> HTMLResponse:
    who = user(request)
    ctx = _ctx(request)
    with ctx.sessions() as s:
        decisions, total = queries.planner_decisions(s, None, 200, 0)
        pools, _ = queries.pools(s, 200, 0)
        workers, _ = queries.workers(s, state="ready", pool=None, role=None, limit=500, offset=0)
    load = pool_load([w.model_dump() for w in workers])
    return page(request, "planner.html", who, decisions=decisions, total=total, pools=pools, load=load, msg=msg,
                lines=replica_lines(decisions))


@router.post("/planner/pin")
async def planner_pin(request: Request) -> Response:
    who = operator(request)
    form = await _form(request)
    ctx = _ctx(request)
    name = form.get("pool", "")[:128]

    def act() -> str:
        with ctx.sessions() as s:
            if form.get("action") == "unpin":
                services.pin_pool(s, ctx, who, name, None, form.get("reason", "")[:500])
                return f"unpinned {name}"
            body = PinUpdate(replicas=int(form.get("replicas", "")), reason=form.get("reason", "")[:500])
            services.pin_pool(s, ctx, who, name, body)
            return f"pinned {name} at {body.replicas}"

    try:
        msg = await run_in_threadpool(act)
    except ApiError as e:
        raise PageError(e.status, e.message) from None
    except ValueError as e:
        raise PageError(422, f"replicas: {str(e).splitlines()[0]}") from None
    return RedirectResponse(f"/console/planner?msg={quote(msg)}", 303)


# -- doctor ---------------------------------------------------------------------------------------


def run_doctor(ctx: AdminContext) -> doctor.DoctorReport:
    if ctx.live is None:
        raise PageError(503, "this admin process has no view of the log (started without a broker)")
    with ctx.sessions() as s:
        regs = [doctor.RegisteredWorker(worker_id=w.worker_id, epoch=w.epoch, state=w.state, endpoint=w.endpoint,
                                        block_size=w.block_size, hash_algo=w.hash_algo, capacity=dict(w.capacity or {}))
                for w in s.scalars(select(Worker))]
    index, actual, algo, bs = doctor.gather(regs, ctx.live, doctor.http_fetcher(worker_credential()))
    expected = doctor.Expected(block_size=bs, hash_algo=algo, topic_prefix=ctx.catalog.prefix)
    return doctor.diagnose(expected, regs, index, actual)


@router.get("/doctor")
def doctor_page(request: Request) -> HTMLResponse:
    who = user(request)
    report = run_doctor(_ctx(request))
    return page(request, "doctor.html", who, report=report)


@api.get("/doctor")
def doctor_json(c: Ctx, who: Viewer) -> JSONResponse:
    """The doctor's report (``switchyard doctor``): configuration mismatches, each with what to
    change, and per worker the index's blocks against the worker's own."""
    try:
        return JSONResponse(run_doctor(c).to_dict())
    except PageError as e:
        return JSONResponse({"error": {"message": e.message, "code": "unavailable"}}, status_code=e.status)


# -- dashboards -----------------------------------------------------------------------------------


def prometheus_url() -> str:
    st = StackSettings.from_env()
    return f"http://{st.host}:{st.prometheus_port}"


@router.get("/dashboards")
def dashboards_page(request: Request, d: str = "", pool: str = ".*", window: int = 900) -> HTMLResponse:
    who = user(request)
    docs = dash.dashboards()
    name = d if d in docs else next(iter(docs))
    window = max(60, min(window, 86_400))
    pool = pool[:128] or ".*"
    results = dash.evaluate(prometheus_url(), docs[name], pool=pool, window_s=window, step_s=max(window // 60, 5))
    return page(request, "dashboards.html", who, names=list(docs), name=name, title=docs[name].get("title", name),
                results=results, pool=pool, window=window)


# -- wiring ---------------------------------------------------------------------------------------


async def _login_required(request: Request, exc: LoginRequired) -> Response:
    if request.url.path.endswith("/stream"):
        return Response(status_code=401)
    return RedirectResponse(f"/console/login?why={quote(exc.why)}" if exc.why else "/console/login", 303)


async def _page_error(request: Request, exc: PageError) -> HTMLResponse:
    who = None
    try:
        who = user(request)
    except LoginRequired:
        pass
    return page(request, "error.html", who, status=exc.status, message=exc.message)


async def _api_error_page(request: Request, exc: ApiError) -> Response:
    if request.url.path.startswith("/console"):
        return await _page_error(request, PageError(exc.status, exc.message))
    return await api_error_response(request, exc)


def install(app: FastAPI) -> None:
    app.include_router(router)
    app.include_router(api)
    app.mount("/console/static", StaticFiles(directory=str(HERE / "static")), name="console-static")
    app.add_exception_handler(LoginRequired, _login_required)
    app.add_exception_handler(PageError, _page_error)
    app.add_exception_handler(ApiError, _api_error_page)
