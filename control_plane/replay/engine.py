"""The replay engine: log reader + pure folds, shared by the CLI and the admin API.

``ReplayEngine(reader, catalog)`` answers three questions from the log alone:

* :meth:`state` -- the router view (prefix index + worker registry), the load view and the
  routers' in-flight ledgers as they were at a point of the log. It starts from the newest
  snapshot (``snapshots`` topic) whose positions are all at or before the point, or from the
  start of the log, and folds the rest.
* :meth:`verify` -- re-executes every ``RequestRouted`` in a range (:mod:`.verify`).
* :meth:`whatif` -- re-scores the range under another router config and simulates both configs
  on the simulated engine (:mod:`.whatif`).

Progress is reported through a ``progress(description, total) -> bar`` factory (the CLI passes
tqdm, the API a callback that updates the job row); bars need ``update(n)`` and ``close()``.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import xxhash

from control_plane.replay.errors import BadPoint, ReplayError
from control_plane.replay.points import Point, check_range, format_positions, parse_point, parse_positions
from control_plane.replay.state import RequestTraffic, ViewFolder, view_summary
from control_plane.replay.verify import (DecisionCheck, DecisionRecord, VerifyReport, check_rejection, check_state,
                                         check_table)
from control_plane.router import Decision, NoEligibleWorker, RouterConfig
from control_plane.router.admission import folded_terms
from control_plane.router.inputs import DecisionInputs, decision_inputs, router_seed
from control_plane.router.ledger import RouterLedger
from control_plane.router.view import RouterView
from common.errors import LogReadError
from common.log.catalog import Catalog
from common.log.fold import FoldStats
from common.log.reader import TP, LocatedEvent, LogReader, LogRecord, RecordBatch, scan, scan_events
from common.settings import BusSettings
from schemas import EventCodec, SchemaError
from schemas.events import RequestAdmitted, RequestCompleted, RequestRejected, RequestRouted, RouterConfigChanged
from schemas.types import RequestPhase
from schemas.signing import ForgedEvent, snapshot_data

log = logging.getLogger(__name__)

VIEW_STREAMS = ("workers", "kv")
DEFAULT_TTL_S = RouterConfig().inflight_ttl_s


class Bar(Protocol):
    def update(self, n: int = 1) -> Any: ...

    def close(self) -> Any: ...


ProgressFactory = Callable[[str, "int | None"], Bar]


class _NullBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def no_progress(desc: str, total: int | None) -> Bar:
    return _NullBar()


class _SnapHead(msgspec.Struct):
    """The part of a router-view snapshot needed to choose one (the index bytes are skipped)."""

    format: int
    hash_algo: str
    block_size: int
    positions: list[tuple[str, int, int]]
    applied: int


@dataclass(frozen=True)
class SnapshotInfo:
    offset: int
    key: str
    positions: dict[TP, int]
    applied: int


@dataclass
class _Cursor:
    """Buffered forward reading of one partition (many small advances, few broker reads):
    ``buf`` holds the record batches read and not yet folded."""

    next_unread: int
    high: int
    buf: deque[RecordBatch] = field(default_factory=deque)


class ConfigBook:
    """Router configs by version: given ones (files, the log once it records them) or, for a
    version nobody gave, the router's default (``RouterConfig(version=v, mode=recorded mode)``,
    which is what ``switchyard router`` runs without ``--config``), flagged as assumed."""

    def __init__(self, configs: dict[int, RouterConfig] | None = None) -> None:
        self.configs = dict(configs or {})
        self.assumed: set[int] = set()
        self.from_log: set[int] = set()
        self.notes: list[str] = []

    def add_from_log(self, logged: dict[int, RouterConfig]) -> None:
        """Versions the log records (``RouterConfigChanged``) win over files given for them."""
        for v, c in logged.items():
            given = self.configs.get(v)
            if given is not None and given != c:
                self.notes.append(f"config v{v}: the file given differs from the log; using the log's")
            self.configs[v] = c
            self.from_log.add(v)

    def get(self, version: int, mode) -> tuple[RouterConfig, bool]:
        c = self.configs.get(version)
        if c is not None:
            return c, False
        self.assumed.add(version)
        return RouterConfig(version=version, mode=mode), True

    def ttl_s(self) -> float:
        return max([c.inflight_ttl_s for c in self.configs.values()] + [DEFAULT_TTL_S])


def router_streams(events) -> dict[str, list[LocatedEvent]]:
    """Each router incarnation's own events ("<router>@<epoch>"), in the order it published
    them: a producer stamps its events strictly increasing in time, whatever partition they
    went to (ties in older logs fall back to the log position). Routers are the producers of
    ``RequestRouted``; the workers' events (their own ``PrefillCompleted``, transfers) are not
    part of a router's state."""
    evs = list(events)
    routers = {e.env.producer for e in evs if isinstance(e.env.data, RequestRouted)}
    out: dict[str, list[LocatedEvent]] = {}
    for e in evs:
        if e.env.producer in routers:
            out.setdefault(f"{e.env.producer}@{e.env.epoch}", []).append(e)
    for stream in out.values():
        stream.sort(key=lambda e: (e.at_ns, e.topic, e.partition, e.offset))
    return out


@dataclass
class WalkItem:
    """One recorded decision in the range, with everything rebuilt around it."""

    record: DecisionRecord
    config: RouterConfig
    config_assumed: bool
    inputs: DecisionInputs | None
    error: str | None
    check: DecisionCheck | None = None
    table_decision: Decision | None = None
    state_decision: Decision | None = None
    #: The TTFT budget's margin, queue TTFT and spread at the decision, from the router's ledger folded
    #: to it (only when the decision recorded the budget test's terms).
    margin: tuple[float, float, float] | None = None


@dataclass
class Walk:
    """What a walk over a range saw besides the decisions."""

    items_seen: int = 0
    records_read: int = 0
    routers: set[str] = field(default_factory=set)
    admissions: dict[str, LocatedEvent] = field(default_factory=dict)
    completions: dict[str, LocatedEvent] = field(default_factory=dict)
    #: The router view the walk rebuilt last (hash algorithm, block size) and its registry.
    view_algo: tuple[str, int] | None = None
    workers: dict[str, Any] = field(default_factory=dict)
    #: Per TTFT budget refusal in the range with its terms: (position, verdict of
    #: :func:`~control_plane.replay.verify.check_rejection`).
    rejections: list[tuple[str, str]] = field(default_factory=list)


class ReplayEngine:
    def __init__(self, reader: LogReader, catalog: Catalog, *, codec: EventCodec | None = None,
                 progress: ProgressFactory = no_progress, chunk: int = 20000) -> None:
        self.reader = reader
        self.catalog = catalog
        # The live folds refuse a forged event (schemas/signing.py), so replay must too, or it
        # would re-execute on a different view: the checkout's master secret checks them.
        self.codec = codec or EventCodec(verifier=BusSettings.from_env().verifier())
        self.progress = progress
        self.chunk = chunk
        self._snapshots: list[SnapshotInfo] | None = None

    # -- topics and points ------------------------------------------------------------------

    def topics(self, streams) -> list[str]:
        return [self.catalog.topic(s) for s in streams]

    def all_partitions(self, topics) -> list[TP]:
        return [(t, p) for t in topics for p in self.reader.partitions(t)]

    def point_ts(self, point: Point) -> int | None:
        """The timestamp a point stands for (None for start/end/positions)."""
        if point.kind == "time":
            return point.ts_ms
        if point.kind == "record":
            return self._record(point.topic, point.partition, point.offset).ts_ms
        if point.kind == "request":
            return self._request_routed(point.request_id)[1].ts_ms
        return None

    def resolve(self, point: Point | str, topics, *, side: str = "end") -> dict[TP, int]:
        """Per partition of ``topics``: the offset where the point falls.

        ``side="end"``: the next offset *after* the point (exclusive end of "everything up to
        the point"); ``side="start"``: the first offset *at or after* it.
        """
        if isinstance(point, str):
            point = parse_point(point)
        tps = self.all_partitions(topics)
        out: dict[TP, int] = {}
        if point.kind in ("start", "end"):
            for t, p in tps:
                lo, hi = self.reader.bounds(t, p)
                out[(t, p)] = lo if point.kind == "start" else hi
            return out
        if point.kind == "positions":
            for t, p in tps:
                lo, hi = self.reader.bounds(t, p)
                out[(t, p)] = min(max(point.positions.get((t, p), hi), lo), hi)
            return out
        if point.kind == "request":
            routed, rec = self._request_routed(point.request_id)
            pos = parse_positions(routed.index_position)
            recorded_topics = {t for t, _ in pos}
            for t, p in tps:
                if (t, p) == (rec.topic, rec.partition):
                    out[(t, p)] = rec.offset + (1 if side == "end" else 0)
                elif t in recorded_topics:
                    lo, hi = self.reader.bounds(t, p)
                    out[(t, p)] = min(max(pos.get((t, p), lo), lo), hi)
                else:
                    out[(t, p)] = self._time_offset(t, p, rec.ts_ms, side)
            return out
        if point.kind == "record":
            rec = self._record(point.topic, point.partition, point.offset)
            for t, p in tps:
                if (t, p) == (point.topic, point.partition):
                    out[(t, p)] = point.offset + (1 if side == "end" else 0)
                else:
                    out[(t, p)] = self._time_offset(t, p, rec.ts_ms, side)
            return out
        for t, p in tps:  # a time
            out[(t, p)] = self._time_offset(t, p, point.ts_ms, side)
        return out

    def _time_offset(self, t: str, p: int, ts_ms: int, side: str) -> int:
        return self.reader.offset_for_time(t, p, ts_ms + 1 if side == "end" else ts_ms)

    def _record(self, topic: str, partition: int, offset: int) -> LogRecord:
        if topic not in set(self.catalog.all_topics()):
            raise BadPoint(f"topic {topic!r} is not under prefix {self.catalog.prefix!r}")
        for r in self.reader.read(topic, partition, offset, offset + 1):
            return r
        lo, hi = self.reader.bounds(topic, partition)
        raise BadPoint(f"no record at {topic}:{partition}:{offset} (partition holds {lo}..{hi - 1})")

    def _request_routed(self, request_id: str) -> tuple[RequestRouted, LogRecord]:
        """The last RequestRouted of a request (its partition follows from its key)."""
        topic = self.catalog.topic("requests")
        parts = self.reader.partitions(topic)
        p = xxhash.xxh64_intdigest(request_id.encode()) % len(parts)
        found: tuple[RequestRouted, LogRecord] | None = None
        for rec, env in scan_events(self.reader, topic, codec=self.codec, key=request_id.encode(), partitions=[p]):
            if isinstance(env.data, RequestRouted):
                found = (env.data, rec)
        if found is None:
            raise BadPoint(f"no RequestRouted for request {request_id!r} in {topic}")
        return found

    # -- configs ----------------------------------------------------------------------------

    def router_configs(self) -> dict[int, RouterConfig]:
        """Every router config version the ``admin`` stream records (``RouterConfigChanged``)."""
        topic = self.catalog.topic("admin")
        out: dict[int, RouterConfig] = {}
        try:
            parts = self.reader.partitions(topic)
        except LogReadError:
            return out
        for rec, env in scan_events(self.reader, topic, codec=self.codec, partitions=parts):
            if not isinstance(env.data, RouterConfigChanged):
                continue
            try:
                out[env.data.config_version] = msgspec.convert(
                    {**env.data.config, "version": env.data.config_version}, RouterConfig)
            except msgspec.ValidationError as e:
                log.warning("RouterConfigChanged v%d at %s:%d:%d does not validate: %s",
                            env.data.config_version, topic, rec.partition, rec.offset, e)
        return out

    # -- snapshots --------------------------------------------------------------------------

    def snapshots(self) -> list[SnapshotInfo]:
        """Router-view snapshots still in the (compacted) snapshots topic."""
        if self._snapshots is not None:
            return self._snapshots
        topic = self.catalog.topic("snapshots")
        head = msgspec.msgpack.Decoder(_SnapHead)
        out: list[SnapshotInfo] = []
        try:
            parts = self.reader.partitions(topic)
        except LogReadError:
            parts = []
        for rec in scan(self.reader, topic, partitions=parts):
            if rec.value is None or rec.key is None or not rec.key.startswith(b"router-view:"):
                continue
            data = self._opened(rec)
            if data is None:
                continue
            try:
                h = head.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            out.append(SnapshotInfo(rec.offset, rec.key.decode(),
                                    {(t, pp): o for t, pp, o in h.positions}, h.applied))
        self._snapshots = out
        return out

    def _opened(self, rec: LogRecord) -> bytes | None:
        """A snapshot record's view bytes once its owner's signature checks (schemas/signing.py),
        else None (logged): replay, like a restarting router, never starts from a forgery."""
        verifier = self.codec.verifier
        if verifier is None:
            return snapshot_data(rec.value)
        try:
            return verifier.open_snapshot(rec.key.decode(errors="replace"), rec.value)
        except ForgedEvent as e:
            log.warning("replay skips the snapshot at %s:%d:%d (%s): %s", rec.topic, rec.partition, rec.offset,
                        e.reason, e)
            return None

    def _best_snapshot(self, key: str, targets: dict[TP, int]) -> SnapshotInfo | None:
        best = None
        for s in self.snapshots():
            if s.key != key or any(targets.get(tp, 0) < off for tp, off in s.positions.items()):
                continue
            if best is None or s.applied > best.applied:
                best = s
        return best

    def _load_snapshot(self, s: SnapshotInfo) -> RouterView:
        topic = self.catalog.topic("snapshots")
        for p in self.reader.partitions(topic):
            for rec in self.reader.read(topic, p, s.offset, s.offset + 1):
                if rec.offset == s.offset and (data := self._opened(rec)) is not None:
                    return RouterView.restore(data)
        raise LogReadError(f"snapshot at {topic}:{s.offset} disappeared (compacted?)")

    # -- views ------------------------------------------------------------------------------

    def new_view(self, hash_algo: str, block_size: int, targets: dict[TP, int] | None,
                 use_snapshots: bool = True) -> tuple[RouterView, SnapshotInfo | None]:
        """An empty view, or the newest snapshot whose positions are all at or before ``targets``."""
        # lazy: start-up time: loads confluent_kafka only when called
        from control_plane.router.stream import snapshot_key

        view = RouterView(hash_algo, block_size)
        if use_snapshots and targets is not None:
            s = self._best_snapshot(snapshot_key(view), targets)
            if s is not None:
                return self._load_snapshot(s), s
        return view, None

    def view_at(self, targets: dict[TP, int], hash_algo: str, block_size: int, *,
                use_snapshots: bool = True) -> tuple[RouterView, FoldStats, SnapshotInfo | None]:
        """The router view folded exactly up to ``targets`` (exclusive offsets)."""
        view, snap = self.new_view(hash_algo, block_size, targets, use_snapshots)
        adv = ViewAdvancer(self, view)
        adv.advance_to(targets, progress=True)
        return view, adv.folder.stats, snap

    # -- state ------------------------------------------------------------------------------

    def state(self, at: str, *, hash_algo: str = "sha256", block_size: int = 64, use_snapshots: bool = True,
              configs: ConfigBook | None = None, with_requests: bool = True) -> tuple[dict, RouterView]:
        """Router view + load view + in-flight ledgers at ``at`` (see :mod:`.points`)."""
        t0 = time.perf_counter()
        point = parse_point(at)
        targets = self.resolve(point, self.topics(VIEW_STREAMS), side="end")
        view, stats, snap = self.view_at(targets, hash_algo, block_size, use_snapshots=use_snapshots)
        out: dict[str, Any] = {
            "at": point.text, "point": point.describe(),
            "snapshot": ({"offset": snap.offset, "applied": snap.applied,
                          "positions": format_positions(snap.positions)} if snap else None),
            "fold": msgspec.to_builtins(stats),
            "view": view_summary(view),
        }
        if with_requests:
            req_topic = self.catalog.topic("requests")
            req_targets = self.resolve(point, [req_topic], side="end")
            lows = {tp: self.reader.bounds(*tp)[0] for tp in req_targets}
            located, _ = self.read_requests(lows, req_targets)
            load = RequestTraffic()
            for loc in located:
                load.apply(loc.env, loc.topic, loc.partition, loc.offset)
            out["load"] = load.as_dict()
            out["load"]["positions"] = format_positions(load.positions)
            out["ledgers"] = self._ledgers_at(located, configs or ConfigBook())
        out["seconds"] = round(time.perf_counter() - t0, 3)
        return out, view

    def read_requests(self, starts: dict[TP, int], ends: dict[TP, int]) -> tuple[list[LocatedEvent], int]:
        """The decodable records of request partitions from ``starts`` to ``ends`` (exclusive),
        partition by partition in offset order, and how many records were read (the ones that
        do not decode are read around, as every tool does)."""
        located: list[LocatedEvent] = []
        read = 0
        for loc in self.iter_requests(starts, ends):
            read += 1
            if loc is not None:
                located.append(loc)
        return located, read

    def iter_requests(self, starts: dict[TP, int], ends: dict[TP, int]) -> Iterator[LocatedEvent | None]:
        """:meth:`read_requests` one record at a time, for a fold that keeps none of them (a
        list of a stream's envelopes costs the garbage collector more than the fold): one item
        per record read, None for one that does not decode."""
        bar = self.progress("reading requests", sum(max(e - starts[tp], 0) for tp, e in ends.items()))
        decode = self.codec.decode
        try:
            for (t, p), e in ends.items():
                for batch in self.reader.read_batches(t, p, starts[(t, p)], e):
                    bar.update(len(batch.offsets))
                    for offset, value in zip(batch.offsets, batch.values):
                        if value is None:
                            yield None
                            continue
                        try:
                            env = decode(value)
                        except SchemaError:
                            yield None
                            continue
                        yield LocatedEvent(env, t, p, offset)
        finally:  # also when the caller stops early
            bar.close()

    def _ledgers_at(self, located: list[LocatedEvent], configs: ConfigBook) -> dict:
        """Each router incarnation's ledger after its last recorded event: the fold of its own
        events (the same :class:`RouterLedger` the live router keeps)."""
        out = {}
        for inc, stream in router_streams(located).items():
            ledger = RouterLedger(configs.ttl_s())
            for loc in stream:
                ledger.apply(loc.env)
            ledger.inflight.expire(stream[-1].at_ns / 1e9)
            loads = {}
            for wid in sorted({loc.env.data.worker_id for loc in stream if isinstance(loc.env.data, RequestRouted)}):
                ld = ledger.load_for(wid)
                if ld.requests:
                    loads[wid] = {"prefill_tokens": ld.prefill_tokens, "decode_blocks": ld.decode_blocks,
                                  "requests": ld.requests}
            out[inc] = {"inflight_entries": len(ledger), "workers": loads, "open_requests": ledger.open_requests(),
                        "rr_cursor": dict(sorted(ledger.rr_cursor.items()))}
        return out

    # -- the decision walk (verify and whatif) ----------------------------------------------

    def walk(self, frm: str, to: str, configs: ConfigBook, on_item: Callable[[WalkItem], None], *,
             check: bool = True) -> Walk:
        """Rebuild every recorded decision in [frm, to] of the requests stream with its inputs.

        Per router incarnation, in time order: its ledger is replayed from its own events
        (starting ``inflight_ttl_s`` before ``frm``: older entries have expired), and a router
        view is advanced to each decision's ``index_position``.
        """
        walk = Walk()
        req_topic = self.catalog.topic("requests")
        p_from, p_to = parse_point(frm), parse_point(to)
        check_range(p_from, p_to)
        start = self.resolve(p_from, [req_topic], side="start")
        end = self.resolve(p_to, [req_topic], side="end")
        if any(start[tp] > end.get(tp, start[tp]) for tp in start):
            raise BadPoint(f"the range starts at {frm!r}, after it ends at {to!r} (in {req_topic})")
        from_ts = self.point_ts(p_from)
        look = dict(start)
        if from_ts is not None:
            back = from_ts - int(configs.ttl_s() * 1000) - 60_000
            for (t, p) in start:
                look[(t, p)] = min(start[(t, p)], self.reader.offset_for_time(t, p, back))
        located, read = self.read_requests(look, end)
        walk.records_read += read
        for loc in located:
            ev = loc.env.data
            if isinstance(ev, RequestAdmitted):
                walk.admissions.setdefault(ev.request_id, loc)
            elif isinstance(ev, RequestCompleted):
                walk.completions[ev.request_id] = loc
        streams = router_streams(located)

        def in_range(loc: LocatedEvent) -> bool:
            return start[(loc.topic, loc.partition)] <= loc.offset < end[(loc.topic, loc.partition)]

        n_decisions = sum(1 for st in streams.values() for loc in st
                          if isinstance(loc.env.data, RequestRouted) and in_range(loc))
        bar = self.progress("decisions", n_decisions)
        views: dict[tuple[str, int], ViewAdvancer] = {}
        for inc, stream in sorted(streams.items(), key=lambda kv: kv[1][0].at_ns):
            walk.routers.add(inc)
            # The router's own state, folded from its own events as it folded them live.
            ledger = RouterLedger(configs.ttl_s())
            admitted: dict[str, LocatedEvent] = {}
            # A refusal's test ran at its terms' ``at_s``; its event is recorded a moment later,
            # after events of other requests the ledger may fold first: its margin is taken from
            # the ledger as it stood at ``at_s`` (before the first event stamped after it).
            refusals = sorted((loc.env.data.admission.at_s, i) for i, loc in enumerate(stream)
                              if check and isinstance(loc.env.data, RequestRejected)
                              and loc.env.data.admission is not None and in_range(loc))
            margins: dict[int, tuple[float, float, float]] = {}
            for loc in stream:
                while refusals and refusals[0][0] * 1e9 < loc.at_ns:
                    at_s, i = refusals.pop(0)
                    margins[i] = _margin_at(ledger, stream[i].env.data, at_s)
                routed = loc.env.data
                if isinstance(routed, RequestAdmitted):
                    admitted[routed.request_id] = loc
                elif isinstance(routed, RequestRouted) and in_range(loc):
                    walk.items_seen += 1
                    item = self._decision_item(loc, admitted.get(routed.request_id), ledger, configs, views, walk)
                    if check:
                        _check(item)
                    on_item(item)
                    bar.update(1)
                ledger.apply(loc.env)
            for at_s, i in refusals:  # stamped after the stream's last event
                margins[i] = _margin_at(ledger, stream[i].env.data, at_s)
            for i in sorted(margins):
                walk.rejections.append((stream[i].position, check_rejection(stream[i].env.data, margins[i])))
        bar.close()
        return walk

    def _decision_item(self, loc: LocatedEvent, adm_loc: LocatedEvent | None, ledger: RouterLedger, configs: ConfigBook,
                       views: dict, walk: Walk) -> WalkItem:
        """One recorded decision with its inputs rebuilt through the router's decision path:
        the view advanced to its ``index_position``, the router's ledger folded up to it."""
        routed: RequestRouted = loc.env.data  # type: ignore[assignment]
        rec = _record_of(loc, adm_loc)
        config, assumed = configs.get(routed.config_version, routed.mode)
        item = WalkItem(record=rec, config=config, config_assumed=assumed, inputs=None, error=None)
        adm = rec.admitted
        if adm is None:
            item.error = "unverifiable: its RequestAdmitted is outside the replayed range"
            return item
        key = (adm.hash_algo, adm.block_size)
        targets = self._decision_targets(routed)
        adv = views.get(key)
        if adv is None or not adv.can_reach(targets):
            view, _ = self.new_view(adm.hash_algo, adm.block_size, targets)
            adv = views[key] = ViewAdvancer(self, view)
        try:
            adv.advance_to(targets)
            item.inputs = decision_inputs(
                adv.view, ledger, request_id=routed.request_id, prompt_tokens=adm.prompt_tokens,
                block_hashes=adm.block_hashes, block_size=adm.block_size,
                expected_output_tokens=routed.expected_output_tokens or adm.max_tokens, phase=routed.phase,
                attempt=routed.attempt, now=routed.decided_at_s or loc.at_ns / 1e9,
                excluded=routed.excluded_workers, peer_reach=config.tier_weights.peer > 0,
                engine_steps=routed.ttft_model is None or routed.ttft_model.ms_per_step_token_sq is not None,
                pairs=config.pd_pairs, session=routed.session, session_ttl_s=config.session_ttl_s)
            if routed.admission is not None:
                at_s = routed.admission.at_s
                item.margin = folded_terms(ledger.margin, at_s, routed.admission)
        except (ReplayError, LogReadError, NoEligibleWorker, ValueError) as e:
            item.error = f"error rebuilding state: {e}"
        walk.view_algo = key
        walk.workers = adv.view.workers
        return item

    def _decision_targets(self, routed: RequestRouted) -> dict[TP, int]:
        """A decision's ``index_position`` over every view partition (absent = nothing read)."""
        pos = parse_positions(routed.index_position)
        return {tp: pos.get(tp, 0) for tp in self.all_partitions(self.topics(VIEW_STREAMS))}

    # -- verify -----------------------------------------------------------------------------

    def verify(self, frm: str = "start", to: str = "end", *, configs: ConfigBook | None = None,
               keep_checks: bool = False) -> VerifyReport:
        t0 = time.perf_counter()
        configs = configs or ConfigBook()
        configs.add_from_log(self.router_configs())
        report = VerifyReport(range_from=frm, range_to=to)
        versions: set[int] = set()

        def on_item(item: WalkItem) -> None:
            chk = item.check
            report.decisions += 1
            versions.add(chk.config_version)
            if chk.table.startswith("unverifiable"):
                report.unverifiable += 1
            if chk.table == "match":
                report.table_matches += 1
            if chk.state == "match":
                report.state_matches += 1
            if chk.matched and chk.seed_rule_ok:
                report.identical += 1
            else:
                report.mismatches.append(chk)
            if keep_checks:
                report.checks.append(chk)

        walk = self.walk(frm, to, configs, on_item)
        report.rejections = len(walk.rejections)
        report.rejections_matched = sum(1 for _, v in walk.rejections if v == "match")
        report.rejection_mismatches = [f"{pos}: {v}" for pos, v in walk.rejections if v != "match"]
        report.config_versions = sorted(versions)
        report.configs_assumed = sorted(configs.assumed)
        report.configs_from_log = sorted(configs.from_log & versions)
        report.notes = list(configs.notes)
        report.routers = sorted(walk.routers)
        report.records_read = walk.records_read
        report.seconds = time.perf_counter() - t0
        return report

    # -- whatif -----------------------------------------------------------------------------

    def whatif(self, frm: str, to: str, alternative: RouterConfig, *, configs: ConfigBook | None = None,
               profile: str = "mocker", simulate: bool = True):
        # lazy: start-up time: loads numpy only when called
        from control_plane.replay.whatif import WhatIf

        configs = configs or ConfigBook()
        configs.add_from_log(self.router_configs())
        w = WhatIf(alternative)
        walk = self.walk(frm, to, configs, w.on_item)
        return w.finish(walk, frm, to, configs=configs, profile=profile, simulate=simulate, progress=self.progress)


def _margin_at(ledger: RouterLedger, rejected: RequestRejected, at_s: float) -> tuple[float, float, float]:
    """The budget test's margin, queue TTFT and spread as the live router computed them for a refused
    request: after the decision's own ``prepare`` at ``at_s`` (a refusal is a first prefilling
    decision: no decode entry to release)."""
    ledger.prepare(rejected.request_id, RequestPhase.PREFILL, at_s)
    return folded_terms(ledger.margin, at_s, rejected.admission)


def _record_of(ev: LocatedEvent, adm: LocatedEvent | None) -> DecisionRecord:
    env = ev.env
    return DecisionRecord(routed=env.data, admitted=adm.env.data if adm else None, at_ns=env.occurred_at_ns,
                          producer=env.producer, epoch=env.epoch, position=ev.position, event_id=env.event_id)


def _check(item: WalkItem) -> None:
    """Run the table and state checks of one decision and attach the verdict."""
    rec, r = item.record, item.record.routed
    chk = DecisionCheck(request_id=r.request_id, phase=r.phase.value, attempt=r.attempt,
                        router=f"{rec.producer}@{rec.epoch}", position=rec.position, at_ns=rec.at_ns,
                        recorded_worker=r.worker_id, config_version=r.config_version, table="error: not run",
                        state="error: not run", config_assumed=item.config_assumed,
                        seed_rule_ok=router_seed(r.request_id, r.phase.value, r.attempt) == r.rng_seed)
    if rec.admitted is None:
        chk.table = chk.state = item.error or "unverifiable"
    else:
        chk.table, item.table_decision, chk.table_diffs = check_table(rec, item.config)
        if item.table_decision is not None:
            chk.table_worker = item.table_decision.worker_id
        if item.inputs is None:
            chk.state = item.error or "error: no state"
        else:
            chk.state, item.state_decision, chk.state_diffs, chk.input_diffs = check_state(
                rec, item.inputs, item.config, item.margin)
            if item.state_decision is not None:
                chk.state_worker = item.state_decision.worker_id
    if not chk.seed_rule_ok:
        chk.notes.append("rng_seed differs from the router's seed rule for (request, phase, attempt)")
    if item.config_assumed:
        chk.notes.append(f"config v{r.config_version} not given: assumed the router default (mode {r.mode.value})")
    item.check = chk


class ViewAdvancer:
    """Advances one RouterView partition by partition to target positions, reading ahead."""

    def __init__(self, engine: ReplayEngine, view: RouterView) -> None:
        self.engine = engine
        self.view = view
        self.folder = ViewFolder(view, engine.codec)
        self.cursors: dict[TP, _Cursor] = {}

    def refresh(self) -> dict[TP, int]:
        """Re-read the log end of every partition followed (a live view catching up)."""
        for tp, c in self.cursors.items():
            c.high = self.engine.reader.bounds(*tp)[1]
        return {tp: c.high for tp, c in self.cursors.items()}

    def can_reach(self, targets: dict[TP, int]) -> bool:
        """False when some target lies behind the view (a rebuild is needed)."""
        return all(self.view.positions.get(tp, 0) <= off for tp, off in targets.items())

    def _cursor(self, tp: TP) -> _Cursor:
        c = self.cursors.get(tp)
        if c is None:
            lo, hi = self.engine.reader.bounds(*tp)
            c = self.cursors[tp] = _Cursor(max(self.view.positions.get(tp, lo), lo), hi)
        return c

    def advance_to(self, targets: dict[TP, int], progress: bool = False) -> None:
        """Fold every partition up to (excluding) its target offset. A target past the end of
        the log seen when the partition was first read stops at that end."""
        reader, chunk, pos = self.engine.reader, self.engine.chunk, self.view.positions
        cursors = {tp: self._cursor(tp) for tp in targets}
        bar: Bar = _NullBar()
        if progress:
            todo = sum(max(min(targets[tp], c.high) - (c.buf[0].offsets[0] if c.buf else c.next_unread), 0)
                       for tp, c in cursors.items())
            bar = self.engine.progress("folding kv+workers", todo)
        # workers first, then kv: what a live fold sees in practice (the result does not depend on it)
        for tp in sorted(targets, key=lambda tp: (0 if tp[0].endswith(".workers") else 1, tp)):
            c = cursors[tp]
            target = min(targets[tp], c.high)
            buf = c.buf
            while pos.get(tp, 0) < target:
                if not buf:
                    if c.next_unread >= target:
                        break  # the offsets left hold no record (compaction): nothing to fold
                    stop = min(c.high, max(target, c.next_unread + chunk))
                    buf.extend(reader.read_batches(tp[0], tp[1], c.next_unread, stop))
                    c.next_unread = stop
                    continue
                batch = buf[0]
                k = bisect_left(batch.offsets, target)
                if k == 0:
                    break
                if k < len(batch):  # fold up to the target, keep the rest
                    buf[0] = batch.slice(k, len(batch))
                    batch = batch.slice(0, k)
                else:
                    buf.popleft()
                self.folder.apply_batch(batch)
                bar.update(len(batch))
        bar.close()
