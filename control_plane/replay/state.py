"""Folding the log into the views replay rebuilds. Pure: records in, state out.

* :class:`ViewFolder` folds ``kv`` and ``workers`` records into a
  :class:`~control_plane.router.view.RouterView` exactly as the router's Faust agent does
  (``control_plane.streams.router_view``): a record below the view's position is skipped, a
  record that does not decode advances the position and is counted (the live agent
  dead-letters it), a record the index refuses is counted (``RouterView.apply`` has already
  advanced the position). So a view rebuilt here at the positions a router recorded equals the
  router's view then (``digest()`` compares them).
* :class:`LoadView` folds the ``requests`` stream: what each worker has been sent and not yet
  finished, and per-worker counters. Together with the load the workers report (in the router
  view's registry) and the routers' in-flight ledgers (:mod:`control_plane.replay.ledger`) it is
  the load picture at a point of the log.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from control_plane.index.errors import IndexRejected
from control_plane.replay.log import LogRecord
from control_plane.router.view import RouterView
from schemas import Envelope, EventCodec, SchemaError
from schemas.events import (
    Event,
    RequestAdmitted,
    RequestCompleted,
    RequestFailed,
    RequestRejected,
    RequestRouted,
)


class FoldStats(msgspec.Struct, kw_only=True):
    """What a fold did with the records it was given."""

    records: int = 0
    applied: int = 0
    #: Records already covered by the view's positions (a snapshot, or a re-read).
    skipped: int = 0
    #: Records that are not decodable envelopes (the live agent dead-letters them).
    undecodable: int = 0
    #: Records the prefix index refused (other hash algorithm, block size, cache group).
    rejected: int = 0


class ViewFolder:
    """Applies raw records of ``kv`` and ``workers`` to one :class:`RouterView`."""

    def __init__(self, view: RouterView, codec: EventCodec | None = None) -> None:
        self.view = view
        self.codec = codec or EventCodec()
        self.stats = FoldStats()

    def apply(self, rec: LogRecord) -> None:
        view = self.view
        tp = (rec.topic, rec.partition)
        self.stats.records += 1
        if rec.offset < view.positions.get(tp, 0):
            self.stats.skipped += 1
            return
        if rec.value is None:
            view.positions[tp] = rec.offset + 1
            self.stats.undecodable += 1
            return
        try:
            env = self.codec.decode(rec.value)
        except SchemaError:
            view.positions[tp] = rec.offset + 1
            self.stats.undecodable += 1
            return
        try:
            view.apply(env, rec.topic, rec.partition, rec.offset, rec.ts_ms)
        except IndexRejected:
            self.stats.rejected += 1
            return
        self.stats.applied += 1

    def apply_all(self, records: Iterable[LogRecord]) -> None:
        for r in records:
            self.apply(r)


class WorkerTraffic(msgspec.Struct, kw_only=True):
    """One worker as the request stream sees it."""

    worker_id: str
    #: Requests routed here (any phase) and not yet completed, failed or rejected.
    inflight: int = 0
    inflight_prompt_tokens: int = 0
    routed: int = 0
    completed: int = 0
    failed: int = 0
    last_routed_at_ns: int = 0


class _Open(msgspec.Struct):
    worker_id: str
    phase: str
    prompt_tokens: int


class LoadView:
    """Per worker: what the routers sent it and it has not finished. Folds ``requests``."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerTraffic] = {}
        self._prompt: dict[str, int] = {}
        #: request id -> the route it is currently on
        self._open: dict[str, _Open] = {}
        self.admitted = 0
        self.completed = 0
        self.failed = 0
        self.rejected = 0
        self.positions: dict[tuple[str, int], int] = {}

    def _w(self, wid: str) -> WorkerTraffic:
        w = self.workers.get(wid)
        if w is None:
            w = self.workers[wid] = WorkerTraffic(worker_id=wid)
        return w

    def _close(self, rid: str) -> None:
        o = self._open.pop(rid, None)
        if o is not None:
            w = self._w(o.worker_id)
            w.inflight -= 1
            w.inflight_prompt_tokens -= o.prompt_tokens

    def apply(self, env: Envelope[Event], topic: str = "", partition: int = 0, offset: int = -1) -> None:
        if topic:
            self.positions[(topic, partition)] = offset + 1
        ev = env.data
        if isinstance(ev, RequestAdmitted):
            self.admitted += 1
            self._prompt[ev.request_id] = ev.prompt_tokens
        elif isinstance(ev, RequestRouted):
            self._close(ev.request_id)  # a retry or the decode phase replaces the previous route
            pt = self._prompt.get(ev.request_id, 0)
            w = self._w(ev.worker_id)
            w.routed += 1
            w.inflight += 1
            w.inflight_prompt_tokens += pt
            w.last_routed_at_ns = env.occurred_at_ns
            self._open[ev.request_id] = _Open(ev.worker_id, ev.phase.value, pt)
        elif isinstance(ev, RequestCompleted):
            self.completed += 1
            self._w(ev.worker_id).completed += 1
            self._close(ev.request_id)
            self._prompt.pop(ev.request_id, None)
        elif isinstance(ev, RequestFailed):
            if ev.worker_id:
                self._w(ev.worker_id).failed += 1
            self._close(ev.request_id)
            if not ev.retried:
                self.failed += 1
                self._prompt.pop(ev.request_id, None)
        elif isinstance(ev, RequestRejected):
            self.rejected += 1
            self._close(ev.request_id)
            self._prompt.pop(ev.request_id, None)

    def as_dict(self) -> dict:
        return {"admitted": self.admitted, "completed": self.completed, "failed": self.failed,
                "rejected": self.rejected, "inflight": len(self._open),
                "workers": {k: msgspec.to_builtins(v) for k, v in sorted(self.workers.items())}}


def view_summary(view: RouterView) -> dict:
    """The router view in plain data: index stats, per worker registry + residency."""
    stats = view.index.stats()
    blocks: dict[str, dict[str, int]] = {}
    for rank, per in stats.blocks.items():
        d = blocks.setdefault(rank.worker_id, {})
        for tier, n in per.items():
            d[tier.value] = d.get(tier.value, 0) + n
    workers = {}
    for wid, w in sorted(view.workers.items()):
        workers[wid] = {**msgspec.to_builtins(w), "blocks": blocks.get(wid, {})}
    return {
        "hash_algo": view.hash_algo, "block_size": view.block_size,
        "distinct_hashes": stats.distinct_hashes, "applied": view.applied,
        "stale_workers": view.stale_workers(),
        "deregistered": list(stats.deregistered),
        "counters": stats.counters,
        "blocks": blocks,
        "workers": workers,
        "positions": {f"{t}:{p}": o for (t, p), o in sorted(view.positions.items())},
        "digest": view.digest(),
    }
