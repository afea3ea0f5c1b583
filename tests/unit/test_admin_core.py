"""The admin service's pure parts: the audit projection's folds, the request trace, tokens,
authentication at a given time, the failed-authentication limiter and replay job arguments."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

import pytest

from control_plane.admin.audit.projection import audit_row, counter_of, fold_pool, fold_worker, payload_json
from control_plane.admin import jobargs
from control_plane.admin.auth import (
    Denial,
    Principal,
    Role,
    TokenRecord,
    authenticate,
    expiry,
    issue_token,
    parse_token,
    verify_secret,
)
from control_plane.admin.jobs import public_error
from control_plane.admin.ratelimit import FailureLimiter
from control_plane.admin.queries import build_trace
from control_plane.admin.shapes import EventPublic
from control_plane.replay.errors import BadPoint
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


def _record(**overrides) -> tuple[TokenRecord, str]:
    t = issue_token(overrides.pop("token_id", None))
    now = datetime(2027, 1, 1, tzinfo=timezone.utc)
    fields = dict(token_id=t.token_id, name="ops", role="operator", salt=t.salt, token_hash=t.token_hash,
                  expires_at=expiry(now, 30))
    return TokenRecord(**{**fields, **overrides}), parse_token(t.token)[1]


def test_authentication_checks_the_secret_before_revocation_and_expiry() -> None:
    rec, secret = _record()
    start = datetime(2027, 1, 1, tzinfo=timezone.utc)
    assert authenticate(rec, secret, start) == Principal(rec.token_id, "ops", Role.OPERATOR)
    assert authenticate(rec, secret, start + timedelta(days=30)) is Denial.EXPIRED  # expiry is exclusive
    assert authenticate(rec, secret + "x", start + timedelta(days=30)) is Denial.INVALID  # no hint without it
    assert authenticate(None, secret, start) is Denial.INVALID
    revoked, secret = _record(revoked_at=start)
    assert authenticate(revoked, secret, start) is Denial.REVOKED
    assert [d.guess for d in Denial] == [True, True, False, False]
    # Rotation keeps the id and changes the secret.
    again = issue_token(rec.token_id)
    assert again.token.startswith(f"sy_{rec.token_id}_") and again.token_hash != rec.token_hash


def test_failure_limiter_buckets() -> None:
    """burst 3, 0.5/s: three failures empty a bucket; one token refills in 2 s, so Retry-After is
    ceil((1 - 0) / 0.5) = 2, and after 1 s it is ceil((1 - 0.5) / 0.5) = 1."""
    lim = FailureLimiter(3, 0.5, max_keys=4)
    keys = ["addr:a", "token:t1"]
    for _ in range(3):
        assert lim.retry_after(keys, 100.0) is None
        lim.failed(keys, 100.0)
    assert lim.retry_after(keys, 100.0) == 2
    assert lim.retry_after(["addr:a"], 101.0) == 1
    assert lim.retry_after(["token:t1"], 102.0) is None
    assert lim.retry_after(["addr:b"], 100.0) is None  # other keys untouched
    assert lim.retry_after(keys, 50.0) == 2  # a clock stepping back refills nothing
    # Bounded memory: full buckets are forgotten first, then the least recently touched.
    for i in range(10):
        lim.failed([f"addr:spray{i}"], 200.0)
    assert len(lim) == 4 and lim.retry_after(["addr:spray9"], 200.0) is None
    lim.failed(["addr:late"], 300.0)  # by then the others refilled: forgotten
    assert len(lim) == 1
    with pytest.raises(ValueError):
        FailureLimiter(0, 1.0)


def test_replay_points_are_checked_for_plausibility_and_order() -> None:
    now = 1_800_000_000_000
    p = jobargs.point
    assert p("2027-01-15T07:00:00Z", now, "at").kind == "time"
    for bad in ("1999-12-31T23:59:59Z", "2027-01-16T09:00:00Z", "t:0:9223372036854775808", "nonsense"):
        with pytest.raises(BadPoint, match="^at"):
            p(bad, now, "at")
    ok = [("start", "end"), ("end", "end"), ("t:0:1", "t:0:1"), ("t:0:9", "t:1:1"), ("2026-01-01", "t:0:3"),
          ('{"t:0": 1}', '{"t:0": 2, "t:1": 0}')]
    for a, b in ok:
        jobargs.check_range(p(a, now, "from"), p(b, now, "to"))
    bad = [("end", "start"), ("end", "t:0:1"), ("t:0:1", "start"), ("2026-02-01", "2026-01-01"),
           ("t:0:9", "t:0:1"), ('{"t:0": 3}', '{"t:0": 2}')]
    for a, b in bad:
        with pytest.raises(BadPoint, match="is after to"):
            jobargs.check_range(p(a, now, "from"), p(b, now, "to"))


def test_a_job_error_is_one_line_without_paths() -> None:
    assert public_error(OSError("/srv/data/x.log: denied\nmore"), "j1") == (
        "replay failed: internal error (OSError) (details in the admin server's log, job j1)")
    line = public_error(BadPoint("no export at /home/ops/run.sylog\n  File \"/x/y.py\""), "j2")
    assert line == "BadPoint: no export at <path> (details in the admin server's log, job j2)"
