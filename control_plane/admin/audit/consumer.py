"""The audit consumer: folds the topics into the admin store (Kafka -> projection -> SQL).

It reads every partition itself (``assign_all``) from the positions stored in
``audit_positions``, and commits each batch's rows and its new positions in one database
transaction: after a crash it resumes exactly where the last committed batch ended. Records
redelivered anyway (a batch re-read after a failed commit, the API having ingested an operator
action first) are no-ops: rows are keyed by event id and folds run only for new rows.

Records that do not decode are dead-lettered by :class:`EventConsumer` and skipped (their
offsets still advance); a batch the database refuses is retried with backoff, never skipped.
"""

from __future__ import annotations

import logging
import threading
import time

from sqlalchemy.orm import Session, sessionmaker

from control_plane.admin.audit.store import AuditStore, IngestResult, LocatedEvent
from kernel.log.kafka import EventConsumer
from kernel.settings import BusSettings

log = logging.getLogger(__name__)


class AuditConsumer:
    def __init__(self, bus: BusSettings, sessions: sessionmaker[Session], *, streams=("requests", "workers", "planner",
                 "admin", "kv"), batch: int = 2000, name: str = "audit", store: AuditStore | None = None) -> None:
        self.bus = bus
        self.sessions = sessions
        self.store = store or AuditStore()
        self.streams = tuple(streams)
        self.batch = batch
        self.name = name
        self.totals = IngestResult()
        self.batches = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._consumer: EventConsumer | None = None
        self.last_error: str | None = None

    def _open(self) -> EventConsumer:
        with self.sessions() as s:
            start = AuditStore.positions(s)
        return EventConsumer(self.bus, self.streams, assign_all=True, start_offsets=start, dedupe=False,
                             consumer_name=f"{self.bus.topic_prefix}.{self.name}")

    def step(self, timeout: float = 0.5) -> int:
        """Consume and commit one batch; returns the number of events in it."""
        if self._consumer is None:
            self._consumer = self._open()
        c = self._consumer
        got = c.poll_batch(self.batch, timeout)
        positions = {tp: off for tp, off in c.positions().items()}
        if not got and not positions:
            return 0
        events = [LocatedEvent(d.envelope, d.topic, d.partition, d.offset) for d in got]
        delay = 0.2
        while True:
            try:
                with self.sessions.begin() as s:
                    res = self.store.ingest(s, events, positions)
                break
            except Exception as e:  # a database hiccup: retry the same batch, never skip it
                self.last_error = _public(e)
                log.warning("audit batch of %d events not stored (%s); retrying in %.1fs", len(events), e, delay)
                if self._stop.wait(delay):
                    raise
                delay = min(delay * 2, 5.0)
        self.batches += 1
        self.totals.received += res.received
        self.totals.inserted += res.inserted
        self.totals.duplicates += res.duplicates
        return len(got)

    def lag(self) -> int:
        if self._consumer is None:
            return -1
        return sum(self._consumer.lag().values())

    def drain(self, timeout: float = 30.0) -> None:
        """Consume until the log end seen now is stored (tests, ``admin audit --once``)."""
        if self._consumer is None:
            self._consumer = self._open()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.step(0.2)
            if self.lag() == 0:
                self.step(0.05)
                return
        raise TimeoutError(f"audit consumer still {self.lag()} records behind after {timeout}s")

    # -- background thread ------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="audit-consumer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step(0.5)
            except Exception as e:  # keep the API up; say why the audit stalls
                self.last_error = _public(e)
                log.exception("audit consumer step failed")
                self._stop.wait(1.0)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None


def _public(e: BaseException) -> str:
    """``last_error`` as ``/health`` shows it, without a token: the kind of failure only. A
    driver's message carries SQL, parameters and server addresses; those stay in the log."""
    return f"{type(e).__name__} (details in the admin server's log)"
