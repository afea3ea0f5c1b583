"""A worker's lifecycle as the log tells it: the one rule every view that folds registrations
applies (the router view, the planner's load view, the admin audit, the metrics, a worker's
peer directory). Pure.

Issue 36: a worker's signed ``WorkerRegistered``, copied unchanged to another partition after
the worker had stopped, brought it back in the router (duplicates were checked per partition,
and a registration of the same epoch was accepted again) while the admin view said ``gone``.
The rule, per worker, over the epochs (incarnations) its lifecycle events name:

* a registration is admitted only if its epoch is newer than every registration already
  folded (:meth:`Lifecycle.admits`): a copy, wherever it lands, is the same epoch, so it is
  never accepted twice, and a worker's start takes a new epoch (its start time in ms);
* an incarnation is ``gone`` once a ``WorkerDeregistered`` of that epoch *or a newer one* was
  folded, ``draining`` once a ``WorkerDraining`` was, else ``ready`` (:meth:`Lifecycle.state`).
  Gone stays gone until a registration of a newer epoch.

Every field is a maximum, so folding the same events in any order across partitions ends in
the same lifecycle, and a copy of an event changes nothing (the fold is idempotent).
"""

from __future__ import annotations

import msgspec

READY, DRAINING, GONE = "ready", "draining", "gone"


def admits_registration(registered_epoch: int | None, epoch: int) -> bool:
    """The rule itself: a registration of ``epoch`` is admitted only when it is newer than the
    newest registration folded (``registered_epoch``; None: none yet). A view whose worker record
    exists only once a registration is folded passes that record's epoch."""
    return registered_epoch is None or epoch > registered_epoch


class Lifecycle(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What the log said of one worker's incarnations: the newest epoch of each kind of event."""

    registered: int = -1
    draining: int = -1
    ended: int = -1

    def admits(self, epoch: int) -> bool:
        """True when a registration of ``epoch`` is new (never one folded already, nor older)."""
        return admits_registration(self.registered, epoch)

    def state(self, epoch: int) -> str:
        """The state of incarnation ``epoch``: gone, draining or ready."""
        if self.ended >= epoch:
            return GONE
        if self.draining >= epoch:
            return DRAINING
        return READY

    def after(self, event_type: str, epoch: int) -> Lifecycle:
        """The lifecycle once a ``WorkerRegistered`` / ``WorkerDraining`` / ``WorkerDeregistered``
        of ``epoch`` is folded (any other type: unchanged)."""
        field = _FIELD_OF.get(event_type)
        if field is None or getattr(self, field) >= epoch:
            return self
        return msgspec.structs.replace(self, **{field: epoch})


_FIELD_OF = {"WorkerRegistered": "registered", "WorkerDraining": "draining", "WorkerDeregistered": "ended"}
LIFECYCLE_TYPES = frozenset(_FIELD_OF)


class Lifecycles:
    """The lifecycles of every worker of a view (its part of the view's snapshot: :attr:`by_worker`)."""

    __slots__ = ("by_worker",)

    def __init__(self, by_worker: dict[str, Lifecycle] | None = None) -> None:
        self.by_worker: dict[str, Lifecycle] = dict(by_worker or {})

    def get(self, worker_id: str) -> Lifecycle:
        return self.by_worker.get(worker_id) or _EMPTY

    def fold(self, event_type: str, worker_id: str, epoch: int) -> tuple[Lifecycle, Lifecycle]:
        """Fold one lifecycle event: (the lifecycle before, the lifecycle after)."""
        before = self.get(worker_id)
        after = before.after(event_type, epoch)
        if after is not before:
            self.by_worker[worker_id] = after
        return before, after


_EMPTY = Lifecycle()
