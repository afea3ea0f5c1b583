"""The admin service's pure parts: the audit projection's folds, the request trace, tokens."""

from __future__ import annotations

import time

from control_plane.admin.audit.projection import audit_row, counter_of, fold_pool, fold_worker, payload_json
from control_plane.admin.auth import Role, issue_token, parse_token, verify_secret
from control_plane.admin.queries import build_trace
from control_plane.admin.shapes import EventPublic
from schemas import EnvelopeFactory
from schemas import events as ev
from schemas.types import RoutingMode


def _env(producer: str, epoch: int, payload, **kw):
    return EnvelopeFactory(producer, epoch, time.time_ns).wrap(payload, **kw)


def _reg(epoch: int, endpoint: str = "http://w"):
    return _env("w1", epoch, ev.WorkerRegistered(worker_id="w1", role="decode", pool="p", endpoint=endpoint, block_size=16,
                                              hash_algo="sha256", transfer=ev.TransferInfo(agent_metadata=b"\x00\x01")))


def test_worker_fold_keeps_the_newest_incarnation() -> None:
    row = fold_worker(None, _reg(5))
    assert (row["epoch"], row["state"], row["role"]) == (5, "ready", "decode")
    loaded = fold_worker(row, _env("w1", 5, ev.WorkerLoadReported(worker_id="w1", running=2, waiting=1)))
    assert loaded["running"] == 2
    assert fold_worker(loaded, _env("w1", 4, ev.WorkerLoadReported(worker_id="w1", running=9, waiting=9))) is None
    # A newer incarnation's load arriving before its registration: taken, marked unregistered.
    early = fold_worker(loaded, _env("w1", 6, ev.WorkerLoadReported(worker_id="w1", running=0, waiting=0)))
    assert (early["epoch"], early["state"]) == (6, "unregistered")
    assert fold_worker(early, _reg(6, "http://new"))["state"] == "ready"
    # An operator's drain request comes from the admin producer, whose epoch is not the worker's.
    asked = fold_worker(loaded, _env("admin-api", 999, ev.WorkerDrainRequested(worker_id="w1", actor="ops")))
    assert (asked["epoch"], asked["drain_requested_by"]) == (5, "ops")


def test_counters_pools_and_rows() -> None:
    routed = _env("r", 1, ev.RequestRouted(request_id="q", worker_id="w1", mode=RoutingMode.KV, config_version=1,
                                        rng_seed=1), correlation_id="q")
    assert counter_of(routed) == ("w1", "routed")
    assert counter_of(_env("r", 1, ev.RequestFailed(request_id="q", reason="x", code="timeout"))) is None
    row = audit_row(routed, "t.requests", 2, 40)
    assert (row["request_id"], row["worker_id"], row["decision_id"]) == ("q", "w1", routed.event_id)
    pool = fold_pool(None, _env("a", 1, ev.PoolUpdated(actor="ops", pool="p", role="decode", max_replicas=4)))
    pool = fold_pool(pool, _env("a", 1, ev.PoolPinned(actor="bob", pool="p", replicas=3, reason="x")))
    assert (pool["max_replicas"], pool["pinned_replicas"], pool["version"], pool["updated_by"]) == (4, 3, 2, "bob")
    pool = fold_pool(pool, _env("a", 1, ev.PoolPinned(actor="bob", pool="p")))
    assert pool["pinned_replicas"] is None and pool["pin_reason"] == ""


def test_payloads_are_storable_json() -> None:
    doc = payload_json(_reg(1).data)
    assert doc["transfer"]["agent_metadata"] == "AAE="  # bytes as base64
    doc = payload_json(ev.RequestFailed(request_id="q", reason="bad\x00byte", code="x"))
    assert doc["reason"] == "bad\ufffdbyte"  # PostgreSQL text/JSONB cannot hold NUL


def _ev(t: str, at: int, **payload) -> EventPublic:
    return EventPublic(event_id=f"e{at}", type=t, version=1, key="q", producer="p", epoch=1, seq=at, request_id="q",
                       worker_id=payload.get("worker_id"), pool=None, decision_id=None, occurred_at_ns=at * 1_000_000,
                       topic="t.requests", partition=0, offset=at, payload=payload)


def test_trace_names_what_is_missing() -> None:
    adm = _ev("RequestAdmitted", 0, prompt_tokens=10, max_tokens=2)
    pre = _ev("RequestRouted", 1, phase="prefill", worker_id="p1", mode="kv")
    done = _ev("PrefillCompleted", 5, worker_id="p1", duration_ms=4.0)
    t = build_trace("q", [adm, pre, done])
    assert (t.outcome, t.complete, t.mode) == ("in_flight", False, "disaggregated")
    assert t.missing == ["RequestRouted(phase=decode)", "KvTransferStarted", "KvTransferCompleted", "RequestCompleted"]
    agg = build_trace("q", [adm, _ev("RequestRouted", 1, phase="aggregated", worker_id="w"),
                            _ev("RequestCompleted", 9, worker_id="w", output_tokens=2, ttft_ms=3.0, e2e_ms=8.0)])
    assert (agg.complete, agg.mode, agg.steps[-1].since_admission_ms) == (True, "aggregated", 9.0)


def test_tokens_are_checked_against_salted_hashes() -> None:
    t = issue_token()
    tid, secret = parse_token(t.token)
    assert tid == t.token_id and verify_secret(t.salt, t.token_hash, secret)
    assert not verify_secret(t.salt, t.token_hash, secret + "x")
    assert issue_token().token_hash != t.token_hash
    for bad in ("", "sy_", "xx_12345678_abc", "sy_nothex!_abc", "sy_12345678_"):
        assert parse_token(bad) is None
    assert Role.ADMIN.allows(Role.OPERATOR) and not Role.VIEWER.allows(Role.OPERATOR)
