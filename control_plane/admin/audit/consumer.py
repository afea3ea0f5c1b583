"""The audit consumer: folds the topics into the admin store (Kafka -> projection -> SQL).

It reads every partition itself (``assign_all``) from the positions stored in
``audit_positions``, and commits each batch's rows and its new positions in one database
transaction: after a crash it resumes exactly where the last committed batch ended. Records
redelivered anyway (a batch re-read after a failed commit, the API having ingested an operator
action first) are no-ops: rows are keyed by event id and folds run only for new rows.

Poison never stalls the audit (the failure rules):

* A record that does not decode (or names an over-long worker id) is dead-lettered by
  :class:`EventConsumer` and skipped; its offset still advances.
* A batch the database refuses while it answers a probe (``SELECT 1``) is stored again one
  record per transaction, to find the record at fault. A record whose error is deterministic
  (:func:`is_deterministic`: the database refused the row's values, ``DataError`` or
  ``IntegrityError``, or the fold raised) is dead-lettered at once; any other error is retried
  with backoff up to :attr:`RetryPolicy.max_attempts` tries, then dead-lettered. Its position is
  committed past it only once the dead letter is acknowledged by the broker, so a crash in
  between re-reads it rather than losing it.
* While the database does not answer, nothing is blamed on a record: the batch waits, with
  backoff and without bound, for the database to come back.
* While it is retrying (a record or the database), :attr:`AuditConsumer.stuck` says where and
  why, and the admin ``/health`` reports ``degraded`` with that reason; it is cleared once the
  consumer moves on.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from sqlalchemy import exc as sa_exc
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from control_plane.admin.audit.store import AuditStore, IngestResult
from common.log.fold import apply_failed_reason
from common.log.kafka import Delivered, EventConsumer
from common.log.reader import LocatedEvent
from common.settings import BusSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    """How long the audit consumer keeps trying before it gives up on a record."""

    #: Tries of one record whose error may be transient (the database answers, yet refused it
    #: with, say, a lock timeout) before it is dead-lettered. Deterministic errors: one try.
    max_attempts: int = 5
    #: Backoff between tries: doubles from ``first_delay_s`` up to ``max_delay_s``.
    first_delay_s: float = 0.2
    max_delay_s: float = 5.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1 (one try)")
        if not 0 < self.first_delay_s <= self.max_delay_s:
            raise ValueError("need 0 < first_delay_s <= max_delay_s")

    def delays(self):
        delay = self.first_delay_s
        while True:
            yield delay
            delay = min(delay * 2, self.max_delay_s)


@dataclass(frozen=True)
class Stuck:
    """What the consumer is retrying: a record (``source`` is ``topic:partition:offset``) or the
    database (``source`` is ``"database"``)."""

    source: str
    attempts: int
    error: str
    since_ns: int

    @property
    def reason(self) -> str:
        if self.source == "database":
            return f"audit waiting for the database: {self.error}"
        return f"audit retrying {self.source} (try {self.attempts}): {self.error}"


def is_deterministic(e: BaseException) -> bool:
    """Would the same record fail the same way on every try? True when the database refused its
    values (a string too long, a number out of range, a constraint) or the fold itself raised
    (anything that is not a database or network error)."""
    if isinstance(e, (sa_exc.DataError, sa_exc.IntegrityError)):
        return True
    return not isinstance(e, (sa_exc.SQLAlchemyError, OSError))


def _describe(e: BaseException) -> str:
    # SQLAlchemy's text repeats the statement and its parameters: the first line says why.
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


class AuditConsumer:
    def __init__(self, bus: BusSettings, sessions: sessionmaker[Session], *, streams=("requests", "workers", "planner",
                 "admin", "kv"), batch: int = 2000, name: str = "audit", store: AuditStore | None = None,
                 retry: RetryPolicy = RetryPolicy(), linger_s: float = 0.1) -> None:
        """``linger_s``: how long a batch waits for more records after its first one. The audit
        is not on any request's path; one transaction per record under load would cost the
        admin server a core."""
        self.bus = bus
        self.sessions = sessions
        self.store = store or AuditStore()
        self.streams = tuple(streams)
        self.batch = batch
        self.name = name
        self.retry = retry
        self.linger_s = linger_s
        #: Positions known to be committed to ``audit_positions``: a batch writes only the ones
        #: it moved (a stream of small batches over ~30 partitions otherwise rewrites them all).
        self._stored: dict[tuple[str, int], int] = {}
        self.totals = IngestResult()
        self.batches = 0
        self.dead_lettered = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._consumer: EventConsumer | None = None
        #: The failure being retried, in public words (:func:`_public`); None once a step succeeds.
        self.last_error: str | None = None
        #: Set while a record or the database is being retried (read by ``/health``).
        self.stuck: Stuck | None = None

    def _open(self) -> EventConsumer:
        with self.sessions() as s:
            start = AuditStore.positions(s)
        self._stored = dict(start)
        return EventConsumer(self.bus, self.streams, assign_all=True, start_offsets=start, dedupe=False,
                             consumer_name=f"{self.bus.topic_prefix}.{self.name}")

    def step(self, timeout: float = 0.5) -> int:
        """Consume and commit one batch; returns the number of events in it."""
        if self._consumer is None:
            self._consumer = self._open()
        c = self._consumer
        got = c.poll_batch(self.batch, timeout, linger=self.linger_s)
        positions = {tp: off for tp, off in c.positions().items() if self._stored.get(tp) != off}
        if not got and not positions:
            return 0
        self._confirm_dead_letters("records that did not decode", 0)  # the batch's positions pass them
        res = self._store_batch(got, positions)
        self.batches += 1
        self.totals.received += res.received
        self.totals.inserted += res.inserted
        self.totals.duplicates += res.duplicates
        return len(got)

    # -- storing, with the failure rules of the module docstring ----------------------------

    def _transaction(self, got: list[Delivered], positions: dict[tuple[str, int], int]) -> IngestResult:
        events = [LocatedEvent(d.envelope, d.topic, d.partition, d.offset) for d in got]
        with self.sessions.begin() as s:
            res = self.store.ingest(s, events, positions)
        self._stored.update(positions)  # committed: the block above ended without raising
        return res

    def _store_batch(self, got: list[Delivered], positions: dict[tuple[str, int], int]) -> IngestResult:
        """The whole batch in one transaction; one record per transaction if the database refuses
        it; waits (unbounded) while the database does not answer."""
        delays = self.retry.delays()
        while True:
            try:
                res = self._transaction(got, positions)
            except Exception as e:
                self.last_error = _public(e)
                if got and self._database_answers():
                    log.warning("audit batch of %d events refused (%s); storing them one by one", len(got),
                                _describe(e))
                    return self._store_each(got, positions)
                self._wait("database", 0, self.last_error, next(delays), _describe(e))
                continue
            self.stuck = self.last_error = None  # stored: whatever failed before is behind it
            return res

    def _store_each(self, got: list[Delivered], positions: dict[tuple[str, int], int]) -> IngestResult:
        total = IngestResult()
        for d in got:
            res = self._store_record(d)
            total.received += res.received
            total.inserted += res.inserted
            total.duplicates += res.duplicates
        # The batch's positions also cover records dead-lettered when they did not decode.
        self._store_batch([], positions)
        return total

    def _store_record(self, d: Delivered) -> IngestResult:
        source = f"{d.topic}:{d.partition}:{d.offset}"
        past = {(d.topic, d.partition): d.offset + 1}
        delays = self.retry.delays()
        attempts = 0
        while True:
            try:
                res = self._transaction([d], past)
            except Exception as e:
                self.last_error = _public(e)
                if not self._database_answers():  # not the record's fault: do not count the try
                    self._wait("database", 0, self.last_error, next(delays), _describe(e))
                    continue
                attempts += 1
                if is_deterministic(e) or attempts >= self.retry.max_attempts:
                    self._dead_letter(d, e, attempts)
                    self._store_batch([], past)
                    return IngestResult(received=1)
                self._wait(source, attempts, self.last_error, next(delays), _describe(e))
                continue
            self.stuck = self.last_error = None
            return res

    def _dead_letter(self, d: Delivered, e: BaseException, attempts: int) -> None:
        """Send ``d`` to the dead-letter topic and wait until the broker has it (its position is
        committed past it right after)."""
        assert self._consumer is not None
        error = f"{_describe(e)} (after {attempts} {'try' if attempts == 1 else 'tries'})"
        log.error("audit gives up on %s:%d:%d: %s", d.topic, d.partition, d.offset, error)
        self._consumer.dead_letter(d, apply_failed_reason(e), error)
        self._confirm_dead_letters(f"{d.topic}:{d.partition}:{d.offset}", attempts)
        self.dead_lettered += 1

    def _confirm_dead_letters(self, source: str, attempts: int) -> None:
        assert self._consumer is not None
        delays = self.retry.delays()
        while self._consumer.flush_dead_letters(10.0):
            self._wait(source, attempts, "the dead-letter topic does not acknowledge", next(delays))

    def _database_answers(self) -> bool:
        try:
            with self.sessions() as s:
                s.execute(text("SELECT 1"))
            return True
        except Exception:
            return False

    def _wait(self, source: str, attempts: int, error: str, delay: float, detail: str | None = None) -> None:
        """Mark the consumer stuck on ``source`` and back off; raises if asked to stop. ``error``
        is what ``/health`` shows; ``detail`` (the driver's message) goes to the log only."""
        since = self.stuck.since_ns if self.stuck is not None and self.stuck.source == source else time.time_ns()
        self.stuck = Stuck(source, attempts, error, since)
        log.warning("%s%s; retrying in %.1fs", self.stuck.reason, f" [{detail}]" if detail else "", delay)
        if self._stop.wait(delay):
            raise RuntimeError(f"audit consumer stopped while stuck: {self.stuck.reason}")

    # -- progress ---------------------------------------------------------------------------

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
                self.last_error = None
            except Exception as e:  # keep the API up; say why the audit stalls
                if self._stop.is_set():
                    break
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
