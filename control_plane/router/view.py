"""The router's materialized view of the log: prefix index + worker registry + positions. Pure.

``RouterView.apply`` folds one decoded record (with its topic, partition and offset) from the
``kv`` and ``workers`` streams. The same fold runs in a live router (following the log's tail), in
the replay tool and in tests, so a view rebuilt from the log equals the live one at the same
offsets.

Sequencing: producers number events per topic partition (see ``schemas.envelope``), so the
index is told the producer as ``"<producer>@<topic>:<partition>"``; its dedupe, gap and epoch
logic then works per ordered substream.

The index is a :class:`~control_plane.router.ports.KvIndex`: the native
:class:`~control_plane.index.native.NativePrefixIndex` (the differential tests pass the oracle's,
``tests/oracles/prefix_index.py``). ``apply_record`` offers a record's bytes to the index first:
the native index decodes KV envelopes itself; what it does not take goes through the codec and
``apply``.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import msgspec

from control_plane.index.errors import IndexRejected
from control_plane.index.shapes import ApplyOutcome, Match, WorkerRank
from control_plane.index.native import NativePrefixIndex
from control_plane.router.ports import KvIndex
from control_plane.router.decision import WorkerLoad, WorkerOverlap
from common.fleet import Fleet, Lifecycle
from common.log.fold import Poisoned
from schemas.envelope import Envelope, EventCodec
from schemas.events import (
    Event,
    WorkerDeregistered,
    WorkerDraining,
    WorkerLoadReported,
    WorkerRegistered,
)
from schemas.types import WorkerId

if TYPE_CHECKING:
    from common.log.reader import RecordBatch

SNAPSHOT_FORMAT = 1


class WorkerState(msgspec.Struct, kw_only=True):
    """What the router knows about one worker incarnation."""

    worker_id: str
    epoch: int
    role: str
    pool: str
    endpoint: str
    model: str = ""
    block_size: int = 0
    capacity: dict[str, int] = {}
    #: "ready" | "draining" | "gone"
    state: str = "ready"
    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    active_decode_blocks: int = 0
    tier_usage: dict[str, float] = {}
    registered_at_ns: int = 0
    reported_at_ns: int = 0

    @property
    def routable(self) -> bool:
        return self.state == "ready"

    @property
    def device_capacity_blocks(self) -> int:
        return int(self.capacity.get("device", 0))


class _Snapshot(msgspec.Struct, kw_only=True):
    format: int
    hash_algo: str
    block_size: int
    index: bytes
    workers: list[WorkerState]
    #: [topic, partition, next offset]
    positions: list[tuple[str, int, int]]
    #: [topic, partition, timestamp ms of the last applied record]
    last_ts_ms: list[tuple[str, int, int]]
    applied: int
    #: Each worker's lifecycle (common/fleet.py); absent in snapshots written before it.
    lifecycles: dict[str, Lifecycle] = {}


def rejected_poison(e: IndexRejected, key: bytes | None = None) -> Poisoned:
    """A record the index refused, as the fold glue's poison (dead-lettered live, counted in replay)."""
    return Poisoned(f"index_rejected:{e.reason}", str(e), key)


@dataclass(frozen=True)
class Applied:
    outcome: str  # an ApplyOutcome value, or "worker" for registry-only events
    worker_id: str | None = None


#: Where a worker's endpoint may be (loopback unless configured): networks, or host names.
DEFAULT_WORKER_NETWORKS: tuple[str, ...] = ("127.0.0.0/8", "::1/128", "localhost")


class EndpointAllowlist:
    """Which registered endpoints the router may send requests (prompts included) to:
    ``scheme://host[:port]`` with the host in the listed networks, or named exactly. Pure: no name is resolved, so every fold of the same
    log, live or replayed, accepts the same registrations."""

    def __init__(self, entries: tuple[str, ...] = DEFAULT_WORKER_NETWORKS) -> None:
        self.entries = tuple(entries)
        self._nets = []
        self._names = set()
        for e in entries:
            try:
                self._nets.append(ipaddress.ip_network(e, strict=False))
            except ValueError:
                self._names.add(e.lower())

    def refusal(self, endpoint: str) -> str | None:
        """Why ``endpoint`` is refused, or None."""
        try:
            parts = urlsplit(endpoint)
            host = parts.hostname
            parts.port  # noqa: B018 - raises ValueError on a port that is not a number in range
        except ValueError as e:
            return f"endpoint {endpoint[:200]!r} is not a URL ({e})"
        if parts.scheme not in ("http", "https") or not host:
            return f"endpoint {endpoint[:200]!r} is not an http(s) URL with a host"
        # scheme://host[:port] and nothing else: the router appends the path itself, and a path,
        # query, fragment or user of the registration's choosing would steer its calls (with
        # the worker's bearer) to any route of the allowed hosts.
        if parts.path or parts.query or parts.fragment or "?" in endpoint or "#" in endpoint \
                or parts.username is not None or parts.password is not None:
            return f"endpoint {endpoint[:200]!r} must be scheme://host[:port] only (no user, path, query or fragment)"
        try:
            addr = ipaddress.ip_address(host)
        except ValueError:
            return None if host.lower() in self._names else (
                f"endpoint host {host!r} is not in the worker allowlist {list(self.entries)}")
        if any(addr in n for n in self._nets):
            return None
        return f"endpoint address {host} is not in the worker allowlist {list(self.entries)}"


class RouterView:
    def __init__(self, hash_algo: str, block_size: int, allowlist: EndpointAllowlist | None = None, *,
                 index: KvIndex | None = None) -> None:
        """``index``: an empty index of ``hash_algo`` and ``block_size`` to fold into (None: the
        native one; the differential tests pass the oracle's)."""
        self.index: KvIndex = NativePrefixIndex(hash_algo, block_size) if index is None else index
        self.allowlist = allowlist or EndpointAllowlist()
        self.workers: dict[str, WorkerState] = {}
        #: What the log said of each worker's incarnations: which registration is new, which
        #: incarnation is gone (common/fleet.py, the one fold every view shares).
        self.fleet = Fleet()
        self.positions: dict[tuple[str, int], int] = {}
        self.last_ts_ms: dict[tuple[str, int], int] = {}
        self.applied = 0
        #: (topic, partition) -> "@topic:partition", the index's producer suffix.
        self._suffixes: dict[tuple[str, int], str] = {}

    @property
    def hash_algo(self) -> str:
        return self.index.hash_algo

    @property
    def block_size(self) -> int:
        return self.index.block_size

    # -- folding ----------------------------------------------------------------------------

    def apply(self, env: Envelope[Event], topic: str, partition: int, offset: int, ts_ms: int = 0) -> Applied:
        """Fold one record. Raises ``IndexRejected`` for events the caller must dead-letter
        (the position still advances: a poison record is never re-read)."""
        tp = (topic, partition)
        self.positions[tp] = offset + 1
        if ts_ms:
            self.last_ts_ms[tp] = ts_ms
        self.applied += 1
        outcome = self.index.apply(f"{env.producer}@{topic}:{partition}", env.epoch, env.seq, env.data)
        if outcome in (ApplyOutcome.DUPLICATE, ApplyOutcome.FENCED):
            return Applied(outcome.value)
        self._fold_worker(env)
        return Applied(outcome.value, getattr(env.data, "worker_id", None))

    def apply_record(self, value: bytes, topic: str, partition: int, offset: int, ts_ms: int,
                     codec: EventCodec) -> Applied:
        """Fold one record from its value bytes; the same fold as ``apply(codec.decode(value))``.

        KV envelopes go straight to the native index's decoder (no Python objects per event);
        records it does not take are decoded by ``codec``. Either way ``codec`` checks first that
        the record's owner signed it (when it has a verifier). Raises ``SchemaError`` for a record
        the codec cannot decode or that is forged (nothing changed: the caller advances and dead-letters) and
        ``IndexRejected`` like ``apply`` (the position has advanced).
        """
        codec.check_owner(value)  # the index's byte path does not verify signatures
        tp = (topic, partition)
        try:
            outcome = self.index.apply_bytes(value, self._suffix(tp))
        except IndexRejected:
            self._advance(tp, offset, ts_ms)
            raise
        if outcome is not None:
            self._advance(tp, offset, ts_ms)
            if outcome is ApplyOutcome.DUPLICATE or outcome is ApplyOutcome.FENCED:
                return Applied(outcome.value)
            return Applied(outcome.value, self.index.last_worker())
        return self.apply(codec.decode(value), topic, partition, offset, ts_ms)

    def apply_run(self, batch: RecordBatch, start: int, codec: EventCodec) -> tuple[int, IndexRejected | None]:
        """Fold ``batch`` (one partition's records) from record ``start`` on, for as long as the
        native index takes the records whole (kv envelopes, each verified as its owner's when
        ``codec`` verifies); the same fold as ``apply_record`` of each. Returns ``(end,
        rejected)`` as :meth:`NativePrefixIndex.apply_run`: record ``end`` is left to
        ``apply_record`` unless ``rejected`` says it was folded and refused (the position has
        advanced past it). The oracle index (tests) takes none."""
        tp = (batch.topic, batch.partition)
        native_verifier = codec.verifier.native() if codec.verifier is not None else None
        end, rejected = self.index.apply_run(batch.values, start, self._suffix(tp), native_verifier)
        last = end if rejected is not None else end - 1
        if last >= start:
            self.positions[tp] = batch.offsets[last] + 1
            ts = batch.ts_ms
            for k in range(last, start - 1, -1):  # ``apply``'s rule: the last record with a time
                if ts[k]:
                    self.last_ts_ms[tp] = ts[k]
                    break
            self.applied += last - start + 1
        return end, rejected

    def _suffix(self, tp: tuple[str, int]) -> str:
        suffix = self._suffixes.get(tp)
        if suffix is None:
            suffix = self._suffixes[tp] = f"@{tp[0]}:{tp[1]}"
        return suffix

    def _advance(self, tp: tuple[str, int], offset: int, ts_ms: int) -> None:
        self.positions[tp] = offset + 1
        if ts_ms:
            self.last_ts_ms[tp] = ts_ms
        self.applied += 1

    def _fold_worker(self, env: Envelope[Event]) -> None:
        handler = _WORKER_HANDLERS.get(type(env.data))
        if handler is not None:
            handler(self, env)

    def _current(self, env: Envelope[Event]) -> WorkerState | None:
        """The incarnation an event is about, if it is the one registered: an older one's news
        is stale, and a newer one is not routable before its registration is folded."""
        cur = self.workers.get(env.data.worker_id)  # type: ignore[attr-defined]
        return cur if cur is not None and env.epoch == cur.epoch else None

    def _registered(self, env: Envelope[Event]) -> None:
        if not self.fleet.admits(env):
            return  # a copy of a registration already folded, or an older incarnation's
        why = self.allowlist.refusal(env.data.endpoint)  # type: ignore[attr-defined]
        if why is not None:  # the position has advanced: dead-lettered, never re-read
            raise IndexRejected("endpoint_not_allowed", f"worker {env.data.worker_id!r}: {why}")  # type: ignore[attr-defined]
        ch = self.fleet.fold(env)
        reg = ch.registration
        self.workers[reg.worker_id] = WorkerState(
            worker_id=reg.worker_id, epoch=reg.epoch, role=reg.role, pool=reg.pool, endpoint=reg.endpoint,
            model=reg.model, block_size=reg.block_size, capacity=reg.capacity, registered_at_ns=reg.registered_at_ns,
            state=ch.state)

    def _load_reported(self, env: Envelope[Event]) -> None:
        cur = self._current(env)
        if cur is None or env.occurred_at_ns <= cur.reported_at_ns:
            return  # a report older than the one folded (a copy, or one replayed elsewhere)
        ev: WorkerLoadReported = env.data  # type: ignore[assignment]
        cur.running, cur.waiting = ev.running, ev.waiting
        cur.queued_prefill_tokens = ev.queued_prefill_tokens
        cur.active_decode_blocks = ev.active_decode_blocks
        cur.tier_usage = dict(ev.tier_usage)
        cur.reported_at_ns = env.occurred_at_ns

    def _lifecycle_event(self, env: Envelope[Event]) -> None:
        """``WorkerDraining`` / ``WorkerDeregistered``: the registered incarnation's state is what
        the fleet says (a deregistration of it or of a newer one: gone for good)."""
        ch = self.fleet.fold(env)
        cur = self.workers.get(ch.worker_id)
        if cur is not None:
            cur.state = ch.after.state(cur.epoch)

    # -- queries ----------------------------------------------------------------------------

    def matches(self, hashes) -> dict[str, Match]:
        """Per worker id (DP rank 0 and the best rank merged), the matched prefix."""
        out: dict[str, Match] = {}
        for rank, m in self.index.find_matches(hashes).items():
            prev = out.get(rank.worker_id)
            if prev is None or m.depth > prev.depth:
                out[rank.worker_id] = m
        return out

    def routable(self, role: str | None = None) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.routable and (role is None or w.role == role)]

    # -- the decision's inputs (``control_plane.router.inputs.CandidateSource``) --------------

    def candidates(self, role: str) -> list[WorkerLoad]:
        """The routable workers of ``role`` as a decision sees them (registry + last report)."""
        return [WorkerLoad(worker_id=w.worker_id, role=w.role, queued_prefill_tokens=w.queued_prefill_tokens,
                           active_decode_blocks=w.active_decode_blocks, inflight_requests=w.running + w.waiting,
                           kv_capacity_blocks=w.device_capacity_blocks)
                for w in self.workers.values() if w.routable and w.role == role]

    def overlaps(self, hashes) -> dict[str, WorkerOverlap]:
        """The index's match per worker, in the decision's terms."""
        return {wid: WorkerOverlap.from_tiers(m.by_tier, stale=m.stale) for wid, m in self.matches(hashes).items()}

    def stale_workers(self) -> list[str]:
        """Registered workers (not gone) whose index entries may be out of date: the ones whose
        staleness can touch a decision. A stray KV event of a worker that never registered (or
        has gone) is in the index, flagged, but never a candidate, so it does not make the view
        DEGRADED."""
        flagged = self.index.stale_workers()  # read per decision (its health): usually empty
        if not flagged:
            return []
        return sorted({r.worker_id for r in flagged
                       if (st := self.workers.get(r.worker_id)) is not None and st.state != "gone"})

    # -- checkpoints ------------------------------------------------------------------------

    def snapshot(self) -> bytes:
        snap = _Snapshot(
            format=SNAPSHOT_FORMAT, hash_algo=self.hash_algo, block_size=self.block_size,
            index=self.index.snapshot(), workers=list(self.workers.values()),
            positions=[(t, p, o) for (t, p), o in sorted(self.positions.items())],
            last_ts_ms=[(t, p, o) for (t, p), o in sorted(self.last_ts_ms.items())],
            applied=self.applied, lifecycles=dict(self.fleet.by_worker))
        return msgspec.msgpack.encode(snap)

    @classmethod
    def restore(cls, data: bytes, allowlist: EndpointAllowlist | None = None) -> RouterView:
        snap = msgspec.msgpack.decode(data, type=_Snapshot)
        if snap.format != SNAPSHOT_FORMAT:
            raise ValueError(f"router snapshot format {snap.format} not supported (want {SNAPSHOT_FORMAT})")
        view = cls(snap.hash_algo, snap.block_size, allowlist)
        view.index = NativePrefixIndex.restore(snap.index)
        view.workers = {w.worker_id: w for w in snap.workers}
        view.positions = {(t, p): o for t, p, o in snap.positions}
        view.last_ts_ms = {(t, p): o for t, p, o in snap.last_ts_ms}
        view.applied = snap.applied
        view.fleet = Fleet(snap.lifecycles or {w.worker_id: Fleet.of_state(w.epoch, w.state) for w in snap.workers})
        return view

    def digest(self) -> str:
        """A stable fingerprint of the folded state (index residency, stale flags, workers),
        independent of fold order: equal digests mean equal views."""
        import hashlib

        d = self.as_dict()
        canon = msgspec.json.encode(_canonical(d), order="sorted")
        return hashlib.sha256(canon).hexdigest()

    def as_dict(self) -> dict:
        """Comparable form (tests compare a live view with the oracle fold of the log)."""
        return {"index": self.index.as_dict(),
                "workers": {k: msgspec.to_builtins(v) for k, v in sorted(self.workers.items())}}


#: The registry's fold: one handler per worker lifecycle event (the rest only feed the index).
_WORKER_HANDLERS = {
    WorkerRegistered: RouterView._registered,
    WorkerLoadReported: RouterView._load_reported,
    WorkerDraining: RouterView._lifecycle_event,
    WorkerDeregistered: RouterView._lifecycle_event,
}


def _canonical(x):
    if isinstance(x, dict):
        return sorted(([_canonical(k), _canonical(v)] for k, v in x.items()), key=repr)
    if isinstance(x, (set, frozenset)):
        return sorted((_canonical(v) for v in x), key=repr)
    if isinstance(x, (list, tuple)):
        return [_canonical(v) for v in x]
    return x


__all__ = ["RouterView", "WorkerState", "Applied", "WorkerRank", "WorkerId"]
