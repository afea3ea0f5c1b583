"""The router end to end: real broker, real HTTP, the official `openai` client, two workers
(tests/support/mini_worker.py) that publish real KV events, kill -9 of the router."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest

from control_plane.replay.engine import ReplayEngine
from common.log.catalog import Catalog
from common.log.reader import KafkaLogReader
from common.net import free_port
from common.settings import BusSettings
from schemas.events import RequestCompleted, RequestFailed, RequestRouted
from tests.integration.test_router_view import oracle
from tests.support.events import read_stream, router_ids
from tests.support.waits import wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


class Procs:
    def __init__(self, bus: BusSettings, log_dir: Path | None = None) -> None:
        self.env = {**os.environ, "SWITCHYARD_KAFKA_BOOTSTRAP": bus.bootstrap,
                    "SWITCHYARD_TOPIC_PREFIX": bus.topic_prefix, "PYTHONUNBUFFERED": "1"}
        self.procs: list[subprocess.Popen] = []
        # The routers' output: in the test's tmp dir when given (pytest keeps the last runs),
        # else in a private dir removed on close.
        self._own_dir = None if log_dir is not None else Path(tempfile.mkdtemp(prefix="router-test-"))
        self.log = open((log_dir or self._own_dir) / "router.log", "ab")

    def worker(self, wid: str, *extra: str) -> tuple[subprocess.Popen, int]:
        port = free_port()
        p = subprocess.Popen([sys.executable, "-m", "tests.support.mini_worker", "--worker-id", wid,
                              "--port", str(port), *extra], env=self.env)
        self.procs.append(p)
        _wait_http(f"http://127.0.0.1:{port}/health")
        return p, port

    def router(self, port: int, rid: str = "r-test", *extra: str) -> subprocess.Popen:
        """A router; without ``extra``, with API keys off (what these tests are about is
        routing; tests/integration/test_router_keys.py is about the keys)."""
        extra = extra or ("--no-auth",)
        p = subprocess.Popen([sys.executable, "-m", "switchyard.cli", "router", "--port", str(port),
                              "--router-id", rid, "--snapshot-every", "1", *extra], env=self.env,
                             stdout=self.log, stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
        self.log.close()
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)


def _wait_http(url: str, pred=lambda r: r.status_code == 200, timeout: float = 60) -> httpx.Response:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = httpx.get(url, timeout=2)
            if pred(last):
                return last
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} not ready: {last.text if last is not None else 'no answer'}")


def _view_caught_up(base: str, bus: BusSettings, streams=("kv", "workers"), timeout: float = 30) -> dict:
    """Until the router's view has folded every record of ``streams`` written before the call;
    returns its /router/view body."""
    cat = Catalog(bus.topic_prefix)
    with KafkaLogReader(bus.bootstrap) as reader:
        ends = {f"{t}:{p}": reader.bounds(t, p)[1] for t in map(cat.topic, streams) for p in reader.partitions(t)}
    seen: dict = {}

    def caught_up() -> dict | None:
        nonlocal seen
        seen = httpx.get(f"{base}/router/view", timeout=5).json()
        pos = seen["positions"]
        return seen if all(pos.get(tp, 0) >= end for tp, end in ends.items() if end) else None

    return wait_for(caught_up, timeout, what=lambda: f"router view at the log end {ends}: {seen.get('positions')}")


def _checkpointed(bus: BusSettings, applied: int) -> bool:
    """A router-view snapshot on the log covers ``applied`` folded records."""
    with KafkaLogReader(bus.bootstrap) as reader:
        return any(s.applied >= applied for s in ReplayEngine(reader, Catalog(bus.topic_prefix)).snapshots())


def _routed(bus: BusSettings) -> dict[str, list[RequestRouted]]:
    """Each request's decisions, by the client's request id where it sent one."""
    client = {rid: cid for cid, rid in router_ids(bus).items()}
    out: dict[str, list[RequestRouted]] = {}
    for env in read_stream(bus, "requests"):
        if isinstance(env.data, RequestRouted):
            out.setdefault(client.get(env.data.request_id, env.data.request_id), []).append(env.data)
    return out


def test_openai_client_prefix_affinity_failover_and_router_restart(bus: BusSettings, procs: Procs) -> None:
    procs.worker("w1")
    procs.worker("w2")
    port = free_port()
    router = procs.router(port)
    base = f"http://127.0.0.1:{port}"
    _wait_http(f"{base}/health", lambda r: r.status_code == 200 and r.json()["workers"] == 2)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)

    # Non-streaming and streaming, completions and chat.
    r = client.completions.create(model="switchyard-sim", prompt="hello world " * 50, max_tokens=8)
    assert r.choices[0].text and r.usage.completion_tokens == 8
    chunks = list(client.completions.create(model="switchyard-sim", prompt="stream me " * 40, max_tokens=6,
                                            stream=True))
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) == 6
    chat = client.chat.completions.create(model="switchyard-sim", max_tokens=5,
                                          messages=[{"role": "user", "content": "hi " * 30}])
    assert chat.choices[0].message.content and chat.object == "chat.completion"
    chat_stream = list(client.chat.completions.create(model="switchyard-sim", max_tokens=4, stream=True,
                                                      messages=[{"role": "user", "content": "yo " * 30}]))
    assert sum(1 for c in chat_stream if c.choices and c.choices[0].delta.content) == 4
    assert [m.id for m in client.models.list().data] == ["switchyard-sim"]

    # Bad bodies: 4xx with a message, never 500.
    bad = httpx.post(f"{base}/v1/completions", json={"prompt": [], "max_tokens": 3})
    assert bad.status_code == 400 and "prompt" in bad.json()["error"]["message"]
    bad = httpx.post(f"{base}/v1/chat/completions", json={"messages": "nope"})
    assert bad.status_code == 400
    bad = httpx.post(f"{base}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert 400 <= bad.status_code < 500
    # The attacker's requests (tests/integration/test_router_input.py has them all): each a 4xx
    # with a reason over one keep-alive connection; the view stays EXACT, both workers ready.
    with httpx.Client(base_url=base, timeout=30, limits=httpx.Limits(max_connections=1)) as one:
        ports = set()
        for body, status, code in [
            (b'{"prompt":"\\ud800"}', 400, "invalid_unicode"),
            (b'{"prompt":[1, 18446744073709551616]}', 400, "invalid_token_id"),
            (b'{"prompt":"hi","max_tokens":131072}', 400, "max_tokens_exceeded"),
            (b'{"prompt":"hi","n":2}', 400, "unsupported_parameter"),
            (b'{"prompt":"hi","model":"nope"}', 404, "model_not_found"),
            (b'{"prompt":"hi","request_id":"a\\nb"}', 400, "invalid_value"),
            (b'{"prompt":"' + b"a " * 1_000_000 + b'"}', 400, "context_length_exceeded"),
        ]:
            r = one.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text
            ports.add(r.extensions["network_stream"].get_extra_info("client_addr")[1])
        r = one.post("/v1/completions", json={"prompt": "after the attack " * 5, "max_tokens": 2})
        ports.add(r.extensions["network_stream"].get_extra_info("client_addr")[1])
        assert r.status_code == 200 and len(ports) == 1, (r.text, ports)
    h = httpx.get(f"{base}/health").json()
    assert h["state"] == "EXACT" and h["workers"] == 2 and h["stale_workers"] == [], h
    assert not [e for e in read_stream(bus, "requests") if isinstance(e.data, RequestFailed)]

    # Prefix affinity: a long shared document; after the first request's KV events are folded,
    # requests sharing it land on the worker that holds it.
    doc = list(range(1000, 1000 + 64 * 24))  # 24 blocks of token ids
    first = client.completions.create(model="switchyard-sim", prompt=doc + [1, 2, 3], max_tokens=2,
                                      extra_body={"request_id": "affinity-0"})
    assert first.choices
    _wait_http(f"{base}/router/view", lambda r: r.json()["hashes"] >= 24)
    for i in range(1, 6):
        client.completions.create(model="switchyard-sim", prompt=doc + [7, i], max_tokens=2, extra_body={"request_id": f"affinity-{i}"})
    routed = _routed(bus)
    holder = routed["affinity-0"][-1].worker_id
    assert [routed[f"affinity-{i}"][-1].worker_id for i in range(1, 6)] == [holder] * 5
    row = next(s for s in routed["affinity-1"][-1].scores if s.worker_id == holder)
    assert row.overlap_blocks == 24 and row.overlap_by_tier == {"device": 24}
    assert routed["affinity-1"][-1].config_version == 1 and routed["affinity-1"][-1].view_state == "EXACT"

    # A worker that dies mid-stream: the streaming client gets a clean error, never a hang;
    # a request sent while it is down is retried on a live worker.
    procs.worker("w3", "--die-after", "2")
    _wait_http(f"{base}/health", lambda r: r.json()["workers"] == 3)
    outcomes = []
    for i in range(6):
        try:
            got = list(client.completions.create(model="switchyard-sim", prompt=f"crash {i} " * 30, max_tokens=5, stream=True,
                                                 extra_body={"request_id": f"crash-{i}"}))
            outcomes.append(sum(1 for c in got if c.choices and c.choices[0].text))
        except openai.APIError as e:
            outcomes.append(f"error: {e}")
    assert all(o == 5 or str(o).startswith("error") for o in outcomes), outcomes
    failed = [e.data for e in read_stream(bus, "requests") if isinstance(e.data, RequestFailed)]
    assert any(f.worker_id == "w3" for f in failed) or outcomes.count(5) == 6

    # kill -9 the router; a new one comes back EXACT from snapshot + tail and equals the oracle.
    # Let a checkpoint land: a snapshot of the view as it is once the traffic's events are in it.
    applied = _view_caught_up(base, bus)["applied"]
    wait_for(lambda: _checkpointed(bus, applied), timeout=30, what=f"a router-view checkpoint of {applied} records")
    router.send_signal(signal.SIGKILL)
    router.wait(10)
    client.close()
    port2 = free_port()
    procs.router(port2, rid="r-test")
    base2 = f"http://127.0.0.1:{port2}"
    h = _wait_http(f"{base2}/health", lambda r: r.status_code == 200 and r.json()["state"] in ("EXACT", "DEGRADED")).json()
    view = _wait_http(f"{base2}/router/view?digest=true", lambda r: r.status_code == 200).json()
    upto = {(k.rsplit(":", 1)[0], int(k.rsplit(":", 1)[1])): v for k, v in view["positions"].items()}
    want = oracle(bus, "sha256", 64, upto=upto)
    assert view["digest"] == want.digest(), (view, h)
    completed = [e.data for e in read_stream(bus, "requests") if isinstance(e.data, RequestCompleted)]
    ids = router_ids(bus)
    assert {c.request_id for c in completed} >= {ids[f"affinity-{i}"] for i in range(6)}
