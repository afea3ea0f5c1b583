"""Read side of the admin API: queries over the admin store and the folded index view."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session, sessionmaker

from control_plane.admin.db.models import (
    CONFIG_TABLES,
    ApiToken,
    AuditEvent,
    Pool,
    ReplayJob,
    ReplayResult,
    RouterKeyRow,
    Worker,
    WorkerIncarnation,
)
from control_plane.admin.errors import NotFound, Unavailable
from control_plane.admin.shapes import (
    EventPublic,
    Health,
    IncarnationPublic,
    IndexStats,
    OverlapQuery,
    OverlapResult,
    PlannerDecisionPublic,
    PoolPublic,
    RequestTrace,
    TraceStep,
    WorkerDetail,
    WorkerOverlapPublic,
    WorkerPublic,
)
from common.hashing import HashAlgo, HashConfig, hash_blocks
from common.tokenizer import HashTokenizer

if TYPE_CHECKING:
    from control_plane.admin.audit.consumer import AuditConsumer
    from control_plane.admin.liveview import LiveView


def page(session: Session, stmt, limit: int, offset: int, order_by) -> tuple[list, int]:
    total = session.scalar(select(func.count()).select_from(stmt.subquery()))
    rows = session.scalars(stmt.order_by(*order_by).limit(limit).offset(offset)).all()
    return list(rows), int(total or 0)


def health(sessions: sessionmaker[Session], audit: AuditConsumer | None) -> Health:
    """Is the database reachable, and how far has the audit consumer got. Never raises: a
    database that cannot answer is the ``degraded`` status, not an error."""
    db_ok = True
    try:
        with sessions() as s:
            s.execute(text("SELECT 1"))
    except Exception:
        db_ok = False
    progress: dict[str, Any] = {"enabled": audit is not None}
    reasons = [] if db_ok else ["database unreachable"]
    if audit is not None:
        stuck = audit.stuck  # one read: the consumer thread replaces it
        progress.update(batches=audit.batches, events=audit.totals.inserted,
                        duplicates=audit.totals.duplicates, dead_lettered=audit.dead_lettered,
                        last_error=audit.last_error, stuck=None if stuck is None else stuck.reason)
        if stuck is not None:
            reasons.append(stuck.reason)
        elif progress["last_error"]:  # failing, not yet waiting: degraded until a step succeeds
            reasons.append(f"audit consumer: {progress['last_error']}")
    return Health(status="degraded" if reasons else "ok", database=db_ok, audit=progress, reasons=reasons)


# -- workers -------------------------------------------------------------------------------------


def workers(session: Session, *, state: str | None, pool: str | None, role: str | None, limit: int, offset: int):
    stmt = select(Worker)
    if state:
        stmt = stmt.where(Worker.state == state)
    if pool:
        stmt = stmt.where(Worker.pool == pool)
    if role:
        stmt = stmt.where(Worker.role == role)
    rows, total = page(session, stmt, limit, offset, (Worker.worker_id,))
    return [WorkerPublic.model_validate(r, from_attributes=True) for r in rows], total


def worker(session: Session, worker_id: str) -> tuple[WorkerPublic, list[IncarnationPublic]]:
    w = session.get(Worker, worker_id)
    if w is None:
        raise NotFound(f"no worker {worker_id!r} in the log")
    incs = session.scalars(select(WorkerIncarnation).where(WorkerIncarnation.worker_id == worker_id)
                           .order_by(WorkerIncarnation.epoch.desc())).all()
    return (WorkerPublic.model_validate(w, from_attributes=True),
            [IncarnationPublic.model_validate(i, from_attributes=True) for i in incs])


def worker_detail(session: Session, live: LiveView | None, worker_id: str) -> WorkerDetail:
    """One worker with its incarnations and, from the prefix index folded from the log, the
    blocks it holds per tier (none, and not stale, in a process without a view of the log)."""
    w, incs = worker(session, worker_id)
    blocks: dict[str, int] = {}
    stale = False
    if live is not None:
        with live.read() as view:
            blocks = index_blocks(view).get(worker_id, {})
            stale = worker_id in view.stale_workers()
    return WorkerDetail(**w.model_dump(), incarnations=incs, blocks=blocks, stale=stale)


# -- pools ---------------------------------------------------------------------------------------


def _pool_public(session: Session, p: Pool) -> PoolPublic:
    counts = Counter({s: n for s, n in session.execute(
        select(Worker.state, func.count()).where(Worker.pool == p.name).group_by(Worker.state))})
    return PoolPublic.model_validate({**{c.key: getattr(p, c.key) for c in Pool.__table__.columns},
                                      "workers": dict(counts)})


def pools(session: Session, limit: int, offset: int) -> tuple[list[PoolPublic], int]:
    rows, total = page(session, select(Pool), limit, offset, (Pool.name,))
    return [_pool_public(session, p) for p in rows], total


def pool(session: Session, name: str) -> PoolPublic:
    p = session.get(Pool, name)
    if p is None:
        raise NotFound(f"no pool {name!r}")
    return _pool_public(session, p)


def pool_row(session: Session, p: Pool) -> PoolPublic:
    return _pool_public(session, p)


# -- configs -------------------------------------------------------------------------------------


def config_versions(session: Session, kind: str, limit: int, offset: int):
    model = CONFIG_TABLES[kind]
    return page(session, select(model), limit, offset, (model.version.desc(),))


def config_version(session: Session, kind: str, version: int | None):
    model = CONFIG_TABLES[kind]
    if version is None:
        row = session.scalars(select(model).order_by(model.version.desc()).limit(1)).first()
        if row is None:
            raise NotFound(f"no {kind} config recorded yet (PUT /{kind}-config)")
        return row
    row = session.get(model, version)
    if row is None:
        raise NotFound(f"no {kind} config version {version}")
    return row


# -- events, planner, traces ---------------------------------------------------------------------


def event_public(r: AuditEvent) -> EventPublic:
    return EventPublic(event_id=r.event_id, type=r.type, version=r.version, key=r.key, producer=r.producer,
                       epoch=r.epoch, seq=r.seq, request_id=r.request_id, worker_id=r.worker_id, pool=r.pool,
                       decision_id=r.decision_id, occurred_at_ns=r.occurred_at_ns, topic=r.topic,
                       partition=r.kafka_partition, offset=r.kafka_offset, payload=r.payload)


def events(session: Session, *, type_: str | None, request_id: str | None, worker_id: str | None, pool: str | None,
           decision_id: str | None, since_ns: int | None, limit: int, offset: int):
    stmt = select(AuditEvent)
    for col, val in ((AuditEvent.type, type_), (AuditEvent.request_id, request_id), (AuditEvent.worker_id, worker_id),
                     (AuditEvent.pool, pool), (AuditEvent.decision_id, decision_id)):
        if val:
            stmt = stmt.where(col == val)
    if since_ns is not None:
        stmt = stmt.where(AuditEvent.occurred_at_ns >= since_ns)
    rows, total = page(session, stmt, limit, offset, (AuditEvent.occurred_at_ns.desc(), AuditEvent.event_id))
    return [event_public(r) for r in rows], total


def planner_decisions(session: Session, pool: str | None, limit: int, offset: int):
    stmt = select(AuditEvent).where(AuditEvent.type == "ScalingDecision")
    if pool:
        stmt = stmt.where(AuditEvent.pool == pool)
    rows, total = page(session, stmt, limit, offset, (AuditEvent.occurred_at_ns.desc(), AuditEvent.event_id))
    ids = [r.decision_id for r in rows if r.decision_id]
    applied = {a.decision_id: a.payload for a in session.scalars(
        select(AuditEvent).where(AuditEvent.type == "ScalingApplied", AuditEvent.decision_id.in_(ids)))} if ids else {}
    out = []
    for r in rows:
        p = r.payload
        out.append(PlannerDecisionPublic(
            decision_id=r.decision_id or "", pool=r.pool or "", occurred_at_ns=r.occurred_at_ns, role=p.get("role", ""),
            from_replicas=p.get("from_replicas", 0), to_replicas=p.get("to_replicas", 0), reason=p.get("reason", ""),
            config_version=p.get("config_version", 0), inputs=p.get("inputs", {}), applied=applied.get(r.decision_id)))
    return out, total


def trace(session: Session, request_id: str) -> RequestTrace:
    """The trace of ``request_id``: the router's id, or else a client's own id for it (the
    newest ``RequestAdmitted`` whose ``client_request_id`` it is)."""
    rows = _request_rows(session, request_id)
    if not rows:
        rid = session.scalars(select(AuditEvent.request_id).where(
            AuditEvent.type == "RequestAdmitted",
            AuditEvent.payload["client_request_id"].as_string() == request_id)
            .order_by(AuditEvent.occurred_at_ns.desc()).limit(1)).first()
        if rid:
            request_id, rows = rid, _request_rows(session, rid)
    if not rows:
        raise NotFound(f"no event of request {request_id!r} in the audit log")
    return build_trace(request_id, [event_public(r) for r in rows])


def _request_rows(session: Session, request_id: str) -> list[AuditEvent]:
    return list(session.scalars(select(AuditEvent).where(AuditEvent.request_id == request_id)
                                .order_by(AuditEvent.occurred_at_ns, AuditEvent.topic, AuditEvent.kafka_partition,
                                          AuditEvent.kafka_offset)).all())


@dataclass
class _TraceFold:
    """What the steps of one request's trace accumulate, read in time order."""

    outcome: str
    #: The phase of each RequestRouted (aggregated, or prefill then decode).
    phases: list[str] = field(default_factory=list)
    routing: list[dict[str, Any]] = field(default_factory=list)


def _admitted(t: _TraceFold, e: EventPublic, p: dict[str, Any]) -> str:
    return (f"{p.get('prompt_tokens')} prompt tokens ({len(p.get('block_hashes', []))} blocks), "
            f"max_tokens {p.get('max_tokens')}")


def _routed(t: _TraceFold, e: EventPublic, p: dict[str, Any]) -> str:
    t.phases.append(p.get("phase", "aggregated"))
    t.routing.append({"phase": p.get("phase", "aggregated"), "worker_id": p.get("worker_id"), "mode": p.get("mode"),
                      "attempt": p.get("attempt", 0), "reason": p.get("reason", ""),
                      "config_version": p.get("config_version"), "rng_seed": p.get("rng_seed"),
                      "view_state": p.get("view_state", ""), "index_position": p.get("index_position", {}),
                      "scores": p.get("scores", []), "event_id": e.event_id})
    return f"{p.get('phase', 'aggregated')} -> {p.get('worker_id')} ({p.get('mode')}, attempt {p.get('attempt', 0)})"


def _prefilled(t: _TraceFold, e: EventPublic, p: dict[str, Any]) -> str:
    return (f"prefill done on {p.get('worker_id')} in {p.get('duration_ms', 0):.1f} ms, "
            f"{p.get('cached_tokens', 0)} cached")


def _transfer(t: _TraceFold, e: EventPublic, p: dict[str, Any]) -> str:
    # "KvTransferStarted" -> "started", and so on.
    return (f"{e.type[10:].lower()}: {p.get('src_worker')} -> {p.get('dst_worker')}, {p.get('blocks')} blocks, "
            f"{p.get('bytes', 0)} B via {p.get('backend')}")


def _transfer_failed(t: _TraceFold, e: EventPublic, p: dict[str, Any]) -> str:
    return _transfer(t, e, p) + f" ({p.get('reason')}; fallback {p.get('fallback')})"


def _completed(t: _TraceFold, e: EventPublic, p: dict[str, Any]) -> str:
    t.outcome = "completed"
    return (f"{p.get('output_tokens')} tokens on {p.get('worker_id')}, ttft {p.get('ttft_ms', 0):.1f} ms, "
            f"e2e {p.get('e2e_ms', 0):.1f} ms")


def _failed(t: _TraceFold, e: EventPublic, p: dict[str, Any]) -> str:
    if not p.get("retried"):
        t.outcome = "failed"  # a retried attempt is not the request's end
    return f"{p.get('code')}: {p.get('reason')}" + (" (retried)" if p.get("retried") else "")


def _rejected(t: _TraceFold, e: EventPublic, p: dict[str, Any]) -> str:
    t.outcome = "rejected"
    return f"{p.get('code')}: {p.get('reason')}"


#: Event type -> (the trace stage it is a step of, its fold: updates the trace, answers the
#: step's summary). Other event types of the request are in ``events`` but are no step.
_TRACE_STEPS: dict[str, tuple[str, Callable[[_TraceFold, EventPublic, dict[str, Any]], str]]] = {
    "RequestAdmitted": ("admitted", _admitted),
    "RequestRouted": ("routed", _routed),
    "PrefillCompleted": ("prefill", _prefilled),
    "KvTransferStarted": ("transfer", _transfer),
    "KvTransferCompleted": ("transfer", _transfer),
    "KvTransferFailed": ("transfer", _transfer_failed),
    "RequestCompleted": ("completed", _completed),
    "RequestFailed": ("failed", _failed),
    "RequestRejected": ("rejected", _rejected),
}


def build_trace(request_id: str, evs: list[EventPublic]) -> RequestTrace:
    """The causal chain of one request from its events in time order. Pure."""
    t0 = next((e.occurred_at_ns for e in evs if e.type == "RequestAdmitted"), None)
    steps = []
    types = Counter(e.type for e in evs)
    fold = _TraceFold(outcome="in_flight" if types["RequestAdmitted"] else "unknown")
    for e in evs:
        step = _TRACE_STEPS.get(e.type)
        if step is None:
            continue
        stage, summarize = step
        steps.append(TraceStep(stage=stage, type=e.type, occurred_at_ns=e.occurred_at_ns,
                               since_admission_ms=None if t0 is None else (e.occurred_at_ns - t0) / 1e6,
                               worker_id=e.worker_id, summary=summarize(fold, e, e.payload)))
    outcome, phases, routing = fold.outcome, fold.phases, fold.routing
    mode = ("disaggregated" if {"prefill", "decode"} & set(phases) else "aggregated" if phases else "unknown")
    missing = []
    if not types["RequestAdmitted"]:
        missing.append("RequestAdmitted")
    if outcome != "rejected":
        if not phases:
            missing.append("RequestRouted")
        if mode == "disaggregated":
            for ph in ("prefill", "decode"):
                if ph not in phases:
                    missing.append(f"RequestRouted(phase={ph})")
            if not types["PrefillCompleted"]:
                missing.append("PrefillCompleted")
            if not types["KvTransferStarted"]:
                missing.append("KvTransferStarted")
            if not (types["KvTransferCompleted"] or types["KvTransferFailed"]):
                missing.append("KvTransferCompleted")
    if outcome in ("in_flight", "unknown"):
        missing.append("RequestCompleted")
    return RequestTrace(request_id=request_id, outcome=outcome, complete=not missing, mode=mode, missing=missing,
                        steps=steps, routing=routing, events=evs)


# -- jobs, tokens --------------------------------------------------------------------------------


def jobs(session: Session, limit: int, offset: int):
    return page(session, select(ReplayJob), limit, offset, (ReplayJob.created_at.desc(), ReplayJob.id))


def job(session: Session, job_id: str) -> ReplayJob:
    j = session.get(ReplayJob, job_id)
    if j is None:
        raise NotFound(f"no replay job {job_id!r}")
    return j


def job_result(session: Session, job_id: str) -> ReplayResult:
    j = job(session, job_id)
    r = session.get(ReplayResult, job_id)
    if r is None:
        raise NotFound(f"replay job {job_id} has no result yet (status {j.status})", code="not_ready")
    return r


def tokens(session: Session, limit: int, offset: int):
    return page(session, select(ApiToken), limit, offset, (ApiToken.created_at, ApiToken.id))


def router_keys(session: Session, limit: int, offset: int, include_revoked: bool):
    stmt = select(RouterKeyRow).where(RouterKeyRow.issued_at_ns > 0)
    if not include_revoked:
        stmt = stmt.where(RouterKeyRow.revoked_at_ns.is_(None))
    return page(session, stmt, limit, offset, (RouterKeyRow.issued_at_ns, RouterKeyRow.key_id))


# -- the prefix index (folded from the log) ------------------------------------------------------


def _live(live: LiveView | None) -> LiveView:
    if live is None:
        raise Unavailable("this admin process has no view of the log (started without a broker)")
    return live


def index_stats(live: LiveView | None, digest: bool) -> IndexStats:
    """Residency per worker and tier, stale workers and positions of the view, caught up first
    when it is older than its ``max_age_s``."""
    live = _live(live)
    with live.read() as view:
        st = view.index.stats()
        return IndexStats(hash_algo=view.hash_algo, block_size=view.block_size, distinct_hashes=st.distinct_hashes,
                          applied=view.applied, age_ms=live.age_ms, stale_workers=view.stale_workers(),
                          deregistered=list(st.deregistered), blocks=index_blocks(view), counters=st.counters,
                          positions={f"{t}:{p}": o for (t, p), o in sorted(view.positions.items())},
                          digest=view.digest() if digest else None)


def overlap(live: LiveView | None, hash_algo: str, block_size: int, body: OverlapQuery) -> OverlapResult:
    """Which workers hold how much of a prompt's prefix, per tier, longest first. Text is
    tokenized like the router's default ``hash`` tokenizer, then hashed with this process's
    ``hash_algo`` and ``block_size``."""
    live = _live(live)
    tokens = body.tokens if body.tokens is not None else HashTokenizer().encode(body.prompt or "")
    cfg = HashConfig(HashAlgo(hash_algo), block_size)
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


def index_blocks(view) -> dict[str, dict[str, int]]:
    blocks: dict[str, dict[str, int]] = {}
    for rank, per in view.index.stats().blocks.items():
        d = blocks.setdefault(rank.worker_id, {})
        for tier, n in per.items():
            d[tier.value] = d.get(tier.value, 0) + n
    return blocks


def jsonable(x: Any) -> Any:
    """Non-finite floats to None (JSONB and strict JSON refuse NaN/inf)."""
    import math

    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x
