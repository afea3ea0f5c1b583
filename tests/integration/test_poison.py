"""Poison never stalls a view: every consumer of the log, given a record that does not decode
and a decodable one whose apply fails, followed by good records, applies the good ones, puts the
poison on the dead-letter topic with its reason and source, moves its position past it, and
(where it retries) reports DEGRADED while stuck and OK once it moved on.

Consumers: the audit projection (SQL, real PostgreSQL), the router view, the planner's load
view, the metrics processor (Faust apps), and the planner's admin follower (EventConsumer).
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from control_plane.admin import queries
from control_plane.admin.audit.consumer import AuditConsumer, RetryPolicy
from control_plane.admin.audit.store import AuditStore
from control_plane.admin.db.models import Worker
from control_plane.admin.db.session import make_engine, session_factory
from control_plane.admin.wiring import migrate
from kernel.log.catalog import Catalog
from kernel.log.kafka import Ack, EventProducer
from kernel.settings import BusSettings
from schemas import events as ev
from schemas.types import MAX_WORKER_ID_LEN, RoutingMode
from tests.support.db import postgres_database
from tests.support.deadletters import DeadLetter, dead_letters
from tests.support.waits import wait_for

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
    p.produce_raw(topic, value, key, on_delivery=lambda err, m: where.append(f"{m.topic()}:{m.partition()}:{m.offset()}"))
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
    p.publish(ev.WorkerRegistered(worker_id="w1", role="aggregated", pool="p", endpoint="http://w1",
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

    store = FlakyStore({fold_bug.event_id: ValueError("injected fold bug"),
                        transient.event_id: sa_exc.OperationalError("UPDATE workers", {}, Exception("injected lock timeout"))})
    with postgres_database() as url:
        migrate(url)
        eng = make_engine(url)
        sessions = session_factory(eng)
        c = AuditConsumer(bus, sessions, streams=("workers", "requests"), batch=50, store=store,
                          retry=RetryPolicy(max_attempts=3, first_delay_s=0.4, max_delay_s=2.0))
        assert queries.health(sessions, c).status == "ok"
        c.start()
        try:
            degraded = wait_for(lambda: (h if (h := queries.health(sessions, c)).status == "degraded" else None),
                                timeout=30, what="audit health degraded while it retries")
            assert any(where.source(transient.event_id) in r for r in degraded.reasons), degraded
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
