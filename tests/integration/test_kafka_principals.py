"""Each component is its own Kafka principal, confined by ACLs (issue 14, item 1): against the
running stack, every role can write the topics of its role and read the log, and every other
write is refused by the broker (TOPIC_AUTHORIZATION_FAILED), whatever the record says: a router
cannot register a worker, a worker cannot pin a pool or scale one, only the admin API and a
router (recording the config it started with) write ``admin``."""

from __future__ import annotations

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from ops.security.check import ACCEPTED, REFUSED
from ops.security.probes_bus import join_group
from common.log.catalog import Catalog
from common.log.principals import ROLES
from common.settings import BusSettings

pytestmark = [pytest.mark.kafka]


def _as(bus: BusSettings, role: str) -> BusSettings:
    return BusSettings.from_env({}, role=role, bootstrap=bus.bootstrap, topic_prefix=bus.topic_prefix,
                                secrets_dir=bus.secrets_dir)


def _write(bus: BusSettings, stream: str) -> str | None:
    """Write one record; the delivery error, or None when it was written."""
    out: list[str | None] = []
    p = Producer({**bus.client_conf(), "message.timeout.ms": 10000, "acks": "all", "logger": None})
    p.produce(Catalog(bus.topic_prefix).topic(stream), value=b"\x80", key=b"forged-0",
              on_delivery=lambda err, _m: out.append(str(err) if err else None))
    assert p.flush(20) == 0, "no delivery report"
    return out[0]


@pytest.mark.parametrize("name", sorted(ROLES))
def test_a_role_writes_its_topics_and_nothing_else(bus: BusSettings, name: str) -> None:
    me = _as(bus, name)
    for stream in (s.stream for s in Catalog(bus.topic_prefix).specs):
        err = _write(me, stream)
        if stream in ROLES[name].writes:
            assert err is None, f"{name} could not write {stream}: {err}"
        else:
            assert err is not None and "TOPIC_AUTHORIZATION_FAILED" in err, f"{name} wrote {stream}: {err}"


def test_every_role_reads_the_streams_it_folds_and_no_other(bus: BusSettings) -> None:
    """Issue 36: components read the log as the super user. Now each reads, with its own
    principal, through the same reader its restores use, only its role's streams."""
    from common.errors import LogReadError
    from common.log.reader import KafkaLogReader

    cat = Catalog(bus.topic_prefix)
    for stream in ("kv", "workers", "requests", "planner", "admin", "snapshots", "deadletter"):
        assert _write(bus, stream) is None  # the super user (the operator's tools)
    for name, r in ROLES.items():
        with KafkaLogReader(_as(bus, name), timeout_s=10) as reader:
            for stream in (s.stream for s in cat.specs):
                topic = cat.topic(stream)
                if r.reads is None or stream in r.reads:
                    got = [rec.value for p in reader.partitions(topic) for rec in reader.read(topic, p, 0, 1 << 62)]
                    assert b"\x80" in got, f"{name} read nothing of {stream}"
                else:
                    with pytest.raises(LogReadError, match="TOPIC_AUTHORIZATION_FAILED"):
                        for p in reader.partitions(topic):  # refused here, or at the fetch of a topic it writes
                            list(reader.read(topic, p, 0, 1 << 62))


def test_a_role_joins_only_its_own_consumer_groups(bus: BusSettings) -> None:
    """Issue 36, item 1: the processor's credential joined the router view's group and was handed
    its partitions. Now the broker refuses a group outside the role's own prefixes (the router's
    view is in no group at all; its role's groups are its assign-only consumers' ids), and the
    router's credential no longer joins the groups its view left (``router-view.``)."""
    p = bus.topic_prefix
    verdict, detail = join_group(_as(bus, "router"), f"{p}.router-view.demo-router.1", Catalog(p).topic("workers"),
                                 timeout_s=20)
    assert verdict == REFUSED, detail
    victims = {"router": f"{p}.router.demo-router.1", "planner": f"{p}.load-view.planner.1",
               "processor": f"{p}.metrics.demo.1"}
    workers = Catalog(p).topic("workers")
    for attacker in ("processor", "worker", "admin"):
        for owner, group in victims.items():
            if owner == attacker:
                continue
            verdict, detail = join_group(_as(bus, attacker), group, workers, timeout_s=20)
            assert verdict == REFUSED, (attacker, group, detail)  # REFUSED: GROUP_AUTHORIZATION_FAILED
    for owner, group in victims.items():
        verdict, detail = join_group(_as(bus, owner), group, workers, timeout_s=20)
        assert verdict == ACCEPTED, (owner, detail)


def test_a_forged_snapshot_is_dead_lettered_and_the_restore_takes_the_owners(bus: BusSettings) -> None:
    """Issue 36: ``snapshots`` was unsigned, so the processor's credential (which writes it, for
    its own projection) could write a router view the routers restore at their next start. The
    security probe writes a router's snapshot and two newer forgeries under its key with the
    processor's credential; the routers' restore (``SnapshotStore.load_latest``) refuses both,
    dead-letters them ``forged:*`` and restores the router's own."""
    from common.log.kafka import H_DLQ_REASON, H_DLQ_SOURCE

    from ops.security.check import Targets
    from ops.security.probes_bus import probe_forged_snapshots

    t = Targets(router_url=None, admin_url=None, kafka_bootstrap=bus.bootstrap, postgres_url="", redis_url="",
                pids=[], topic_prefix=bus.topic_prefix)
    probes = probe_forged_snapshots(t)
    assert [p.verdict for p in probes] == [REFUSED, REFUSED], probes
    dlq = Catalog(bus.topic_prefix).deadletter
    c = Consumer({**bus.client_conf(), "group.id": f"{bus.topic_prefix}.ops.dlq", "enable.auto.commit": False,
                  "logger": None})
    reasons: dict[str, str] = {}
    try:
        c.assign([TopicPartition(dlq, 0, 0)])
        for _ in range(40):
            m = c.poll(0.5)
            if m is not None and not m.error():
                h = {k: v.decode() for k, v in m.headers() or ()}
                reasons[h[H_DLQ_SOURCE]] = h[H_DLQ_REASON]
            if len(reasons) == 2:
                break
    finally:
        c.close()
    assert sorted(reasons.values()) == ["forged:bad_signature", "forged:unsigned"], reasons


def test_a_flood_of_forged_snapshots_costs_a_restore_a_bounded_search(bus: BusSettings) -> None:
    """Past ``MAX_REFUSED`` forgeries in a row the restore stops looking and folds the log
    (returns None), rather than reading every forged record the topic holds."""
    from common.log.snapshots import MAX_REFUSED, SnapshotStore

    key = "router-view:sha256:16"
    router = _as(bus, "router")
    SnapshotStore(router).save(key, b"the router's own")
    p = Producer({**_as(bus, "planner").client_conf(), "logger": None})
    for i in range(MAX_REFUSED + 2):
        p.produce(Catalog(bus.topic_prefix).topic("snapshots"), value=b"forged %d" % i, key=key.encode())
    assert p.flush(20) == 0
    store = SnapshotStore(router)
    assert store.load_latest(key) is None
    assert [r for _, r in store.refused] == ["forged:unsigned"] * MAX_REFUSED
    SnapshotStore(router).save(key, b"newer")  # a signed newest record is found first again
    assert SnapshotStore(router).load_latest(key) == b"newer"


def test_the_security_probe_of_foreign_reads_is_refused(bus: BusSettings) -> None:
    """``security-check``'s reads beyond a role's streams, against empty topics (a fresh stack:
    the probe used to skip the fetch there and say "accepted, read 0 records") and against
    records that are there; and a read the role may make is accepted on an empty topic too (the
    broker answered the fetch: the partition's end)."""
    from ops.security.check import Targets
    from ops.security.probes_bus import FOREIGN_READS, fetch_every_partition, probe_reads

    t = Targets(router_url=None, admin_url=None, kafka_bootstrap=bus.bootstrap, postgres_url="", redis_url="",
                pids=[], topic_prefix=bus.topic_prefix)
    empty = probe_reads(t)
    assert len(empty) == len(FOREIGN_READS) and all(p.verdict == REFUSED for p in empty), empty
    assert fetch_every_partition(_as(bus, "router"), Catalog(bus.topic_prefix).topic("requests"))[0] == ACCEPTED
    for stream in {s for _, s in FOREIGN_READS}:
        assert _write(bus, stream) is None
    probes = probe_reads(t)
    assert len(probes) == len(FOREIGN_READS) and all(p.verdict == REFUSED for p in probes), probes
