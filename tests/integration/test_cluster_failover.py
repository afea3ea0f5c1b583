"""A replicated cluster losing a partition leader: kill -9 it under a steady produce, and every
acknowledged event is still on the log exactly once, with no unexplained sequence gap.

A private three-broker cluster (``stack up --brokers 3``'s code, own data dir and free ports)
so that killing a broker never disturbs the stack the other tests use. Topics have three
replicas and ``min.insync.replicas`` 2: with the leader dead, the other two keep taking
``acks=all`` writes once the controller has fenced it and moved the leadership.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource

from common.stack_settings import StackSettings
from ops.stack.kafka import KafkaService
from ops.stack.process import processes_mentioning
from common.log.admin import apply_topics
from common.log.catalog import Catalog
from common.log.kafka import Ack, EventConsumer, EventProducer
from common.log.acks import check_acks
from common.log.reader import KafkaLogReader
from common.net import free_port
from common.settings import BusSettings
from schemas.events import BlockStored
from tests.support.waits import wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

KEY = "w-failover"  # one key: one partition, whose leader is killed


@pytest.fixture
def cluster(tmp_path):
    # Three brokers and three controllers on a small shared box: small heaps, C1 only (half the
    # start-up CPU).
    s = StackSettings(state_dir=tmp_path / "stack", kafka_port=free_port(span=6), kafka_brokers=3,
                      kafka_heap="384m", kafka_jvm_opts="-XX:TieredStopAtLevel=1")
    kafka = KafkaService(s)
    try:
        yield kafka
    finally:
        kafka.stop()
        assert processes_mentioning(str(s.state_dir)) == [], "a broker outlived the test"


def _partition_state(admin: AdminClient, topic: str, partition: int) -> tuple[int, list[int]]:
    """(leader, in-sync replicas) of one partition, fresh from the metadata."""
    p = admin.list_topics(topic, timeout=5).topics[topic].partitions[partition]
    return p.leader, sorted(p.isrs)


class Sender(threading.Thread):
    """Publishes at a steady rate until stopped; keeps when each event was published and when
    each acknowledgement came back."""

    def __init__(self, bus: BusSettings, interval_s: float = 0.004) -> None:
        super().__init__(daemon=True)
        self.producer = EventProducer(bus, "failover-producer", ack_ledger=True, on_ack=self.on_ack)
        self.interval_s = interval_s
        self.stop = threading.Event()
        self.published_at: dict[str, float] = {}
        self.acked_at: list[tuple[float, str]] = []
        self.partitions: set[int] = set()
        self.error: BaseException | None = None

    def on_ack(self, a: Ack) -> None:
        if a.error is None:
            self.acked_at.append((time.monotonic(), a.envelope.event_id))
            self.partitions.add(a.partition)

    def run(self) -> None:
        i = 0
        try:
            while not self.stop.is_set():
                t = time.monotonic()
                env = self.producer.publish(BlockStored(worker_id=KEY, tier="device", block_hashes=[i],
                                                        block_size=16, hash_algo="sha256_cbor"))
                self.published_at[env.event_id] = t
                i += 1
                self.producer.poll(self.interval_s)  # serve delivery reports while pacing
        except BaseException as e:  # noqa: BLE001 - reported by the test, not lost with the thread
            self.error = e

    def first_ack_published_after(self, t0: float) -> float | None:
        for at, eid in list(self.acked_at):
            if self.published_at.get(eid, 0.0) >= t0:
                return at
        return None


class Reader(threading.Thread):
    """A consumer reading through the failover, with the usual dedupe: one that reads every
    partition itself, or a group member committing after each batch (its coordinator and the
    replicated ``__consumer_offsets`` may be on the killed broker)."""

    def __init__(self, bus: BusSettings, group_id: str | None = None) -> None:
        super().__init__(daemon=True)
        self.consumer = EventConsumer(bus, ["kv"], group_id=group_id, assign_all=group_id is None,
                                      consumer_name=group_id or "failover-reader")
        self.group = group_id is not None
        self.seen: Counter[str] = Counter()
        self.stop = threading.Event()
        self.commit_errors = 0

    def run(self) -> None:
        while not self.stop.is_set():
            batch = self.consumer.poll_batch(1000, 0.2)
            for d in batch:
                self.seen[d.envelope.event_id] += 1
            if batch and self.group:
                try:
                    self.consumer.commit()
                except KafkaException:  # coordinator moving: the next commit covers it
                    self.commit_errors += 1
        self.consumer.close()


def _assert_replicated(admin: AdminClient, topic: str) -> None:
    md = admin.list_topics(timeout=10)
    assert sorted(md.brokers) == [1, 2, 3]
    assert all(len(p.replicas) == 3 for p in md.topics[topic].partitions.values())
    res = ConfigResource(ConfigResource.Type.TOPIC, topic)
    assert admin.describe_configs([res])[res].result()["min.insync.replicas"].value == "2"


def _kill_leader_until_produce_resumes(cluster: KafkaService, admin: AdminClient, topic: str,
                                       sender: Sender) -> tuple[int, int, float]:
    """Kill -9 the leader of the sender's partition; wait for the first acknowledgement of an
    event published after the kill and for a new leader without it in the ISR. Returns
    (partition, killed broker, failover seconds)."""
    [partition] = sender.partitions
    leader, isr = _partition_state(admin, topic, partition)
    assert isr == [1, 2, 3]
    cluster.kill9(leader)
    t_kill = time.monotonic()
    t_first = wait_for(lambda: sender.first_ack_published_after(t_kill) or sender.error, timeout=60,
                       what=lambda: f"an ack of an event published after the kill of broker {leader}")
    assert not isinstance(t_first, BaseException), t_first

    def moved() -> tuple[int, list[int]] | None:
        state = _partition_state(admin, topic, partition)
        return state if state[0] not in (-1, leader) else None

    new_leader, isr_after = wait_for(moved, timeout=30, what="a new leader in the metadata")
    assert leader not in isr_after
    print(f"\nFAILOVER broker {leader} (leader of {topic}:{partition}) kill -9 -> first acked produce after the "
          f"kill: {t_first - t_kill:.2f} s; new leader {new_leader}, ISR {isr_after}")
    return partition, leader, t_first - t_kill


def _wait_acks(sender: Sender, n: int, what: str) -> None:
    target = len(sender.acked_at) + n
    wait_for(lambda: len(sender.acked_at) >= target or sender.error, timeout=60,
             what=lambda: f"{n} acks {what}: {len(sender.acked_at)}/{target}")
    assert sender.error is None, f"the sender died: {sender.error!r}"


def test_kill9_of_the_partition_leader_keeps_every_acknowledged_event_once(cluster: KafkaService) -> None:
    t0 = time.monotonic()
    cluster.start()
    print(f"\nCLUSTER up in {time.monotonic() - t0:.1f} s")
    bus = BusSettings(bootstrap=cluster.s.kafka_bootstrap, topic_prefix="failover")
    apply_topics(bus)
    topic = Catalog(bus.topic_prefix).topic("kv")
    admin = AdminClient({**bus.client_conf()})
    _assert_replicated(admin, topic)

    sender = Sender(bus)
    readers = [Reader(bus), Reader(bus, group_id="failover-group")]
    for r in [*readers, sender]:
        r.start()
    try:
        try:
            _wait_acks(sender, 500, "before the kill")
            partition, killed, _ = _kill_leader_until_produce_resumes(cluster, admin, topic, sender)
            # Keep producing, then bring the killed broker back: it catches up, rejoins the ISR.
            _wait_acks(sender, 500, "after the failover")
            t_restart = time.monotonic()
            cluster.start()
            wait_for(lambda: _partition_state(admin, topic, partition)[1] == [1, 2, 3], timeout=60,
                     what=lambda: f"ISR back to 3: {_partition_state(admin, topic, partition)}")
            print(f"REJOIN broker {killed} restarted and back in the ISR after {time.monotonic() - t_restart:.1f} s")
        finally:
            sender.stop.set()
            sender.join(30)
        assert sender.error is None, f"the sender died: {sender.error!r}"
        producer = sender.producer
        assert producer.flush(60) == 0
        assert producer.failed == [], [f.error for f in producer.failed[:3]]
        entries = producer.ledger.entries()
        acked = {e.event_id for e in entries if e.acked}
        assert len(acked) == len(sender.published_at), "every published event was acknowledged"

        with KafkaLogReader(bus.bootstrap) as log_reader:
            report = check_acks(log_reader, entries)
        print(f"LEDGER {report.summary()}")
        assert report.ok, report.summary()
        assert report.acked == len(acked) and report.records == len(acked), "each acked id once, nothing else"

        # The consumers read through the leader change: every acked event once, no gap.
        for r in readers:
            wait_for(lambda: set(r.seen) >= acked, timeout=60,
                     what=lambda: f"{r.consumer.name} to see all {len(acked)} acked events: {len(r.seen)}")
            assert max(r.seen.values()) == 1, r.consumer.name
            assert r.consumer.gaps == [], r.consumer.name
        print(f"READERS each saw {len(acked)} events once; group commits that failed during the failover: "
              f"{readers[1].commit_errors}")
        producer.close()
    finally:
        for r in readers:
            r.stop.set()
            r.join(30)
