"""Read side of the admin API: queries over the admin store and the folded index view."""

from __future__ import annotations

from collections import Counter
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from control_plane.api.db.models import (
    ApiToken,
    AuditEvent,
    PlannerConfigVersion,
    Pool,
    ReplayJob,
    ReplayResult,
    RouterConfigVersion,
    Worker,
    WorkerIncarnation,
)
from control_plane.api.errors import NotFound
from control_plane.api.shapes import (
    EventPublic,
    IncarnationPublic,
    PlannerDecisionPublic,
    PoolPublic,
    RequestTrace,
    TraceStep,
    WorkerPublic,
)


def page(session: Session, stmt, limit: int, offset: int, order_by) -> tuple[list, int]:
    total = session.scalar(select(func.count()).select_from(stmt.subquery()))
    rows = session.scalars(stmt.order_by(*order_by).limit(limit).offset(offset)).all()
    return list(rows), int(total or 0)


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
    model = RouterConfigVersion if kind == "router" else PlannerConfigVersion
    return page(session, select(model), limit, offset, (model.version.desc(),))


def config_version(session: Session, kind: str, version: int | None):
    model = RouterConfigVersion if kind == "router" else PlannerConfigVersion
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
    rows = session.scalars(select(AuditEvent).where(AuditEvent.request_id == request_id)
                           .order_by(AuditEvent.occurred_at_ns, AuditEvent.topic, AuditEvent.kafka_partition,
                                     AuditEvent.kafka_offset)).all()
    if not rows:
        raise NotFound(f"no event of request {request_id!r} in the audit log")
    return build_trace(request_id, [event_public(r) for r in rows])


_STAGE = {"RequestAdmitted": "admitted", "RequestRouted": "routed", "PrefillCompleted": "prefill",
          "KvTransferStarted": "transfer", "KvTransferCompleted": "transfer", "KvTransferFailed": "transfer",
          "RequestCompleted": "completed", "RequestFailed": "failed", "RequestRejected": "rejected"}


def build_trace(request_id: str, evs: list[EventPublic]) -> RequestTrace:
    """The causal chain of one request from its events in time order. Pure."""
    t0 = next((e.occurred_at_ns for e in evs if e.type == "RequestAdmitted"), None)
    steps, routing = [], []
    phases: list[str] = []
    types = Counter(e.type for e in evs)
    outcome = "in_flight" if types["RequestAdmitted"] else "unknown"
    for e in evs:
        p = e.payload
        stage = _STAGE.get(e.type)
        if stage is None:
            continue
        if e.type == "RequestAdmitted":
            s = f"{p.get('prompt_tokens')} prompt tokens ({len(p.get('block_hashes', []))} blocks), max_tokens {p.get('max_tokens')}"
        elif e.type == "RequestRouted":
            phases.append(p.get("phase", "aggregated"))
            routing.append({"phase": p.get("phase", "aggregated"), "worker_id": p.get("worker_id"), "mode": p.get("mode"),
                            "attempt": p.get("attempt", 0), "reason": p.get("reason", ""),
                            "config_version": p.get("config_version"), "rng_seed": p.get("rng_seed"),
                            "view_state": p.get("view_state", ""), "index_position": p.get("index_position", {}),
                            "scores": p.get("scores", []), "event_id": e.event_id})
            s = f"{p.get('phase', 'aggregated')} -> {p.get('worker_id')} ({p.get('mode')}, attempt {p.get('attempt', 0)})"
        elif e.type == "PrefillCompleted":
            s = f"prefill done on {p.get('worker_id')} in {p.get('duration_ms', 0):.1f} ms, {p.get('cached_tokens', 0)} cached"
        elif e.type.startswith("KvTransfer"):
            s = (f"{e.type[10:].lower()}: {p.get('src_worker')} -> {p.get('dst_worker')}, {p.get('blocks')} blocks, "
                 f"{p.get('bytes', 0)} B via {p.get('backend')}")
            if e.type == "KvTransferFailed":
                s += f" ({p.get('reason')}; fallback {p.get('fallback')})"
        elif e.type == "RequestCompleted":
            outcome = "completed"
            s = (f"{p.get('output_tokens')} tokens on {p.get('worker_id')}, ttft {p.get('ttft_ms', 0):.1f} ms, "
                 f"e2e {p.get('e2e_ms', 0):.1f} ms")
        elif e.type == "RequestFailed":
            if not p.get("retried"):
                outcome = "failed"
            s = f"{p.get('code')}: {p.get('reason')}" + (" (retried)" if p.get("retried") else "")
        else:
            outcome = "rejected"
            s = f"{p.get('code')}: {p.get('reason')}"
        steps.append(TraceStep(stage=stage, type=e.type, occurred_at_ns=e.occurred_at_ns,
                               since_admission_ms=None if t0 is None else (e.occurred_at_ns - t0) / 1e6,
                               worker_id=e.worker_id, summary=s))
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
