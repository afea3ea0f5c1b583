"""The admin plane's defences, on real PostgreSQL and on SQLite: tokens expire and rotate,
failed authentications are rate-limited, config payloads and replay job arguments are checked
when submitted, a failed job shows a viewer one line, and the CLI's pin goes through the API
with a token whose name is the recorded actor.

The time is a fake clock handed to the context (expiry and the rate limit read only it); the
event log is the in-memory adapter (the Kafka one is covered by ``test_admin_api.py``)."""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from control_plane.admin.app import create_app
from control_plane.admin.context import AdminContext
from control_plane.admin.db.models import ReplayJob, utcnow
from control_plane.admin.db.session import make_engine, session_factory
from control_plane.admin.ports import InlineJobRunner, MemoryEventLog
from control_plane.admin.services import SYSTEM, create_token, update_pool
from control_plane.admin.settings import AdminSettings
from control_plane.admin.shapes import PoolUpdate, TokenCreate
from control_plane.admin.wiring import migrate
from common.log.catalog import Catalog
from common.net import free_port
from tests.support.db import postgres_database, sqlite_database

pytestmark = pytest.mark.postgres

DAY = 86_400.0
T0 = 1_800_000_000.0  # 2027-01-15T08:00:00Z


class FakeClock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


class BrokenReader:
    """A log reader whose every call fails the way a driver does: with a server path in the message."""

    def __init__(self, where: str) -> None:
        self.where = where

    def close(self) -> None:
        pass

    def __getattr__(self, name: str):
        raise RuntimeError(f"cannot open {self.where}/secret/segment.log: permission denied")


@dataclass
class Env:
    ctx: AdminContext
    clock: FakeClock
    events: MemoryEventLog
    client: TestClient
    tokens: dict[str, str]

    def h(self, role: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[role]}"}

    def actions(self, action: str) -> list:
        return [e.env.data for e in self.events.events if e.env.type == "AdminAction" and e.env.data.action == action]


def _make_env(url: str, tmp_path: Path, **settings) -> Env:
    migrate(url)
    engine = make_engine(url)
    clock, events = FakeClock(), MemoryEventLog()
    ctx = AdminContext(settings=AdminSettings(db_url=url, audit=False, **settings), sessions=session_factory(engine),
                       events=events, catalog=Catalog("mem"), reader_factory=lambda: BrokenReader(str(tmp_path)),
                       jobs=InlineJobRunner(), clock=clock)
    ctx.on_close.append(engine.dispose)
    tokens = {}
    with ctx.sessions() as s:
        for role in ("viewer", "operator", "admin"):
            _, tokens[role] = create_token(s, ctx, SYSTEM, TokenCreate(name=f"{role}-1", role=role))
        update_pool(s, ctx, SYSTEM, "default", PoolUpdate(role="aggregated", min_replicas=1, max_replicas=4))
    return Env(ctx, clock, events, TestClient(create_app(ctx)), tokens)


@pytest.fixture(params=["postgresql", "sqlite"])
def env(request, tmp_path):
    db = postgres_database() if request.param == "postgresql" else sqlite_database(tmp_path)
    with db as url:
        e = _make_env(url, tmp_path, auth_fail_burst=5, auth_fail_per_s=0.5)
        try:
            yield e
        finally:
            for fn in e.ctx.on_close:
                fn()


# -- expiry and rotation --------------------------------------------------------------------------


def test_tokens_expire_with_a_clear_reason(env: Env) -> None:
    c, admin = env.client, env.h("admin")
    short = c.post("/tokens", json={"name": "short", "role": "viewer", "expires_in_days": 1}, headers=admin).json()
    default = c.get("/tokens", headers=admin).json()["items"]
    assert {t["name"]: t["expires_at"][:10] for t in default}["viewer-1"] == "2027-02-14"  # T0 + 30 days
    assert short["expires_at"].startswith("2027-01-16T08:00:00")
    bearer = {"Authorization": f"Bearer {short['token']}"}
    assert c.get("/whoami", headers=bearer).json()["name"] == "short"
    env.clock.advance(DAY - 1)
    assert c.get("/whoami", headers=bearer).status_code == 200
    env.clock.advance(1)
    for _ in range(8):  # more than the burst: a stale client with its right secret is no guesser
        r = c.get("/whoami", headers=bearer)
        assert r.status_code == 401 and r.json()["error"]["code"] == "token_expired", r.text
        assert "expired at 2027-01-16T08:00:00" in r.json()["error"]["message"]
        assert r.headers["www-authenticate"] == "Bearer"
    # The lifetime is bounded by the server's maximum (365 days) and the shape's (3650).
    too_long = c.post("/tokens", json={"name": "forever", "role": "viewer", "expires_in_days": 400}, headers=admin)
    assert too_long.status_code == 422 and "maximum of 365" in too_long.json()["error"]["message"]
    assert c.post("/tokens", json={"name": "f2", "role": "viewer", "expires_in_days": 0},
                  headers=admin).status_code == 422
    created = env.actions("token_created")[-1]
    assert created.target == "short" and created.details["expires_at"] == "2027-01-16T08:00:00+00:00"


def test_rotation_replaces_the_secret_and_is_recorded(env: Env) -> None:
    c, admin = env.client, env.h("admin")
    old = env.tokens["viewer"]
    token_id = old.split("_")[1]
    env.clock.advance(31 * DAY)  # expired...
    assert c.get("/whoami", headers=env.h("viewer")).json()["error"]["code"] == "token_expired"
    assert c.post(f"/tokens/{token_id}/rotate", headers=env.h("operator")).status_code == 401  # expired too
    admin_id = env.tokens["admin"].split("_")[1]
    assert c.post(f"/tokens/{admin_id}/rotate", headers=admin).status_code == 401  # nor can an expired admin
    with env.ctx.sessions() as s:  # ...so an admin token issued at the new time does it
        _, fresh_admin = create_token(s, env.ctx, SYSTEM, TokenCreate(name="admin-2", role="admin"))
    admin = {"Authorization": f"Bearer {fresh_admin}"}
    r = c.post(f"/tokens/{token_id}/rotate", json={"expires_in_days": 7}, headers=admin)
    assert r.status_code == 200, r.text
    new = r.json()
    assert (new["id"], new["name"], new["role"]) == (token_id, "viewer-1", "viewer")
    assert new["token"] != old and new["token"].startswith(f"sy_{token_id}_") and new["rotated_at"]
    assert c.get("/whoami", headers={"Authorization": f"Bearer {new['token']}"}).json()["name"] == "viewer-1"
    gone = c.get("/whoami", headers={"Authorization": f"Bearer {old}"})
    assert gone.status_code == 401 and gone.json()["error"]["code"] == "unauthorized"  # the old secret is dead
    rotated = env.actions("token_rotated")
    assert [(a.target, a.actor, a.actor_role, a.details["token_id"]) for a in rotated] == [
        ("viewer-1", "admin-2", "admin", token_id)]
    # Viewers cannot rotate; a revoked token cannot be rotated back to life; revocation is an event.
    v = {"Authorization": f"Bearer {new['token']}"}
    assert c.post(f"/tokens/{token_id}/rotate", headers=v).status_code == 403
    assert c.delete(f"/tokens/{token_id}", headers=admin).status_code == 200
    assert [a.details["token_id"] for a in env.actions("token_revoked")] == [token_id]
    assert c.get("/whoami", headers=v).json()["error"]["code"] == "token_revoked"
    assert c.post(f"/tokens/{token_id}/rotate", headers=admin).status_code == 409
    assert c.post("/tokens/0123abcd/rotate", headers=admin).status_code == 404


# -- rate limit -----------------------------------------------------------------------------------


def test_failed_authentications_are_rate_limited_per_token_id_and_source(env: Env) -> None:
    """burst 5, 0.5/s: five wrong secrets for a token id are 401, the sixth 429 with Retry-After 2
    (one token refills in 1 / 0.5 = 2 s). Only that (id, address) pair is limited: the right
    secret still authenticates from the same address, and the same id from another address is
    untouched (issue 36, item 5)."""
    c = env.client
    good = env.tokens["operator"]
    token_id = good.split("_")[1]
    wrong = {"Authorization": f"Bearer sy_{token_id}_{'x' * 43}"}
    for _ in range(5):
        assert c.get("/whoami", headers=wrong).status_code == 401
    limited = c.get("/whoami", headers=wrong)
    assert limited.status_code == 429 and limited.headers["retry-after"] == "2", limited.text
    assert limited.json()["error"]["code"] == "rate_limited"
    # The valid credential is never locked out by someone else's guesses, not even from the
    # guesser's own address (on one box every client is 127.0.0.1).
    assert c.get("/whoami", headers=env.h("operator")).json()["name"] == "operator-1"
    other = TestClient(c.app, client=("10.0.0.7", 40000))
    assert other.get("/whoami", headers=wrong).status_code == 401  # another source: its own bucket
    assert other.get("/whoami", headers=env.h("operator")).status_code == 200
    env.clock.advance(2.0)  # one token back
    assert c.get("/whoami", headers=wrong).status_code == 401
    assert c.get("/whoami", headers=wrong).status_code == 429
    # Spraying malformed or unknown ids is limited per address, and never stops a real token.
    spray = TestClient(c.app, client=("10.0.0.8", 40000))
    codes = [spray.get("/whoami", headers={"Authorization": f"Bearer sy_{i:08x}_nope"}).status_code
             for i in range(7)]
    assert codes == [401] * 5 + [429] * 2
    assert spray.get("/whoami", headers={"Authorization": "Bearer garbage"}).status_code == 429
    assert spray.get("/whoami", headers=env.h("viewer")).status_code == 200
    # A missing token is not a guess.
    assert TestClient(c.app, client=("10.0.0.9", 1)).get("/whoami").status_code == 401


def test_x_forwarded_for_is_trusted_only_from_a_configured_proxy(env: Env) -> None:
    """A client that invents an X-Forwarded-For on each request is still limited under its own
    address; behind a configured proxy, each forwarded client has its own bucket."""
    spray = TestClient(env.client.app, client=("10.0.0.10", 1))
    codes = [spray.get("/whoami", headers={"Authorization": f"Bearer sy_{i:08x}_nope",
                                           "X-Forwarded-For": f"192.0.2.{i}"}).status_code for i in range(6)]
    assert codes == [401] * 5 + [429]
    env.ctx.settings = AdminSettings(db_url="sqlite://", audit=False, auth_fail_burst=5, auth_fail_per_s=0.5,
                                     trusted_proxies=frozenset({"10.0.0.11"}))
    proxy = TestClient(env.client.app, client=("10.0.0.11", 1))
    for client in ("198.51.100.1", "198.51.100.2"):
        codes = [proxy.get("/whoami", headers={"Authorization": f"Bearer sy_{i:08x}_nope",
                                               "X-Forwarded-For": f"6.6.6.6, {client}"}).status_code for i in range(6)]
        assert codes == [401] * 5 + [429], client  # the hop the proxy appended, not the client's own


# -- payloads checked when submitted --------------------------------------------------------------


def test_config_payloads_refuse_unknown_fields(env: Env) -> None:
    c, op = env.client, env.h("operator")
    for kind, config, field in (
        ("planner", {"interval_s": 30}, "interval_s"),
        ("planner", {"pools": [{"name": "p", "role": "decode", "itl_slo_ms": 40, "colour": "red"}]}, "colour"),
        ("router", {"mode": "kv", "bogus": 1}, "bogus"),
        ("router", {"tier_weights": {"device": 1.0, "tape": 0.1}}, "tape"),
    ):
        r = c.put(f"/{kind}-config", json={"config": config}, headers=op)
        assert r.status_code == 422 and field in r.json()["error"]["message"], (kind, r.text)
    assert c.put("/planner-config", json={"config": {}, "colour": 1}, headers=op).status_code == 422
    bad_rule = c.put("/planner-config", json={"config": {"scale_down_threshold": 1.5}}, headers=op)
    assert bad_rule.status_code == 422 and "scale_down_threshold" in bad_rule.json()["error"]["message"]
    assert c.put("/pools/default", json={"role": "aggregated", "max_replicas": 2, "colour": 1},
                 headers=op).status_code == 422
    assert c.get("/planner-config", headers=op).status_code == 404  # nothing refused was recorded
    assert not [e for e in env.events.events if e.env.type == "PlannerConfigChanged"]
    ok = c.put("/planner-config", json={"config": {"tick_s": 30, "pools": [
        {"name": "p", "role": "decode", "itl_slo_ms": 40}]}}, headers=op)
    assert ok.status_code == 200 and ok.json()["config"]["tick_s"] == 30, ok.text


@pytest.mark.parametrize("body, says", [
    ({"kind": "verify", "from": "2027-01-15T08:00:00Z", "to": "2027-01-14T00:00:00Z"}, "is after to"),
    ({"kind": "verify", "from": "end", "to": "t.requests:0:5"}, "after the end"),
    ({"kind": "whatif", "from": "t.requests:0:10", "to": "t.requests:0:3", "router_config": {}}, "swap"),
    ({"kind": "verify", "from": '{"t.kv:0": 9}', "to": '{"t.kv:0": 2}'}, "t.kv:0"),
    ({"kind": "verify", "from": "1970-01-02T00:00:00Z"}, "2000-01-01"),
    ({"kind": "state", "at": "2999-01-01T00:00:00Z"}, "a day past now"),
    ({"kind": "state", "at": "99999999999999999"}, "past the year 9999"),
    ({"kind": "state", "at": "t.kv:0:99999999999999999999"}, "beyond Kafka's"),
    ({"kind": "state", "at": "yesterday"}, "not a point"),
    ({"kind": "state", "block_size": 0}, "block_size"),
    ({"kind": "state", "hash_algo": "md5"}, "hash_algo"),
    ({"kind": "state", "hash_algo": "xxhash"}, "seed"),
    ({"kind": "verify", "block_size": 16}, "state jobs"),
    ({"kind": "state", "colour": "red"}, "colour"),
])
def test_bad_replay_arguments_are_refused_at_submission(env: Env, body: dict, says: str) -> None:
    r = env.client.post("/replay/jobs", json=body, headers=env.h("operator"))
    assert r.status_code == 422 and says in r.json()["error"]["message"], r.text
    with env.ctx.sessions() as s:
        assert s.query(ReplayJob).count() == 0


# -- errors a viewer sees ---------------------------------------------------------------------------


def test_a_failed_job_shows_a_viewer_one_line_and_logs_the_traceback(env: Env, tmp_path: Path, caplog) -> None:
    with caplog.at_level(logging.ERROR, logger="control_plane.admin.jobs"):
        r = env.client.post("/replay/jobs", json={"kind": "state", "at": "2027-01-15T07:00:00Z", "block_size": 16},
                            headers=env.h("operator"))
    assert r.status_code == 202, r.text
    job = env.client.get(f"/replay/jobs/{r.json()['id']}", headers=env.h("viewer")).json()
    assert job["status"] == "failed" and job["params"]["block_size"] == 16
    err = job["error"]
    assert "\n" not in err and "Traceback" not in err and str(tmp_path) not in err and "File " not in err, err
    assert err.startswith("replay failed: internal error (RuntimeError)") and r.json()["id"] in err
    logged = [rec for rec in caplog.records if r.json()["id"] in rec.getMessage()]
    assert logged and logged[0].exc_info and "segment.log" in str(logged[0].exc_info[1])
    # A row written before errors were one line shows its first line only.
    with env.ctx.sessions.begin() as s:
        s.add(ReplayJob(id="00ff", kind="state", params={}, status="failed", created_at=utcnow(),
                        error=f"RuntimeError: boom\nTraceback (most recent call last):\n  File \"{tmp_path}/x.py\""))
    old = env.client.get("/replay/jobs/00ff", headers=env.h("viewer")).json()
    assert old["error"] == "RuntimeError: boom"
    assert "Traceback" not in env.client.get("/replay/jobs", headers=env.h("viewer")).text


# -- the CLI's pin goes through the API -----------------------------------------------------------


@pytest.fixture
def served(env: Env):
    """The same app served over HTTP on a free port (the CLI talks to a real server)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(env.client.app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the admin server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(15)


def _pins(env: Env) -> list:
    return [e.env.data for e in env.events.events if e.env.type == "PoolPinned"]


def _cli(url: str, *args: str, token: str | None = None):
    from switchyard.cli import app

    environ = {"SWITCHYARD_ADMIN_URL": url, "SWITCHYARD_ADMIN_TOKEN": token or ""}
    return CliRunner().invoke(app, ["planner", *args], env=environ)


def test_cli_pin_needs_a_token_and_records_its_name(env: Env, served: str, tmp_path: Path) -> None:
    refused = _cli(served, "pin", "default", "2")
    assert refused.exit_code == 2 and "SWITCHYARD_ADMIN_TOKEN" in refused.output, refused.output
    assert _cli(served, "pin", "default", "2", token="sy_0123abcd_guess").exit_code == 1
    viewer = _cli(served, "pin", "default", "2", token=env.tokens["viewer"])
    assert viewer.exit_code == 1 and "403" in viewer.output
    assert _pins(env) == []
    # The actor is the token's name; an --actor naming anyone else is refused before any change.
    spoof = _cli(served, "pin", "default", "2", "--actor", "probe-admin", token=env.tokens["operator"])
    assert spoof.exit_code == 2 and "probe-admin" in spoof.output and _pins(env) == []
    ok = _cli(served, "pin", "default", "2", "--reason", "launch", token=env.tokens["operator"])
    assert ok.exit_code == 0 and "as operator-1" in ok.output, ok.output
    assert [(p.pool, p.replicas, p.reason, p.actor, p.actor_role) for p in _pins(env)] == [
        ("default", 2, "launch", "operator-1", "operator")]
    # A token file readable by others is refused; mode 600 works.
    f = tmp_path / "token"
    f.write_text(env.tokens["operator"] + "\n")
    os.chmod(f, 0o644)
    loose = _cli(served, "unpin", "default", "--token-file", str(f))
    assert loose.exit_code == 2 and "chmod 600" in loose.output
    os.chmod(f, 0o600)
    done = _cli(served, "unpin", "default", "--reason", "over", "--token-file", str(f))
    assert done.exit_code == 0, done.output
    assert (_pins(env)[-1].replicas, _pins(env)[-1].reason, _pins(env)[-1].actor) == (None, "over", "operator-1")
    same = _cli(served, "pin", "default", "3", "--actor", "operator-1", token=env.tokens["operator"])
    assert same.exit_code == 0 and "deprecated" in same.output


# -- router API keys ------------------------------------------------------------------------------


def test_router_keys_are_issued_and_revoked_by_admins_as_events_without_the_secret(env: Env) -> None:
    """POST /router-keys (admin only) returns the key once; the event carries its id, salt, hash,
    expiry and limits, never the secret; the routers' fold of those events accepts the key, then
    refuses it once DELETE /router-keys/{id} recorded its revocation."""
    from control_plane.router.keys import KeyTable, Refusal, RouterKey

    c, admin = env.client, env.h("admin")
    body = {"name": "chat-frontend", "expires_in_days": 2, "rate_per_s": 5, "burst": 10, "max_concurrent": 3}
    for role in ("viewer", "operator"):
        assert c.post("/router-keys", json=body, headers=env.h(role)).status_code == 403
        assert c.get("/router-keys", headers=env.h(role)).status_code == 403
    assert c.post("/router-keys", json=body).status_code == 401
    r = c.post("/router-keys", json=body, headers=admin)
    assert r.status_code == 201, r.text
    made = r.json()
    key, key_id = made["key"], made["key_id"]
    assert key.startswith(f"sk-sy_{key_id}_") and made["expires_at_ns"] == int((T0 + 2 * DAY) * 1e9)
    assert (made["rate_per_s"], made["burst"], made["max_concurrent"], made["issued_by"]) == (5.0, 10, 3, "admin-1")
    # A second live key of that name is a conflict; bad limits are a 422 with the reason.
    assert c.post("/router-keys", json=body, headers=admin).status_code == 409
    bad = c.post("/router-keys", json={"name": "b", "burst": 4}, headers=admin)
    assert bad.status_code == 422 and "rate_per_s" in bad.json()["error"]["message"]
    assert c.post("/router-keys", json={"name": "z", "rate_per_s": 0}, headers=admin).status_code == 422

    [issued] = [e.env for e in env.events.events if e.env.type == "RouterKeyIssued"]
    assert key.split("_", 2)[2] not in repr(issued.data) and issued.data.actor == "admin-1"
    assert (issued.key, issued.data.key_id, issued.data.rate_per_s) == (f"router-key:{key_id}", key_id, 5.0)
    table = KeyTable()
    for e in env.events.events:
        table.apply(e.env)
    assert isinstance(table.verify(key, int(T0 * 1e9)), RouterKey)

    listed = c.get("/router-keys", headers=admin).json()
    assert [k["key_id"] for k in listed["items"]] == [key_id] and "key" not in listed["items"][0]
    assert c.delete("/router-keys/0badcafe", headers=admin).status_code == 404
    assert c.delete(f"/router-keys/{key_id}", headers=env.h("operator")).status_code == 403
    gone = c.delete(f"/router-keys/{key_id}", params={"reason": "leaked"}, headers=admin)
    assert gone.status_code == 200 and gone.json()["revoke_reason"] == "leaked" and gone.json()["revoked_by"] == "admin-1"
    assert c.delete(f"/router-keys/{key_id}", headers=admin).status_code == 200  # again: no second event
    assert [e.env.type for e in env.events.events].count("RouterKeyRevoked") == 1
    for e in env.events.events[-1:]:
        table.apply(e.env)
    assert table.verify(key, int(T0 * 1e9)).why is Refusal.REVOKED
    assert c.get("/router-keys", headers=admin).json()["items"] == []
    assert len(c.get("/router-keys", params={"include_revoked": True}, headers=admin).json()["items"]) == 1
    # The name is free again once its key is revoked.
    assert c.post("/router-keys", json={"name": "chat-frontend"}, headers=admin).status_code == 201
