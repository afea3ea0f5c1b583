"""Router API keys, core only: the key table folded from admin events, verification of a
presented bearer at a given time, and the per-key limits with an injected clock; then the HTTP
front with auth on (401/429 bodies, the slot held until the answer is sent, the OpenAPI
declaration), over in-memory ports."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from control_plane.router import RouterConfig
from control_plane.router.health import assess
from control_plane.router.server import create_app
from control_plane.router.serving import RouterApp, RouterAuth, RouterMetrics
from control_plane.router.keys import KEY_PREFIX, Denied, KeyGate, KeyLimits, KeyTable, Refusal, RouterKey
from control_plane.router.proxy import Router
from control_plane.router.view import RouterView, WorkerState
from control_plane.router.worker_calls import MemoryReply, MemoryWorkerCalls, WorkerCall
from common import bearer
from common.hashing import HashAlgo, HashConfig
from common.log.sink import MemorySink
from schemas import EnvelopeFactory
from schemas import events as ev

S = 1_000_000_000
T0 = 1_800_000_000 * S


def _env(payload, at_ns: int = T0):
    return EnvelopeFactory("admin-api", 1, lambda: at_ns).wrap(payload)


def _issue(table: KeyTable, key_id: str | None = None, at_ns: int = T0, **fields) -> str:
    """Issue a key into ``table`` through its event; returns the plain key."""
    issued = bearer.issue(KEY_PREFIX, key_id)
    payload = {"actor": "root", "key_id": issued.id, "name": f"key-{issued.id}", "salt": issued.salt,
               "key_hash": issued.hash, **fields}
    assert table.apply(_env(ev.RouterKeyIssued(**payload), at_ns))
    return issued.plain


def _revoke(table: KeyTable, key_id: str, at_ns: int = T0) -> bool:
    return table.apply(_env(ev.RouterKeyRevoked(actor="root", key_id=key_id, reason="test"), at_ns))


def _key(**limits) -> RouterKey:
    return RouterKey(key_id="0000000a", name="k", salt="00", key_hash="x", limits=KeyLimits(**limits))


# -- the table and verification ----------------------------------------------------------------


def test_an_issued_key_verifies_and_a_wrong_secret_or_unknown_id_is_invalid() -> None:
    table = KeyTable()
    plain = _issue(table)
    key_id = plain.split("_")[1]
    got = table.verify(plain, T0)
    assert isinstance(got, RouterKey) and got.key_id == key_id
    for bad in (plain[:-1] + ("A" if plain[-1] != "A" else "B"), f"{KEY_PREFIX}_ffffffff_{plain.split('_', 2)[2]}",
                "sy_" + plain.split("_", 1)[1], "not-a-key", "sk-sy__x"):
        denied = table.verify(bad, T0)
        assert isinstance(denied, Denied) and denied.why is Refusal.INVALID, bad
    missing = table.verify(None, T0)
    assert isinstance(missing, Denied) and missing.why is Refusal.MISSING and missing.why.status == 401


def test_revoked_and_expired_are_said_only_to_the_holder_of_the_secret() -> None:
    table = KeyTable()
    live = _issue(table, expires_at_ns=T0 + 60 * S)
    gone = _issue(table)
    assert _revoke(table, gone.split("_")[1], T0 + S)
    assert table.verify(gone, T0 + 2 * S).why is Refusal.REVOKED
    assert table.verify(gone[:-2] + "zz", T0 + 2 * S).why is Refusal.INVALID
    assert isinstance(table.verify(live, T0 + 59 * S), RouterKey)
    assert table.verify(live, T0 + 60 * S).why is Refusal.EXPIRED  # expiry is exclusive: at 60 s it is over


def test_the_log_decides_first_issue_wins_and_a_revoked_id_stays_revoked() -> None:
    table = KeyTable()
    first = _issue(table, "0000beef")
    # A second issue of the same id (a forged or replayed event) changes nothing: the first hash holds.
    second = bearer.issue(KEY_PREFIX, "0000beef")
    assert not table.apply(_env(ev.RouterKeyIssued(actor="x", key_id="0000beef", name="again", salt=second.salt,
                                                   key_hash=second.hash)))
    assert isinstance(table.verify(first, T0), RouterKey) and table.verify(second.plain, T0).why is Refusal.INVALID
    assert _revoke(table, "0000beef") and not _revoke(table, "0000beef")  # revoking twice: one change
    # A revocation before its issue (an id never seen yet) still holds when the issue arrives.
    assert _revoke(table, "0000cafe")
    late = _issue(table, "0000cafe")
    assert table.verify(late, T0).why is Refusal.REVOKED
    # Other admin events are not the table's.
    assert not table.apply(_env(ev.PoolPinned(actor="op", pool="p", replicas=1)))
    assert table.applied == 4


def test_a_table_folded_again_from_the_same_events_is_equal() -> None:
    live = KeyTable()
    _issue(live, rate_per_s=2.0, burst=3, max_concurrent=1)
    _issue(live, "00000002", expires_at_ns=T0 + S)
    _revoke(live, "00000002", T0 + 5)
    events = [_env(ev.RouterKeyIssued(actor="r", key_id=k.key_id, name=k.name, salt=k.salt, key_hash=k.key_hash,
                                      expires_at_ns=k.expires_at_ns, rate_per_s=k.limits.rate_per_s,
                                      burst=k.limits.burst, max_concurrent=k.limits.max_concurrent), T0)
              for k in live.keys.values()] + [_env(ev.RouterKeyRevoked(actor="r", key_id="00000002"), T0 + 5)]
    replayed = KeyTable()
    for e in events:
        replayed.apply(e)
    assert replayed.as_dict() == live.as_dict()


# -- the limits ---------------------------------------------------------------------------------


def test_the_rate_is_a_token_bucket_with_a_burst() -> None:
    """rate 2/s, burst 3: three at t=0 pass, the fourth waits (1 - 0) / 2 = 0.5 s -> Retry-After 1;
    at t=0.5 one token is back (0.5 s * 2/s), at t=0.75 only half of the next."""
    gate, key = KeyGate(), _key(rate_per_s=2.0, burst=3)
    for _ in range(3):
        assert gate.admit(key, 0.0) is None
        gate.release(key)
    over = gate.admit(key, 0.0)
    assert over.why is Refusal.RATE and over.why.status == 429 and over.retry_after_s == 1
    assert gate.admit(key, 0.5) is None
    gate.release(key)
    assert gate.admit(key, 0.75).why is Refusal.RATE
    assert gate.admit(key, 100.0) is None  # refilled, never above the burst: 3 in all
    assert gate.admit(key, 100.0) is None and gate.admit(key, 100.0) is None
    assert gate.admit(key, 100.0).why is Refusal.RATE


def test_a_bucket_refills_to_its_burst_and_no_further() -> None:
    gate, key = KeyGate(), _key(rate_per_s=10.0, burst=2)
    results = [gate.admit(key, 1000.0) for _ in range(3)]
    assert results[:2] == [None, None] and results[2].why is Refusal.RATE
    # 0.35 s later: 3.5 tokens earned, 2 kept.
    results = [gate.admit(key, 1000.35) for _ in range(3)]
    assert results[:2] == [None, None] and results[2].why is Refusal.RATE
    # A clock stepping back refills nothing.
    assert gate.admit(key, 999.0).why is Refusal.RATE


def test_the_default_burst_is_one_second_of_the_rate() -> None:
    assert _key(rate_per_s=2.5).limits.bucket_size == 3.0 and _key(rate_per_s=0.2).limits.bucket_size == 1.0


def test_concurrency_is_counted_until_release_and_spends_no_rate_token() -> None:
    gate, key = KeyGate(), _key(max_concurrent=2, rate_per_s=1.0, burst=3)
    assert gate.admit(key, 0.0) is None and gate.admit(key, 0.0) is None
    over = gate.admit(key, 0.0)
    assert over.why is Refusal.CONCURRENCY and over.why.status == 429 and gate.inflight(key.key_id) == 2
    gate.release(key)
    assert gate.admit(key, 0.0) is None  # the third token: the refusal above took none
    gate.release(key)
    gate.release(key)
    assert gate.inflight(key.key_id) == 0


@pytest.mark.parametrize(("limits", "says"), [
    ({"rate_per_s": 0.0}, "positive"), ({"rate_per_s": float("nan")}, "positive"),
    ({"rate_per_s": 1.0, "burst": 0}, "at least 1"), ({"burst": 5}, "bucket"), ({"max_concurrent": 0}, "at least 1")])
def test_limits_that_could_never_pass_are_refused(limits: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        KeyLimits(**limits)


# -- the HTTP front -----------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.s = 0.0

    def ns(self) -> int:
        return T0 + int(self.s * S)

    def mono(self) -> float:
        return self.s


def _app(table: KeyTable, clock: Clock, release: asyncio.Event | None = None):
    """A router with one aggregated worker in memory; the worker answers once
    ``release`` is set (None: at once)."""

    async def worker(call: WorkerCall) -> MemoryReply:
        if release is not None:
            await release.wait()
        chunk = {"choices": [{"text": " t", "token_ids": [300], "finish_reason": "length"}]}
        return MemoryReply(200, f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())

    view = RouterView("sha256", 16)
    view.workers["w"] = WorkerState(worker_id="w", epoch=1, role="aggregated", pool="p", endpoint="http://w:1",
                                    capacity={"device": 1000})
    router = Router(router_id="r-keys", view=view, producer=MemorySink(), config=RouterConfig(),
                    hash_config=HashConfig(HashAlgo.SHA256, 16), workers=MemoryWorkerCalls(worker))
    auth = RouterAuth(table=table, clock_ns=clock.ns, monotonic=clock.mono)
    def health():
        return assess(view.positions, {}, view.last_ts_ms, [], 0.0, True)

    ctx = RouterApp(router=router, tokenizer=None, metrics=RouterMetrics(), served_model="m", health=health,
                    auth=auth)
    return create_app(ctx), auth


BODY = {"prompt": [1, 2, 3], "max_tokens": 1}


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_generation_needs_a_key_and_refusals_are_openai_errors() -> None:
    table, clock = KeyTable(), Clock()
    good = _issue(table, rate_per_s=1.0, burst=2)
    revoked = _issue(table)
    _revoke(table, revoked.split("_")[1])
    app, _ = _app(table, clock)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
        cases = [({}, 401, "missing_api_key"), (_bearer("sk-sy_00000000_nope"), 401, "invalid_api_key"),
                 (_bearer(revoked), 401, "api_key_revoked")]
        for headers, status, code in cases:
            r = await client.post("/v1/completions", json=BODY, headers=headers)
            assert r.status_code == status, r.text
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == code
            assert err["type"] == "invalid_request_error" and r.headers["www-authenticate"] == "Bearer"
        # A bad body with no key is a 401, not a 400: the key is checked before the body is read.
        r = await client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 401
        for _ in range(2):
            r = await client.post("/v1/completions", json=BODY, headers=_bearer(good))
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == " t"
        r = await client.post("/v1/completions", json=BODY, headers=_bearer(good))
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "rate_limit_exceeded" and r.json()["error"]["type"] == "rate_limit_exceeded"
        clock.s += 1.0
        assert (await client.post("/v1/completions", json=BODY, headers=_bearer(good))).status_code == 200
        # The routes that take no key still answer without one.
        assert (await client.get("/v1/models")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200
        assert (await client.get("/health")).status_code == 200


async def test_a_request_holds_its_keys_concurrency_slot_until_its_answer_is_sent() -> None:
    table, clock, release = KeyTable(), Clock(), asyncio.Event()
    key = _issue(table, max_concurrent=1)
    app, auth = _app(table, clock, release)
    key_id = key.split("_")[1]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
        first = asyncio.ensure_future(client.post("/v1/completions", json={**BODY, "stream": True},
                                                  headers=_bearer(key)))
        while auth.gate.inflight(key_id) == 0:
            await asyncio.sleep(0.01)
        r = await client.post("/v1/completions", json=BODY, headers=_bearer(key))
        assert r.status_code == 429 and r.json()["error"]["code"] == "concurrency_limit_exceeded"
        release.set()
        assert (await first).status_code == 200
        assert auth.gate.inflight(key_id) == 0
        assert (await client.post("/v1/completions", json=BODY, headers=_bearer(key))).status_code == 200
        # A refused body releases its slot too.
        r = await client.post("/v1/completions", json={"prompt": "x", "bogus": 1}, headers=_bearer(key))
        assert r.status_code == 400 and auth.gate.inflight(key_id) == 0


def test_the_openapi_schema_declares_the_key_and_the_401_and_429_answers() -> None:
    app, _ = _app(KeyTable(), Clock())
    doc = app.openapi()
    assert doc["components"]["securitySchemes"]["ApiKey"] == {
        "type": "http", "scheme": "bearer", "bearerFormat": "sk-sy_<id>_<secret>",
        "description": "A router API key (an admin issues it: POST /router-keys on the admin API)."}
    for path in ("/v1/completions", "/v1/chat/completions"):
        op = doc["paths"][path]["post"]
        assert op["security"] == [{"ApiKey": []}] and {"401", "429"} <= set(op["responses"])
    assert "security" not in doc["paths"]["/health"]["get"] and "security" not in doc["paths"]["/v1/models"]["get"]


def test_key_limits_are_shared_when_a_redis_url_is_set_unless_asked_otherwise() -> None:
    from control_plane.router.wiring import RouterSettings, key_limits_mode

    assert key_limits_mode(RouterSettings(redis_url="redis://r:1/0")) == "shared"
    assert key_limits_mode(RouterSettings()) == "local"
    assert key_limits_mode(RouterSettings(redis_url="redis://r:1/0", key_limits="local")) == "local"
    with pytest.raises(ValueError, match="needs a Redis URL"):
        key_limits_mode(RouterSettings(key_limits="shared"))
    with pytest.raises(ValueError, match="shared .* or local"):
        key_limits_mode(RouterSettings(redis_url="redis://r:1/0", key_limits="global"))
