"""Router API keys end to end (issue 14, item 3): the real admin API (``switchyard admin serve``
on SQLite) issues and revokes keys as events on the broker, a real router process folds them,
and the official ``openai`` client calls it: a key works, no key or a wrong one is a 401, a
revoked key is refused once the router folded the revocation, a key over its rate or its
concurrency is a 429. A second router replica started afterwards knows every key from the log,
and shares each key's limits with the first (through the stack's Redis)."""

from __future__ import annotations

import subprocess
import sys
import threading

import httpx
import openai
import pytest

from control_plane.admin.client import AdminClient
from common.net import free_port
from common.settings import BusSettings
from tests.integration.test_router import Procs, _wait_http
from tests.support.waits import wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

MODEL = "switchyard-sim"


@pytest.fixture
def admin(bus: BusSettings, procs: Procs, tmp_path) -> AdminClient:
    """The admin API as its own process, and an admin token made the bootstrap way (the CLI,
    straight into its database)."""
    db = f"sqlite:///{tmp_path / 'admin.db'}"
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "switchyard.cli", "admin", "serve", "--port", str(port),
                          "--db-url", db, "--no-audit"], env=procs.env, stdout=procs.log, stderr=subprocess.STDOUT)
    procs.procs.append(p)
    _wait_http(f"http://127.0.0.1:{port}/health")
    made = subprocess.run([sys.executable, "-m", "switchyard.cli", "admin", "create-token", "--name", "keys-admin",
                           "--role", "admin", "--db-url", db], env=procs.env, capture_output=True, text=True,
                          timeout=120)
    assert made.returncode == 0, made.stderr
    client = AdminClient(f"http://127.0.0.1:{port}", made.stdout.strip().splitlines()[-1])
    yield client
    client.close()


def _router(procs: Procs) -> str:
    port = free_port()
    procs.router(port, f"r-keys-{port}", "--auth")
    base = f"http://127.0.0.1:{port}"
    _wait_http(f"{base}/health", lambda r: r.status_code == 200 and r.json()["workers"] == 1)
    return base


def _client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30)


def _complete(client: openai.OpenAI, **kw):
    return client.completions.create(model=MODEL, prompt="hello keys " * 10, max_tokens=kw.pop("max_tokens", 2), **kw)


def test_keys_issued_and_revoked_through_the_admin_api_gate_the_router(bus: BusSettings, procs: Procs,
                                                                      admin: AdminClient) -> None:
    procs.worker("w-keys", "--token-delay", "0.05")
    plain = admin.issue_router_key("plain")
    base = _router(procs)

    assert _complete(_client(base, plain["key"])).choices[0].text
    for wrong in ("sk-sy_00000000_not-a-secret", plain["key"][:-3] + "xyz", "sy_0000000a_an-admin-token"):
        with pytest.raises(openai.AuthenticationError) as e:
            _complete(_client(base, wrong))
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key", e.value.body
    r = httpx.post(f"{base}/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"

    # A key issued while the router runs works once folded; revoked, it is refused once folded.
    late = admin.issue_router_key("late")
    wait_for(lambda: _status(base, late["key"]) == 200, timeout=20, what="the new key folded")
    admin.revoke_router_key(late["key_id"], "test")
    wait_for(lambda: _status(base, late["key"]) == 401, timeout=20, what="the revocation folded")
    with pytest.raises(openai.AuthenticationError) as e:
        _complete(_client(base, late["key"]))
    assert e.value.body["code"] == "api_key_revoked"

    # Over its rate: burst 2 at 0.2/s, so the third in a row is a 429 with Retry-After (5 s).
    slow = admin.issue_router_key("slow", rate_per_s=0.2, burst=2)
    wait_for(lambda: _status(base, slow["key"]) != 401, timeout=20, what="the rated key folded")
    client = _client(base, slow["key"])
    _complete(client)  # the wait above spent the first token
    with pytest.raises(openai.RateLimitError) as e:
        _complete(client)
    assert e.value.body["code"] == "rate_limit_exceeded" and int(e.value.response.headers["retry-after"]) >= 1

    # Over its concurrency: one stream in flight, a second request is a 429 until it ends.
    single = admin.issue_router_key("single", max_concurrent=1)
    wait_for(lambda: _status(base, single["key"]) == 200, timeout=20, what="the single-slot key folded")
    client = _client(base, single["key"])
    started, finished = threading.Event(), threading.Event()

    def long_stream() -> None:
        for _ in _complete(client, max_tokens=80, stream=True):
            started.set()
        finished.set()

    t = threading.Thread(target=long_stream, daemon=True)
    t.start()
    assert started.wait(30)
    with pytest.raises(openai.RateLimitError) as e:
        _complete(client)
    assert e.value.body["code"] == "concurrency_limit_exceeded"
    t.join(60)
    assert finished.is_set()
    assert _complete(client).choices[0].text  # the slot is free again

    # One token in all, spent on the first replica before the second starts.
    once = admin.issue_router_key("once", rate_per_s=0.001, burst=1)
    wait_for(lambda: _status(base, once["key"]) == 200, timeout=20, what="the one-token key folded")

    # A replica started now learns every key from the log: the live ones work, the revoked one does not.
    second = _router(procs)
    assert _status(second, plain["key"]) == 200 and _status(second, single["key"]) == 200
    assert _status(second, late["key"]) == 401
    # The limits are the key's across both replicas (counted in the stack's Redis): a token spent
    # on the first is gone on the second, and a stream on the first holds the key's one slot.
    assert _status(second, once["key"]) == 429 and _status(base, once["key"]) == 429
    started.clear()
    t = threading.Thread(target=long_stream, daemon=True)
    t.start()
    assert started.wait(30)
    r = httpx.post(f"{second}/v1/completions", headers={"Authorization": f"Bearer {single['key']}"}, timeout=30,
                   json={"model": MODEL, "prompt": "probe", "max_tokens": 1})
    assert r.status_code == 429 and r.json()["error"]["code"] == "concurrency_limit_exceeded"
    t.join(60)
    assert _status(second, single["key"]) == 200
    # Health, metrics and the view need no key.
    for path in ("/health", "/metrics", "/router/view", "/v1/models"):
        assert httpx.get(f"{second}{path}", timeout=10).status_code == 200, path


def _status(base: str, key: str) -> int:
    r = httpx.post(f"{base}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=30,
                   json={"model": MODEL, "prompt": "probe", "max_tokens": 1})
    return r.status_code
