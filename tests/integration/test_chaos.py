"""Fault injection under load, on a private stack: kill -9 in turn the router, the metrics
stream processor, a worker and the Kafka broker; restart each; then check that

* the log holds every event once after dedupe, with no sequence gap in any producer's stream;
* the restarted router's index equals the oracle fold of the log at the same offsets;
* every admitted request ended (completed, rejected, or failed with a reason), none hanging;

and report the time to recover from each fault. (The planner leader's kill -9 is covered by
the planner's leader-election test.)"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter

import httpx
import pytest

from control_plane.settings import StackSettings
from control_plane.stack import Stack
from kernel.log.admin import apply_topics
from kernel.log.catalog import Catalog
from kernel.log.sequencing import SequenceTracker
from kernel.net import free_port
from kernel.settings import BusSettings, repo_root
from schemas.events import RequestAdmitted, RequestCompleted, RequestFailed, RequestRejected
from tests.integration.test_router import _wait_http
from tests.integration.test_router_view import oracle
from tests.integration.workerproc import WorkerProc
from tests.support.events import read_stream
from tests.support.waits import wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

WORKER_ARGS = ("--speedup", "20", "--block-size", "64", "--device-blocks", "1024", "--disk-blocks", "64",
               "--load-interval", "0.5")


def _raw_records(bus: BusSettings):
    """Every record of every event topic: (topic, partition, envelope)."""
    out = []
    for stream in ("kv", "requests", "workers"):
        topic = Catalog(bus.topic_prefix).topic(stream)
        for env in read_stream(bus, stream):
            out.append((topic, env))
    return out


def _request_ends(bus: BusSettings) -> tuple[list, set[str], set[str]]:
    """(request events, admitted ids, ids whose end is on the log)."""
    reqs = read_stream(bus, "requests")
    admitted = {e.data.request_id for e in reqs if isinstance(e.data, RequestAdmitted)}
    ended = {e.data.request_id for e in reqs if isinstance(e.data, (RequestCompleted, RequestRejected))
             or (isinstance(e.data, RequestFailed) and not e.data.retried)}
    return reqs, admitted, ended


class Load(threading.Thread):
    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.stop = threading.Event()
        self.sent = 0
        self.outcomes: Counter[str] = Counter()

    def run(self) -> None:
        doc = list(range(2000, 2000 + 64 * 6))
        with httpx.Client(timeout=30) as c:
            while not self.stop.is_set():
                i = self.sent
                self.sent += 1
                try:
                    r = c.post(f"{self.url}/v1/completions", json={
                        "model": "switchyard-sim", "prompt": doc + [i % 7] * 64 + [i], "max_tokens": 8, "stream": True,
                        "request_id": f"chaos-{i}"})
                    self.outcomes["ok" if r.status_code == 200 and "[DONE]" in r.text else f"http-{r.status_code}"] += 1
                except httpx.HTTPError as e:
                    self.outcomes[type(e).__name__] += 1
                time.sleep(0.05)


def test_kill9_each_component_under_load_loses_nothing(tmp_path) -> None:
    state = repo_root() / ".stack" / "tests" / f"chaos-{uuid.uuid4().hex[:6]}"
    s = StackSettings(state_dir=state, kafka_port=free_port(pair=True))
    stack = Stack(s)
    stack.up(["kafka"])
    kafka = stack.services["kafka"]
    bus = BusSettings(bootstrap=s.kafka_bootstrap, topic_prefix="chaos")
    apply_topics(bus)
    env = {**os.environ, "SWITCHYARD_KAFKA_BOOTSTRAP": bus.bootstrap, "SWITCHYARD_TOPIC_PREFIX": bus.topic_prefix,
           "PYTHONUNBUFFERED": "1"}
    log = open(tmp_path / "procs.log", "ab")
    procs: dict[str, subprocess.Popen] = {}
    rport, mport = free_port(), free_port()  # below the ephemeral range: restarted on the same port

    def start_router() -> None:
        procs["router"] = subprocess.Popen([sys.executable, "-m", "switchyard.cli", "router", "--port", str(rport),
                                            "--router-id", "chaos-router", "--snapshot-every", "1"],
                                           env=env, stdout=log, stderr=subprocess.STDOUT)

    def start_metrics() -> None:
        procs["metrics"] = subprocess.Popen([sys.executable, "-m", "switchyard.cli", "metrics", "run", "--port",
                                             str(mport), "--processor-id", "chaos"], env=env, stdout=log,
                                            stderr=subprocess.STDOUT)

    workers = [WorkerProc(bus, f"cw-{i}", tmp_path / f"w{i}", tmp_path, args=WORKER_ARGS) for i in range(2)]
    base = f"http://127.0.0.1:{rport}"
    load = Load(base)
    recovery: dict[str, float] = {}
    try:
        for w in workers:
            w.start()
        start_router()
        start_metrics()
        _wait_http(f"{base}/health", lambda r: r.status_code == 200 and r.json()["workers"] == 2)
        _wait_http(f"http://127.0.0.1:{mport}/health")
        def served(more: int, what: str) -> None:
            """Until ``more`` further requests were served in full (traffic flows)."""
            target = load.outcomes["ok"] + more
            wait_for(lambda: load.outcomes["ok"] >= target, timeout=60,
                     what=lambda: f"{more} requests served {what}: {dict(load.outcomes)}")

        load.start()
        served(10, "before the first fault")

        def fault(name: str, kill, restart, ready) -> None:
            kill()
            t0 = time.monotonic()
            restart()
            ready()
            recovery[name] = time.monotonic() - t0
            served(5, f"after the {name} recovered")

        fault("router",
              lambda: (procs["router"].send_signal(signal.SIGKILL), procs["router"].wait(10)),
              start_router,
              lambda: _wait_http(f"{base}/health", lambda r: r.status_code == 200 and r.json()["state"] == "EXACT"
                                 and r.json()["workers"] == 2, timeout=90))
        fault("metrics_processor",
              lambda: (procs["metrics"].send_signal(signal.SIGKILL), procs["metrics"].wait(10)),
              start_metrics,
              lambda: _wait_http(f"http://127.0.0.1:{mport}/health", timeout=90))
        fault("worker", workers[0].kill, workers[0].launch,
              lambda: (workers[0].wait_ready(60),
                       _wait_http(f"{base}/health", lambda r: r.json()["workers"] == 2 and r.json()["state"] == "EXACT",
                                  timeout=60)))
        fault("kafka_broker", kafka.kill9, kafka.start,
              lambda: _wait_http(f"{base}/health", lambda r: r.status_code == 200 and r.json()["state"] == "EXACT"
                                 and r.json()["lag_events"] == 0, timeout=120))
        load.stop.set()
        load.join(60)
        # The last requests' events land: every admitted request's end is on the log.
        last: tuple = ()

        def all_ended() -> bool:
            nonlocal last
            last = _request_ends(bus)
            return bool(last[1]) and last[1] <= last[2]

        wait_for(all_ended, timeout=15, interval=0.5,
                 what=lambda: f"the end of every admitted request; missing {sorted(last[1] - last[2])[:10]}")

        # 1. Exactly once after dedupe, no gap in any producer's per-partition sequence.
        tracker = SequenceTracker()
        ids: Counter[str] = Counter()
        for topic, e in _raw_records(bus):
            obs = tracker.observe(f"{topic}:{e.key}", e.producer, e.epoch, e.seq)  # key -> one partition
            if obs.accepted:
                ids[e.event_id] += 1
        assert max(ids.values()) == 1
        assert tracker.outstanding_gaps() == {}, tracker.outstanding_gaps()

        # 2. The router's index equals the oracle fold at the same offsets.
        view = _wait_http(f"{base}/router/view?digest=true").json()
        upto = {(k.rsplit(":", 1)[0], int(k.rsplit(":", 1)[1])): v for k, v in view["positions"].items()}
        assert view["digest"] == oracle(bus, "sha256", 64, upto=upto).digest()

        # 3. Every admitted request ended.
        reqs, admitted, ended = _request_ends(bus)
        assert admitted and admitted <= ended, sorted(admitted - ended)[:10]
        completed = {e.data.request_id for e in reqs if isinstance(e.data, RequestCompleted)}
        assert len(completed) >= 0.5 * len(admitted)
        print(f"\nchaos: {load.sent} requests sent, client outcomes {dict(load.outcomes)}; "
              f"{len(admitted)} admitted, {len(completed)} completed; recovery seconds "
              + ", ".join(f"{k} {v:.1f}" for k, v in recovery.items()))
    finally:
        load.stop.set()
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for w in workers:
            w.kill()
        stack.down()
        shutil.rmtree(state, ignore_errors=True)
