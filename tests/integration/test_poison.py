"""Poison never stalls a view: every consumer of the log, given a record that does not decode
and a decodable one whose apply fails, followed by good records, applies the good ones, puts the
poison on the dead-letter topic with its reason and source, moves its position past it, and
(where it retries) reports DEGRADED while stuck and OK once it moved on.

Consumers: the audit projection (SQL, real PostgreSQL; also through a real database outage,
which blames no record), the router view, the planner's load view, the metrics processor (Faust
apps), the planner's admin follower and a plain EventConsumer group member, and the worker's
peer directory (a cache: it skips and counts poison). Failures of the fold are injected through
subclasses of the real view or store; nothing else is faked.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from control_plane.admin import queries
from control_plane.admin.audit.consumer import AuditConsumer, RetryPolicy
from control_plane.admin.audit.store import AuditStore
from control_plane.admin.db.models import Worker
from control_plane.admin.db.session import make_engine, session_factory
from control_plane.admin.wiring import migrate
from common.log.catalog import Catalog
from common.log.kafka import Ack, EventProducer
from common.settings import BusSettings
from schemas import events as ev
from schemas.types import MAX_WORKER_ID_LEN, RoutingMode
from tests.support.db import postgres_database
from tests.support.deadletters import DeadLetter, committed, dead_letters
from tests.support.waits import until, wait_for

pytestmark = pytest.mark.kafka


class Located:
    """Collects where each published record landed (``topic:partition:offset``)."""

    def __init__(self) -> None:
        self.acks: list[Ack] = []

    def __call__(self, ack: Ack) -> None:
        self.acks.append(ack)

    def source(self, event_id: str) -> str:
        a = next(a for a in self.acks if a.envelope.event_id == event_id)
        return f"{a.topic}:{a.partition}:{a.offset}"


def _raw_source(p: EventProducer, topic: str, value: bytes, key: bytes) -> list[str]:
    """Produce raw bytes; the list receives ``topic:partition:offset`` once delivered."""
    where: list[str] = []
    p.produce_raw(topic, value, key,
                  on_delivery=lambda err, m: where.append(f"{m.topic()}:{m.partition()}:{m.offset()}"))
    return where


def _by_source(bus: BusSettings, n: int) -> dict[str, DeadLetter]:
    got = wait_for(lambda: (d if len(d := dead_letters(bus)) >= n else None), timeout=30,
                   what=lambda: dead_letters(bus))
    return {d.source: d for d in got}


# -- the audit projection -------------------------------------------------------------------------


class FlakyStore(AuditStore):
    """The real store, failing on chosen events the way a database or a fold would."""

    def __init__(self, failures: dict[str, BaseException]) -> None:
        self.failures = failures
        self.tries: dict[str, int] = {}

    def ingest(self, session, events, positions=None):
        events = list(events)
        for e in events:
            err = self.failures.get(e.env.event_id)
            if err is not None:
                if len(events) == 1:  # tries of the record alone (not of a batch it was in)
                    self.tries[e.env.event_id] = self.tries.get(e.env.event_id, 0) + 1
                raise err
        return super().ingest(session, events, positions)


def test_audit_dead_letters_poison_and_says_degraded_while_it_retries(bus: BusSettings) -> None:
    """On the workers topic, in order: a registration, garbage bytes, a load report naming a
    300-character worker id (refused by the codec), one with ``running`` beyond PostgreSQL's
    integer (DataError: dead-lettered at once), one whose store fails with an injected ValueError
    (at once) and one with an injected OperationalError while the database answers (retried:
    3 tries, 0.4 s + 0.8 s of backoff, DEGRADED meanwhile), then good load reports and a routing."""
    topic = Catalog(bus.topic_prefix).topic("workers")
    where = Located()
    p = EventProducer(bus, "w1", epoch=100, on_ack=where)
    p.publish(ev.WorkerRegistered(worker_id="w1", role="aggregated", pool="p", endpoint="http://127.0.0.1/w1",
                                  block_size=16, hash_algo="sha256"))
    garbage = _raw_source(p, topic, b"\x00\xffnot an envelope", b"w1")
    long_id = "x" * (MAX_WORKER_ID_LEN + 44)
    too_long = p.publish(ev.WorkerLoadReported(worker_id=long_id, running=1, waiting=0))
    out_of_range = p.publish(ev.WorkerLoadReported(worker_id="w1", running=2**40, waiting=0))
    fold_bug = p.publish(ev.WorkerLoadReported(worker_id="w1", running=7, waiting=0))
    transient = p.publish(ev.WorkerLoadReported(worker_id="w1", running=8, waiting=0))
    p.publish(ev.WorkerLoadReported(worker_id="w1", running=2, waiting=1))
    last = p.publish(ev.WorkerLoadReported(worker_id="w1", running=3, waiting=4))
    rp = EventProducer(bus, "router-a")
    rp.publish(ev.RequestRouted(request_id="q1", worker_id="w1", mode=RoutingMode.KV, config_version=1, rng_seed=1))
    assert p.flush(10) == 0 and rp.flush(10) == 0 and garbage

    lock_timeout = sa_exc.OperationalError("UPDATE workers", {}, Exception("injected lock timeout"))
    store = FlakyStore({fold_bug.event_id: ValueError("injected fold bug"), transient.event_id: lock_timeout})
    with postgres_database() as url:
        migrate(url)
        eng = make_engine(url)
        sessions = session_factory(eng)
        c = AuditConsumer(bus, sessions, streams=("workers", "requests"), batch=50, store=store,
                          retry=RetryPolicy(max_attempts=3, first_delay_s=0.4, max_delay_s=2.0))
        assert queries.health(sessions, c).status == "ok"
        c.start()
        try:
            # Degraded from the first failure (its last_error), then naming the record it retries.
            degraded = wait_for(lambda: (h if (h := queries.health(sessions, c)).status == "degraded" and any(
                where.source(transient.event_id) in r for r in h.reasons) else None),
                                timeout=30, what="audit health degraded while it retries")
            assert "OperationalError" in degraded.audit["stuck"]

            def applied():
                with sessions() as s:
                    w = s.get(Worker, "w1")
                    return w is not None and (w.running, w.waiting, w.routed) == (3, 4, 1)

            wait_for(applied, timeout=30, what="the good records after the poison applied")
            healthy = wait_for(lambda: (h if (h := queries.health(sessions, c)).status == "ok" else None),
                               timeout=30, what="audit health ok once it moved on")
            assert healthy.reasons == [] and healthy.audit["stuck"] is None and healthy.audit["dead_lettered"] == 3
        finally:
            c.stop()
        assert store.tries == {fold_bug.event_id: 1, transient.event_id: 3}

        letters = _by_source(bus, 5)
        want = {garbage[0]: "malformed", where.source(too_long.event_id): "malformed",
                where.source(out_of_range.event_id): "apply_failed:DataError",
                where.source(fold_bug.event_id): "apply_failed:ValueError",
                where.source(transient.event_id): "apply_failed:OperationalError"}
        assert {s: letters[s].reason for s in want} == want
        assert "characters" in letters[where.source(too_long.event_id)].error
        assert "out of range" in letters[where.source(out_of_range.event_id)].error
        assert "after 3 tries" in letters[where.source(transient.event_id)].error
        assert {letters[s].consumer for s in want} == {f"{bus.topic_prefix}.audit"}
        # Committed past every poison record: the stored position is beyond the last record.
        with sessions() as s:
            positions = AuditStore.positions(s)
        t, part, off = where.source(last.event_id).rsplit(":", 2)
        assert positions[(t, int(part))] == int(off) + 1
        with sessions() as s:  # the refused rows are not half-stored
            assert s.scalar(sa.select(sa.func.count()).select_from(Worker)) == 1
        eng.dispose()



def test_audit_blames_no_record_while_the_database_is_down(bus: BusSettings) -> None:
    """A real outage: the test database stops accepting connections and its sessions are
    terminated. The audit waits (health degraded, saying it waits for the database), dead-letters
    nothing, and stores the records once the database is back."""
    from tests.support.db import pg_admin_url

    p = EventProducer(bus, "w1", epoch=100)
    p.publish(ev.WorkerRegistered(worker_id="w1", role="aggregated", pool="p", endpoint="http://127.0.0.1/w1",
                                  block_size=16, hash_algo="sha256"))
    assert p.flush(10) == 0
    admin = make_engine(pg_admin_url(), isolation_level="AUTOCOMMIT")
    with postgres_database() as url:
        migrate(url)
        name = url.rsplit("/", 1)[1]
        eng = make_engine(url)
        sessions = session_factory(eng)
        c = AuditConsumer(bus, sessions, streams=("workers",), retry=RetryPolicy(first_delay_s=0.1, max_delay_s=0.5))
        c.drain()
        c.start()
        try:
            with admin.connect() as a:
                a.execute(sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false'))
                a.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :d"),
                          {"d": name})
            p.publish(ev.WorkerLoadReported(worker_id="w1", running=5, waiting=6))
            assert p.flush(10) == 0
            down = wait_for(lambda: (h if (h := queries.health(sessions, c)).audit["stuck"] else None), timeout=30,
                            what="audit waiting for the database")
            assert down.status == "degraded" and not down.database
            assert "waiting for the database" in down.audit["stuck"], down
            with admin.connect() as a:
                a.execute(sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))

            def stored():
                with sessions() as s:
                    w = s.get(Worker, "w1")
                    return w is not None and (w.running, w.waiting) == (5, 6)

            wait_for(stored, timeout=30, what="the record stored once the database is back")
            wait_for(lambda: queries.health(sessions, c).status == "ok", timeout=30, what="health ok again")
        finally:
            c.stop()
            with admin.connect() as a:
                a.execute(sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))
        assert c.dead_lettered == 0 and dead_letters(bus) == []
        eng.dispose()
    admin.dispose()


# -- the Faust processors: a pure fold, so poison is dead-lettered at once (no retry window) ------


def _poison_stream(bus: BusSettings, stream: str, key: str, before, bug, after) -> dict[str, str]:
    """On ``stream``, keyed ``key`` (one partition, in this order): the events ``before``, garbage
    bytes, ``bug`` (decodable; the injected fold raises on it), the events ``after``. Returns
    where the garbage, the bug and the last event landed (``topic:partition:offset``)."""
    topic = Catalog(bus.topic_prefix).topic(stream)
    where = Located()
    p = EventProducer(bus, key, epoch=1, on_ack=where)
    for e in before:
        p.publish(e)
    garbage = _raw_source(p, topic, b"\x00\xffnot an envelope", key.encode())
    bug_env = p.publish(bug)
    last = [p.publish(e) for e in after][-1]
    assert p.flush(10) == 0 and garbage
    return {"garbage": garbage[0], "bug": where.source(bug_env.event_id), "last": where.source(last.event_id)}


def _past(positions: dict[tuple[str, int], int], source: str) -> bool:
    tp, off = _tp(source)
    return positions.get(tp, 0) > off


def _tp(source: str) -> tuple[tuple[str, int], int]:
    topic, part, off = source.rsplit(":", 2)
    return (topic, int(part)), int(off)


async def _committed_past(bus: BusSettings, group: str, source: str, timeout: float = 40.0) -> None:
    """Poll until the processor's consumer group committed past ``source`` (Faust commits on its
    interval)."""
    (topic, part), off = _tp(source)
    deadline = time.monotonic() + timeout
    while (got := await asyncio.to_thread(committed, bus, group, topic)).get(part, -1) <= off:
        assert time.monotonic() < deadline, f"group {group} committed {got} on {topic}, not past {source}"
        await asyncio.sleep(0.2)


def _assert_dead_lettered(bus: BusSettings, where: dict[str, str], want: dict[str, str], consumer: str) -> None:
    letters = _by_source(bus, len(want))
    got = {k: (letters[where[k]].reason, letters[where[k]].consumer) for k in want if where[k] in letters}
    assert got == {k: (r, consumer) for k, r in want.items()}, letters
    if "bug" in want:
        assert "injected fold bug" in letters[where["bug"]].error


def _load(worker_id: str, running: int, waiting: int = 0) -> ev.WorkerLoadReported:
    return ev.WorkerLoadReported(worker_id=worker_id, running=running, waiting=waiting)


def _registered(worker_id: str) -> ev.WorkerRegistered:
    return ev.WorkerRegistered(worker_id=worker_id, role="aggregated", pool="agg", endpoint="http://127.0.0.1:9",
                               block_size=16, hash_algo="sha256_cbor")


def _is_bug(env) -> bool:
    return isinstance(env.data, ev.WorkerLoadReported) and env.data.running == 99


async def test_router_view_dead_letters_poison_and_goes_on(bus: BusSettings) -> None:
    """Garbage, a load report the injected fold raises on, then a good one: the view has the
    good one, both poison records are dead-lettered by the view (its incarnation named), the
    view's positions and its checkpoint's are past them, and the view is EXACT. (The view is in
    no consumer group: its positions are its snapshot's, nothing is committed.)"""
    from control_plane.router.stream import RouterViewProcessor
    from control_plane.router.view import RouterView

    class FaultyView(RouterView):
        def apply(self, env, *args, **kwargs):
            if _is_bug(env):
                raise ValueError("injected fold bug")
            return super().apply(env, *args, **kwargs)

    where = _poison_stream(bus, "workers", "w-a", [_registered("w-a"), _load("w-a", 1)], _load("w-a", 99),
                           [_load("w-a", 3, 4)])
    view = FaultyView("sha256_cbor", 16)
    proc = RouterViewProcessor(bus, "r-poison", view, snapshot_every_s=3600)
    await proc.start()
    try:
        await until(lambda: proc.caught_up, timeout=60, what=lambda: view.positions)
        assert (view.workers["w-a"].running, view.workers["w-a"].waiting) == (3, 4)
        tp, last = _tp(where["last"])
        assert view.positions[tp] == last + 1
        assert proc.dead_lettered == 2 and proc.health().state == "EXACT", proc.health()
        assert await proc.checkpoint(force=True)
        restored = RouterViewProcessor.load_view(bus, "sha256_cbor", 16)
        assert restored.positions[tp] == last + 1
    finally:
        await proc.stop()
    _assert_dead_lettered(bus, where, {"garbage": "malformed", "bug": "apply_failed:ValueError"}, proc.incarnation)


async def test_load_view_dead_letters_poison_and_goes_on(bus: BusSettings) -> None:
    from control_plane.planner.load_view import LoadView
    from control_plane.planner.stream import LoadViewProcessor

    class FaultyView(LoadView):
        def apply(self, env):
            if _is_bug(env):
                raise ValueError("injected fold bug")
            return super().apply(env)

    where = _poison_stream(bus, "workers", "a1", [_registered("a1")], _load("a1", 99), [_load("a1", 2), _load("a1", 3)])
    view = FaultyView()
    proc = LoadViewProcessor(bus, "lv-poison", view, snapshot_every_s=3600, counters=False)
    await proc.start()
    try:
        await until(lambda: proc.caught_up, timeout=60, what=lambda: view.positions)
        assert view.applied == 3  # the registration and the two good reports
        tp, last = _tp(where["last"])
        assert view.positions[tp] == last + 1
        assert proc.dead_lettered == 2
        await _committed_past(bus, proc.group, where["last"])
    finally:
        await proc.stop()
    _assert_dead_lettered(bus, where, {"garbage": "malformed", "bug": "apply_failed:ValueError"}, proc.group)


async def test_metrics_processor_dead_letters_what_its_fold_raises_on(bus: BusSettings, tmp_path) -> None:
    """The metrics processor counts undecodable records (the acting consumers dead-letter them)
    and dead-letters a record its own fold raised on; both are behind its position."""
    from control_plane.metrics.projection import MetricsProjection, ProjectionConfig
    from control_plane.metrics.stream import MetricsProcessor, MetricsSettings

    class FaultyProjection(MetricsProjection):
        def apply(self, env, *args, **kwargs):
            out = super().apply(env, *args, **kwargs)  # a handler bug: the position advanced first
            if _is_bug(env):
                raise ValueError("injected fold bug")
            return out

    where = _poison_stream(bus, "workers", "m1", [_registered("m1")], _load("m1", 99), [_load("m1", 2)])
    settings = MetricsSettings(processor_id="m-poison", port=0,
                               projection=ProjectionConfig(hash_algo="sha256_cbor", block_size=16),
                               snapshot_every_s=3600, probe_every_s=0.5, data_dir=tmp_path)
    proc = MetricsProcessor(bus, settings, FaultyProjection(settings.projection))
    await proc.start()
    try:
        await until(lambda: proc.caught_up, timeout=60, what=lambda: proc.projection.positions)
        (topic, part), last = _tp(where["last"])
        await until(lambda: proc.projection.positions.get(("workers", part), 0) == last + 1, timeout=30,
                    what=lambda: proc.projection.positions)
        records = proc.projection.as_dict()["switchyard_metrics_records_total"]
        assert records[("workers", "undecodable")] == 1 and records[("workers", "applied")] == 3, records
        assert proc.fold_errors == 1 and proc.dead_lettered == 1 and proc.health()["state"] == "OK"
        await _committed_past(bus, proc.group, where["last"])
    finally:
        await proc.stop()
    _assert_dead_lettered(bus, where, {"bug": "apply_failed:ValueError"}, proc.group)


# -- an EventConsumer follower: the planner's admin stream ----------------------------------------


def test_planner_admin_follower_dead_letters_poison_and_goes_on(bus: BusSettings) -> None:
    from control_plane.planner.admin import AdminInputs
    from control_plane.planner.runner import AdminFollower

    class FaultyInputs(AdminInputs):
        def apply(self, env):
            if getattr(env.data, "pool", None) == "bug":
                raise ValueError("injected fold bug")
            return super().apply(env)

    where = _poison_stream(bus, "admin", "pool-key", [ev.PoolPinned(pool="p0", replicas=1, actor="op")],
                           ev.PoolPinned(pool="bug", replicas=2, actor="op"),
                           [ev.PoolPinned(pool="p1", replicas=3, actor="op")])
    follower = AdminFollower(bus, "planner-poison")
    follower.inputs = FaultyInputs()
    follower.start()
    try:
        pins = wait_for(lambda: (pins if "p1" in (pins := follower.current(None)[0]) else None), timeout=30,
                        what=lambda: follower.current(None))
        assert {k: v.replicas for k, v in pins.items()} == {"p0": 1, "p1": 3}
        wait_for(lambda: all(_past(follower.positions(), where[k]) for k in ("garbage", "bug")), timeout=10,
                 what=follower.positions)
    finally:
        follower.stop()
    _assert_dead_lettered(bus, where, {"garbage": "malformed", "bug": "apply_failed:ValueError"},
                          "planner-poison.admin")


# -- the worker's peer directory: a cache with a side-channel fallback ---------------------------


def test_peer_directory_skips_poison_and_goes_on(bus: BusSettings) -> None:
    """Garbage claiming to be a WorkerRegistered and a registration with junk transfer info are
    skipped (counted, not dead-lettered: see ``PeerDirectory.skipped``); the registration of the
    worker's next start is known."""
    from data_plane.transfer.metadata import BlockRegion, EndpointMetadata
    from data_plane.workers.peers import PeerDirectory

    topic = Catalog(bus.topic_prefix).topic("workers")
    p = EventProducer(bus, "p1", epoch=1)
    p.produce_raw(topic, b"\x00\xffnot an envelope", b"p1", [("sy-type", b"WorkerRegistered")])
    p.publish(ev.WorkerRegistered(worker_id="p1", role="prefill", pool="pre", endpoint="http://127.0.0.1/p1", block_size=16,
                                  hash_algo="sha256_cbor",
                                  transfer=ev.TransferInfo(agent_name="p1:0", agent_metadata=b"junk")))
    good = EndpointMetadata(agent_name="p1:2", agent_metadata=b"nixl", region=BlockRegion(base_addr=4096, block_len=64,
                                                                                          n_blocks=4))
    assert p.flush(10) == 0
    # The worker's next start (a registration is admitted once per epoch: common/fleet.py).
    p = EventProducer(bus, "p1", epoch=2)
    p.publish(ev.WorkerRegistered(worker_id="p1", role="prefill", pool="pre", endpoint="http://127.0.0.1/p1", block_size=16,
                                  hash_algo="sha256_cbor", transfer=good.to_transfer_info()))
    assert p.flush(10) == 0
    directory = PeerDirectory()
    directory.follow(bus)
    try:
        assert wait_for(lambda: directory.known("p1:2"), timeout=30, what="the good registration") == good
        assert directory.skipped == 2
    finally:
        directory.stop()


# -- common's EventConsumer as a group member -------------------------------------------------


def test_event_consumer_commits_past_what_it_dead_lettered(bus: BusSettings) -> None:
    """Garbage, then an event its handler cannot apply (handed to ``dead_letter``), then a good
    one: the group's committed offset passes both, and both dead letters name this consumer."""
    from common.log.kafka import EventConsumer

    where = _poison_stream(bus, "requests", "r-1", [], ev.RequestFailed(request_id="r-1", reason="bug", code="x"),
                           [ev.RequestFailed(request_id="r-1", reason="ok", code="x")])
    c = EventConsumer(bus, ["requests"], group_id=f"{bus.topic_prefix}.it-commit", consumer_name="it-commit")
    try:
        handled = []

        def poll_until_the_last() -> bool:
            for d in c.poll_batch(100, 0.2):
                if d.envelope.data.reason == "bug":
                    c.dead_letter(d, "apply_failed:ValueError", "ValueError: injected fold bug")
                else:
                    handled.append(d.envelope.data.reason)
            return handled == ["ok"]

        wait_for(poll_until_the_last, timeout=30, what=lambda: handled)
        c.commit()
    finally:
        c.close()
    (topic, part), last = _tp(where["last"])
    assert committed(bus, f"{bus.topic_prefix}.it-commit", topic)[part] == last + 1
    _assert_dead_lettered(bus, where, {"garbage": "malformed", "bug": "apply_failed:ValueError"}, "it-commit")
