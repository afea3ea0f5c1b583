"""Operator actions: every mutating call of the admin API, as plain functions.

Each one checks its preconditions against the admin store, records the action as an event in
the log (who did it: the token's name and role), and folds that same event into the store in
the caller's transaction (:meth:`AuditStore.ingest`), so the caller reads its own write at
once and the audit consumer's later copy is a no-op. The log is written first: if it refuses,
nothing changed anywhere. Local-only state (API tokens, replay jobs) is written after its
event, in the same transaction.

Raises :class:`~control_plane.admin.errors.ApiError` subclasses; the app maps them to HTTP.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from control_plane.admin import jobargs
from control_plane.admin.auth import Principal, Role, expiry, issue_token
from control_plane.admin.context import AdminContext
from control_plane.admin.db.models import (
    CONFIG_TABLES,
    ApiToken,
    PlannerConfigVersion,
    Pool,
    ReplayJob,
    RouterConfigVersion,
    RouterKeyRow,
    Worker,
    utcnow,
)
from control_plane.admin.errors import Conflict, Invalid, NotFound
from control_plane.admin.jobs import run_job
from control_plane.admin.shapes import (
    PinUpdate,
    PlannerConfigUpdate,
    PoolUpdate,
    ReplayJobCreate,
    RouterConfigUpdate,
    RouterKeyCreate,
    TokenCreate,
    TokenRotate,
)
from control_plane.planner.config import PlannerConfig
from control_plane.replay.errors import BadPoint
from control_plane.router import RouterConfig
from control_plane.router.keys import KEY_PREFIX, KeyLimits
from common import bearer
from common.errors import HashConfigError
from common.hashing import HashAlgo, HashConfig
from common.log.reader import LocatedEvent
from schemas.events import (
    AdminAction,
    Event,
    PlannerConfigChanged,
    PoolPinned,
    PoolUpdated,
    RouterConfigChanged,
    RouterKeyIssued,
    RouterKeyRevoked,
    WorkerDrainRequested,
)
from schemas.types import PoolName, WorkerId, WorkerRole


def record(ctx: AdminContext, session: Session, payload: Event) -> LocatedEvent:
    """Append ``payload`` to the log (acknowledged), then fold it into the store."""
    loc = ctx.events.record(payload)
    ctx.store.ingest(session, [loc], positions={})
    return loc


def _actor(who: Principal) -> dict[str, str]:
    return {"actor": who.name, "actor_role": who.role.value}


# -- workers -------------------------------------------------------------------------------------


def request_drain(session: Session, ctx: AdminContext, who: Principal, worker_id: str, reason: str) -> LocatedEvent:
    """Ask the scaler owning ``worker_id`` to drain it (``WorkerDrainRequested``). The worker then
    reports ``WorkerDraining`` and ``WorkerDeregistered`` itself: the API never forges a
    worker's own events (their producer epoch would fence or reset the worker's index state)."""
    w = session.get(Worker, worker_id)
    if w is None:
        raise NotFound(f"no worker {worker_id!r} in the log")
    if w.state == "gone":
        raise Conflict(f"worker {worker_id} is gone (deregistered in epoch {w.epoch}): nothing to drain")
    with ctx.write_lock:
        loc = record(ctx, session, WorkerDrainRequested(worker_id=WorkerId(worker_id), reason=reason, **_actor(who)))
    session.commit()
    return loc


# -- pools ---------------------------------------------------------------------------------------


def update_pool(session: Session, ctx: AdminContext, who: Principal, name: str, body: PoolUpdate) -> Pool:
    pinned = session.scalar(select(Pool.pinned_replicas).where(Pool.name == name))
    if pinned is not None and not body.min_replicas <= pinned <= body.max_replicas:
        raise Conflict(f"pool {name} is pinned at {pinned} replicas, outside the new bounds "
                       f"[{body.min_replicas}, {body.max_replicas}]: unpin it first")
    with ctx.write_lock:
        record(ctx, session, PoolUpdated(pool=PoolName(name), role=WorkerRole(body.role), ttft_slo_ms=body.ttft_slo_ms,
                                         itl_slo_ms=body.itl_slo_ms, min_replicas=body.min_replicas,
                                         max_replicas=body.max_replicas, gpus_per_replica=body.gpus_per_replica,
                                         gpu_budget=body.gpu_budget, **_actor(who)))
    session.commit()
    return session.get(Pool, name)


def pin_pool(session: Session, ctx: AdminContext, who: Principal, name: str, body: PinUpdate | None,
             unpin_reason: str = "") -> Pool:
    """Pin (``body``) or unpin (None, for ``unpin_reason``) a pool's size (``PoolPinned``)."""
    pool = session.get(Pool, name)
    if pool is None:
        raise NotFound(f"no pool {name!r}: PUT /pools/{name} first")
    if body is not None and not pool.min_replicas <= body.replicas <= pool.max_replicas:
        raise Invalid(f"replicas={body.replicas} is outside pool {name}'s bounds [{pool.min_replicas}, "
                      f"{pool.max_replicas}]: widen them first (PUT /pools/{name})")
    with ctx.write_lock:
        record(ctx, session, PoolPinned(pool=PoolName(name), replicas=body.replicas if body else None,
                                        reason=body.reason if body else unpin_reason, **_actor(who)))
    session.commit()
    session.refresh(pool)
    return pool


# -- configs -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigKind:
    """What differs between the router's and the planner's config: the rest of recording a
    version (the expected-version check, numbering, the event, the row) is one path."""

    #: The request shape of ``PUT /{kind}-config``.
    body: type[RouterConfigUpdate] | type[PlannerConfigUpdate]
    event: type[RouterConfigChanged] | type[PlannerConfigChanged]
    #: (the body's config, the version it is recorded as) -> the config the event carries;
    #: raises :class:`Invalid` with the reason when the config breaks a rule.
    build: Callable[[Any, int], dict[str, Any]]


def _router_config(config: Any, version: int) -> dict[str, Any]:
    # RouterConfig's own validation runs here: its cross-field rules and their reasons.
    try:
        cfg = msgspec.convert({**config.model_dump(), "version": version}, RouterConfig)
    except msgspec.ValidationError as e:
        raise Invalid(f"router config rejected: {e}") from None
    return msgspec.to_builtins(cfg)


def _planner_config(config: dict[str, Any], version: int) -> dict[str, Any]:
    # Decoded here exactly as the planner decodes it on load (PlannerConfig forbids unknown
    # fields and runs its cross-field rules), so a config no planner would apply is refused now
    # with the reason (e.g. "Object contains unknown field `interval_s`"), never recorded. What
    # is recorded is what was sent: omitted fields keep meaning "the planner's default".
    body = {**config, "version": version}
    try:
        msgspec.convert(body, PlannerConfig)
    except msgspec.ValidationError as e:
        raise Invalid(f"planner config rejected: {e}") from None
    return body


CONFIG_KINDS: dict[str, ConfigKind] = {
    "router": ConfigKind(body=RouterConfigUpdate, event=RouterConfigChanged, build=_router_config),
    "planner": ConfigKind(body=PlannerConfigUpdate, event=PlannerConfigChanged, build=_planner_config),
}


def put_config(session: Session, ctx: AdminContext, who: Principal, kind: str,
               body: RouterConfigUpdate | PlannerConfigUpdate) -> RouterConfigVersion | PlannerConfigVersion:
    """Record the next version of the ``kind`` config (``RouterConfigChanged`` /
    ``PlannerConfigChanged``). Under the write lock, so two callers never mint one version."""
    spec, model = CONFIG_KINDS[kind], CONFIG_TABLES[kind]
    with ctx.write_lock:
        current = session.scalar(select(func.max(model.version))) or 0
        if body.expected_version is not None and body.expected_version != current:
            raise Conflict(f"{kind} config is at version {current}, not {body.expected_version}")
        version = current + 1
        config = spec.build(body.config, version)
        record(ctx, session, spec.event(config_version=version, config=config, **_actor(who)))
        session.commit()
    return session.get(model, version)


# -- tokens --------------------------------------------------------------------------------------


def _ttl_days(ctx: AdminContext, asked: int | None) -> int:
    days = ctx.settings.token_ttl_days if asked is None else asked
    if days > ctx.settings.token_max_ttl_days:
        raise Invalid(f"expires_in_days={days} is over this server's maximum of {ctx.settings.token_max_ttl_days}: "
                      "a long-lived secret outlives the reason it was issued for")
    return days


def create_token(session: Session, ctx: AdminContext, who: Principal, body: TokenCreate) -> tuple[ApiToken, str]:
    days = _ttl_days(ctx, body.expires_in_days)
    with ctx.write_lock:
        if session.scalar(select(ApiToken.id).where(ApiToken.name == body.name)) is not None:
            raise Conflict(f"a token named {body.name!r} exists (names are what the audit records; pick another)")
        issued = issue_token()
        now = ctx.now()
        expires = expiry(now, days)
        record(ctx, session, AdminAction(action="token_created", target=body.name,
                                         details={"token_id": issued.token_id, "role": body.role,
                                                  "expires_at": expires.isoformat(timespec="seconds")},
                                         **_actor(who)))
        row = ApiToken(id=issued.token_id, name=body.name, role=body.role, salt=issued.salt,
                       token_hash=issued.token_hash, created_at=now, created_by=who.name, expires_at=expires)
        session.add(row)
        session.commit()
    return row, issued.token


def rotate_token(session: Session, ctx: AdminContext, who: Principal, token_id: str,
                 body: TokenRotate) -> tuple[ApiToken, str]:
    """A new secret (and expiry) for ``token_id``; the old secret stops authenticating when this
    commits. The id, name and role stay, so the audit keeps naming one actor."""
    days = _ttl_days(ctx, body.expires_in_days)
    with ctx.write_lock:
        row = session.get(ApiToken, token_id)
        if row is None:
            raise NotFound(f"no token {token_id!r}")
        if row.revoked_at is not None:
            raise Conflict(f"token {token_id} is revoked: issue a new one (POST /tokens)")
        fresh = issue_token(row.id)
        now = ctx.now()
        expires = expiry(now, days)
        record(ctx, session, AdminAction(action="token_rotated", target=row.name,
                                         details={"token_id": row.id, "role": row.role,
                                                  "expires_at": expires.isoformat(timespec="seconds")},
                                         **_actor(who)))
        row.salt, row.token_hash = fresh.salt, fresh.token_hash
        row.expires_at, row.rotated_at = expires, now
        session.commit()
    return row, fresh.token


def revoke_token(session: Session, ctx: AdminContext, who: Principal, token_id: str) -> ApiToken:
    row = session.get(ApiToken, token_id)
    if row is None:
        raise NotFound(f"no token {token_id!r}")
    if row.revoked_at is None:
        with ctx.write_lock:
            record(ctx, session, AdminAction(action="token_revoked", target=row.name,
                                             details={"token_id": row.id, "role": row.role}, **_actor(who)))
            row.revoked_at = ctx.now()
            session.commit()
    return row


# -- router API keys -----------------------------------------------------------------------------


def issue_router_key(session: Session, ctx: AdminContext, who: Principal,
                     body: RouterKeyCreate) -> tuple[RouterKeyRow, str]:
    """Issue a router API key (``RouterKeyIssued``: its id, salt, hash, expiry and limits, never
    the secret). Every router folds the event into its key table; the plain key is returned
    once, here."""
    try:
        KeyLimits(rate_per_s=body.rate_per_s, burst=body.burst, max_concurrent=body.max_concurrent)
    except ValueError as e:
        raise Invalid(f"limits rejected: {e}") from None
    with ctx.write_lock:
        live = select(RouterKeyRow.key_id).where(RouterKeyRow.name == body.name, RouterKeyRow.revoked_at_ns.is_(None))
        if session.scalar(live) is not None:
            raise Conflict(f"a router key named {body.name!r} is live: revoke it first, or pick another name")
        issued = bearer.issue(KEY_PREFIX)
        while session.get(RouterKeyRow, issued.id) is not None:  # ids are never reused, revoked ones included
            issued = bearer.issue(KEY_PREFIX)
        expires = int((ctx.clock() + body.expires_in_days * 86_400) * 1e9) if body.expires_in_days else None
        record(ctx, session, RouterKeyIssued(key_id=issued.id, name=body.name, salt=issued.salt, key_hash=issued.hash,
                                             expires_at_ns=expires, rate_per_s=body.rate_per_s, burst=body.burst,
                                             max_concurrent=body.max_concurrent,
                                             session_from_user=body.session_from_user, **_actor(who)))
        session.commit()
    return session.get(RouterKeyRow, issued.id), issued.plain


def revoke_router_key(session: Session, ctx: AdminContext, who: Principal, key_id: str, reason: str) -> RouterKeyRow:
    """Revoke a router API key (``RouterKeyRevoked``); the routers refuse it once they folded
    the event. Revoking a revoked key changes nothing."""
    with ctx.write_lock:
        row = session.get(RouterKeyRow, key_id)
        if row is None or not row.issued_at_ns:
            raise NotFound(f"no router key {key_id!r}")
        if row.revoked_at_ns is None:
            record(ctx, session, RouterKeyRevoked(key_id=key_id, reason=reason, **_actor(who)))
            session.commit()
            session.refresh(row)
    return row


# -- replay jobs ---------------------------------------------------------------------------------


def start_replay_job(session: Session, ctx: AdminContext, who: Principal, body: ReplayJobCreate) -> ReplayJob:
    """Queue a replay job after checking its arguments (:mod:`control_plane.admin.jobargs`): a
    job that could not mean anything is a 422 now, not a failed job later."""
    now_ms = int(ctx.clock() * 1000)
    params: dict[str, Any] = {"kind": body.kind}
    try:
        if body.kind == "state":
            jobargs.point(body.at, now_ms, "at")
            params["at"] = body.at
        else:
            jobargs.check_range(jobargs.point(body.from_, now_ms, "from"), jobargs.point(body.to, now_ms, "to"))
            params.update({"from": body.from_, "to": body.to})
    except BadPoint as e:
        raise Invalid(str(e)) from None
    if body.hash_algo is not None or body.block_size is not None:
        if body.kind != "state":
            raise Invalid("hash_algo and block_size are for state jobs (verify and whatif read the recorded hashes)")
        algo, size = body.hash_algo or ctx.settings.hash_algo, body.block_size or ctx.settings.block_size
        try:
            HashConfig(HashAlgo(algo), size)
        except HashConfigError as e:
            raise Invalid(f"hashing rejected: {e}") from None
        params.update({"hash_algo": algo, "block_size": size})
    if body.kind == "whatif":
        try:
            alt = msgspec.convert({**body.router_config.model_dump(), "version": 0}, RouterConfig)
        except msgspec.ValidationError as e:
            raise Invalid(f"router_config rejected: {e}") from None
        params["router_config"] = msgspec.to_builtins(alt)
        params["simulate"] = body.simulate
    job_id = secrets.token_hex(8)
    record(ctx, session, AdminAction(action="replay_job_started", target=job_id,
                                     details={k: v for k, v in params.items() if isinstance(v, (str, int, bool))},
                                     **_actor(who)))
    job = ReplayJob(id=job_id, kind=body.kind, params=params, status="queued", progress=0.0, stage="",
                    created_at=utcnow(), created_by=who.name)
    session.add(job)
    session.commit()
    ctx.jobs.submit(lambda: run_job(ctx, job_id))
    return job


def fail_interrupted_jobs(session: Session) -> int:
    """Jobs left queued or running by a previous process will never finish: say so."""
    n = 0
    for job in session.scalars(select(ReplayJob).where(ReplayJob.status.in_(("queued", "running")))):
        job.status, job.finished_at, job.error = "failed", utcnow(), "interrupted: the admin process restarted"
        n += 1
    session.commit()
    return n


SYSTEM = Principal(token_id="-", name="system", role=Role.ADMIN)
