"""The fleet: every worker's lifecycle as the log tells it, folded once. Pure.

One state machine for every view that folds the ``workers`` stream's lifecycle events (the
router view, the planner's load view, the admin audit, the metrics, a worker's peer directory):
each calls :meth:`Fleet.fold` (or :func:`step` on a lifecycle it keeps itself, as the audit does
in its rows) and projects the :class:`Change` into its own record. Load reports are not
lifecycle events: each view folds them for the incarnation the fleet says is registered.

The rule, per worker, over the epochs (incarnations) its ``WorkerRegistered`` /
``WorkerDraining`` / ``WorkerDeregistered`` events name (issue 36: a signed registration copied
unchanged to another partition after the worker stopped must not bring it back):

* a registration is admitted only if its epoch is newer than every registration already
  folded (:meth:`Lifecycle.admits`): a copy, wherever it lands, is the same epoch, so it is
  never accepted twice, and a worker's start takes a new epoch (its start time in ms);
* an incarnation is ``gone`` once a ``WorkerDeregistered`` of that epoch *or a newer one* was
  folded, ``draining`` once a ``WorkerDraining`` was, else ``ready`` (:meth:`Lifecycle.state`).
  Gone stays gone until a registration of a newer epoch.

Every field of a :class:`Lifecycle` is a maximum, so folding the same events in any order that
keeps each partition's order ends in the same lifecycle, and a copy of an event changes nothing
(the fold is idempotent): ``tests/unit/test_fleet.py`` checks it over random interleavings.
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from schemas.envelope import Envelope
from schemas.events import Event, TransferInfo, WorkerDeregistered, WorkerDraining, WorkerRegistered

READY, DRAINING, GONE = "ready", "draining", "gone"


class Lifecycle(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What the log said of one worker's incarnations: the newest epoch of each kind of event
    (-1: none), and the event time of the newest deregistration."""

    registered: int = -1
    draining: int = -1
    ended: int = -1
    #: Event time of the deregistration of epoch ``ended`` (the latest, were there several).
    ended_at_ns: int = 0

    def admits(self, epoch: int) -> bool:
        """True when a registration of ``epoch`` is new (never one folded already, nor older)."""
        return epoch > self.registered

    def state(self, epoch: int) -> str:
        """The state of incarnation ``epoch``: gone, draining or ready."""
        if self.ended >= epoch:
            return GONE
        if self.draining >= epoch:
            return DRAINING
        return READY

    @property
    def current(self) -> str | None:
        """The state of the registered incarnation (None: no registration folded)."""
        return self.state(self.registered) if self.registered >= 0 else None

    def after(self, event_type: str, epoch: int, at_ns: int = 0) -> Lifecycle:
        """The lifecycle once a ``WorkerRegistered`` / ``WorkerDraining`` / ``WorkerDeregistered``
        of ``epoch`` (event time ``at_ns``) is folded (any other type: unchanged)."""
        # Built field by field: cheaper than msgspec.structs.replace with keywords.
        if event_type == "WorkerRegistered":
            if epoch <= self.registered:
                return self
            return Lifecycle(registered=epoch, draining=self.draining, ended=self.ended, ended_at_ns=self.ended_at_ns)
        if event_type == "WorkerDraining":
            if epoch <= self.draining:
                return self
            return Lifecycle(registered=self.registered, draining=epoch, ended=self.ended, ended_at_ns=self.ended_at_ns)
        if event_type == "WorkerDeregistered":
            if (epoch, at_ns) <= (self.ended, self.ended_at_ns):
                return self
            return Lifecycle(registered=self.registered, draining=self.draining, ended=epoch, ended_at_ns=at_ns)
        return self


LIFECYCLE_TYPES = frozenset({WorkerRegistered.TYPE, WorkerDraining.TYPE, WorkerDeregistered.TYPE})
NEW = Lifecycle()


class Registration(msgspec.Struct, frozen=True, kw_only=True):
    """What an admitted ``WorkerRegistered`` says of its incarnation, in plain values."""

    worker_id: str
    epoch: int
    role: str
    pool: str
    endpoint: str
    model: str
    block_size: int
    capacity: dict[str, int]
    hash_algo: str
    transfer: TransferInfo | None
    registered_at_ns: int

    @classmethod
    def of(cls, env: Envelope[Event]) -> Registration:
        ev: WorkerRegistered = env.data  # type: ignore[assignment]
        return cls(worker_id=ev.worker_id, epoch=env.epoch, role=_name(ev.role), pool=ev.pool, endpoint=ev.endpoint,
                   model=ev.model, block_size=ev.block_size, capacity=dict(ev.capacity), hash_algo=ev.hash_algo,
                   transfer=ev.transfer, registered_at_ns=env.occurred_at_ns)


def _name(role) -> str:
    # An enum on a decoded event; the plain string when a test builds one by hand.
    return role.value if hasattr(role, "value") else str(role)


class Change(NamedTuple):
    """One lifecycle event folded: the worker's lifecycle before and after it, and the
    registration it admitted (None: it admitted none)."""

    worker_id: str
    before: Lifecycle
    after: Lifecycle
    registration: Registration | None

    @property
    def state(self) -> str | None:
        """The state of the registered incarnation now (None: none registered)."""
        return self.after.current


def step(life: Lifecycle, env: Envelope[Event]) -> Change | None:
    """The one transition: ``life`` after the lifecycle event ``env`` (None: not one)."""
    if env.type not in LIFECYCLE_TYPES:
        return None
    wid = env.data.worker_id  # type: ignore[attr-defined]
    after = life.after(env.type, env.epoch, env.occurred_at_ns)
    admitted = env.type == WorkerRegistered.TYPE and life.admits(env.epoch)
    return Change(wid, life, after, Registration.of(env) if admitted else None)


class Fleet:
    """Every worker's lifecycle, by worker id (:attr:`by_worker`, a view's snapshot part)."""

    __slots__ = ("by_worker",)

    def __init__(self, by_worker: dict[str, Lifecycle] | None = None) -> None:
        self.by_worker: dict[str, Lifecycle] = dict(by_worker or {})

    def get(self, worker_id: str) -> Lifecycle:
        return self.by_worker.get(worker_id) or NEW

    def admits(self, env: Envelope[Event]) -> bool:
        """Would ``env``, a ``WorkerRegistered``, be admitted (checked before a view validates it)."""
        return self.get(env.data.worker_id).admits(env.epoch)  # type: ignore[attr-defined]

    def fold(self, env: Envelope[Event]) -> Change | None:
        """Fold one event (None: not a lifecycle event; nothing changed)."""
        if env.type not in LIFECYCLE_TYPES:
            return None
        ch = step(self.get(env.data.worker_id), env)  # type: ignore[attr-defined]
        if ch is not None and ch.after is not ch.before:
            self.by_worker[ch.worker_id] = ch.after
        return ch

    @staticmethod
    def of_state(epoch: int, state: str, ended_at_ns: int = 0) -> Lifecycle:
        """The lifecycle a record written before lifecycles were kept implies: its one
        incarnation, registered, in ``state`` (how a view reads an older snapshot)."""
        return Lifecycle(registered=epoch, draining=epoch if state == DRAINING else -1,
                         ended=epoch if state == GONE else -1, ended_at_ns=ended_at_ns if state == GONE else 0)
