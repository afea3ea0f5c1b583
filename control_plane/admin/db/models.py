"""Tables of the admin store (SQLAlchemy 2.0 typed models), for PostgreSQL and SQLite alike.

Two kinds of tables:

* **Projections of the log** (rebuildable by replaying the topics into an empty database):
  ``audit_events`` (every event, keyed by event id), ``audit_positions`` (how far the audit
  consumer got, committed in the same transaction as the rows), ``workers`` and
  ``worker_incarnations`` (the registry and load view), ``pools``, ``router_configs``,
  ``planner_configs``, ``router_keys`` (folded from the ``admin`` stream: every change is an
  event first).
* **Local state** that does not belong in the log: ``api_tokens`` (salted hashes; a secret must
  never reach a forever-retained topic; creating and revoking one is still an event), and
  ``replay_jobs`` / ``replay_results``.

Times: event times are unix nanoseconds as recorded (``*_at_ns``, BIGINT); local row times are
timezone-aware UTC datetimes (:class:`UTCDateTime` keeps them aware on SQLite too).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

#: JSON on SQLite, JSONB on PostgreSQL (indexable, compact).
JsonType = JSON().with_variant(JSONB(), "postgresql")

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator):
    """Stored as naive UTC, returned as aware UTC (SQLite drops time zones)."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(timezone.utc).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect) -> datetime | None:
        return None if value is None else value.replace(tzinfo=timezone.utc)


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {dict[str, Any]: JsonType, datetime: UTCDateTime}


# -- audit projection ----------------------------------------------------------------------------


class AuditEvent(Base):
    """Every event of the audited topics, once (upserted by event id: redelivery is a no-op)."""

    __tablename__ = "audit_events"

    event_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    type: Mapped[str] = mapped_column(String(64), index=True)
    version: Mapped[int] = mapped_column(Integer)
    key: Mapped[str] = mapped_column(String(512))
    producer: Mapped[str] = mapped_column(String(256))
    epoch: Mapped[int] = mapped_column(BigInteger)
    seq: Mapped[int] = mapped_column(BigInteger)
    #: The request the event belongs to (its correlation id, or the payload's request id).
    request_id: Mapped[str | None] = mapped_column(String(256), index=True)
    worker_id: Mapped[str | None] = mapped_column(String(256), index=True)
    pool: Mapped[str | None] = mapped_column(String(128), index=True)
    #: ScalingDecision/ScalingApplied ``decision_id``; a RequestRouted's own event id.
    decision_id: Mapped[str | None] = mapped_column(String(128), index=True)
    occurred_at_ns: Mapped[int] = mapped_column(BigInteger, index=True)
    topic: Mapped[str] = mapped_column(String(256))
    kafka_partition: Mapped[int] = mapped_column(Integer)
    kafka_offset: Mapped[int] = mapped_column(BigInteger)
    payload: Mapped[dict[str, Any]] = mapped_column(JsonType)

    __table_args__ = (Index("ix_audit_events_position", "topic", "kafka_partition", "kafka_offset"),)


class AuditPosition(Base):
    """Next offset to read per partition; written in the same transaction as the rows."""

    __tablename__ = "audit_positions"

    topic: Mapped[str] = mapped_column(String(256), primary_key=True)
    kafka_partition: Mapped[int] = mapped_column(Integer, primary_key=True)
    next_offset: Mapped[int] = mapped_column(BigInteger)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Worker(Base):
    """The newest incarnation of each worker and its last reported load, plus request counters."""

    __tablename__ = "workers"

    worker_id: Mapped[str] = mapped_column(String(256), primary_key=True)
    epoch: Mapped[int] = mapped_column(BigInteger)
    role: Mapped[str] = mapped_column(String(16), default="")
    pool: Mapped[str] = mapped_column(String(128), default="", index=True)
    endpoint: Mapped[str] = mapped_column(String(512), default="")
    model: Mapped[str] = mapped_column(String(256), default="")
    #: ready | draining | gone | unregistered (load seen, registration not yet)
    state: Mapped[str] = mapped_column(String(16), default="ready")
    capacity: Mapped[dict[str, Any]] = mapped_column(JsonType, default=dict)
    block_size: Mapped[int] = mapped_column(Integer, default=0)
    hash_algo: Mapped[str] = mapped_column(String(64), default="")
    running: Mapped[int] = mapped_column(Integer, default=0)
    waiting: Mapped[int] = mapped_column(Integer, default=0)
    queued_prefill_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    active_decode_blocks: Mapped[int] = mapped_column(BigInteger, default=0)
    tier_usage: Mapped[dict[str, Any]] = mapped_column(JsonType, default=dict)
    registered_at_ns: Mapped[int] = mapped_column(BigInteger, default=0)
    reported_at_ns: Mapped[int] = mapped_column(BigInteger, default=0)
    drain_requested_at_ns: Mapped[int | None] = mapped_column(BigInteger)
    drain_requested_by: Mapped[str | None] = mapped_column(String(128))
    routed: Mapped[int] = mapped_column(BigInteger, default=0)
    completed: Mapped[int] = mapped_column(BigInteger, default=0)
    failed: Mapped[int] = mapped_column(BigInteger, default=0)
    #: The worker's lifecycle (common/fleet.py): the newest epoch registered, draining and
    #: deregistered (-1: none), which ``state`` is derived from.
    registered_epoch: Mapped[int] = mapped_column(BigInteger, default=-1, server_default="-1")
    draining_epoch: Mapped[int] = mapped_column(BigInteger, default=-1, server_default="-1")
    ended_epoch: Mapped[int] = mapped_column(BigInteger, default=-1, server_default="-1")


class WorkerIncarnation(Base):
    """One process lifetime of a worker (the envelope epoch of its registration)."""

    __tablename__ = "worker_incarnations"

    worker_id: Mapped[str] = mapped_column(String(256), primary_key=True)
    epoch: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    role: Mapped[str] = mapped_column(String(16), default="")
    pool: Mapped[str] = mapped_column(String(128), default="")
    endpoint: Mapped[str] = mapped_column(String(512), default="")
    registered_at_ns: Mapped[int | None] = mapped_column(BigInteger)
    draining_at_ns: Mapped[int | None] = mapped_column(BigInteger)
    deregistered_at_ns: Mapped[int | None] = mapped_column(BigInteger)
    reason: Mapped[str] = mapped_column(String(512), default="")


# -- configuration (projections of the admin stream) ---------------------------------------------


class Pool(Base):
    """SLO targets and bounds of a pool (``PoolUpdated``) and its pin (``PoolPinned``)."""

    __tablename__ = "pools"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    role: Mapped[str] = mapped_column(String(16))
    ttft_slo_ms: Mapped[float | None] = mapped_column(Float)
    itl_slo_ms: Mapped[float | None] = mapped_column(Float)
    min_replicas: Mapped[int] = mapped_column(Integer, default=0)
    max_replicas: Mapped[int] = mapped_column(Integer, default=0)
    gpus_per_replica: Mapped[int] = mapped_column(Integer, default=1)
    gpu_budget: Mapped[int | None] = mapped_column(Integer)
    pinned_replicas: Mapped[int | None] = mapped_column(Integer)
    pin_reason: Mapped[str] = mapped_column(String(512), default="")
    #: How many PoolUpdated/PoolPinned events shaped this row.
    version: Mapped[int] = mapped_column(Integer, default=0)
    updated_at_ns: Mapped[int] = mapped_column(BigInteger, default=0)
    updated_by: Mapped[str] = mapped_column(String(128), default="")
    last_event_id: Mapped[str] = mapped_column(String(64), default="")


class ConfigVersionColumns:
    """The columns of a config version table: one row per ``*ConfigChanged`` event, numbered by
    the version it assigned (never autoincremented: the log numbers them)."""

    version: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    config: Mapped[dict[str, Any]] = mapped_column(JsonType)
    created_at_ns: Mapped[int] = mapped_column(BigInteger)
    created_by: Mapped[str] = mapped_column(String(128))
    actor_role: Mapped[str] = mapped_column(String(16), default="")
    event_id: Mapped[str] = mapped_column(String(64))


class RouterConfigVersion(ConfigVersionColumns, Base):
    __tablename__ = "router_configs"


class PlannerConfigVersion(ConfigVersionColumns, Base):
    __tablename__ = "planner_configs"


#: The version table of each config kind (the ``/{kind}-config`` routes, the store's fold).
CONFIG_TABLES: dict[str, type[RouterConfigVersion] | type[PlannerConfigVersion]] = {
    "router": RouterConfigVersion, "planner": PlannerConfigVersion}


class RouterKeyRow(Base):
    """A router API key as the log states it (``RouterKeyIssued``, ``RouterKeyRevoked``): what
    an admin lists and revokes. Not its salt or hash: the routers verify keys from the log, the
    admin store only says which exist."""

    __tablename__ = "router_keys"

    key_id: Mapped[str] = mapped_column(String(16), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), index=True)
    expires_at_ns: Mapped[int | None] = mapped_column(BigInteger)
    rate_per_s: Mapped[float | None] = mapped_column(Float)
    burst: Mapped[int | None] = mapped_column(Integer)
    max_concurrent: Mapped[int | None] = mapped_column(Integer)
    issued_at_ns: Mapped[int] = mapped_column(BigInteger, default=0)
    issued_by: Mapped[str] = mapped_column(String(128), default="")
    revoked_at_ns: Mapped[int | None] = mapped_column(BigInteger)
    revoked_by: Mapped[str | None] = mapped_column(String(128))
    revoke_reason: Mapped[str] = mapped_column(String(512), default="")
    last_event_id: Mapped[str] = mapped_column(String(64), default="")


# -- local state ---------------------------------------------------------------------------------


class ApiToken(Base):
    """A bearer token: ``sy_<id>_<secret>``; only sha256(salt || secret) is stored. Rotation
    replaces the salt and hash (the id, name and role stay: the audit keeps one actor)."""

    __tablename__ = "api_tokens"

    id: Mapped[str] = mapped_column(String(16), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    role: Mapped[str] = mapped_column(String(16))
    salt: Mapped[str] = mapped_column(String(64))
    token_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    created_by: Mapped[str] = mapped_column(String(128), default="")
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    #: The token stops authenticating at this time (set at issue and at every rotation).
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
    rotated_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class ReplayJob(Base):
    __tablename__ = "replay_jobs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))
    params: Mapped[dict[str, Any]] = mapped_column(JsonType)
    #: queued | running | succeeded | failed
    status: Mapped[str] = mapped_column(String(16), default="queued", index=True)
    progress: Mapped[float] = mapped_column(Float, default=0.0)
    stage: Mapped[str] = mapped_column(String(64), default="")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    created_by: Mapped[str] = mapped_column(String(128), default="")
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    error: Mapped[str | None] = mapped_column(Text)


class ReplayResult(Base):
    __tablename__ = "replay_results"

    job_id: Mapped[str] = mapped_column(String(32), ForeignKey("replay_jobs.id", ondelete="CASCADE"), primary_key=True)
    summary: Mapped[dict[str, Any]] = mapped_column(JsonType)
    detail: Mapped[dict[str, Any]] = mapped_column(JsonType)
    plot_png: Mapped[bytes | None] = mapped_column(LargeBinary)
