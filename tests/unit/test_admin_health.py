"""Admin ``/health`` (issue 36): degraded while the audit consumer's last step failed, ok again
once a step succeeds. The audit consumer is a hand-written stand-in with the attributes
``queries.health`` reads; the database is a real SQLite one."""

from __future__ import annotations

from dataclasses import dataclass, field

from control_plane.admin import queries
from control_plane.admin.db.session import make_engine, session_factory
from control_plane.admin.audit.store import IngestResult


@dataclass
class _Audit:
    last_error: str | None = None
    stuck: object = None
    batches: int = 0
    dead_lettered: int = 0
    totals: IngestResult = field(default_factory=IngestResult)


def test_health_is_degraded_while_the_audit_consumer_has_an_error(tmp_path) -> None:
    sessions = session_factory(make_engine(f"sqlite:///{tmp_path / 'a.db'}"))
    audit = _Audit()
    assert queries.health(sessions, audit).status == "ok"  # type: ignore[arg-type]
    audit.last_error = "KafkaException (details in the admin server's log)"
    h = queries.health(sessions, audit)  # type: ignore[arg-type]
    assert h.status == "degraded" and h.reasons == [f"audit consumer: {audit.last_error}"], h
    audit.last_error = None  # a step succeeded
    assert queries.health(sessions, audit).status == "ok"  # type: ignore[arg-type]
