"""The audit projection: what each event contributes to the admin store's tables. Pure.

No SQLAlchemy here: functions take a decoded envelope (and the row state as a plain dict) and
return plain dicts. :mod:`control_plane.admin.audit.store` turns them into batch upserts.

* :func:`audit_row` -- the ``audit_events`` row of any event: indexed by event id, type,
  request (correlation), worker, pool, decision, time and log position; payload as JSON.
* :func:`fold_worker` / :func:`fold_incarnation` -- the worker registry and load view. Which
  registration is admitted and whether an incarnation is draining or gone is the fleet's rule
  (``common/fleet.py``, the one every view applies), on the lifecycle each row keeps
  (``registered_epoch``, ``draining_epoch``, ``ended_epoch``); an older incarnation's events
  never overwrite a newer one's state.
* :func:`counter_of` -- which per-worker counter a request event increments.
* :func:`fold_pool`, :func:`config_row`, :func:`fold_router_key` -- pools, config versions and
  router API keys from the ``admin`` stream.

Each fold dispatches on the payload's type through one table (type -> handler), as
:mod:`control_plane.metrics.projection` does: what an event type does to a table is one entry,
and a type absent from the table leaves the row alone (the fold answers None).

Interleavings: a worker's own events are on one ``workers`` partition, its drain requests on
one ``admin`` partition, and request counters only add; the one cross-topic rule, which
incarnation a drain request is about, goes by event time. So the tables are the same for any
interleaving that keeps each partition's order (``tests/integration/test_audit_interleavings.py``).

Idempotence is the store's job: it folds an event only when its ``audit_events`` row was newly
inserted, so a redelivered event changes nothing, counters included.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

import msgspec

from common.fleet import READY, Lifecycle, step
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
    RouterKeyIssued,
    RouterKeyRevoked,
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


#: Events that are a routing decision themselves: their decision id is their own event id.
_OWN_DECISIONS = frozenset({RequestRouted})


def index_fields(env: Envelope[Event]) -> tuple[str | None, str | None, str | None, str | None]:
    """(request id, worker id, pool, decision id) an event is found by."""
    ev = env.data
    request_id = getattr(ev, "request_id", None) or env.correlation_id
    worker_id = getattr(ev, "worker_id", None) or getattr(ev, "src_worker", None)
    pool = getattr(ev, "pool", None)
    decision_id = getattr(ev, "decision_id", None)
    if decision_id is None and type(ev) in _OWN_DECISIONS:
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

Row = dict[str, Any]
#: (row before, or None; envelope; its payload) -> row after, or None when it does not change.
Fold = Callable[[Row | None, Envelope[Event], Any], Row | None]
#: Mutates ``out`` (a copy of the row, already made) with what the event says.
Apply = Callable[[Row, Envelope[Event], Any], None]


def new_worker(worker_id: str, epoch: int) -> Row:
    return {"worker_id": worker_id, "epoch": epoch, "role": "", "pool": "", "endpoint": "", "model": "",
            "state": "unregistered", "capacity": {}, "block_size": 0, "hash_algo": "", "running": 0, "waiting": 0,
            "queued_prefill_tokens": 0, "active_decode_blocks": 0, "tier_usage": {}, "registered_at_ns": 0,
            "reported_at_ns": 0, "drain_requested_at_ns": None, "drain_requested_by": None, "routed": 0,
            "completed": 0, "failed": 0, "registered_epoch": -1, "draining_epoch": -1, "ended_epoch": -1}


def fold_worker(row: Row | None, env: Envelope[Event]) -> Row | None:
    """The worker row after ``env`` (None: the event does not change it)."""
    fold = _WORKER_FOLDS.get(type(env.data))
    return None if fold is None else fold(row, env, env.data)


def _drain_requested(row: Row | None, env: Envelope[Event], ev: WorkerDrainRequested) -> Row | None:
    # An operator's request (producer: the admin API, whose epoch is not the worker's, on the
    # admin topic): it is about the incarnation registered at its event time. One asked before
    # the registration folded so far was asked of an earlier incarnation.
    if row is not None and env.occurred_at_ns < row["registered_at_ns"]:
        return None
    out = dict(row) if row is not None else new_worker(ev.worker_id, 0)
    out["drain_requested_at_ns"] = env.occurred_at_ns
    out["drain_requested_by"] = _clip(ev.actor, 128)
    return out


def _life(row: Row | None) -> Lifecycle:
    if row is None:
        return Lifecycle()
    return Lifecycle(registered=row["registered_epoch"], draining=row["draining_epoch"], ended=row["ended_epoch"])


def _state(life: Lifecycle, epoch: int) -> str:
    """The row's state: the fleet's for incarnation ``epoch``, ``unregistered`` while it is
    ready but its registration is not folded yet (the topics have no order between partitions)."""
    state = life.state(epoch)
    return "unregistered" if state == READY and life.registered < epoch else state


def _lifecycle_event(row: Row | None, env: Envelope[Event], ev: Any) -> Row | None:
    """``WorkerRegistered`` / ``WorkerDraining`` / ``WorkerDeregistered``: the fleet's step on
    the row's lifecycle; the row is about the newest incarnation any of them named."""
    ch = step(_life(row), env)
    out = dict(row) if row is not None else new_worker(ev.worker_id, env.epoch)
    life = ch.after
    out.update(registered_epoch=life.registered, draining_epoch=life.draining, ended_epoch=life.ended)
    newer = env.epoch > out["epoch"]
    if newer:
        out["epoch"] = env.epoch
    reg = ch.registration
    if reg is not None and reg.epoch == out["epoch"]:
        out.update(role=reg.role, pool=_clip(reg.pool, 128), endpoint=_clip(reg.endpoint, 512),
                   model=_clip(reg.model, 256), capacity=dict(reg.capacity), block_size=reg.block_size,
                   hash_algo=reg.hash_algo[:64], registered_at_ns=reg.registered_at_ns)
        if newer:
            # A new incarnation starts with nothing reported and no drain asked of it, unless the
            # request is from after its registration (folded first: the admin topic ran ahead).
            out.update(running=0, waiting=0, queued_prefill_tokens=0, active_decode_blocks=0, tier_usage={})
            if (out["drain_requested_at_ns"] or 0) < reg.registered_at_ns:
                out.update(drain_requested_at_ns=None, drain_requested_by=None)
    out["state"] = _state(life, out["epoch"])
    return None if out == row else out


def _load_reported(row: Row | None, env: Envelope[Event], ev: WorkerLoadReported) -> Row | None:
    if row is not None and env.epoch < row["epoch"]:
        return None  # an older incarnation's: never overwrites a newer one's state
    out = dict(row) if row is not None else new_worker(ev.worker_id, env.epoch)
    if env.epoch > out["epoch"]:
        # An incarnation whose registration is not folded yet: taken, marked unregistered.
        out["epoch"] = env.epoch
        out["state"] = _state(_life(out), env.epoch)
    out.update(running=ev.running, waiting=ev.waiting, queued_prefill_tokens=ev.queued_prefill_tokens,
               active_decode_blocks=ev.active_decode_blocks, tier_usage=dict(ev.tier_usage),
               reported_at_ns=env.occurred_at_ns)
    return out


_WORKER_FOLDS: dict[type[Event], Fold] = {
    WorkerDrainRequested: _drain_requested,
    WorkerRegistered: _lifecycle_event,
    WorkerLoadReported: _load_reported,
    WorkerDraining: _lifecycle_event,
    WorkerDeregistered: _lifecycle_event,
}


def new_incarnation(worker_id: str, epoch: int) -> Row:
    return {"worker_id": worker_id, "epoch": epoch, "role": "", "pool": "", "endpoint": "",
            "registered_at_ns": None, "draining_at_ns": None, "deregistered_at_ns": None, "reason": ""}


def fold_incarnation(row: Row | None, env: Envelope[Event]) -> Row | None:
    """The ``worker_incarnations`` row (keyed by worker id and the envelope's epoch)."""
    ev = env.data
    apply = _INCARNATION_FOLDS.get(type(ev))
    if apply is None:
        return None
    out = dict(row) if row is not None else new_incarnation(ev.worker_id, env.epoch)
    apply(out, env, ev)
    return out


def _incarnation_registered(out: Row, env: Envelope[Event], ev: WorkerRegistered) -> None:
    out.update(role=_enum(ev.role), pool=_clip(ev.pool, 128), endpoint=_clip(ev.endpoint, 512),
               registered_at_ns=env.occurred_at_ns)


def _incarnation_draining(out: Row, env: Envelope[Event], ev: WorkerDraining) -> None:
    out.update(draining_at_ns=env.occurred_at_ns, reason=_clip(ev.reason, 512))


def _incarnation_gone(out: Row, env: Envelope[Event], ev: WorkerDeregistered) -> None:
    # The draining reason stays when the deregistration gives none.
    out.update(deregistered_at_ns=env.occurred_at_ns, reason=_clip(ev.reason, 512) or out["reason"])


_INCARNATION_FOLDS: dict[type[Event], Apply] = {
    WorkerRegistered: _incarnation_registered,
    WorkerDraining: _incarnation_draining,
    WorkerDeregistered: _incarnation_gone,
}


#: Request event type -> (worker id, counter column) it increments, or None.
_COUNTERS: dict[type[Event], Callable[[Any], tuple[str, str] | None]] = {
    RequestRouted: lambda ev: (ev.worker_id, "routed"),
    RequestCompleted: lambda ev: (ev.worker_id, "completed"),
    # A request that failed before any worker was chosen counts against none.
    RequestFailed: lambda ev: (ev.worker_id, "failed") if ev.worker_id else None,
}


def counter_of(env: Envelope[Event]) -> tuple[str, str] | None:
    """(worker id, counter column) a request event increments."""
    counter = _COUNTERS.get(type(env.data))
    return None if counter is None else counter(env.data)


# -- admin stream --------------------------------------------------------------------------------


def new_pool(name: str) -> Row:
    return {"name": name, "role": "", "ttft_slo_ms": None, "itl_slo_ms": None, "min_replicas": 0, "max_replicas": 0,
            "gpus_per_replica": 1, "gpu_budget": None, "pinned_replicas": None, "pin_reason": "", "version": 0,
            "updated_at_ns": 0, "updated_by": "", "last_event_id": ""}


def fold_pool(row: Row | None, env: Envelope[Event]) -> Row | None:
    ev = env.data
    apply = _POOL_FOLDS.get(type(ev))
    if apply is None:
        return None
    out = dict(row) if row is not None else new_pool(ev.pool)
    apply(out, env, ev)
    # Every pool event is a new version of the row, naming who made it.
    out.update(version=out["version"] + 1, updated_at_ns=env.occurred_at_ns, updated_by=_clip(ev.actor, 128),
               last_event_id=env.event_id[:64])
    return out


def _pool_updated(out: Row, env: Envelope[Event], ev: PoolUpdated) -> None:
    out.update(role=_enum(ev.role), ttft_slo_ms=ev.ttft_slo_ms, itl_slo_ms=ev.itl_slo_ms,
               min_replicas=ev.min_replicas, max_replicas=ev.max_replicas, gpus_per_replica=ev.gpus_per_replica,
               gpu_budget=ev.gpu_budget)


def _pool_pinned(out: Row, env: Envelope[Event], ev: PoolPinned) -> None:
    # An unpin (replicas None) clears the reason with the pin.
    out.update(pinned_replicas=ev.replicas, pin_reason=_clip(ev.reason, 512) if ev.replicas is not None else "")


_POOL_FOLDS: dict[type[Event], Apply] = {PoolUpdated: _pool_updated, PoolPinned: _pool_pinned}

#: Config change event type -> the config kind it versions (the key of ``CONFIG_TABLES``).
CONFIG_EVENTS: dict[type[Event], str] = {RouterConfigChanged: "router", PlannerConfigChanged: "planner"}


def config_row(env: Envelope[Event]) -> tuple[str, Row] | None:
    """("router" | "planner", row) for a config change."""
    ev = env.data
    kind = CONFIG_EVENTS.get(type(ev))
    if kind is None:
        return None
    return kind, {"version": ev.config_version, "config": scrub_nul(msgspec.to_builtins(ev.config)),
                  "created_at_ns": env.occurred_at_ns, "created_by": _clip(ev.actor, 128),
                  "actor_role": (ev.actor_role or "")[:16], "event_id": env.event_id[:64]}


def new_router_key(key_id: str) -> Row:
    return {"key_id": key_id, "name": "", "expires_at_ns": None, "rate_per_s": None, "burst": None,
            "max_concurrent": None, "issued_at_ns": 0, "issued_by": "", "revoked_at_ns": None, "revoked_by": None,
            "revoke_reason": "", "last_event_id": ""}


def fold_router_key(row: Row | None, env: Envelope[Event]) -> Row | None:
    """The ``router_keys`` row after ``env``; the same rules as the routers' key table
    (:class:`control_plane.router.keys.KeyTable`): the first issue of an id wins, a revoked id
    stays revoked."""
    ev = env.data
    apply = _ROUTER_KEY_FOLDS.get(type(ev))
    if apply is None:
        return None
    out = dict(row) if row is not None else new_router_key(ev.key_id)
    return out if apply(out, env, ev) else None


def _router_key_issued(out: Row, env: Envelope[Event], ev: RouterKeyIssued) -> bool:
    if out["issued_at_ns"]:
        return False
    out.update(name=_clip(ev.name, 128), expires_at_ns=ev.expires_at_ns, rate_per_s=ev.rate_per_s, burst=ev.burst,
               max_concurrent=ev.max_concurrent, issued_at_ns=env.occurred_at_ns or 1,
               issued_by=_clip(ev.actor, 128), last_event_id=env.event_id[:64])
    return True


def _router_key_revoked(out: Row, env: Envelope[Event], ev: RouterKeyRevoked) -> bool:
    if out["revoked_at_ns"] is not None:
        return False
    out.update(revoked_at_ns=env.occurred_at_ns, revoked_by=_clip(ev.actor, 128),
               revoke_reason=_clip(ev.reason, 512), last_event_id=env.event_id[:64])
    return True


_ROUTER_KEY_FOLDS: dict[type[Event], Callable[[Row, Envelope[Event], Any], bool]] = {
    RouterKeyIssued: _router_key_issued, RouterKeyRevoked: _router_key_revoked}


def _enum(v) -> str:
    return getattr(v, "value", v)
