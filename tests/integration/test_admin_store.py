"""The admin store: Alembic up and down on PostgreSQL and SQLite, the models match the migrated
schema, and the audit projection is idempotent under redelivery (direct and through the real
consumer and broker)."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import func, select

from control_plane.admin.audit.consumer import AuditConsumer
from control_plane.admin.audit.store import AuditStore
from control_plane.admin.db.models import (
    ApiToken,
    AuditEvent,
    AuditPosition,
    Base,
    Pool,
    RouterConfigVersion,
    Worker,
    WorkerIncarnation,
)
from control_plane.admin.db.session import make_engine, session_factory
from control_plane.admin.wiring import migrate
from common.log.kafka import EventProducer
from common.log.reader import LocatedEvent
from common.settings import BusSettings
from schemas import EnvelopeFactory
from schemas import events as ev
from schemas.types import RoutingMode
from tests.support.db import postgres_database, sqlite_database

pytestmark = pytest.mark.postgres


@pytest.fixture(params=["postgresql", "sqlite"])
def db_url(request, tmp_path):
    ctx = postgres_database() if request.param == "postgresql" else sqlite_database(tmp_path)
    with ctx as url:
        yield url


def _tables(url: str) -> set[str]:
    eng = make_engine(url)
    try:
        return set(sa.inspect(eng).get_table_names())
    finally:
        eng.dispose()


def test_migrations_upgrade_match_the_models_and_downgrade_to_nothing(db_url: str) -> None:
    migrate(db_url)
    assert _tables(db_url) >= {"audit_events", "audit_positions", "workers", "worker_incarnations", "pools",
                               "router_configs", "planner_configs", "api_tokens", "replay_jobs", "replay_results"}
    eng = make_engine(db_url)
    with eng.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    eng.dispose()
    assert diff == [], diff
    migrate(db_url, "base", down=True)
    assert _tables(db_url) <= {"alembic_version"}
    migrate(db_url)  # and up again over the downgraded database
    assert "audit_events" in _tables(db_url)


def test_tokens_from_before_expiry_get_a_grace_period_not_a_lockout(db_url: str) -> None:
    """0002 adds expires_at: a token issued under 0001 expires 30 days after the upgrade."""
    migrate(db_url, "0001")
    eng = make_engine(db_url)
    with eng.begin() as conn:
        conn.execute(sa.text("INSERT INTO api_tokens (id, name, role, salt, token_hash, created_at, created_by) "
                             "VALUES ('0123abcd', 'old', 'admin', '00', '00', :t, 'cli')"),
                     {"t": datetime(2026, 1, 1)})
    migrate(db_url)
    with session_factory(eng)() as s:
        expires = s.get(ApiToken, "0123abcd").expires_at
    want = datetime.now(timezone.utc) + timedelta(days=30)
    assert abs((expires - want).total_seconds()) < 600, expires
    eng.dispose()
    migrate(db_url, "0001", down=True)  # and 0002 comes off again
    assert "expires_at" not in {c["name"] for c in sa.inspect(eng).get_columns("api_tokens")}
    eng.dispose()


def test_worker_rows_from_before_0004_fold_by_the_fleet_rule(db_url: str) -> None:
    """0004 adds each row's lifecycle (common/fleet.py), read from its one incarnation and state:
    a copy of the registration of a worker stored as gone leaves it gone."""
    migrate(db_url, "0003")
    eng = make_engine(db_url)
    with eng.begin() as conn:
        for wid, state in (("w-gone", "gone"), ("w-drain", "draining"), ("w-unreg", "unregistered")):
            conn.execute(sa.text("INSERT INTO workers (worker_id, epoch, role, pool, endpoint, model, state, capacity, "
                                 "block_size, hash_algo, running, waiting, queued_prefill_tokens, active_decode_blocks, "
                                 "tier_usage, registered_at_ns, reported_at_ns, routed, completed, failed) VALUES "
                                 "(:w, 100, 'aggregated', 'p', 'http://w', '', :s, '{}', 16, 'sha256', 0, 0, 0, 0, '{}', "
                                 "1, 0, 0, 0, 0)"), {"w": wid, "s": state})
    migrate(db_url)
    with session_factory(eng)() as s:
        got = {w.worker_id: (w.registered_epoch, w.draining_epoch, w.ended_epoch) for w in s.scalars(select(Worker))}
    assert got == {"w-gone": (100, -1, 100), "w-drain": (100, 100, -1), "w-unreg": (-1, -1, -1)}
    copy = EnvelopeFactory("w-gone", 100, time.time_ns).wrap(ev.WorkerRegistered(
        worker_id="w-gone", role="aggregated", pool="p", endpoint="http://w", block_size=16, hash_algo="sha256"))
    with session_factory(eng)() as s:
        AuditStore().ingest(s, [LocatedEvent(copy, "t.workers", 1, 0)])
        s.commit()
        assert s.get(Worker, "w-gone").state == "gone"
    eng.dispose()
    migrate(db_url, "0003", down=True)  # and 0004 comes off again
    assert "ended_epoch" not in {c["name"] for c in sa.inspect(eng).get_columns("workers")}
    eng.dispose()


# -- idempotence -------------------------------------------------------------------------------


def _events() -> list[LocatedEvent]:
    """Registration, loads, a routed/completed/failed request per worker, pool and config changes."""
    w = EnvelopeFactory("w1", 100, time.time_ns)
    w_new = EnvelopeFactory("w1", 200, time.time_ns)
    r = EnvelopeFactory("router-a", 7, time.time_ns)
    a = EnvelopeFactory("admin-api", 9, time.time_ns)
    out = []

    def put(env, topic: str, offset: int) -> None:
        out.append(LocatedEvent(env, topic, 0, offset))

    put(w.wrap(ev.WorkerRegistered(worker_id="w1", role="aggregated", pool="p", endpoint="http://w1", block_size=16,
                                hash_algo="sha256", capacity={"device": 100})), "t.workers", 0)
    put(w.wrap(ev.WorkerLoadReported(worker_id="w1", running=3, waiting=1, tier_usage={"device": 0.5})), "t.workers", 1)
    for i in range(3):
        put(r.wrap(ev.RequestRouted(request_id=f"q{i}", worker_id="w1", mode=RoutingMode.KV, config_version=1, rng_seed=i),
                   correlation_id=f"q{i}"), "t.requests", 3 * i)
        put(r.wrap(ev.RequestCompleted(request_id=f"q{i}", worker_id="w1", prompt_tokens=10, output_tokens=2, ttft_ms=5,
                                    e2e_ms=9), correlation_id=f"q{i}"), "t.requests", 3 * i + 1)
    put(r.wrap(ev.RequestFailed(request_id="q9", worker_id="w1", reason="x", code="worker_error")), "t.requests", 20)
    # An old incarnation's late load report never overwrites the new one's state.
    put(w_new.wrap(ev.WorkerRegistered(worker_id="w1", role="aggregated", pool="p", endpoint="http://w1b", block_size=16,
                                    hash_algo="sha256")), "t.workers", 2)
    put(w.wrap(ev.WorkerLoadReported(worker_id="w1", running=99, waiting=99)), "t.workers", 3)
    put(a.wrap(ev.PoolUpdated(actor="ops", pool="p", role="aggregated", min_replicas=1, max_replicas=4)), "t.admin", 0)
    put(a.wrap(ev.PoolPinned(actor="ops", pool="p", replicas=2, reason="load test")), "t.admin", 1)
    put(a.wrap(ev.RouterConfigChanged(actor="ops", config_version=1, config={"mode": "kv"})), "t.admin", 2)
    put(w_new.wrap(ev.WorkerDeregistered(worker_id="w1", reason="bye")), "t.workers", 4)
    return out


def _snapshot(session) -> dict:
    w = session.get(Worker, "w1")
    p = session.get(Pool, "p")
    return {
        "events": session.scalar(select(func.count()).select_from(AuditEvent)),
        "worker": (w.epoch, w.state, w.endpoint, w.running, w.routed, w.completed, w.failed),
        "incarnations": sorted((i.epoch, i.deregistered_at_ns is not None)
                               for i in session.scalars(select(WorkerIncarnation))),
        "pool": (p.min_replicas, p.max_replicas, p.pinned_replicas, p.version),
        "configs": session.scalar(select(func.count()).select_from(RouterConfigVersion)),
        "positions": {(x.topic, x.kafka_partition): x.next_offset for x in session.scalars(select(AuditPosition))},
    }


def test_audit_projection_is_idempotent_under_redelivery(db_url: str) -> None:
    migrate(db_url)
    eng = make_engine(db_url)
    sessions = session_factory(eng)
    store = AuditStore()
    evs = _events()
    with sessions.begin() as s:
        res = store.ingest(s, evs)
    assert res.inserted == len(evs) and res.duplicates == 0
    with sessions() as s:
        first = _snapshot(s)
    assert first["worker"] == (200, "gone", "http://w1b", 0, 3, 3, 1)
    assert first["incarnations"] == [(100, False), (200, True)]
    assert first["pool"] == (1, 4, 2, 2) and first["configs"] == 1
    assert first["positions"] == {("t.workers", 0): 5, ("t.requests", 0): 21, ("t.admin", 0): 3}
    # The same batch again, a batch holding duplicates of itself, and an overlapping re-read.
    with sessions.begin() as s:
        assert store.ingest(s, evs).inserted == 0
    with sessions.begin() as s:
        assert store.ingest(s, evs[:5] + evs[:5]).inserted == 0
    with sessions.begin() as s:
        assert store.ingest(s, evs[3:] + evs[:3]).duplicates == len(evs)
    with sessions() as s:
        assert _snapshot(s) == first
    eng.dispose()


@pytest.mark.kafka
def test_audit_consumer_rereading_the_log_never_double_counts(bus: BusSettings, tmp_path) -> None:
    """Through the broker: consume everything, then forget the stored positions (a crash between
    the database commit and anything else) and consume it all again."""
    with sqlite_database(tmp_path) as url:
        migrate(url)
        eng = make_engine(url)
        sessions = session_factory(eng)
        p = EventProducer(bus, "w1", epoch=100)
        p.publish(ev.WorkerRegistered(worker_id="w1", role="aggregated", pool="p", endpoint="http://w1", block_size=16,
                                   hash_algo="sha256"))
        rp = EventProducer(bus, "router-a")
        for i in range(20):
            rp.publish(ev.RequestRouted(request_id=f"q{i}", worker_id="w1", mode=RoutingMode.KV, config_version=1,
                                     rng_seed=i), correlation_id=f"q{i}")
            rp.publish(ev.RequestCompleted(request_id=f"q{i}", worker_id="w1", prompt_tokens=10, output_tokens=2,
                                        ttft_ms=5, e2e_ms=9), correlation_id=f"q{i}")
        assert p.flush(10) == 0 and rp.flush(10) == 0
        c = AuditConsumer(bus, sessions, streams=("workers", "requests"), batch=7)
        c.drain()
        c.stop()
        with sessions() as s:
            before = (s.scalar(select(func.count()).select_from(AuditEvent)), s.get(Worker, "w1").routed,
                      s.get(Worker, "w1").completed)
        assert before == (41, 20, 20)
        with sessions.begin() as s:
            s.execute(sa.delete(AuditPosition))
        c2 = AuditConsumer(bus, sessions, streams=("workers", "requests"), batch=7)
        c2.drain()
        c2.stop()
        assert c2.totals.inserted == 0 and c2.totals.duplicates == 41
        with sessions() as s:
            assert (s.scalar(select(func.count()).select_from(AuditEvent)), s.get(Worker, "w1").routed,
                    s.get(Worker, "w1").completed) == before
        eng.dispose()


def test_operator_actions_record_then_fold_with_the_in_memory_log(tmp_path) -> None:
    """The service layer against its in-memory event log (SQLite): the event is recorded first,
    the store shows it at once, a stale expected_version is refused."""
    from control_plane.admin.context import AdminContext
    from control_plane.admin.errors import Conflict
    from control_plane.admin.ports import InlineJobRunner, MemoryEventLog
    from control_plane.admin.services import SYSTEM, put_config
    from control_plane.admin.settings import AdminSettings
    from control_plane.admin.shapes import RouterConfigIn, RouterConfigUpdate
    from common.log.catalog import Catalog

    with sqlite_database(tmp_path) as url:
        migrate(url)
        eng = make_engine(url)
        log = MemoryEventLog()
        ctx = AdminContext(settings=AdminSettings(db_url=url), sessions=session_factory(eng), events=log,
                           catalog=Catalog("mem"), reader_factory=lambda: None, jobs=InlineJobRunner())
        with ctx.sessions() as s:
            v1 = put_config(s, ctx, SYSTEM, "router", RouterConfigUpdate(config=RouterConfigIn(temperature=0.5)))
            with pytest.raises(Conflict):
                put_config(s, ctx, SYSTEM, "router", RouterConfigUpdate(config=RouterConfigIn(), expected_version=0))
            v2 = put_config(s, ctx, SYSTEM, "router", RouterConfigUpdate(config=RouterConfigIn(), expected_version=1))
        assert (v1.version, v1.config["temperature"], v2.version) == (1, 0.5, 2)
        assert [e.env.data.config_version for e in log.events] == [1, 2]
        assert log.events[0].env.data.actor == "system"
        eng.dispose()
