"""One active planner, against the real Redis and Kafka: two ``planner run`` processes share a
lease; the leader is killed with SIGKILL; the other takes over within a few seconds with a
higher fencing token, follows an operator's ``PoolPinned`` from the admin stream, and a decision
still carrying the dead leader's token is rejected by the scaler (the fencing file both
processes' scalers share)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis

from control_plane.planner.leader import LeaderElector, LeaderLease
from control_plane.planner.scalers import FileFence, VirtualScaler
from common.stack_settings import StackSettings
from common.log.kafka import EventProducer
from common.net import free_port
from common.settings import BusSettings
from schemas.events import PoolPinned, ScalingApplied, ScalingDecision
from schemas.types import WorkerRole
from tests.support.events import read_stream
from tests.support.waits import wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.slow]

TTL_MS = 2000
CONFIG = """
tick_s = 1.0
gpu_budget = 4
[[pools]]
name = "default"
role = "aggregated"
min_replicas = 1
max_replicas = 4
ttft_slo_ms = 2000.0
itl_slo_ms = 50.0
"""


class Planner:
    def __init__(self, bus: BusSettings, planner_id: str, lease: str, state_dir: Path) -> None:
        env = {**os.environ, "SWITCHYARD_KAFKA_BOOTSTRAP": bus.bootstrap, "SWITCHYARD_TOPIC_PREFIX": bus.topic_prefix}
        config = state_dir / "planner.toml"
        config.write_text(CONFIG)
        self.lines: list[tuple[float, str]] = []
        self.health_port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "control_plane.planner", "run", "--scaler", "virtual", "--planner-id", planner_id,
             "--lease", lease, "--lease-ttl-ms", str(TTL_MS), "--state-dir", str(state_dir), "--config", str(config),
             "--health-port", str(self.health_port)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip()))

    def wait_for(self, prefix: str, timeout: float = 30.0) -> tuple[float, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, line in list(self.lines):
                if line.startswith(prefix):
                    return t, line
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no {prefix!r} line; output:\n" + "\n".join(x for _, x in self.lines[-40:]))

    def has(self, prefix: str) -> bool:
        return any(line.startswith(prefix) for _, line in self.lines)

    def health(self) -> dict | None:
        """The planner's /health body (``caught_up``, ``leader``, ``token``...), None while it
        does not answer."""
        try:
            return httpx.get(f"http://127.0.0.1:{self.health_port}/health", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return None

    def standby(self) -> bool:
        """Caught up (so it would act as leader the moment it held a token) and holding none."""
        h = self.health()
        return bool(h and h["caught_up"] and h["leader"] is False and h["token"] is None)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def _token(line: str) -> int:
    return int(line.rsplit("token=", 1)[1].split()[0])


def test_sigkill_leader_is_replaced_within_seconds_and_its_token_is_fenced(bus: BusSettings, tmp_path) -> None:
    lease = f"test-{bus.topic_prefix}"
    planners = {pid: Planner(bus, pid, lease, tmp_path) for pid in ("pa", "pb")}
    try:
        deadline = time.monotonic() + 30
        while not any(p.has("LEADER") for p in planners.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        leaders = [pid for pid, p in planners.items() if p.has("LEADER")]
        assert len(leaders) == 1, f"leaders: {leaders}"
        first = planners[leaders[0]]
        other_id = "pb" if leaders[0] == "pa" else "pa"
        other = planners[other_id]
        token_a = _token(first.wait_for("LEADER")[1])
        first.wait_for("DECISION default 0->1")
        other.wait_for(f"STARTED planner={other_id}")
        # The other one is ready to lead (caught up: with a token it would print LEADER at its
        # next tick) while the first leads, and holds no token.
        wait_for(other.standby, timeout=30, what=lambda: f"{other_id} on standby: {other.health()}")
        assert first.health()["leader"] is True
        assert not other.has("LEADER"), "two leaders at once"

        first.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        first.proc.wait(5)
        t, line = other.wait_for(f"LEADER planner={other_id}", timeout=TTL_MS / 1000 + 8)
        token_b = _token(line)
        takeover = t - killed
        assert takeover < TTL_MS / 1000 + 3, f"takeover took {takeover:.1f}s"
        assert token_b > token_a
        _, dline = other.wait_for("DECISION default")
        assert _token(dline) == token_b and "applied=True" in dline

        # An operator pins the pool through the admin stream: the new leader follows it.
        admin = EventProducer(bus, "operator")
        admin.publish(PoolPinned(actor="test-operator", pool="default", replicas=3, reason="pin test"))
        assert admin.flush(10) == 0
        other.wait_for("DECISION default 1->3", timeout=15)

        # A zombie decision from the dead leader arrives late: the shared fence rejects it.
        zombie = ScalingDecision(pool="default", decision_id="zombie", role=WorkerRole.AGGREGATED, from_replicas=1,
                                 to_replicas=4, reason="late", config_version=1, fencing_token=token_a)
        out = VirtualScaler(fence=FileFence(tmp_path / "virtual" / "fence")).apply(zombie)
        assert not out.success and f"stale fencing token {token_a} < newest seen {token_b}" in out.error
    finally:
        for p in planners.values():
            p.stop()

    planner_events = read_stream(bus, "planner")
    decisions = [e.data for e in planner_events if isinstance(e.data, ScalingDecision)]
    applied = [e.data for e in planner_events if isinstance(e.data, ScalingApplied)]
    assert sorted({d.fencing_token for d in decisions}) == [token_a, token_b]
    pinned = [d for d in decisions if d.inputs.get("pinned") == 3]
    assert pinned and pinned[0].inputs["pinned_by"] == "test-operator" and "pin test" in pinned[0].reason
    assert {e.producer for e in planner_events} == {"pa", "pb"}
    assert all(x.success for x in applied) and len(applied) == len(decisions)


class CountingLease(LeaderLease):
    """The real Redis lease, counting its successful renewals and refused acquires."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.renewals = 0
        self.refusals = 0

    def renew(self) -> bool:
        ok = super().renew()
        self.renewals += ok
        return ok

    def try_acquire(self) -> int | None:
        token = super().try_acquire()
        self.refusals += token is None
        return token


def test_lease_is_exclusive_renewed_and_released(stack_settings: StackSettings) -> None:
    """In-process: one of two electors leads; the lease survives several TTLs by renewal; a clean
    stop releases it and the other takes over at once with the next token."""
    client = redis.Redis.from_url(stack_settings.redis_url)
    name = f"unit-{time.time_ns()}"
    lease_a = CountingLease(client, name, "a", ttl_ms=600)
    a = LeaderElector(lease_a, retry_s=0.05).start()
    b = None
    try:
        deadline = time.monotonic() + 5
        while a.token is None and time.monotonic() < deadline:
            time.sleep(0.02)
        t1 = a.token
        assert t1 is not None
        lease_b = CountingLease(client, name, "b", ttl_ms=600)
        renewed = lease_a.renewals
        b = LeaderElector(lease_b, retry_s=0.05).start()
        # > 3 TTLs: a renews every ttl / 3 (200 ms), so 11 renewals after b started span at least
        # 10 intervals, 2 s, while b keeps being refused: without them the key would have expired
        # three times over.
        wait_for(lambda: lease_a.renewals - renewed >= 11 and lease_b.refusals >= 10, timeout=30,
                 what=lambda: f"renewals {lease_a.renewals - renewed}, b refused {lease_b.refusals}")
        assert a.token == t1 and b.token is None
        a.stop(release=True)
        deadline = time.monotonic() + 1.0
        while b.token is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert b.token == t1 + 1
    finally:
        a.stop()
        if b is not None:
            b.stop()
