"""The audit store's tables are the same for any interleaving that keeps each partition's order.

The audit consumer reads ``requests``, ``workers``, ``planner`` and ``admin`` through one consumer,
so the order between topics and partitions is whatever the broker hands out. The cluster log of
``tests.support.interleave`` (restarts under new epochs, kill -9, request counters, operator
drain requests on the ``admin`` topic) is ingested by the real :class:`AuditStore` on SQLite in
produce order and in random interleavings, in batches as the consumer takes them, and every
table must come out the same (docs/events.md, "Interleavings"). SQLite only: the fold
under test is the projection's, and no server is needed.
"""

from __future__ import annotations

import random
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from control_plane.admin.audit.store import AuditStore
from control_plane.admin.db.models import AuditEvent, AuditPosition, Pool, Worker, WorkerIncarnation
from control_plane.admin.db.session import make_engine, session_factory
from control_plane.admin.wiring import migrate
from common.log.reader import LocatedEvent
from tests.support.interleave import cluster_log, interleavings

AUDIT_STREAMS = ("requests", "workers", "planner", "admin")
N_ORDERS = 4
BATCH = 25


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """One migrated SQLite file; each fold works on a copy (migrating per fold is slow)."""
    path = tmp_path_factory.mktemp("audit") / "template.db"
    migrate(f"sqlite:///{path}")
    return path


def _rows(session, model, skip=()) -> list[tuple]:
    cols = [c.key for c in model.__table__.columns if c.key not in skip]
    return sorted(tuple(repr(getattr(o, c)) for c in cols) for o in session.scalars(select(model)))


def _audit_state(template, work, records) -> dict:
    db = work / f"fold-{random.getrandbits(32):08x}.db"
    shutil.copy(template, db)
    eng = make_engine(f"sqlite:///{db}")
    sessions = session_factory(eng)
    store = AuditStore()
    located = [LocatedEvent(r.env, r.topic, r.partition, r.offset) for r in records]
    for i in range(0, len(located), BATCH):
        with sessions.begin() as s:
            store.ingest(s, located[i:i + BATCH])
    with sessions() as s:
        # Every table the consumer writes, every column but wall-clock bookkeeping.
        state = {"events": _rows(s, AuditEvent, skip=()),
                 "workers": _rows(s, Worker), "incarnations": _rows(s, WorkerIncarnation), "pools": _rows(s, Pool),
                 "positions": _rows(s, AuditPosition, skip=("updated_at",))}
    eng.dispose()
    db.unlink()
    return state


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_the_audit_tables_are_the_same_for_every_interleaving(template, tmp_path, seed: int) -> None:
    log = cluster_log(seed, steps=240)
    states = [_audit_state(template, tmp_path, order)
              for order in interleavings(log, random.Random(seed), N_ORDERS, AUDIT_STREAMS)]
    assert states[0]["workers"] and states[0]["incarnations"]  # something to disagree on
    for s in states[1:]:
        assert s == states[0]
