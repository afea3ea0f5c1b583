"""Request and response shapes of the admin API (pydantic; one shape per purpose).

``XUpdate`` / ``XCreate`` are what a client sends, ``XPublic`` what it gets back; table models
never leave the service layer. Strings that reach the database refuse NUL characters (which
PostgreSQL cannot store) with a 422, and numbers are bounded, so no input becomes a 500.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

import msgspec
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, create_model, field_validator, model_validator

from control_plane.router.config import RouterConfig

T = TypeVar("T")

#: Any text without NUL characters (what PostgreSQL text and JSONB can hold).
Text = Annotated[str, StringConstraints(max_length=2000, pattern=r"^[^\x00]*$")]
Name = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
#: Ids found in the log (worker ids, request ids): anything printable, bounded.
LogId = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f]+$")]
PoolRole = Literal["prefill", "decode", "aggregated"]
RoleName = Literal["viewer", "operator", "admin"]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="null")


class ErrorDetail(BaseModel):
    message: str = Field(description="What went wrong, for a human.")
    code: str = Field(description="Machine-readable cause, e.g. not_found, forbidden, invalid_body.")


class ErrorBody(BaseModel):
    error: ErrorDetail


class Page(BaseModel, Generic[T]):
    items: list[T]
    total: int = Field(description="Items matching the query, over all pages.")
    limit: int
    offset: int


class ActionAccepted(BaseModel):
    """The event an operator action was recorded as (the log is the source of truth)."""

    event_id: str
    type: str
    topic: str
    partition: int
    offset: int
    actor: str


class WhoAmI(BaseModel):
    token_id: str
    name: str
    role: RoleName


class Health(BaseModel):
    status: Literal["ok", "degraded"]
    database: bool
    audit: dict[str, Any]
    reasons: list[str] = Field(default_factory=list,
                               description="Why the status is degraded: the database is unreachable, or the audit "
                                           "consumer is retrying a record (or waiting for the database).")


# -- workers -------------------------------------------------------------------------------------


class WorkerPublic(BaseModel):
    worker_id: str
    epoch: int = Field(description="Current incarnation (envelope epoch of its registration).")
    role: str
    pool: str
    endpoint: str
    model: str
    state: str = Field(description="ready | draining | gone | unregistered")
    capacity: dict[str, Any] = Field(description="Blocks per tier.")
    tier_usage: dict[str, Any] = Field(description="Used fraction per tier (last load report).")
    running: int
    waiting: int
    queued_prefill_tokens: int
    active_decode_blocks: int
    registered_at_ns: int
    reported_at_ns: int
    drain_requested_at_ns: int | None
    drain_requested_by: str | None
    routed: int
    completed: int
    failed: int


class IncarnationPublic(BaseModel):
    epoch: int
    role: str
    pool: str
    endpoint: str
    registered_at_ns: int | None
    draining_at_ns: int | None
    deregistered_at_ns: int | None
    reason: str


class WorkerDetail(WorkerPublic):
    incarnations: list[IncarnationPublic]
    blocks: dict[str, int] = Field(description="Blocks held per tier in the prefix index (folded from the log).")
    stale: bool = Field(description="The index does not trust its view of this worker (gap or new epoch).")


class DrainRequest(Strict):
    reason: Text = ""


# -- pools ---------------------------------------------------------------------------------------


class PoolUpdate(Strict):
    """The full new state of a pool's SLOs and bounds (PUT replaces it)."""

    role: PoolRole
    ttft_slo_ms: float | None = Field(default=None, gt=0, le=3_600_000, description="Time-to-first-token target.")
    itl_slo_ms: float | None = Field(default=None, gt=0, le=600_000, description="Inter-token latency target.")
    min_replicas: int = Field(default=0, ge=0, le=10_000)
    max_replicas: int = Field(default=1, ge=0, le=10_000)
    gpus_per_replica: int = Field(default=1, ge=1, le=64)
    gpu_budget: int | None = Field(default=None, ge=0, le=1_000_000, description="Accelerators the pool may use.")

    @model_validator(mode="after")
    def _bounds(self) -> PoolUpdate:
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) < min_replicas ({self.min_replicas}): the planner "
                             "keeps every decision inside [min, max]")
        if self.gpu_budget is not None and self.gpu_budget < self.min_replicas * self.gpus_per_replica:
            raise ValueError(f"gpu_budget {self.gpu_budget} cannot hold min_replicas x gpus_per_replica = "
                             f"{self.min_replicas * self.gpus_per_replica}: the floor would be unreachable")
        return self


class PinUpdate(Strict):
    replicas: int = Field(ge=0, le=10_000, description="Size to hold the pool at; the planner stops deciding it.")
    reason: Text = ""


class PoolPublic(BaseModel):
    name: str
    role: str
    ttft_slo_ms: float | None
    itl_slo_ms: float | None
    min_replicas: int
    max_replicas: int
    gpus_per_replica: int
    gpu_budget: int | None
    pinned_replicas: int | None
    pin_reason: str
    version: int
    updated_at_ns: int
    updated_by: str
    workers: dict[str, int] = Field(default_factory=dict, description="Workers of the pool by state (audit projection).")


# -- configs -------------------------------------------------------------------------------------


def shape_of(struct: type[msgspec.Struct], name: str, *, exclude: tuple[str, ...] = (), doc: str = "") -> type[Strict]:
    """The request shape of a domain config type, derived from it: the same fields, types and
    defaults (nested structs become nested shapes), unknown fields refused. Nothing is copied by
    hand, so a default changed in the domain type changes the API's with it; the domain type's
    own validation (its cross-field rules and their reasons) runs when the service builds it
    from the body, and answers 422."""
    fields: dict[str, Any] = {}
    for f in msgspec.structs.fields(struct):
        if f.name in exclude:
            continue
        ann = f.type
        nested = isinstance(ann, type) and issubclass(ann, msgspec.Struct)
        if nested:
            ann = shape_of(ann, f"{name}{ann.__name__}")
        if f.default is not msgspec.NODEFAULT:
            default = f.default
            fields[f.name] = (ann, Field(default=default))
        elif f.default_factory is not msgspec.NODEFAULT:
            factory = f.default_factory
            fields[f.name] = (ann, Field(default_factory=(lambda a=ann: a()) if nested else factory))
        else:
            fields[f.name] = (ann, ...)
    model = create_model(name, __base__=Strict, __doc__=doc or struct.__doc__, **fields)
    return model


#: A RouterConfig without its version (the API assigns the next one); see :func:`shape_of`.
RouterConfigIn = shape_of(RouterConfig, "RouterConfigIn", exclude=("version",), doc=(
    "A RouterConfig without its version (the API assigns the next one). Omitted fields take the "
    "router's defaults; cross-field rules (tier weights non-increasing...) answer 422 with the reason."))


class RouterConfigUpdate(Strict):
    config: RouterConfigIn
    expected_version: int | None = Field(default=None, ge=0, le=2**31 - 1,
                                         description="Fail with 409 unless this is the current version.")


class PlannerConfigUpdate(Strict):
    config: dict[str, Any] = Field(description="The planner config (a JSON object; validated by the planner).")
    expected_version: int | None = Field(default=None, ge=0, le=2**31 - 1)

    @field_validator("config")
    @classmethod
    def _storable(cls, v: dict[str, Any]) -> dict[str, Any]:
        _check_json(v, 0)
        return v


def _check_json(x: Any, depth: int) -> None:
    if depth > 16:
        raise ValueError("config nests deeper than 16 levels")
    if isinstance(x, str):
        if "\x00" in x or len(x) > 10_000:
            raise ValueError("strings must be under 10,000 characters, without NUL")
    elif isinstance(x, dict):
        if len(x) > 1000:
            raise ValueError("objects may have at most 1,000 keys")
        for k, v in x.items():
            _check_json(k, depth + 1)
            _check_json(v, depth + 1)
    elif isinstance(x, list):
        if len(x) > 10_000:
            raise ValueError("arrays may have at most 10,000 items")
        for v in x:
            _check_json(v, depth + 1)
    elif isinstance(x, float) and not math.isfinite(x):
        raise ValueError("numbers must be finite")
    elif isinstance(x, int) and not isinstance(x, bool) and abs(x) >= 2**63:
        raise ValueError("integers must fit in 64 bits")


class ConfigVersionPublic(BaseModel):
    version: int
    config: dict[str, Any]
    created_at_ns: int
    created_by: str
    actor_role: str
    event_id: str


# -- planner, index, events ----------------------------------------------------------------------


class PlannerDecisionPublic(BaseModel):
    decision_id: str
    pool: str
    occurred_at_ns: int
    role: str
    from_replicas: int
    to_replicas: int
    reason: str
    config_version: int
    inputs: dict[str, Any]
    applied: dict[str, Any] | None = Field(description="The ScalingApplied that followed, if any.")


class IndexStats(BaseModel):
    hash_algo: str
    block_size: int
    distinct_hashes: int
    applied: int
    age_ms: float = Field(description="How long before the answer the view last caught up with the log end.")
    stale_workers: list[str]
    deregistered: list[str]
    blocks: dict[str, dict[str, int]] = Field(description="Blocks per worker per tier.")
    counters: dict[str, int]
    positions: dict[str, int]
    digest: str | None = None


class OverlapQuery(Strict):
    """A prompt as token ids, or as text (tokenized like the router's default tokenizer)."""

    tokens: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] | None = Field(default=None, max_length=262_144)
    prompt: Annotated[str, StringConstraints(max_length=1_000_000)] | None = None

    @model_validator(mode="after")
    def _one(self) -> OverlapQuery:
        if (self.tokens is None) == (self.prompt is None):
            raise ValueError("give exactly one of tokens or prompt")
        return self


class WorkerOverlapPublic(BaseModel):
    worker_id: str
    matched_blocks: int
    matched_tokens: int
    by_tier: dict[str, int]
    stale: bool
    role: str | None
    state: str | None


class OverlapResult(BaseModel):
    tokens: int
    blocks: int = Field(description="Full blocks of the prompt (the hashed ones).")
    hash_algo: str
    block_size: int
    workers: list[WorkerOverlapPublic] = Field(description="Workers holding a prefix, longest first.")


class EventPublic(BaseModel):
    event_id: str
    type: str
    version: int
    key: str
    producer: str
    epoch: int
    seq: int
    request_id: str | None
    worker_id: str | None
    pool: str | None
    decision_id: str | None
    occurred_at_ns: int
    topic: str
    partition: int
    offset: int
    payload: dict[str, Any]


class TraceStep(BaseModel):
    stage: str = Field(description="admitted | routed | prefill | transfer | completed | failed | rejected")
    type: str
    occurred_at_ns: int
    since_admission_ms: float | None
    worker_id: str | None
    summary: str


class RequestTrace(BaseModel):
    request_id: str
    outcome: str = Field(description="completed | failed | rejected | in_flight | unknown")
    complete: bool = Field(description="Admitted and ended, with every stage its serving mode implies.")
    mode: str = Field(description="aggregated | disaggregated | unknown")
    missing: list[str]
    steps: list[TraceStep]
    routing: list[dict[str, Any]] = Field(description="Each RequestRouted: phase, worker, reason, score table.")
    events: list[EventPublic]


# -- replay jobs ---------------------------------------------------------------------------------


class ReplayJobCreate(Strict):
    kind: Literal["state", "verify", "whatif"]
    at: Annotated[str, StringConstraints(max_length=4000, pattern=r"^[^\x00]*$")] = Field(
        default="end", description="state: the point (ISO time, epoch ms, topic:partition:offset, positions JSON, "
                                   "request:<id>, end).")
    from_: Annotated[str, StringConstraints(max_length=4000, pattern=r"^[^\x00]*$")] = Field(
        default="start", alias="from", description="verify/whatif: start of the range.")
    to: Annotated[str, StringConstraints(max_length=4000, pattern=r"^[^\x00]*$")] = Field(default="end")
    router_config: RouterConfigIn | None = Field(default=None, description="whatif: the alternative config.")
    simulate: bool = Field(default=True, description="whatif: also run the simulated engine.")
    hash_algo: Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"] | None = Field(
        default=None, description="state: the engines' prefix hashing (default: the server's).")
    block_size: int | None = Field(default=None, ge=1, le=4096,
                                   description="state: tokens per hashed block (default: the server's).")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _needs(self) -> ReplayJobCreate:
        if self.kind == "whatif" and self.router_config is None:
            raise ValueError("a whatif job needs router_config (the alternative)")
        return self


class ReplayJobPublic(BaseModel):
    id: str
    kind: str
    params: dict[str, Any]
    status: str = Field(description="queued | running | succeeded | failed")
    progress: float
    stage: str
    created_at: datetime
    created_by: str
    started_at: datetime | None
    finished_at: datetime | None
    error: str | None = Field(description="Why a failed job failed, in one line (the traceback stays in the "
                                          "server's log).")

    @field_validator("error")
    @classmethod
    def _one_line(cls, v: str | None) -> str | None:
        # Rows written before errors were one line held a traceback: never show it.
        return None if v is None else (v.strip().splitlines() or [""])[0][:500]


class ReplayResultPublic(BaseModel):
    job_id: str
    summary: dict[str, Any]
    detail: dict[str, Any]
    has_plot: bool


# -- tokens --------------------------------------------------------------------------------------


#: Days a token authenticates; the server's default (30) when omitted, at most its maximum (365).
ExpiresInDays = Annotated[int | None, Field(default=None, ge=1, le=3650, description=(
    "Days the token authenticates from now (default: the server's token_ttl_days, 30; at most its "
    "token_max_ttl_days, 365)."))]


class TokenCreate(Strict):
    name: Name
    role: RoleName
    expires_in_days: ExpiresInDays = None


class TokenRotate(Strict):
    """A new secret for an existing token id; the old secret stops authenticating at once."""

    expires_in_days: ExpiresInDays = None


class TokenPublic(BaseModel):
    id: str
    name: str
    role: str
    created_at: datetime
    created_by: str
    revoked_at: datetime | None
    expires_at: datetime = Field(description="The token stops authenticating at this time (401 token_expired).")
    rotated_at: datetime | None = Field(description="When its secret was last replaced.")


class TokenCreated(TokenPublic):
    token: str = Field(description="The bearer token. Shown once; only its salted hash is stored.")


# -- router API keys ------------------------------------------------------------------------------


class RouterKeyCreate(Strict):
    """A router API key to issue: who it is for, when it stops (never, by default) and its
    limits on each router replica (none, by default)."""

    name: Name = Field(description="Who or what the key is for; unique among keys that are not revoked.")
    expires_in_days: int | None = Field(default=None, ge=1, le=3650,
                                        description="Days the key authenticates from now; omitted: it never expires.")
    rate_per_s: float | None = Field(default=None, gt=0, le=1_000_000,
                                     description="Requests per second the key may start (per router replica).")
    burst: int | None = Field(default=None, ge=1, le=1_000_000,
                              description="Requests above the rate that may come at once (default: one second's).")
    max_concurrent: int | None = Field(default=None, ge=1, le=1_000_000,
                                       description="Requests the key may have in flight (per router replica).")
    session_from_user: bool = Field(default=False, description=(
        "The OpenAI `user` field of this key's requests names their session, as an x-session-id header "
        "would (docs/sessions.md); off: `user` is only metadata."))

    @model_validator(mode="after")
    def _burst_needs_a_rate(self) -> RouterKeyCreate:
        if self.burst is not None and self.rate_per_s is None:
            raise ValueError("burst is the size of a rate's bucket: give rate_per_s too")
        return self


class RouterKeyPublic(BaseModel):
    key_id: str
    name: str
    expires_at_ns: int | None = Field(description="Unix ns after which it stops authenticating; null: never.")
    rate_per_s: float | None
    burst: int | None
    max_concurrent: int | None
    issued_at_ns: int
    issued_by: str
    revoked_at_ns: int | None
    revoked_by: str | None
    revoke_reason: str


class RouterKeyCreated(RouterKeyPublic):
    key: str = Field(description="The API key (Authorization: Bearer <key> on the router). Shown once: the log and "
                                 "the store keep only its salted hash.")
