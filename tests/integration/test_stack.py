"""The local stack's lifecycle, and the log surviving a broker kill -9.

These tests run a *private* stack (own data dir under .stack/tests, own ports) so that stopping
and killing it never disturbs the shared stack the other tests use.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter

import pytest
from confluent_kafka import Consumer, TopicPartition

from common.stack_settings import SEAWEEDFS_PORTS, StackSettings
from ops.stack import Stack
from ops.stack.process import port_in_use, processes_mentioning
from common.log.admin import apply_topics
from common.log.catalog import Catalog
from common.log.kafka import EventProducer
from common.net import free_port
from common.settings import BusSettings, repo_root
from schemas import EventCodec
from schemas.events import BlockStored

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.fixture
def private_settings():
    state = repo_root() / ".stack" / "tests" / uuid.uuid4().hex[:8]
    s = StackSettings(state_dir=state, kafka_port=free_port(pair=True), postgres_port=free_port(),
                      redis_port=free_port(), prometheus_port=free_port(),
                      seaweedfs_port=free_port(span=SEAWEEDFS_PORTS))
    yield s
    Stack(s).down()
    shutil.rmtree(state, ignore_errors=True)


def _env(s: StackSettings) -> dict[str, str]:
    return {**os.environ, "SWITCHYARD_STATE_DIR": str(s.state_dir), "SWITCHYARD_KAFKA_PORT": str(s.kafka_port),
            "SWITCHYARD_POSTGRES_PORT": str(s.postgres_port), "SWITCHYARD_REDIS_PORT": str(s.redis_port),
            "SWITCHYARD_PROMETHEUS_PORT": str(s.prometheus_port), "SWITCHYARD_SEAWEEDFS_PORT": str(s.seaweedfs_port)}


def _cli(s: StackSettings, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "switchyard.cli", *args], env=_env(s),
                          capture_output=True, text=True, timeout=180)


def test_stack_up_twice_is_harmless_and_down_leaves_no_process(private_settings: StackSettings) -> None:
    s = private_settings
    first = _cli(s, "stack", "up")
    assert first.returncode == 0, first.stderr
    assert first.stdout.count("started") == 5
    pids = {st["service"]: st["pid"] for st in Stack(s).status()}
    assert all(pids.values())

    second = _cli(s, "stack", "up")
    assert second.returncode == 0, second.stderr
    assert second.stdout.count("already running") == 5
    assert {st["service"]: st["pid"] for st in Stack(s).status()} == pids, "nothing restarted"
    status = _cli(s, "stack", "status", "--json")
    assert status.returncode == 0 and '"running": true' in status.stdout

    down = _cli(s, "stack", "down")
    assert down.returncode == 0, down.stderr
    assert processes_mentioning(str(s.state_dir)) == []
    assert not any(port_in_use(s.host, p) for p in (s.kafka_port, s.postgres_port, s.redis_port, s.prometheus_port,
                                                    *s.seaweedfs_ports.values()))
    assert all(not st["running"] for st in Stack(s).status())


def test_broker_kill9_loses_no_acknowledged_event_and_writes_none_twice(private_settings: StackSettings) -> None:
    stack = Stack(private_settings)
    stack.up(["kafka"])
    kafka = stack.services["kafka"]
    bus = BusSettings(bootstrap=private_settings.kafka_bootstrap, topic_prefix="crash")
    apply_topics(bus)

    acked: list[str] = []
    lock = threading.Lock()

    def on_ack(a) -> None:
        if a.error is None:
            with lock:
                acked.append(a.envelope.event_id)

    producer = EventProducer(bus, "crash-producer", on_ack=on_ack)
    total = 30_000
    published: list[str] = []

    errors: list[BaseException] = []

    def send() -> None:
        try:
            for i in range(total):
                env = producer.publish(BlockStored(worker_id=f"w{i % 8}", tier="device", block_hashes=[i],
                                                   block_size=16, hash_algo="sha256_cbor"))
                published.append(env.event_id)
                if i % 200 == 0:
                    time.sleep(0.01)  # keep sending across the crash window
        except BaseException as e:  # noqa: BLE001 - reported by the test, not lost with the thread
            errors.append(e)
            raise

    t = threading.Thread(target=send)
    t.start()
    deadline = time.monotonic() + 90
    while len(acked) < 3_000:
        assert not errors, f"the sender died: {errors[0]!r}"
        assert time.monotonic() < deadline, (f"{len(acked)} acks after 90 s; {len(published)} published, "
                                             f"{len(producer.failed)} failed, sender alive: {t.is_alive()}")
        producer.poll(0.01)  # serve delivery reports also when the sender is between batches
    acked_before_crash = len(acked)
    kafka.kill9()
    time.sleep(1.5)
    kafka.start()
    t.join()
    assert not errors, f"the sender died: {errors[0]!r}"
    assert producer.flush(120) == 0
    assert producer.failed == [], [f.error for f in producer.failed[:3]]
    assert len(acked) == total and acked_before_crash < total

    # Read the raw log (no dedupe): every acknowledged event is there exactly once.
    topic = Catalog(bus.topic_prefix).topic("kv")
    c = Consumer({**bus.client_conf(), "group.id": "crash-check", "auto.offset.reset": "earliest",
                  "enable.auto.commit": False})
    md = c.list_topics(topic, timeout=10)
    c.assign([TopicPartition(topic, p, 0) for p in md.topics[topic].partitions])
    codec = EventCodec()
    seen: Counter[str] = Counter()
    deadline = time.monotonic() + 60
    while sum(seen.values()) < total and time.monotonic() < deadline:
        for m in c.consume(5000, 0.5):
            if not m.error():
                seen[codec.peek(m.value()).event_id] += 1
    end = time.monotonic() + 1
    while time.monotonic() < end:
        for m in c.consume(5000, 0.2):
            if not m.error():
                seen[codec.peek(m.value()).event_id] += 1
    c.close()
    missing = set(acked) - set(seen)
    assert not missing, f"{len(missing)} acknowledged events lost"
    assert max(seen.values()) == 1, f"{sum(v > 1 for v in seen.values())} events written twice"
    assert set(seen) == set(published)
