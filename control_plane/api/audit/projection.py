"""The audit projection: what each event contributes to the admin store's tables. Pure.

No SQLAlchemy here: functions take a decoded envelope (and the row state as a plain dict) and
return plain dicts. :mod:`control_plane.api.audit.store` turns them into batch upserts.

* :func:`audit_row` -- the ``audit_events`` row of any event: indexed by event id, type,
  request (correlation), worker, pool, decision, time and log position; payload as JSON.
* :func:`fold_worker` / :func:`fold_incarnation` -- the worker registry and load view (same
  epoch rules as :class:`control_plane.router.view.RouterView`: an older incarnation's events
  never overwrite a newer one's state).
* :func:`counter_of` -- which per-worker counter a request event increments.
* :func:`fold_pool`, :func:`config_row` -- pools and config versions from the ``admin`` stream.

Idempotence is the store's job: it folds an event only when its ``audit_events`` row was newly
inserted, so a redelivered event changes nothing, counters included.
"""

from __future__ import annotations

import base64
from typing import Any

import msgspec

from schemas import Envelope
from schemas.events import (
    Event,
    PlannerConfigChanged,
    PoolPinned,
    PoolUpdated,
    RequestCompleted,
    RequestFailed,
    RequestRouted,
    RouterConfigChanged,
    WorkerDeregistered,
    WorkerDraining,
    WorkerDrainRequested,
    WorkerLoadReported,
    WorkerRegistered,
)

_json_enc = msgspec.json.Encoder()


def payload_json(data: Event) -> dict[str, Any]:
    """The payload as JSON-able builtins (bytes as base64). NUL characters, which PostgreSQL
    text and JSONB cannot store, are replaced by U+FFFD (only when present: a cheap check on
    the encoded form first)."""
    doc = msgspec.to_builtins(data, enc_hook=_enc_hook)
    if b"\\u0000" in _json_enc.encode(doc):
        doc = scrub_nul(doc)
    return doc


def _enc_hook(obj):
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(obj)).decode()
    raise NotImplementedError(type(obj))


def scrub_nul(x):
    if isinstance(x, str):
        return x.replace("\x00", "\ufffd")
    if isinstance(x, dict):
        return {scrub_nul(k): scrub_nul(v) for k, v in x.items()}
    if isinstance(x, list):
        return [scrub_nul(v) for v in x]
    return x


def _clip(s: str | None, n: int) -> str | None:
    if s is None:
        return None
    s = s.replace("\x00", "\ufffd")
    return s if len(s) <= n else s[:n]


def index_fields(env: Envelope[Event]) -> tuple[str | None, str | None, str | None, str | None]:
    """(request id, worker id, pool, decision id) an event is found by."""
    ev = env.data
    request_id = getattr(ev, "request_id", None) or env.correlation_id
    worker_id = getattr(ev, "worker_id", None) or getattr(ev, "src_worker", None)
    pool = getattr(ev, "pool", None)
    decision_id = getattr(ev, "decision_id", None)
    if decision_id is None and isinstance(ev, RequestRouted):
        decision_id = env.event_id
    return request_id, worker_id, pool, decision_id


def audit_row(env: Envelope[Event], topic: str, partition: int, offset: int) -> dict[str, Any]:
    request_id, worker_id, pool, decision_id = index_fields(env)
    return {
        "event_id": _clip(env.event_id, 64), "type": _clip(env.type, 64), "version": env.version, "key": _clip(env.key, 512),
        "producer": _clip(env.producer, 256), "epoch": env.epoch, "seq": env.seq,
        "request_id": _clip(request_id, 256), "worker_id": _clip(worker_id, 256), "pool": _clip(pool, 128),
        "decision_id": _clip(decision_id, 128), "occurred_at_ns": env.occurred_at_ns, "topic": topic,
        "kafka_partition": partition, "kafka_offset": offset, "payload": payload_json(env.data),
    }


# -- workers -------------------------------------------------------------------------------------


def new_worker(worker_id: str, epoch: int) -> dict[str, Any]:
    return {"worker_id": worker_id, "epoch": epoch, "role": "", "pool": "", "endpoint": "", "model": "",
            "state": "unregistered", "capacity": {}, "block_size": 0, "hash_algo": "", "running": 0, "waiting": 0,
            "queued_prefill_tokens": 0, "active_decode_blocks": 0, "tier_usage": {}, "registered_at_ns": 0,
            "reported_at_ns": 0, "drain_requested_at_ns": None, "drain_requested_by": None, "routed": 0,
            "completed": 0, "failed": 0}


WORKER_EVENTS = (WorkerRegistered, WorkerLoadReported, WorkerDraining, WorkerDeregistered, WorkerDrainRequested)


def fold_worker(row: dict[str, Any] | None, env: Envelope[Event]) -> dict[str, Any] | None:
    """The worker row after ``env`` (None: the event does not change it)."""
    ev = env.data
    if not isinstance(ev, WORKER_EVENTS):
        return None
    if isinstance(ev, WorkerDrainRequested):
        # An operator's request (producer: the admin API, whose epoch is not the worker's).
        out = dict(row) if row is not None else new_worker(ev.worker_id, 0)
        out["drain_requested_at_ns"] = env.occurred_at_ns
        out["drain_requested_by"] = _clip(ev.actor, 128)
        return out
    if row is not None and env.epoch < row["epoch"]:
        return None  # an older incarnation
    out = dict(row) if row is not None else new_worker(ev.worker_id, env.epoch)
    newer = env.epoch > out["epoch"]
    if isinstance(ev, WorkerRegistered):
        out.update(epoch=env.epoch, role=_enum(ev.role), pool=_clip(ev.pool, 128), endpoint=_clip(ev.endpoint, 512),
                   model=_clip(ev.model, 256), state="ready", capacity=dict(ev.capacity), block_size=ev.block_size,
                   hash_algo=ev.hash_algo[:64], registered_at_ns=env.occurred_at_ns)
        if newer:
            out.update(running=0, waiting=0, queued_prefill_tokens=0, active_decode_blocks=0, tier_usage={},
                       drain_requested_at_ns=None, drain_requested_by=None)
        return out
    if newer:
        # An incarnation whose registration is not folded yet (the topics have no order
        # between partitions): take it, marked unregistered until the registration arrives.
        out.update(epoch=env.epoch, state="unregistered")
    if isinstance(ev, WorkerLoadReported):
        out.update(running=ev.running, waiting=ev.waiting, queued_prefill_tokens=ev.queued_prefill_tokens,
                   active_decode_blocks=ev.active_decode_blocks, tier_usage=dict(ev.tier_usage),
                   reported_at_ns=env.occurred_at_ns)
    elif isinstance(ev, WorkerDraining):
        out["state"] = "draining"
    else:
        out["state"] = "gone"
    return out


def fold_incarnation(row: dict[str, Any] | None, env: Envelope[Event]) -> dict[str, Any] | None:
    """The ``worker_incarnations`` row (keyed by worker id and the envelope's epoch)."""
    ev = env.data
    if not isinstance(ev, (WorkerRegistered, WorkerDraining, WorkerDeregistered)):
        return None
    out = dict(row) if row is not None else {
        "worker_id": ev.worker_id, "epoch": env.epoch, "role": "", "pool": "", "endpoint": "",
        "registered_at_ns": None, "draining_at_ns": None, "deregistered_at_ns": None, "reason": ""}
    if isinstance(ev, WorkerRegistered):
        out.update(role=_enum(ev.role), pool=_clip(ev.pool, 128), endpoint=_clip(ev.endpoint, 512),
                   registered_at_ns=env.occurred_at_ns)
    elif isinstance(ev, WorkerDraining):
        out.update(draining_at_ns=env.occurred_at_ns, reason=_clip(ev.reason, 512))
    else:
        out.update(deregistered_at_ns=env.occurred_at_ns, reason=_clip(ev.reason, 512) or out["reason"])
    return out


def counter_of(env: Envelope[Event]) -> tuple[str, str] | None:
    """(worker id, counter column) a request event increments."""
    ev = env.data
    if isinstance(ev, RequestRouted):
        return ev.worker_id, "routed"
    if isinstance(ev, RequestCompleted):
        return ev.worker_id, "completed"
    if isinstance(ev, RequestFailed) and ev.worker_id:
        return ev.worker_id, "failed"
    return None


# -- admin stream --------------------------------------------------------------------------------


def fold_pool(row: dict[str, Any] | None, env: Envelope[Event]) -> dict[str, Any] | None:
    ev = env.data
    if not isinstance(ev, (PoolUpdated, PoolPinned)):
        return None
    out = dict(row) if row is not None else {
        "name": ev.pool, "role": "", "ttft_slo_ms": None, "itl_slo_ms": None, "min_replicas": 0, "max_replicas": 0,
        "gpus_per_replica": 1, "gpu_budget": None, "pinned_replicas": None, "pin_reason": "", "version": 0,
        "updated_at_ns": 0, "updated_by": "", "last_event_id": ""}
    if isinstance(ev, PoolUpdated):
        out.update(role=_enum(ev.role), ttft_slo_ms=ev.ttft_slo_ms, itl_slo_ms=ev.itl_slo_ms,
                   min_replicas=ev.min_replicas, max_replicas=ev.max_replicas, gpus_per_replica=ev.gpus_per_replica,
                   gpu_budget=ev.gpu_budget)
    else:
        out.update(pinned_replicas=ev.replicas, pin_reason=_clip(ev.reason, 512) if ev.replicas is not None else "")
    out.update(version=out["version"] + 1, updated_at_ns=env.occurred_at_ns, updated_by=_clip(ev.actor, 128),
               last_event_id=env.event_id[:64])
    return out


def config_row(env: Envelope[Event]) -> tuple[str, dict[str, Any]] | None:
    """("router" | "planner", row) for a config change."""
    ev = env.data
    if isinstance(ev, (RouterConfigChanged, PlannerConfigChanged)):
        kind = "router" if isinstance(ev, RouterConfigChanged) else "planner"
        return kind, {"version": ev.config_version, "config": scrub_nul(msgspec.to_builtins(ev.config)),
                      "created_at_ns": env.occurred_at_ns, "created_by": _clip(ev.actor, 128),
                      "actor_role": (ev.actor_role or "")[:16], "event_id": env.event_id[:64]}
    return None


def _enum(v) -> str:
    return getattr(v, "value", v)
