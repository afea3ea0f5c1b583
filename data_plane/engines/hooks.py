"""The router side's port of the cluster driver: what it asks and tells the router side.

:class:`ClusterHooks` is the contract; :class:`Hooks` the silent base a router side subclasses
(what it does not override is never even buffered: :func:`listens`). The driver is
:class:`~data_plane.engines.cluster.Cluster`.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, NamedTuple, Protocol

from data_plane.engines.core import EngineStats
from data_plane.engines.request import EngineRequest
from schemas.events import KvEvent
from schemas.types import RequestId, WorkerId


class Placement(NamedTuple):
    """Where a request's phase runs, and the engine request the worker gets for it."""

    worker: WorkerId
    request: EngineRequest


class HandOff(Enum):
    #: ``hand_off``'s answer for a request with no decode phase (its prefill token was its last
    #: one): it is finished there.
    FINISHED = "finished"


class ClusterHooks(Protocol):
    """What the driver asks and tells the router side, in the one-heap loop's order.

    The two deciding hooks, :meth:`arrive` and :meth:`hand_off`, and timer callbacks see every
    notification that precedes them. A timer callback and ``arrive`` may read any engine (every
    worker is at that instant); ``hand_off`` may read the engines of workers that are not
    prefill workers (those run ahead, see :class:`Cluster`). The notifications (``on_*``) get
    values, never live engines: they may be delivered after the engine has moved on.
    """

    def arrive(self, request: EngineRequest, now: float) -> Placement | None:
        """A request arrives: place its first phase (None: the hooks keep it and place it later
        with :meth:`Cluster.place`, e.g. when a worker becomes ready)."""
        ...

    def hand_off(self, request: EngineRequest, worker: WorkerId, token: int,
                 now: float) -> Placement | HandOff | None:
        """Prefill ``worker`` delivered ``request``'s first token (``token``): place its decode
        phase (None: the hooks place it later with :meth:`Cluster.place`; ``HandOff.FINISHED``:
        it has none)."""
        ...

    def on_first_token(self, worker: WorkerId, request_id: RequestId, t: float) -> None:
        """A worker that is not a prefill worker delivered the token of index 0 of its request."""
        ...

    def on_complete(self, worker: WorkerId, request_id: RequestId, t: float) -> None:
        """A worker that is not a prefill worker delivered its request's last token."""
        ...

    def on_kv(self, worker: WorkerId, events: list[KvEvent], t: float) -> None:
        """``worker``'s KV events of the step that ended ``kv_event_lag_ms`` before ``t``."""
        ...

    def on_load_report(self, worker: WorkerId, stats: EngineStats, t: float) -> None:
        """``worker``'s periodic load report (``Cluster(load_report_ms=...)``)."""
        ...

    def on_ready(self, worker: WorkerId, t: float) -> None:
        """A worker added with a start-up delay can take requests from now on."""
        ...

    def on_gone(self, worker: WorkerId, t: float) -> None:
        """A drained worker has nothing left (no work, no held blocks), or was cancelled before
        it became ready."""
        ...


class Hooks:
    """Silent hooks to subclass: a notification a subclass does not override is never even
    buffered (the driver checks), so a router side pays only for what it listens to."""

    def arrive(self, request: EngineRequest, now: float) -> Placement | None:
        raise NotImplementedError("a cluster's hooks must place arrivals")

    def hand_off(self, request: EngineRequest, worker: WorkerId, token: int,
                 now: float) -> Placement | HandOff | None:
        return HandOff.FINISHED

    def on_first_token(self, worker: WorkerId, request_id: RequestId, t: float) -> None:
        pass

    def on_complete(self, worker: WorkerId, request_id: RequestId, t: float) -> None:
        pass

    def on_kv(self, worker: WorkerId, events: list[KvEvent], t: float) -> None:
        pass

    def on_load_report(self, worker: WorkerId, stats: EngineStats, t: float) -> None:
        pass

    def on_ready(self, worker: WorkerId, t: float) -> None:
        pass

    def on_gone(self, worker: WorkerId, t: float) -> None:
        pass


def listens(hooks: Any, name: str) -> bool:
    """Whether ``hooks`` overrides the notification ``name`` (else the driver never buffers it)."""
    return getattr(type(hooks), name, None) is not getattr(Hooks, name)

