"""``switchyard security-check``'s probes of the log (issue 36, items 1-3), each the real attack
with at most one component's Kafka credential, read from the stack's secrets as a compromised
process could:

* **consumer groups**: each role's credential joins the consumer groups of the running views it
  does not own (the router's view, the planner's load view, the metrics processor), under the
  assignor name Faust uses. Refused: the broker answers GROUP_AUTHORIZATION_FAILED
  (common/log/principals.py). A group the probe finds none of is probed by its prefix, with a
  group id of its own under that prefix.
* **a foreign member of the same role**: with the router's own credential (the only one the
  broker lets into the router's groups), the attack of issue 36 on the live router's view: join
  the group id its view's consumer names, under Faust's assignor name with metadata that is not
  Faust's, and take every partition once leader. Refused: the view is in no group (it assigns
  its partitions itself, ``control_plane/streaming.py`` ``TailProcessor``), so it loses nothing
  and ``/health`` stays EXACT.
* **replayed registration**: with the worker credential, a signed ``WorkerRegistered`` of a
  worker the log says is gone is copied, byte for byte, to another partition of ``workers``.
  Refused: the router's ``/health`` never counts that worker again (common/fleet.py). The
  probe registers, and deregisters, a worker of its own first (its endpoint is a closed port),
  so no real worker is touched.
* **forged requests**: with the worker credential, request events as producer ``demo-router``
  (unsigned, and signed with the worker's own key). Refused: a consumer of the running system
  dead-letters each as ``forged:*`` (schemas/signing.py), so the planner and the metrics never
  count them.
* **reads beyond a role's streams**: a worker's credential reading the admin stream (router
  keys' ids, pins), the planner's decisions and every request; a router's the dead letters and
  the planner's decisions; the planner's the KV index. Refused: TOPIC_AUTHORIZATION_FAILED
  (``Role.reads``, common/log/principals.py), through the reader the components' restores use.
* **forged snapshots**: with the processor's credential (which may write ``snapshots``, for its
  own projection), a router view's snapshot: unsigned, and signed with the processor's own
  key. Refused: the restore every router runs at start (``SnapshotStore.load_latest``)
  dead-letters both ``forged:*`` and restores the router's own snapshot before them. The probe
  writes under a key of its own (``router-view:security-check-<tag>:16``, owned by the routers
  like every ``router-view:*``) and leaves a tombstone, so the demo's router is not touched.
"""

from __future__ import annotations

import time
import uuid

from common.log.catalog import Catalog
from common.log.kafka import H_DLQ_REASON, H_DLQ_SOURCE, EventProducer
from common.log.principals import group_id
from common.log.reader import tail_group_id
from common.log.snapshots import SnapshotStore
from common.settings import BusSettings
from ops.security.probe import ACCEPTED, REFUSED, SERVER_ERROR, SKIPPED, Probe, Targets, quiet
from schemas import EventCodec
from schemas.envelope import EnvelopeFactory
from schemas.events import RequestAdmitted, RequestCompleted, RouterKeyIssued, WorkerDeregistered, WorkerRegistered

#: Group prefixes (after ``<prefix>.``) of the running views, and the role owning each.
#: The router's view is in no group (it assigns its partitions); ``router.`` holds the ids its
#: assign-only consumers name.
VIEW_GROUPS = {"router.": "router", "load-view.": "planner", "metrics.": "processor"}


def _bus(role: str | None, t: Targets):
    return BusSettings.from_env(role=role, bootstrap=t.kafka_bootstrap, topic_prefix=t.topic_prefix)


def join_group(bus, group: str, topic: str, timeout_s: float = 15.0) -> tuple[str, str]:
    """Join ``group`` as a Faust member would (assignor ``faust``, then the range one):
    (verdict, detail)."""
    from confluent_kafka import Consumer, KafkaException

    errors: list[str] = []
    assigned: list = []
    c = Consumer({**bus.client_conf(), "group.id": group, "enable.auto.commit": False, "logger": quiet(),
                  "partition.assignment.strategy": "range", "error_cb": lambda e: errors.append(str(e))})
    try:
        c.subscribe([topic], on_assign=lambda _c, ps: assigned.extend(ps))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not assigned and not errors:
            try:
                m = c.poll(0.2)
            except KafkaException as e:
                errors.append(str(e))
                break
            if m is not None and m.error():
                errors.append(str(m.error()))
    finally:
        c.close()
    if errors and "GROUP_AUTHORIZATION_FAILED" in errors[0]:
        return REFUSED, errors[0][:100]
    if assigned:
        return ACCEPTED, f"joined {group} and was handed {len(assigned)} partitions"
    return SERVER_ERROR, (errors[0] if errors else f"neither refused nor assigned within {timeout_s:g} s")[:100]


def probe_groups(t: Targets) -> list[Probe]:
    """Every other role's credential joins each running view's consumer group."""
    from confluent_kafka.admin import AdminClient


    admin = AdminClient({**_bus(None, t).client_conf(), "logger": quiet()})
    listed = admin.list_consumer_groups(request_timeout=10).result()
    groups = sorted(g.group_id for g in listed.valid)
    topic = Catalog(t.topic_prefix).topic("workers")
    out = []
    for prefix, owner in VIEW_GROUPS.items():
        full = f"{t.topic_prefix}.{prefix}"
        live = [g for g in groups if g.startswith(full)]
        group = live[-1] if live else f"{full}security-check-{uuid.uuid4().hex[:8]}"
        for role in ("processor", "worker", "router", "admin", "planner"):
            if role == owner:
                continue
            verdict, detail = join_group(_bus(role, t), group, topic)
            what = "groups" if owner == "router" else "view group"  # the router's view is in none
            out.append(Probe("kafka", f"the {role}'s credential joins the {owner}'s {what} "
                                      f"({'live' if live else 'by prefix'})", verdict, detail))
    return out


def probe_replayed_registration(t: Targets, timeout_s: float = 20.0) -> list[Probe]:
    """A worker of the probe's own registers and deregisters; its registration's bytes are then
    copied to another partition with the worker credential. The router must not count it."""
    from confluent_kafka import Producer


    attack = "a worker's signed registration, replayed to another partition after it stopped"
    if not t.router_url:
        return [Probe("kafka", attack, SKIPPED, "no router to watch")]
    wid = f"security-check-replay-{uuid.uuid4().hex[:8]}"
    bus = _bus("worker", t)
    records: list = []
    prod = EventProducer(bus, wid, on_ack=records.append)
    try:
        prod.publish(WorkerRegistered(worker_id=wid, role="decode", pool="security-check",
                                      endpoint="http://127.0.0.1:9", block_size=16, hash_algo="sha256"))
        prod.publish(WorkerDeregistered(worker_id=wid, reason="security-check"))
        if prod.flush(20) != 0 or len(records) != 2 or any(a.error for a in records):
            return [Probe("kafka", attack, SERVER_ERROR, f"could not write the probe's own worker: {records}")]
    finally:
        prod.close(10)
    reg = records[0]
    # The bytes as they are on the log, read back with the same credential.
    from confluent_kafka import Consumer, TopicPartition


    c = Consumer({**bus.client_conf(), "group.id": group_id(t.topic_prefix, bus.username, "security-check"),
                  "enable.auto.commit": False, "logger": quiet()})
    try:
        c.assign([TopicPartition(reg.topic, reg.partition, reg.offset)])
        m = None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (m is None or m.error()):
            m = c.poll(0.5)
        n_parts = len(c.list_topics(reg.topic, timeout=10).topics[reg.topic].partitions)
    finally:
        c.close()
    if m is None or m.error():
        return [Probe("kafka", attack, SERVER_ERROR, "could not read the registration back")]
    other = (reg.partition + 1) % n_parts
    try:
        before = _get(t.router_url, "/health")["workers"]
    except Exception as e:  # noqa: BLE001 - a router that does not answer is a server error
        return [Probe("kafka", attack, SERVER_ERROR, f"router /health: {e}")]
    acks: list = []
    p = Producer({**bus.client_conf(), "logger": quiet()})
    p.produce(reg.topic, value=m.value(), key=m.key(), partition=other, headers=m.headers(),
              on_delivery=lambda err, msg: acks.append((err, msg.offset())))
    p.flush(20)
    if not acks or acks[0][0] is not None:
        err = acks[0][0] if acks else "no delivery report"
        return [Probe("kafka", attack, REFUSED if "AUTHORIZATION" in str(err) else SERVER_ERROR,
                      f"copy not written: {err}")]
    offset = acks[0][1]
    # The router's view must fold the copy and still count the same routable workers.
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pos = _get(t.router_url, "/router/view")["positions"].get(f"{reg.topic}:{other}", 0)
            now = _get(t.router_url, "/health")["workers"]
        except Exception as e:  # noqa: BLE001
            return [Probe("kafka", attack, SERVER_ERROR, f"router: {e}")]
        if now > before:
            return [Probe("kafka", attack, ACCEPTED, f"the router routes to {now} workers, {before} before the copy")]
        if pos > offset:
            return [Probe("kafka", attack, REFUSED, f"copied to {reg.topic}:{other}:{offset}; the router folded it "
                                                     f"and still routes to {now} workers")]
        time.sleep(0.2)
    return [Probe("kafka", attack, SERVER_ERROR, f"the router did not fold the copy within {timeout_s:g} s")]


def _get(router_url: str, path: str) -> dict:
    import httpx

    return httpx.get(f"{router_url.rstrip('/')}{path}", timeout=5).json()


def probe_forged_requests(t: Targets) -> list[Probe]:
    """Request events as producer ``demo-router`` with the worker credential: dead-lettered
    ``forged:*`` by the running system (the check of :func:`probe_forged_events`)."""
    if not t.router_url:
        return [Probe("kafka", "forged request events", SKIPPED, "no running consumer to refuse them")]
    tag = uuid.uuid4().hex[:8]
    codec = EventCodec()

    def raw(payload) -> bytes:
        return codec.encode(EnvelopeFactory("demo-router", 1, lambda: time.time_ns()).wrap(payload, key=payload.key()))

    adm = raw(RequestAdmitted(request_id=f"security-check-{tag}", model="m", prompt_tokens=16, max_tokens=1,
                              block_size=16, hash_algo="sha256"))
    done = raw(RequestCompleted(request_id=f"security-check-{tag}", worker_id=f"security-check-{tag}",
                                prompt_tokens=16, output_tokens=1, ttft_ms=1.0, e2e_ms=1.0))
    sealed = BusSettings.from_env(role="worker").signer(f"security-check-{tag}").seal(done)
    return probe_forged_events(t.kafka_bootstrap, t.topic_prefix, forgeries=[
        ("worker", "requests", adm, "a worker's credential publishes RequestAdmitted as demo-router (unsigned)"),
        ("worker", "requests", sealed,
         "a worker's credential publishes RequestCompleted as demo-router (signed with its own key)"),
    ])


async def steal_group(bus, group: str, topics: list[str], got: list, stop) -> None:
    """The attack of issue 36 on a Faust group: join ``group`` under the assignor name Faust uses
    (``faust``), with member metadata that is not Faust's (its leader fails to decode it), and,
    once leader, hand every partition to itself. ``got`` receives the partitions it was handed;
    it leaves when ``stop`` (an ``asyncio.Event``) is set."""
    from aiokafka import AIOKafkaConsumer
    from aiokafka.coordinator.assignors.abstract import AbstractPartitionAssignor
    from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment, ConsumerProtocolMemberMetadata

    class Greedy(AbstractPartitionAssignor):
        name = "faust"
        version = 0

        @classmethod
        def assign(cls, cluster, members):
            out = {m: ConsumerProtocolMemberAssignment(0, [], b"") for m in members}
            out[min(members)] = ConsumerProtocolMemberAssignment(
                0, [(t, sorted(cluster.partitions_for_topic(t) or ())) for t in topics], b"")
            return out

        @classmethod
        def metadata(cls, topics_):
            return ConsumerProtocolMemberMetadata(0, list(topics_), b"not faust's metadata")

        @classmethod
        def on_assignment(cls, assignment):
            got.extend(assignment.partitions())

    c = AIOKafkaConsumer(*topics, bootstrap_servers=bus.bootstrap, group_id=group, enable_auto_commit=False,
                         security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-256",
                         sasl_plain_username=bus.username, sasl_plain_password=bus.secret(),
                         ssl_context=bus.ssl_context(), partition_assignment_strategy=(Greedy,))
    await c.start()
    try:
        while not stop.is_set():
            await c.getmany(timeout_ms=200)
    finally:
        await c.stop()


def probe_foreign_member(t: Targets, hold_s: float = 12.0, timeout_s: float = 60.0) -> list[Probe]:
    """With the router's own credential (the one principal the broker lets into the router's
    groups), the attack of issue 36 on the live router's view: join the very group id its view's
    consumer names, under Faust's assignor name, and take every partition once leader. Refused:
    the view follows its partitions by assignment, in no group, so it loses nothing: its
    ``/health`` stays EXACT for ``hold_s`` (two of its watch rounds) with the member in place."""
    import asyncio

    attack = "the router's credential joins the group the live router view's consumer names and takes every partition"
    if not t.router_url:
        return [Probe("kafka", attack, SKIPPED, "no router running")]
    deadline = time.monotonic() + timeout_s
    while (before := _get(t.router_url, "/health")).get("state") != "EXACT":
        if time.monotonic() > deadline:
            return [Probe("kafka", attack, SERVER_ERROR, f"the router was not EXACT before the probe: {before}"[:100])]
        time.sleep(0.5)
    router = _bus("router", t)
    group = tail_group_id(t.topic_prefix, router.username, f"router-view.{before['router_id']}")
    cat = Catalog(t.topic_prefix)
    got: list = []
    states: list[str] = []

    async def attack_and_watch() -> tuple[str, str]:
        stop = asyncio.Event()
        thief = asyncio.create_task(steal_group(router, group, [cat.topic(s) for s in ("kv", "workers")], got, stop))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        held_from = None
        try:
            while loop.time() < deadline:
                await asyncio.sleep(0.25)
                if thief.done():
                    thief.result()  # raises what stopped it
                h = await asyncio.to_thread(_get, t.router_url, "/health")
                states.append(h.get("state", "?"))
                if states[-1] != "EXACT":
                    return ACCEPTED, f"the router's view said {states[-1]} {h.get('reasons')} with the member in {group}"
                if got and held_from is None:
                    held_from = loop.time()
                if held_from is not None and loop.time() - held_from >= hold_s:
                    return REFUSED, (f"the member was handed {len(got)} partitions of {group}; the router's view, "
                                     f"in no group, stayed EXACT for {hold_s:g} s")
            return SERVER_ERROR, f"the member was never handed a partition of {group} within {timeout_s:g} s"
        finally:
            stop.set()
            await asyncio.wait_for(thief, 30)

    try:
        verdict, detail = asyncio.run(attack_and_watch())
    except Exception as e:  # noqa: BLE001 - the probe's own failure is reported, never hidden
        return [Probe("kafka", attack, SERVER_ERROR, f"{type(e).__name__}: {e}"[:100])]
    return [Probe("kafka", attack, verdict, detail)]


#: (role, stream) reads outside the role's :attr:`~common.log.principals.Role.reads`.
FOREIGN_READS = (("worker", "admin"), ("worker", "planner"), ("worker", "requests"), ("router", "deadletter"),
                 ("router", "planner"), ("planner", "kv"))


def fetch_every_partition(bus, topic: str, timeout_s: float = 15.0) -> tuple[str, str]:
    """A real fetch of every partition of ``topic`` as ``bus``'s principal, from offset 0,
    whether or not it holds records: (verdict, detail). Each partition's answer is a record, its
    end (``_PARTITION_EOF``: the broker answered the fetch, with nothing) or an error: refused
    when the broker says TOPIC_AUTHORIZATION_FAILED (to the metadata or the fetch), accepted once
    every partition answered, a server error when none did within ``timeout_s``.

    Why not :meth:`KafkaLogReader.read`: it fetches nothing when the partition's bounds say there
    is nothing to read, so on an empty topic the probe "read 0 records" without ever asking the
    broker (``security-check`` on a fresh stack: the worker's credential "read" ``requests``)."""
    from confluent_kafka import Consumer, KafkaError, TopicPartition

    c = Consumer({**bus.client_conf(), "group.id": group_id(bus.topic_prefix, bus.username, f"probe-{uuid.uuid4().hex[:8]}"),
                  "enable.auto.commit": False, "enable.partition.eof": True, "auto.offset.reset": "earliest",
                  "fetch.wait.max.ms": 10, "logger": quiet()})
    try:
        md = c.list_topics(topic, timeout=timeout_s).topics.get(topic)
        if md is not None and md.error is not None:
            verdict = REFUSED if md.error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED else SERVER_ERROR
            return verdict, f"metadata: {md.error.name()}"
        if md is None or not md.partitions:
            return SERVER_ERROR, f"topic {topic} does not exist"
        # Offset 0, not "beginning": the first request for each partition is the fetch itself.
        c.assign([TopicPartition(topic, p, 0) for p in md.partitions])
        waiting, records = set(md.partitions), 0
        deadline = time.monotonic() + timeout_s
        while waiting and time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is None:
                continue
            err = m.error()
            if err is None:
                records += 1
            elif err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
                return REFUSED, f"fetch of {m.topic()}:{m.partition()}: {err.name()}"
            elif err.code() != KafkaError._PARTITION_EOF:
                if err.fatal() or not err.retriable():
                    return SERVER_ERROR, f"fetch of {m.topic()}:{m.partition()}: {err}"[:100]
                continue
            waiting.discard(m.partition())
        if waiting:
            return SERVER_ERROR, f"no answer to the fetch of {len(waiting)} partition(s) in {timeout_s:.0f} s"
        return ACCEPTED, f"fetched {len(md.partitions)} partition(s): {records} record(s)"
    finally:
        c.close()


def probe_reads(t: Targets) -> list[Probe]:
    """Each role's credential fetches a stream it does not fold (every partition, records or
    not: :func:`fetch_every_partition`)."""
    out = []
    for role, stream in FOREIGN_READS:
        verdict, detail = fetch_every_partition(_bus(role, t), Catalog(t.topic_prefix).topic(stream))
        out.append(Probe("kafka", f"the {role}'s credential reads {stream}", verdict, detail))
    return out


def probe_forged_snapshots(t: Targets) -> list[Probe]:
    """A router's snapshot, then two forged newer ones under its key with the processor's
    credential; the routers' restore must refuse both and return the router's own."""
    from confluent_kafka import Producer


    key = f"router-view:security-check-{uuid.uuid4().hex[:8]}:16"
    topic = Catalog(t.topic_prefix).topic("snapshots")
    real = f"the router's own snapshot {key}".encode()
    router = _bus("router", t)
    SnapshotStore(router, owner_id="security-check").save(key, real)
    thief = _bus("processor", t)
    forged = {"unsigned": b"a forged router view",
              "signed with its own key": thief.signer("security-check").seal_snapshot(key, b"a forged router view")}
    written: dict[str, str] = {}
    p = Producer({**thief.client_conf(), "message.timeout.ms": 10000, "logger": quiet()})
    for how, value in forged.items():
        got: list = []
        p.produce(topic, value=value, key=key.encode(), on_delivery=lambda err, m: got.append((err, m)))
        p.flush(20)
        err, m = got[0] if got else ("no delivery report", None)
        written[how] = f"not written: {err}" if err is not None else f"{topic}:{m.partition()}:{m.offset()}"
    store = SnapshotStore(router, owner_id="security-check")
    try:
        restored = store.load_latest(key)
    finally:
        tomb = Producer({**router.client_conf(), "logger": quiet()})
        tomb.produce(topic, value=None, key=key.encode())
        tomb.flush(10)
    refused = dict(store.refused)
    out = []
    for how, where in written.items():
        attack = f"the processor's credential writes a router view's snapshot ({how})"
        if where.startswith("not written"):
            out.append(Probe("kafka", attack, REFUSED if "AUTHORIZATION" in where else SERVER_ERROR, where[:100]))
        elif refused.get(where, "").startswith("forged:") and restored == real:
            out.append(Probe("kafka", attack, REFUSED, f"dead-lettered {refused[where]} ({where}); the "
                                                       "restore took the router's own"))
        else:
            out.append(Probe("kafka", attack, ACCEPTED, f"written to {where}; restored "
                                                        f"{'the forgery' if restored != real else 'the real one'}"
                                                        f", refused: {refused.get(where, 'no')}"))
    return out


def run(t: Targets) -> list[Probe]:
    """Every probe of the log (``check.run`` calls it)."""
    return [*probe_groups(t), *probe_reads(t), *probe_replayed_registration(t), *probe_forged_requests(t),
            *probe_forged_snapshots(t), *probe_foreign_member(t)]


# -- each role's credential against the topics it does not own, and forged events ----------------

#: (role whose credential is used, topic stream it must not write, what it would be)
ROLE_ATTACKS = [
    ("worker", "admin", "a worker's credential pins a pool (writes the admin topic)"),
    ("worker", "planner", "a worker's credential scales a pool (writes the planner topic)"),
    ("router", "workers", "a router's credential registers a worker (writes the workers topic)"),
    ("processor", "kv", "the metrics processor's credential writes KV events"),
]


def probe_kafka_roles(bootstrap: str, topic_prefix: str = "sy") -> list[Probe]:
    """Each component's own credential writing a topic its role does not own: the broker must
    refuse it (TOPIC_AUTHORIZATION_FAILED). The record is one byte no consumer could fold, so
    a hole shows up as a dead-lettered record, not as a changed view."""
    from confluent_kafka import Producer


    out = []
    for role, stream, attack in ROLE_ATTACKS:
        bus = BusSettings.from_env(role=role, bootstrap=bootstrap, topic_prefix=topic_prefix)
        errors: list[str] = []
        p = Producer({**bus.client_conf(), "message.timeout.ms": 10000, "logger": quiet()})
        p.produce(Catalog(topic_prefix).topic(stream), value=b"\xc1", key=b"security-check",
                  on_delivery=lambda err, _m: errors.append(str(err)) if err else None)
        left = p.flush(20)
        if left:
            out.append(Probe("kafka", attack, SERVER_ERROR, "no delivery report within 20 s"))
        elif errors and "AUTHORIZATION" in errors[0]:
            out.append(Probe("kafka", attack, REFUSED, errors[0][:100]))
        elif errors:
            out.append(Probe("kafka", attack, SERVER_ERROR, errors[0][:100]))
        else:
            out.append(Probe("kafka", attack, ACCEPTED, f"written to {Catalog(topic_prefix).topic(stream)}"))
    return out


def _forgeries(topic_prefix: str) -> list[tuple[str, str, bytes, str]]:
    """(role, stream, value, attack): writes the brokers' ACLs let through (each role's own
    topics) that are not their owner's to make (schemas/signing.py). The worker ids and key
    id are the probe's own, so an accepted forgery harms no real worker or key."""
    import uuid


    tag = uuid.uuid4().hex[:8]
    victim, evil = f"security-check-victim-{tag}", f"security-check-{tag}"
    codec = EventCodec()

    def raw(payload, producer: str) -> bytes:
        return codec.encode(EnvelopeFactory(producer, 1, lambda: 1).wrap(payload, key=payload.key()))

    def own_key(role: str, producer: str, value: bytes) -> bytes:
        return BusSettings.from_env(role=role).signer(producer).seal(value)

    reg = WorkerRegistered(worker_id=victim, role="decode", pool="security-check", endpoint="http://127.0.0.1:9",
                           block_size=16, hash_algo="sha256")
    key = RouterKeyIssued(actor="security-check", actor_role="admin", key_id=f"sc{tag}", name=f"security-check-{tag}",
                          salt="00", key_hash="00")
    return [
        ("worker", "workers", raw(reg, victim), "a worker's credential registers another worker (unsigned)"),
        ("worker", "workers", own_key("worker", evil, raw(reg, victim)),
         "a worker's credential registers another worker (signed with its own key)"),
        ("router", "admin", own_key("router", "security-check", raw(key, "admin")),
         "a router's credential issues an API key (writes the admin topic it may write)"),
    ]


def probe_forged_events(bootstrap: str, topic_prefix: str = "sy", timeout_s: float = 20.0,
                        forgeries: list[tuple[str, str, bytes, str]] | None = None,
                        refused_reason: str = "forged:", area: str = "kafka") -> list[Probe]:
    """Each forgery written with the credential of a role that may write its topic: refused
    means a consumer of the running system dead-letters it as ``forged:*`` (the router's view
    and key table fold it only through that check), or ``refused_reason`` for other ``forgeries``."""
    from confluent_kafka import Consumer, Producer, TopicPartition


    cat = Catalog(topic_prefix)
    su = BusSettings.from_env(bootstrap=bootstrap, topic_prefix=topic_prefix)
    dlq = Consumer({**su.client_conf(), "group.id": "security-check-dlq", "enable.auto.commit": False,
                    "logger": quiet()})
    try:
        parts = dlq.list_topics(cat.deadletter, timeout=10).topics[cat.deadletter].partitions
        start = [TopicPartition(cat.deadletter, p, dlq.get_watermark_offsets(TopicPartition(cat.deadletter, p),
                                                                             timeout=10)[1]) for p in parts]
        sent: dict[str, tuple[str, str]] = {}  # "topic:partition:offset" -> (attack, error)
        for role, stream, value, attack in forgeries or _forgeries(topic_prefix):
            bus = BusSettings.from_env(role=role, bootstrap=bootstrap, topic_prefix=topic_prefix)
            got: list = []
            p = Producer({**bus.client_conf(), "message.timeout.ms": 10000, "logger": quiet()})
            p.produce(cat.topic(stream), value=value, on_delivery=lambda err, m: got.append((err, m)))
            p.flush(20)
            if not got or got[0][0] is not None:
                sent[f"-{attack}"] = (attack, f"not written: {got[0][0] if got else 'no delivery report'}")
                continue
            m = got[0][1]
            sent[f"{m.topic()}:{m.partition()}:{m.offset()}"] = (attack, "")
        dlq.assign(start)
        reasons: dict[str, str] = {}
        import time

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not all(k in reasons for k in sent if not k.startswith("-")):
            m = dlq.poll(0.5)
            if m is None or m.error():
                continue
            h = {k: v.decode(errors="replace") for k, v in (m.headers() or ())}
            if h.get(H_DLQ_SOURCE) in sent:
                reasons.setdefault(h[H_DLQ_SOURCE], h.get(H_DLQ_REASON, ""))
    finally:
        dlq.close()
    out = []
    for where, (attack, error) in sent.items():
        if where.startswith("-"):
            out.append(Probe(area, attack, REFUSED if "AUTHORIZATION" in error else SERVER_ERROR, error[:100]))
        elif reasons.get(where, "").startswith(refused_reason):
            out.append(Probe(area, attack, REFUSED, f"dead-lettered {reasons[where]} ({where})"))
        else:
            out.append(Probe(area, attack, ACCEPTED, f"written to {where}, " + (
                f"dead-lettered {reasons[where]}" if where in reasons else f"not refused by any consumer within {timeout_s:g} s")))
    return out
