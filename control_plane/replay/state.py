"""Folding the log into the views replay rebuilds. Pure: records in, state out.

* :class:`ViewFolder` folds ``kv`` and ``workers`` records into a
  :class:`~control_plane.router.view.RouterView` exactly as the router's Faust agent does
  (``control_plane.router.stream``): a record below the view's position is skipped, a
  record that does not decode advances the position and is counted (the live agent
  dead-letters it), a record the index refuses is counted (``RouterView.apply`` has already
  advanced the position). So a view rebuilt here at the positions a router recorded equals the
  router's view then (``digest()`` compares them).
* :class:`RequestTraffic` folds the ``requests`` stream: what each worker has been sent and not yet
  finished, and per-worker counters. Together with the load the workers report (in the router
  view's registry) and the routers' in-flight ledgers (:mod:`control_plane.router.ledger`) it is
  the load picture at a point of the log.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import msgspec

from control_plane.index.errors import IndexRejected
from control_plane.router.view import RouterView, rejected_poison
from common.log.fold import Poisoned, RecordFold
from common.log.reader import LogRecord, RecordBatch
from schemas import Envelope, EventCodec
from schemas.events import (
    Event,
    RequestAdmitted,
    RequestCompleted,
    RequestFailed,
    RequestRejected,
    RequestRouted,
)


class ViewFolder:
    """Applies raw records of ``kv`` and ``workers`` to one :class:`RouterView`, through the
    fold glue every view uses (:class:`~common.log.fold.RecordFold`: skip what the view
    covers, count poison, go on) and the view's own record fold (the live agent's)."""

    def __init__(self, view: RouterView, codec: EventCodec | None = None,
                 on_poison: Callable[[LogRecord, Poisoned], None] | None = None) -> None:
        self.view = view
        self.codec = codec or EventCodec()
        self._fold = RecordFold(view.positions, self._apply, on_poison)
        self.stats = self._fold.stats

    def _apply(self, rec: LogRecord) -> None:
        try:
            self.view.apply_record(rec.value, rec.topic, rec.partition, rec.offset, rec.ts_ms, self.codec)
        except IndexRejected as e:
            raise rejected_poison(e) from None

    def _run(self, batch: RecordBatch, start: int) -> tuple[int, Poisoned | None]:
        end, rejected = self.view.apply_run(batch, start, self.codec)
        return end, (None if rejected is None else rejected_poison(rejected))

    def apply(self, rec: LogRecord) -> None:
        self._fold(rec)

    def apply_all(self, records: Iterable[LogRecord]) -> None:
        for r in records:
            self._fold(r)

    def apply_batch(self, batch: RecordBatch) -> None:
        """The same fold as ``apply`` of each record, whole runs at a time in the native index."""
        self._fold.fold_batch(batch, self._run)


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


class RequestTraffic:
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
        handler = _TRAFFIC_HANDLERS.get(type(env.data))
        if handler is not None:
            handler(self, env)

    def _admitted(self, env: Envelope[Event]) -> None:
        ev: RequestAdmitted = env.data  # type: ignore[assignment]
        self.admitted += 1
        self._prompt[ev.request_id] = ev.prompt_tokens

    def _routed(self, env: Envelope[Event]) -> None:
        ev: RequestRouted = env.data  # type: ignore[assignment]
        self._close(ev.request_id)  # a retry or the decode phase replaces the previous route
        pt = self._prompt.get(ev.request_id, 0)
        w = self._w(ev.worker_id)
        w.routed += 1
        w.inflight += 1
        w.inflight_prompt_tokens += pt
        w.last_routed_at_ns = env.occurred_at_ns
        self._open[ev.request_id] = _Open(ev.worker_id, ev.phase.value, pt)

    def _completed(self, env: Envelope[Event]) -> None:
        ev: RequestCompleted = env.data  # type: ignore[assignment]
        self.completed += 1
        self._w(ev.worker_id).completed += 1
        self._close(ev.request_id)
        self._prompt.pop(ev.request_id, None)

    def _failed(self, env: Envelope[Event]) -> None:
        ev: RequestFailed = env.data  # type: ignore[assignment]
        if ev.worker_id:
            self._w(ev.worker_id).failed += 1
        self._close(ev.request_id)
        if not ev.retried:
            self.failed += 1
            self._prompt.pop(ev.request_id, None)

    def _rejected(self, env: Envelope[Event]) -> None:
        rid = env.data.request_id  # type: ignore[attr-defined]
        self.rejected += 1
        self._close(rid)
        self._prompt.pop(rid, None)

    def as_dict(self) -> dict:
        return {"admitted": self.admitted, "completed": self.completed, "failed": self.failed,
                "rejected": self.rejected, "inflight": len(self._open),
                "workers": {k: msgspec.to_builtins(v) for k, v in sorted(self.workers.items())}}


_TRAFFIC_HANDLERS = {
    RequestAdmitted: RequestTraffic._admitted,
    RequestRouted: RequestTraffic._routed,
    RequestCompleted: RequestTraffic._completed,
    RequestFailed: RequestTraffic._failed,
    RequestRejected: RequestTraffic._rejected,
}


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
