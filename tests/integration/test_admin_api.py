"""The admin API on a real PostgreSQL database and the real broker: every endpoint with every
role (and without a token), the events operator actions record, the request trace, the index
queries, replay jobs, and a schemathesis run against the served OpenAPI schema."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Callable

import pytest
from fastapi.testclient import TestClient

from control_plane.admin.app import create_app
from control_plane.admin.audit.consumer import AuditConsumer
from control_plane.admin.db.models import ApiToken
from control_plane.admin.ports import InlineJobRunner, ThreadJobRunner
from control_plane.admin.services import SYSTEM, create_token
from control_plane.admin.settings import AdminSettings
from control_plane.admin.shapes import TokenCreate
from control_plane.admin.wiring import build_admin, migrate
from control_plane.replay.engine import ReplayEngine
from common.hashing import HashAlgo, HashConfig, hash_blocks
from common.log.admin import apply_topics
from common.log.catalog import Catalog
from common.log.kafka import EventProducer
from common.log.reader import KafkaLogReader
from common.settings import BusSettings
from schemas.events import (
    BlockStored,
    CandidateScore,
    KvTransferCompleted,
    KvTransferStarted,
    PrefillCompleted,
    RequestAdmitted,
    RequestCompleted,
    RequestRouted,
    ScalingApplied,
    ScalingDecision,
    WorkerLoadReported,
    WorkerRegistered,
)
from schemas.types import RequestPhase, RoutingMode
from tests.support.db import postgres_database
from tests.support.events import read_stream

pytestmark = [pytest.mark.kafka, pytest.mark.postgres]

DOC = list(range(3000, 3000 + 64 * 6))  # 6 full blocks w1 holds


@dataclass
class Env:
    bus: BusSettings
    ctx: Any
    client: TestClient
    tokens: dict[str, str]
    audit: AuditConsumer
    job_id: str

    def h(self, role: str | None) -> dict[str, str]:
        return {} if role is None else {"Authorization": f"Bearer {self.tokens[role]}"}

    def sync(self) -> None:
        self.audit.drain(30)


def _seed(bus: BusSettings) -> None:
    cfg = HashConfig(HashAlgo.SHA256, 64)
    for port, (wid, role, pool) in enumerate((("w1", "aggregated", "default"), ("w2", "aggregated", "default"),
                                              ("p1", "prefill", "pre"), ("d1", "decode", "dec")), 9001):
        p = EventProducer(bus, wid)
        p.publish(WorkerRegistered(worker_id=wid, role=role, pool=pool, endpoint=f"http://127.0.0.1:{port}", block_size=64,
                                   hash_algo="sha256", capacity={"device": 1000}))
        p.publish(WorkerLoadReported(worker_id=wid, running=1, waiting=0, tier_usage={"device": 0.1}))
        if wid == "w1":
            p.publish(BlockStored(worker_id=wid, tier="device", block_hashes=hash_blocks(DOC, cfg), block_size=64,
                                  hash_algo="sha256"))
        assert p.flush(10) == 0
    # One disaggregated request, every stage recorded by whoever records it in production.
    rid = "dis-1"
    r, pw, dw = EventProducer(bus, "router-x"), EventProducer(bus, "p1"), EventProducer(bus, "d1")
    hashes = hash_blocks(DOC, cfg)
    r.publish(RequestAdmitted(request_id=rid, model="m", prompt_tokens=len(DOC), max_tokens=8, block_hashes=hashes,
                              block_size=64, hash_algo="sha256", client_request_id="my-dis-1"), correlation_id=rid)
    scores = [CandidateScore(worker_id="p1", overlap_blocks=0, prefill_blocks=6.0, decode_blocks=7.0, cost=13.0)]
    r.publish(RequestRouted(request_id=rid, worker_id="p1", phase=RequestPhase.PREFILL, mode=RoutingMode.KV,
                            scores=scores, reason="kv argmin", config_version=1, rng_seed=1), correlation_id=rid)
    pw.publish(PrefillCompleted(request_id=rid, worker_id="p1", prompt_tokens=len(DOC), duration_ms=12.5,
                                kv_transfer_params={"block_ids": [1, 2, 3]}), correlation_id=rid)
    r.publish(RequestRouted(request_id=rid, worker_id="d1", phase=RequestPhase.DECODE, mode=RoutingMode.KV,
                            scores=[CandidateScore(worker_id="d1", decode_blocks=7.0, cost=7.0)], reason="kv argmin",
                            config_version=1, rng_seed=2), correlation_id=rid)
    common = dict(request_id=rid, transfer_id="x1", src_worker="p1", dst_worker="d1", blocks=6, bytes=6 * 16384,
                  backend="UCX")
    dw.publish(KvTransferStarted(**common), correlation_id=rid)
    dw.publish(KvTransferCompleted(**common, duration_ms=1.5), correlation_id=rid)
    dw.publish(RequestCompleted(request_id=rid, worker_id="d1", prompt_tokens=len(DOC), output_tokens=8, ttft_ms=30,
                                e2e_ms=80), correlation_id=rid)
    planner = EventProducer(bus, "planner")
    planner.publish(ScalingDecision(pool="dec", decision_id="sd-1", role="decode", from_replicas=1, to_replicas=2,
                                    reason="itl over target", inputs={"pred_rps": 3.5}, config_version=1))
    planner.publish(ScalingApplied(pool="dec", decision_id="sd-1", replicas=2, scaler="virtual"))
    for p in (r, pw, dw, planner):
        assert p.flush(10) == 0


@pytest.fixture(scope="module")
def env(kafka_bootstrap: str):
    bus = BusSettings(bootstrap=kafka_bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:10]}")
    apply_topics(bus)
    _seed(bus)
    with postgres_database() as url:
        migrate(url)
        ctx = build_admin(AdminSettings(db_url=url, audit=False, view_max_age_s=0.0), bus)
        ctx.jobs.shutdown()
        ctx.jobs = InlineJobRunner()
        audit = AuditConsumer(bus, ctx.sessions, streams=("requests", "workers", "planner", "admin", "kv"))
        tokens = {}
        with ctx.sessions() as s:
            for role in ("viewer", "operator", "admin"):
                _, tokens[role] = create_token(s, ctx, SYSTEM, TokenCreate(name=f"{role}-1", role=role))
        client = TestClient(create_app(ctx))
        e = Env(bus, ctx, client, tokens, audit, "")
        e.sync()
        admin = e.h("admin")
        assert client.put("/pools/default", json={"role": "aggregated", "min_replicas": 1, "max_replicas": 4},
                          headers=admin).status_code == 200
        assert client.put("/router-config", json={"config": {"mode": "kv"}}, headers=admin).status_code == 200
        assert client.put("/planner-config", json={"config": {"tick_s": 30}}, headers=admin).status_code == 200
        job = client.post("/replay/jobs", json={"kind": "state", "at": "end"}, headers=admin)
        assert job.status_code == 202, job.text
        e.job_id = job.json()["id"]
        try:
            yield e
        finally:
            audit.stop()
            for fn in ctx.on_close:
                fn()


# -- every endpoint, every role -------------------------------------------------------------------


@dataclass
class Call:
    method: str
    path: str | Callable[[Env], str]
    needs: str | None  # least role; None = no token needed
    ok: int
    body: Any = None

    def url(self, e: Env) -> str:
        return self.path(e) if callable(self.path) else self.path


def _fresh_token(e: Env) -> str:
    with e.ctx.sessions() as s:
        row, _ = create_token(s, e.ctx, SYSTEM, TokenCreate(name=f"tmp-{uuid.uuid4().hex[:8]}", role="viewer"))
    return f"/tokens/{row.id}"


CALLS = [
    Call("GET", "/health", None, 200),
    Call("GET", "/whoami", "viewer", 200),
    Call("GET", "/workers", "viewer", 200),
    Call("GET", "/workers/w1", "viewer", 200),
    Call("POST", "/workers/w2/drain", "operator", 202, {"reason": "maintenance"}),
    Call("GET", "/pools", "viewer", 200),
    Call("GET", "/pools/default", "viewer", 200),
    Call("PUT", "/pools/default", "operator", 200, {"role": "aggregated", "min_replicas": 1, "max_replicas": 4}),
    Call("PUT", "/pools/default/pin", "operator", 200, {"replicas": 2, "reason": "test"}),
    Call("DELETE", "/pools/default/pin", "operator", 200),
    Call("GET", "/router-config", "viewer", 200),
    Call("GET", "/router-config/versions", "viewer", 200),
    Call("GET", "/router-config/versions/1", "viewer", 200),
    Call("PUT", "/router-config", "operator", 200, {"config": {"mode": "kv", "temperature": 0.1}}),
    Call("GET", "/planner-config", "viewer", 200),
    Call("GET", "/planner-config/versions", "viewer", 200),
    Call("GET", "/planner-config/versions/1", "viewer", 200),
    Call("PUT", "/planner-config", "operator", 200, {"config": {"tick_s": 60}}),
    Call("GET", "/planner/decisions", "viewer", 200),
    Call("GET", "/index/stats", "viewer", 200),
    Call("POST", "/index/overlap", "viewer", 200, {"tokens": DOC}),
    Call("GET", "/requests/dis-1/trace", "viewer", 200),
    Call("GET", "/events", "viewer", 200),
    Call("POST", "/replay/jobs", "operator", 202, {"kind": "verify", "from": "start", "to": "end"}),
    Call("GET", "/replay/jobs", "viewer", 200),
    Call("GET", lambda e: f"/replay/jobs/{e.job_id}", "viewer", 200),
    Call("GET", lambda e: f"/replay/jobs/{e.job_id}/result", "viewer", 200),
    Call("GET", lambda e: f"/replay/jobs/{e.job_id}/plot", "viewer", 200),
    Call("GET", "/tokens", "admin", 200),
    Call("POST", "/tokens", "admin", 201, None),
    Call("DELETE", _fresh_token, "admin", 200),
    Call("POST", lambda e: f"{_fresh_token(e)}/rotate", "admin", 200, {"expires_in_days": 7}),
]
RANK = {None: -1, "viewer": 0, "operator": 1, "admin": 2}


@pytest.mark.parametrize("call", CALLS, ids=lambda c: f"{c.method} {c.path if isinstance(c.path, str) else c.path.__name__}")
def test_every_endpoint_with_every_role(env: Env, call: Call) -> None:
    for role in (None, "viewer", "operator", "admin"):
        body = call.body
        if call.path == "/tokens" and call.method == "POST":
            body = {"name": f"n-{uuid.uuid4().hex[:8]}", "role": "viewer"}
        r = env.client.request(call.method, call.url(env), json=body, headers=env.h(role))
        if call.needs is None or RANK[role] >= RANK[call.needs]:
            assert r.status_code == call.ok, (role, r.text)
        elif role is None:
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", r.text
            assert r.headers["www-authenticate"] == "Bearer"
        else:
            assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", (role, r.text)


def test_bad_tokens_are_401_and_errors_are_json(env: Env) -> None:
    c = env.client
    for token in ("nope", "sy_zzzzzzzz_x", env.tokens["admin"][:-2] + "xx"):
        r = c.get("/workers", headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 401 and r.json()["error"]["message"]
    revoked = c.post("/tokens", json={"name": "short-lived", "role": "viewer"}, headers=env.h("admin")).json()
    assert c.get("/whoami", headers={"Authorization": f"Bearer {revoked['token']}"}).json()["name"] == "short-lived"
    assert c.delete(f"/tokens/{revoked['id']}", headers=env.h("admin")).json()["revoked_at"]
    assert c.get("/whoami", headers={"Authorization": f"Bearer {revoked['token']}"}).status_code == 401
    r = c.get("/nowhere", headers=env.h("viewer"))
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = c.get("/workers?limit=0", headers=env.h("viewer"))
    assert r.status_code == 422 and "limit" in r.json()["error"]["message"]
    with env.ctx.sessions() as s:  # only the salted hash is stored
        assert all(env.tokens["admin"].split("_", 2)[2] not in (t.token_hash, t.salt) for t in s.query(ApiToken))


def test_operator_actions_are_events_naming_the_caller(env: Env) -> None:
    c, op = env.client, env.h("operator")
    cur = c.get("/router-config", headers=op).json()["version"]
    bad = c.put("/router-config", json={"config": {"tier_weights": {"device": 0.5, "host": 0.9}}}, headers=op)
    assert bad.status_code == 422 and "non-increasing" in bad.json()["error"]["message"]
    stale = c.put("/router-config", json={"config": {}, "expected_version": cur - 1}, headers=op)
    assert stale.status_code == 409
    new = c.put("/router-config", json={"config": {"prefill_load_scale": 2.0}, "expected_version": cur}, headers=op)
    assert new.status_code == 200 and new.json()["version"] == cur + 1 and new.json()["created_by"] == "operator-1"
    assert c.put("/pools/default/pin", json={"replicas": 9}, headers=op).status_code == 422  # outside [1, 4]
    assert c.put("/pools/nope/pin", json={"replicas": 1}, headers=op).status_code == 404
    pinned = c.put("/pools/default/pin", json={"replicas": 3, "reason": "launch"}, headers=op).json()
    assert pinned["pinned_replicas"] == 3 and pinned["updated_by"] == "operator-1"
    assert c.put("/pools/default", json={"role": "aggregated", "max_replicas": 2}, headers=op).status_code == 409
    assert c.post("/workers/ghost/drain", headers=op).status_code == 404
    acc = c.post("/workers/w1/drain", json={"reason": "kernel upgrade"}, headers=op).json()
    assert acc["type"] == "WorkerDrainRequested" and acc["actor"] == "operator-1"
    assert c.get("/workers/w1", headers=op).json()["drain_requested_by"] == "operator-1"
    admin_events = {e.event_id: e for e in read_stream(env.bus, "admin")}
    ev = admin_events[acc["event_id"]].data
    assert (ev.worker_id, ev.reason, ev.actor, ev.actor_role) == ("w1", "kernel upgrade", "operator-1", "operator")
    assert {e.data.actor for e in admin_events.values() if e.type == "PoolPinned"} >= {"operator-1"}
    tokens = [e.data for e in admin_events.values() if e.type == "AdminAction" and e.data.action == "token_created"]
    assert {t.target for t in tokens} >= {"viewer-1", "operator-1", "admin-1"}
    # Replay reads config versions from the log: the one just recorded re-validates there.
    logged = ReplayEngine(KafkaLogReader(env.bus.bootstrap), Catalog(env.bus.topic_prefix)).router_configs()
    assert logged[cur + 1].prefill_load_scale == 2.0
    # The audit consumer catching up with the same events changes nothing.
    before = c.get("/pools/default", headers=op).json()
    env.sync()
    assert c.get("/pools/default", headers=op).json() == before


def test_request_trace_is_the_complete_causal_chain(env: Env) -> None:
    t = env.client.get("/requests/dis-1/trace", headers=env.h("viewer")).json()
    assert t["complete"] is True and t["outcome"] == "completed" and t["mode"] == "disaggregated", t["missing"]
    assert [s["stage"] for s in t["steps"]] == ["admitted", "routed", "prefill", "routed", "transfer", "transfer",
                                                "completed"]
    assert [r["phase"] for r in t["routing"]] == ["prefill", "decode"]
    assert t["routing"][0]["scores"][0]["worker_id"] == "p1"
    assert {e["topic"].rsplit(".", 1)[1] for e in t["events"]} == {"requests"}
    assert env.client.get("/requests/nobody/trace", headers=env.h("viewer")).status_code == 404
    # The client's own id (RequestAdmitted.client_request_id) finds the same trace.
    assert env.client.get("/requests/my-dis-1/trace", headers=env.h("viewer")).json() == t


def test_index_overlap_stats_workers_and_planner(env: Env) -> None:
    c, v = env.client, env.h("viewer")
    got = c.post("/index/overlap", json={"tokens": DOC + [1, 2, 3]}, headers=v).json()
    assert got["blocks"] == 6 and got["workers"][0]["worker_id"] == "w1"
    assert got["workers"][0]["matched_blocks"] == 6 and got["workers"][0]["by_tier"] == {"device": 6}
    assert c.post("/index/overlap", json={"prompt": "nothing cached"}, headers=v).json()["workers"] == []
    assert c.post("/index/overlap", json={}, headers=v).status_code == 422
    stats = c.get("/index/stats?digest=true", headers=v).json()
    assert stats["blocks"]["w1"] == {"device": 6} and len(stats["digest"]) == 64
    w1 = c.get("/workers/w1", headers=v).json()
    assert w1["blocks"] == {"device": 6} and w1["incarnations"][0]["endpoint"] == "http://127.0.0.1:9001"
    page = c.get("/workers?role=aggregated&limit=1", headers=v).json()
    assert page["total"] == 2 and len(page["items"]) == 1
    d = c.get("/planner/decisions?pool=dec", headers=v).json()["items"]
    assert d[0]["decision_id"] == "sd-1" and d[0]["applied"]["replicas"] == 2


def test_replay_jobs_run_and_store_results(env: Env) -> None:
    c, op = env.client, env.h("operator")
    res = c.get(f"/replay/jobs/{env.job_id}/result", headers=op).json()
    assert res["summary"]["workers"] == 4 and res["has_plot"]
    png = c.get(f"/replay/jobs/{env.job_id}/plot", headers=op)
    assert png.headers["content-type"] == "image/png" and png.content[:4] == b"\x89PNG"
    job = c.post("/replay/jobs", json={"kind": "whatif", "router_config": {"mode": "round_robin"}, "simulate": False},
                 headers=op).json()
    got = c.get(f"/replay/jobs/{job['id']}", headers=op).json()
    assert got["status"] == "succeeded", got["error"]
    assert c.get(f"/replay/jobs/{job['id']}/result", headers=op).json()["summary"]["decisions"] == 2
    assert c.post("/replay/jobs", json={"kind": "state", "at": "yesterday"}, headers=op).status_code == 422
    assert c.post("/replay/jobs", json={"kind": "whatif"}, headers=op).status_code == 422


def test_schemathesis_finds_no_5xx_and_no_schema_violation(env: Env) -> None:
    import schemathesis
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    from tests.support.schemathesis_run import run_schemathesis

    runner = ThreadJobRunner(1)
    env.ctx.jobs = runner
    schema = schemathesis.openapi.from_asgi("/openapi.json", env.client.app)
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    try:
        failures, seen = run_schemathesis(schema, checks, headers=env.h("admin"))
    finally:
        runner.shutdown(wait=True)
        env.ctx.jobs = InlineJobRunner()
    assert not failures, "\n\n".join(failures)
    # Every operation ran, and something reached past validation on each.
    ops = {(m, p) for m, p, _ in seen}
    assert len(ops) == len(list(schema.get_all_operations())), ops
    print(sorted(seen.items()))
