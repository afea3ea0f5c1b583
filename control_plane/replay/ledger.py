"""Rebuilding a router's in-flight ledger from the events it recorded. Pure.

The live :class:`~control_plane.router.core.Router` mutates its
:class:`~control_plane.routing.InflightLedger` at these moments (``core.py``), and replay maps
each one to something in the log:

=====================================================  ===========================================
live router                                            recorded as / inferred from
=====================================================  ===========================================
``ledger.expire(now)`` before every decision            ``RequestRouted.decided_at_s`` (``now``)
``ledger.add(..., now, ttl)`` right after ``decide``    ``RequestRouted`` (its chosen worker; the
                                                        prefill tokens and blocks are recomputed
                                                        from its score row and the config)
``ledger.complete(rid, prefill)`` before deciding the   the ``RequestRouted`` of phase ``decode``
decode phase (disaggregated)                            (its request's prefill entry goes first)
``ledger.prefill_done(rid)`` on the first token         ``PrefillCompleted`` published by the router
                                                        (aggregated serving; in disaggregated serving
                                                        the decode entry has no prefill tokens)
``ledger.drop_worker(w)`` on a refused connection       ``RequestFailed(code="worker_unreachable")``
``ledger.complete(rid)`` at the end of a request        ``RequestCompleted`` / ``RequestFailed`` /
                                                        ``RequestRejected``
=====================================================  ===========================================

The router is one thread (an event loop) and publishes each of these right after the ledger
change, with no await in between, so ordering its events by their envelope time orders the
ledger changes exactly.

Older logs (before ``decided_at_s`` and the router's ``PrefillCompleted``) are still replayed:
``now`` falls back to the envelope time and the first token to admission time + TTFT. Those
estimates can be off by tens of microseconds; ``ledger_exact`` in the verify report says when a
decision depended on one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from control_plane.routing import InflightLedger, InflightLoad
from schemas import Envelope
from schemas.events import (
    Event,
    PrefillCompleted,
    RequestAdmitted,
    RequestCompleted,
    RequestFailed,
    RequestRejected,
    RequestRouted,
)
from schemas.types import RequestPhase

#: Kinds of ledger operations, in the order they apply when two fall on the same instant.
ADMITTED, ENDED, FIRST_TOKEN, ROUTED = "admitted", "ended", "first_token", "routed"
_KIND_ORDER = {ADMITTED: 0, ENDED: 1, FIRST_TOKEN: 2, ROUTED: 3}


@dataclass(frozen=True)
class Incarnation:
    """One router process: its producer id and epoch (a restart starts an empty ledger)."""

    router_id: str
    epoch: int

    def __str__(self) -> str:
        return f"{self.router_id}@{self.epoch}"


@dataclass(frozen=True)
class Located:
    """A decoded event and where it sits in the log."""

    env: Envelope[Event]
    topic: str
    partition: int
    offset: int

    @property
    def at_ns(self) -> int:
        return self.env.occurred_at_ns

    @property
    def position(self) -> str:
        return f"{self.topic}:{self.partition}:{self.offset}"


@dataclass(frozen=True)
class Op:
    kind: str
    at_ns: int
    request_id: str
    event: Located | None = None
    #: Order among equal times: topic position, then kind.
    tiebreak: tuple = ()


@dataclass
class Timeline:
    """Everything one router incarnation did to its ledger, in order."""

    incarnation: Incarnation
    ops: list[Op] = field(default_factory=list)
    admissions: dict[str, Located] = field(default_factory=dict)
    #: Requests whose first-token time is an estimate (TTFT) or unknown (failed after tokens).
    estimated_first_token: set[str] = field(default_factory=set)


def build_timelines(events: Iterable[Located]) -> dict[Incarnation, Timeline]:
    """Group a router's recorded request events by incarnation and order them in time.

    Only events the router itself produced count (``RequestRouted`` names its producer as
    ``router_id``; workers' ``PrefillCompleted`` and transfer events do not touch the ledger).
    """
    routers: set[str] = set()
    evs = list(events)
    for e in evs:
        if isinstance(e.env.data, RequestRouted):
            routers.add(e.env.producer)
    timelines: dict[Incarnation, Timeline] = {}
    completed_ttft: dict[tuple[Incarnation, str], float] = {}
    recorded_first: set[tuple[Incarnation, str]] = set()
    streamed: set[tuple[Incarnation, str]] = set()
    for e in evs:
        env = e.env
        if env.producer not in routers:
            continue
        inc = Incarnation(env.producer, env.epoch)
        tl = timelines.get(inc)
        if tl is None:
            tl = timelines[inc] = Timeline(inc)
        ev = env.data
        tb = (e.topic, e.partition, e.offset)
        if isinstance(ev, RequestAdmitted):
            tl.admissions[ev.request_id] = e
            tl.ops.append(Op(ADMITTED, env.occurred_at_ns, ev.request_id, e, tb))
        elif isinstance(ev, RequestRouted):
            tl.ops.append(Op(ROUTED, env.occurred_at_ns, ev.request_id, e, tb))
        elif isinstance(ev, PrefillCompleted):
            # Published by the router itself at the first token (its prefill_done).
            tl.ops.append(Op(FIRST_TOKEN, env.occurred_at_ns, ev.request_id, e, tb))
            recorded_first.add((inc, ev.request_id))
        elif isinstance(ev, (RequestCompleted, RequestFailed, RequestRejected)):
            tl.ops.append(Op(ENDED, env.occurred_at_ns, ev.request_id, e, tb))
            if isinstance(ev, RequestCompleted):
                completed_ttft[(inc, ev.request_id)] = ev.ttft_ms
            elif isinstance(ev, RequestFailed) and ev.tokens_sent > 0:
                streamed.add((inc, ev.request_id))
    for key in streamed - recorded_first:
        timelines[key[0]].estimated_first_token.add(key[1])
    for (inc, rid), ttft_ms in completed_ttft.items():
        if (inc, rid) in recorded_first:
            continue
        tl = timelines[inc]
        adm = tl.admissions.get(rid)
        if adm is None:
            continue
        at = adm.at_ns + int(round(ttft_ms * 1e6))
        tl.ops.append(Op(FIRST_TOKEN, at, rid, None, ("~",)))
        tl.estimated_first_token.add(rid)
    for tl in timelines.values():
        tl.ops.sort(key=lambda o: (o.at_ns, _KIND_ORDER[o.kind], o.tiebreak))
    return timelines


class LedgerReplay:
    """Drives an :class:`InflightLedger` through a :class:`Timeline`'s non-decision operations.

    The caller handles ``ROUTED`` operations itself (it needs the view to re-execute the
    decision) and then calls :meth:`routed` with what to add.
    """

    def __init__(self, ttl_s: float) -> None:
        self.ledger = InflightLedger()
        self.ttl_s = ttl_s
        #: request id -> worker of its latest prefill-phase route (disaggregated serving)
        self._prefill_worker: dict[str, str] = {}
        #: request id -> worker of its latest route
        self._last_worker: dict[str, str] = {}
        #: every worker a decision of this router went to
        self.workers: set[str] = set()

    @staticmethod
    def now(at_ns: int, routed: RequestRouted | None = None) -> float:
        """The ``now`` the live ledger used: the recorded ``decided_at_s``, or (older logs)
        the envelope time."""
        if routed is not None and routed.decided_at_s:
            return routed.decided_at_s
        return at_ns / 1e9

    def first_token(self, request_id: str) -> None:
        self.ledger.prefill_done(request_id)

    def ended(self, env: Envelope[Event]) -> None:
        ev = env.data
        if isinstance(ev, RequestFailed) and ev.code == "worker_unreachable":
            # The router dropped everything it had sent to the worker that refused the
            # connection (Router._drop), then completed the request.
            wid = ev.worker_id or self._prefill_worker.get(ev.request_id) or self._last_worker.get(ev.request_id)
            if wid:
                self.ledger.drop_worker(wid)
        self.ledger.complete(ev.request_id)

    def before_decision(self, routed: RequestRouted, at_ns: int) -> None:
        """What the live router did between the previous event and ``decide``."""
        if routed.phase is RequestPhase.DECODE:
            pw = self._prefill_worker.get(routed.request_id)
            if pw is not None:
                self.ledger.complete(routed.request_id, pw)
        self.ledger.expire(self.now(at_ns, routed))

    def routed(self, routed: RequestRouted, hashes, prefill_tokens: int, decode_blocks: int, at_ns: int) -> None:
        self.ledger.add(routed.request_id, routed.worker_id, hashes, prefill_tokens, decode_blocks,
                        self.now(at_ns, routed), self.ttl_s)
        self._last_worker[routed.request_id] = routed.worker_id
        self.workers.add(routed.worker_id)
        if routed.phase is RequestPhase.PREFILL:
            self._prefill_worker[routed.request_id] = routed.worker_id

    def view_for(self, hashes) -> dict[str, InflightLoad]:
        """A frozen copy of what ``decide`` would read now (for later re-scoring)."""
        return dict(self.ledger.view(hashes))


class RecordedInflight:
    """An :class:`~control_plane.routing.InflightView` over a fixed mapping (a snapshot of the
    ledger taken for one decision, or one built from a recorded score table)."""

    def __init__(self, loads: dict[str, InflightLoad]) -> None:
        self._loads = loads

    def view(self, hashes) -> dict[str, InflightLoad]:
        return self._loads
