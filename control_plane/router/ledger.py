"""The router's own account of what it has sent where and not yet seen finish.

Worker load reports and KV events lag a routing decision by tens of milliseconds to seconds.
Without its own account, a router that receives a burst of identical prompts sees the same
empty cluster for every one of them and makes the same choice N times. The ledger closes that
gap with two things per routed request, both kept until the request completes (or its entry
expires, the safety net for a lost completion):

* **added load**: the prefill tokens the chosen worker must still compute for it (dropped at
  ``prefill_done``) and the KV blocks it will hold (dropped at ``complete``);
* **speculative overlap**: the prompt's block hashes, which the worker is about to hold. They
  stay valid while the request runs because an engine cannot evict blocks in use. Once the
  request completes the blocks may be evicted, and the prefix index (fed by the worker's real KV
  events) is the only authority again.

Blocks shared by concurrent requests on one worker are stored once by the engine, so the ledger
counts hashed blocks once per worker (a refcount per hash) and only the unhashed remainder (the
partial last prompt block and the output) per request. That is also what makes the speculative
lookup cheap: every entry holds a whole hash chain from the root, so a worker's hash set is
prefix-closed, membership along a query chain is monotone, and the matched depth is found by a
binary search (O(log n) set lookups) instead of a walk.

How the two interact in a decision: ``docs/routing-cost.md`` (a worked example).

The per-worker accounts (the load sums and the refcounted hashes) are an
:class:`~control_plane.router.ports.InflightAccounts`: ``switchyard_native.InflightAccounts``
(``native/src/inflight.rs``). They hold ``u64`` hashes and ``i64`` counters; handed anything
else they decline and change nothing, and the ledger raises :class:`InvalidRoutingInput`. The
pure-Python executable specification of the accounts is the differential oracle
``tests/oracles/ledger.py`` (``tests/unit/test_native_ledger.py`` folds random operation
sequences through both and requires the same views).

The ledger is plain mutable state owned by one router and passed explicitly; it never reads a
clock (``now`` is an argument). ``decide`` only reads it, through :class:`InflightView`, so a
replay can rebuild it by folding the recorded events and re-run any decision.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec
import switchyard_native

from control_plane.router.admission import PromiseMargin
from control_plane.router.errors import InvalidRoutingInput
from control_plane.router.pairs import PairFit
from control_plane.router.ports import NO_INFLIGHT, InflightAccounts, InflightLoad, InflightView
from control_plane.router.ttft import queue_done
from control_plane.router.ttft_fit import TtftFit
from control_plane.router.sessions import SessionTable
from schemas.envelope import Envelope
from schemas.events import (
    Event,
    FirstToken,
    PrefillCompleted,
    RequestAdmitted,
    RequestCompleted,
    RequestFailed,
    RequestRejected,
    RequestRouted,
    TtftModel,
)
from schemas.types import BlockHash, RequestId, RequestPhase, RoutingMode, WorkerId, WorkerRole


@dataclass(slots=True)
class _Entry:
    hashes: tuple[BlockHash, ...]
    prefill_tokens: int
    #: Blocks not covered by ``hashes`` (partial last block, output); counted per request.
    extra_blocks: int
    expires_at: float
    #: Distinguishes a re-added entry from the one a stale heap item points to.
    seq: int
    #: When it was routed (the decision's ``now``): the TTFT prediction drains the queue from it.
    at: float = 0.0


class InflightLedger:
    """Speculative overlap and added load per worker, keyed by (request, worker).

    A request has one entry per worker it was routed to: one in aggregated serving, two in
    disaggregated serving (its prefill worker and its decode worker). Every mutation is
    idempotent on repeated input (events arrive at least once).
    """

    __slots__ = ("_accounts", "_by_request", "_by_worker", "_entries", "_expiry", "_seq", "_prefill_done_at")

    def __init__(self, *, accounts: InflightAccounts | None = None) -> None:
        """``accounts``: empty per-worker accounts to keep (None: the native ones; the
        differential tests pass the oracle's)."""
        self._entries: dict[tuple[RequestId, WorkerId], _Entry] = {}
        #: Workers each request has entries on, in the order they were added.
        self._by_request: dict[RequestId, list[WorkerId]] = {}
        #: Each worker's entries, in the order they were added.
        self._by_worker: dict[WorkerId, dict[RequestId, _Entry]] = {}
        self._accounts: InflightAccounts = _new_accounts() if accounts is None else accounts
        self._expiry: list[tuple[float, int, RequestId, WorkerId]] = []
        self._seq = 0
        #: Worker -> when the last of its prefills this router saw end ended (``prefill_done``
        #: with a time): the worker is busy with the next of its queue from then on.
        self._prefill_done_at: dict[WorkerId, float] = {}

    # -- mutations ---------------------------------------------------------------------------

    def add(
        self,
        request_id: RequestId,
        worker: WorkerId,
        hashes: Sequence[BlockHash],
        prefill_tokens: int,
        decode_blocks: int,
        now: float,
        ttl: float,
    ) -> None:
        """Record that ``request_id`` was routed to ``worker`` at ``now``.

        ``hashes`` is the prompt's whole hash chain from the root (``RoutingRequest.block_hashes``);
        ``prefill_tokens`` what the worker must compute for it (``Decision.prefill_tokens``);
        ``decode_blocks`` every block it will hold, prompt and output (``Decision.decode_blocks``).
        Re-adding the same (request, worker) replaces the old entry (a retried attempt).
        Raises :class:`InvalidRoutingInput`, recording no entry for the pair, for a hash that is
        not a ``u64`` or a count beyond ``i64`` (what the accounts cannot hold exactly).
        """
        if prefill_tokens < 0 or decode_blocks < 0:
            raise InvalidRoutingInput(
                f"prefill_tokens={prefill_tokens} and decode_blocks={decode_blocks} must be >= 0"
            )
        if not ttl > 0:
            raise InvalidRoutingInput(f"ttl={ttl} must be > 0, or the entry could never expire")
        hashes = tuple(hashes)
        if decode_blocks < len(hashes):
            raise InvalidRoutingInput(
                f"decode_blocks={decode_blocks} < {len(hashes)} prompt block hashes: decode_blocks "
                "counts every block the request holds, its hashed prompt blocks included"
            )
        key = (request_id, worker)
        if key in self._entries:
            self._remove(key)
        extra_blocks = decode_blocks - len(hashes)
        if not self._accounts.add(worker, hashes, prefill_tokens, extra_blocks):
            raise _declined(f"request {request_id} on {worker}", hashes)
        self._seq += 1
        entry = _Entry(hashes, prefill_tokens, extra_blocks, now + ttl, self._seq, now)
        self._entries[key] = entry
        self._by_request.setdefault(request_id, []).append(worker)
        self._by_worker.setdefault(worker, {})[request_id] = entry
        heapq.heappush(self._expiry, (entry.expires_at, entry.seq, request_id, worker))
        if len(self._expiry) > 2 * len(self._entries) + 1024:
            # Completed entries leave their heap items behind until they would have expired;
            # rebuild from the live entries so the heap stays O(entries), amortised O(1) per add.
            self._expiry = [
                (e.expires_at, e.seq, rid, wid) for (rid, wid), e in self._entries.items()
            ]
            heapq.heapify(self._expiry)

    def prefill_done(self, request_id: RequestId, worker: WorkerId | None = None, at: float | None = None
                     ) -> list[tuple[WorkerId, float, int]]:
        """The prompt of ``request_id`` is computed (on ``worker``, or wherever it went), at
        ``at`` (s; None: not known).

        Its prefill tokens stop counting; its blocks and speculative overlap stay until
        ``complete``. Unknown ids are ignored. Returns, with ``at``, for each worker where it
        still had tokens to compute: (worker, busy from, tokens): the worker computed them from
        the later of its routing and the end of the last prefill seen end there, until ``at``.
        """
        out: list[tuple[WorkerId, float, int]] = []
        for key in self._keys(request_id, worker):
            entry = self._entries[key]
            if at is not None and entry.prefill_tokens > 0:
                done = self._prefill_done_at
                prev = done.get(key[1], -math.inf)
                out.append((key[1], min(max(entry.at, prev), at), entry.prefill_tokens))
                done[key[1]] = max(prev, at)
            if not self._accounts.prefill_done(key[1], entry.prefill_tokens):
                raise _declined(f"prefill of request {request_id} on {key[1]}", ())
            entry.prefill_tokens = 0
        return out

    def complete(self, request_id: RequestId, worker: WorkerId | None = None) -> None:
        """``request_id`` finished, failed or left ``worker`` (all its workers when None).

        In disaggregated serving call it for the prefill worker once the KV has been handed off.
        Unknown ids are ignored.
        """
        for key in self._keys(request_id, worker):
            self._remove(key)

    def expire(self, now: float) -> tuple[tuple[RequestId, WorkerId], ...]:
        """Drop entries whose expiry is <= ``now``; return their keys, oldest expiry first."""
        expired: list[tuple[RequestId, WorkerId]] = []
        heap = self._expiry
        while heap and heap[0][0] <= now:
            _, seq, request_id, worker = heapq.heappop(heap)
            key = (request_id, worker)
            entry = self._entries.get(key)
            if entry is not None and entry.seq == seq:
                self._remove(key)
                expired.append(key)
        return tuple(expired)

    def drop_worker(self, worker: WorkerId) -> None:
        """Forget everything sent to ``worker`` (it deregistered or restarted: its KV is gone)."""
        for key in [k for k in self._entries if k[1] == worker]:
            self._remove(key)
        self._prefill_done_at.pop(worker, None)

    # -- queries (the InflightView protocol) -------------------------------------------------

    def load_for(self, worker: WorkerId) -> InflightLoad:
        load = self._accounts.load(worker)
        return NO_INFLIGHT if load is None else load

    def speculative_overlap(self, worker: WorkerId, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of ``hashes`` (a chain from the root) in-flight requests on
        ``worker`` hold."""
        hashes = hashes if type(hashes) is tuple else tuple(hashes)
        depth = self._accounts.overlap(worker, hashes)
        if depth is None:
            raise _declined(f"overlap query on {worker}", hashes)
        return depth

    def view(self, hashes: Sequence[BlockHash]) -> Mapping[WorkerId, InflightLoad]:
        """``load_for`` plus ``speculative_overlap(hashes)`` of every worker with requests in
        flight, in one pass (what :func:`~control_plane.router.decision.decide` reads): a
        read-only ``switchyard_native.InflightView`` (the native decision reads its numbers
        without an object per worker), iterating in the order the workers' accounts opened."""
        hashes = hashes if type(hashes) is tuple else tuple(hashes)
        out = self._accounts.view(hashes)
        if out is None:
            raise _declined("view query", hashes)
        return out

    def pending_prefills(self, worker: WorkerId) -> list[tuple[float, int]]:
        """(routed at, prefill tokens) of the requests on ``worker`` whose prefill is not done,
        in the order they were added (the fold's order, the same live and in replay): the queue
        ``ttft.queue_done`` drains."""
        entries = self._by_worker.get(worker)
        if not entries:
            return []
        return [(e.at, e.prefill_tokens) for e in entries.values() if e.prefill_tokens > 0]

    def prefill_done_at(self, worker: WorkerId) -> float:
        """When the last prefill on ``worker`` that this router saw end ended (s; -inf: none
        seen): ``ttft.queue_done`` starts the queue's drain no earlier."""
        return self._prefill_done_at.get(worker, -math.inf)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_request

    # -- internals ---------------------------------------------------------------------------

    def _keys(
        self, request_id: RequestId, worker: WorkerId | None
    ) -> list[tuple[RequestId, WorkerId]]:
        if worker is not None:
            key = (request_id, worker)
            return [key] if key in self._entries else []
        return [(request_id, w) for w in self._by_request.get(request_id, ())]

    def _remove(self, key: tuple[RequestId, WorkerId]) -> None:
        entry = self._entries.pop(key)
        mine = self._by_worker[key[1]]
        del mine[key[0]]
        if not mine:
            del self._by_worker[key[1]]
        workers = self._by_request[key[0]]
        workers.remove(key[1])
        if not workers:
            del self._by_request[key[0]]
        if not self._accounts.remove(key[1], entry.hashes, entry.prefill_tokens, entry.extra_blocks):
            raise _declined(f"release of request {key[0]} on {key[1]}", ())


def _declined(what: str, hashes: Sequence[BlockHash]) -> InvalidRoutingInput:
    """The accounts refused an input they cannot hold exactly (they changed nothing)."""
    bad = next((h for h in hashes if type(h) is not int or not 0 <= h < 1 << 64), None)
    if bad is not None:
        return InvalidRoutingInput(f"{what}: block hash {bad!r} is not a u64")
    return InvalidRoutingInput(f"{what}: a token or block count beyond i64")


def _new_accounts() -> InflightAccounts:
    # Its views are read-only mappings like dicts (idempotent).
    Mapping.register(switchyard_native.InflightView)
    return switchyard_native.InflightAccounts(InflightLoad)


# ----------------------------------------------------------------------------------------------
# The fold: the router's in-process state from the events it publishes
# ----------------------------------------------------------------------------------------------


class RouterLedger:
    """Everything a router keeps between decisions, as a fold of the events it publishes.

    The live router records each fact (``RequestAdmitted``, ``RequestRouted``, its own
    ``PrefillCompleted``, ``RequestCompleted`` / ``RequestFailed`` / ``RequestRejected``) and
    then applies the stamped envelope here; replay and what-if apply the same envelopes read back
    from the log (one router incarnation's events, merged by ``occurred_at_ns``, which a
    producer stamps strictly increasing); the simulator applies what its virtual router
    records. So the live state, the replayed state and the simulated state are one function of
    one event sequence, not three reconstructions kept in step by hand.

    State: the in-flight ledger (:class:`InflightLedger`), the round-robin cursor per worker
    role, and, per open request, its prompt hashes (from ``RequestAdmitted``) and the worker of
    its prefill phase. The one mutation that is not an event, :meth:`prepare`, is what every
    decision does first: expire entries at the decision's ``now`` and, for a decode phase,
    release the request's prefill entry (its KV has been handed off). ``RequestRouted`` repeats
    it with its recorded ``decided_at_s``, so folding the log needs no extra input.
    """

    __slots__ = ("default_ttl_s", "inflight", "rr_cursor", "ttft_fit", "margin", "pair_fit", "_block_size", "_bound_zero",
                 "_handlers", "_hashes", "_paired", "_pair_pending", "_decode_hop",
                 "_prefill_worker", "_queued_ms", "_prompt_tokens", "sessions")

    def __init__(self, default_ttl_s: float = 600.0) -> None:
        #: Lifetime of an entry whose ``RequestRouted`` predates ``inflight_ttl_s``.
        self.default_ttl_s = default_ttl_s
        self.inflight = InflightLedger()
        #: Worker role -> the last worker round robin chose for it.
        self.rr_cursor: dict[str, WorkerId] = {}
        self._hashes: dict[RequestId, tuple[BlockHash, ...]] = {}
        self._block_size: dict[RequestId, int] = {}
        self._prefill_worker: dict[RequestId, WorkerId] = {}
        #: The TTFT model fitted from this router's decisions and completions (``ttft_fit.py``).
        self.ttft_fit = TtftFit()
        #: Worker -> (the fit's model, it bound with nothing of the queue done).
        self._bound_zero: dict[WorkerId, tuple[TtftModel, TtftModel]] = {}
        #: How far this router's recent predictions fell short (the TTFT budget's margin).
        self.margin = PromiseMargin()
        #: P/D pairs (``pairs.py``): the hand-off and decode ITL fits, each prefill decision's
        #: decode worker, and each decode decision's (prefill worker, decode worker, decided at,
        #: prompt tokens, its row's decode blocks) until its first token and its completion.
        #: Folded whether or not ``RouterConfig.pd_pairs`` is on: the ledger is a fold of the
        #: router's own events alone (replay rebuilds it without the config in force), and a
        #: config that turns pairs on finds the fits warm. Two dict updates per P/D request.
        self.pair_fit = PairFit()
        self._paired: dict[RequestId, WorkerId] = {}
        #: Requests paired with a decode worker and not handed off yet: (worker, blocks), and the
        #: blocks per worker (the load the pairs add there before any decode decision does).
        self._pair_pending: dict[RequestId, tuple[WorkerId, int]] = {}
        self._decode_hop: dict[RequestId, tuple[WorkerId | None, WorkerId, float, int, int]] = {}
        self._queued_ms: dict[RequestId, float] = {}
        self._prompt_tokens: dict[RequestId, int] = {}
        #: Session -> the worker of its last routed phase that prefills (``sessions.py``).
        self.sessions = SessionTable()
        self._handlers = {
            RequestAdmitted: self._admitted,
            RequestRouted: self._routed,
            PrefillCompleted: self._prefill_completed,
            FirstToken: self._first_token,
            RequestCompleted: self._completed,
            RequestFailed: self._failed,
            RequestRejected: self._ended,
        }

    # -- the fold ----------------------------------------------------------------------------

    def apply(self, env: Envelope[Event]) -> None:
        """Fold one of this router's own events (others are ignored)."""
        handler = self._handlers.get(type(env.data))
        if handler is not None:
            handler(env)

    def prepare(self, request_id: RequestId, phase: RequestPhase, now: float) -> None:
        """What a decision does before it reads the ledger (idempotent)."""
        self.ttft_fit.expire(now)
        self.margin.expire(now)
        self.pair_fit.expire(now)
        for rid, _worker in self.inflight.expire(now):
            if rid not in self.inflight:  # its last entry lapsed: its end was never recorded
                self._forget(rid, now)
        if phase is RequestPhase.DECODE:
            worker = self._prefill_worker.get(request_id)
            if worker is not None:
                # Its KV is handed off: computed.
                for w, since, tokens in self.inflight.prefill_done(request_id, worker, now):
                    self.ttft_fit.prefilled(w, since, now, tokens)
                self.inflight.complete(request_id, worker)

    def _admitted(self, env: Envelope[Event]) -> None:
        ev: RequestAdmitted = env.data  # type: ignore[assignment]
        self._hashes[ev.request_id] = tuple(ev.block_hashes)
        self._block_size[ev.request_id] = ev.block_size
        self._prompt_tokens[ev.request_id] = ev.prompt_tokens
        self.margin.arrived(env.occurred_at_ns / 1e9)

    def _routed(self, env: Envelope[Event]) -> None:
        ev: RequestRouted = env.data  # type: ignore[assignment]
        rid = ev.request_id
        now = ev.decided_at_s or env.occurred_at_ns / 1e9
        self.prepare(rid, ev.phase, now)
        if ev.mode is RoutingMode.ROUND_ROBIN:
            self.rr_cursor[role_of_phase(ev.phase)] = ev.worker_id
        self._queued_ms[rid] = max(self._queued_ms.get(rid, 0.0), ev.queued_ms)
        if ev.session and ev.phase is not RequestPhase.DECODE:
            self.sessions.routed(ev.session, ev.worker_id, now)
        if ev.phase is RequestPhase.PREFILL and ev.paired_worker_id:
            self._paired[rid] = ev.paired_worker_id
            self._release_pair(rid)  # a retried prefill pairs again
            blocks = ev.inflight_blocks if ev.inflight_blocks is not None else 0
            self._pair_pending[rid] = (ev.paired_worker_id, blocks)
        elif ev.phase is RequestPhase.DECODE:
            self._release_pair(rid)
            row = next((s for s in ev.scores if s.worker_id == ev.worker_id), None)
            if row is not None:
                self._decode_hop[rid] = (self._prefill_worker.get(rid), ev.worker_id, now,
                                         self._prompt_tokens.get(rid, 0), int(row.decode_blocks))
        if ev.phase is not RequestPhase.DECODE and rid in self._prompt_tokens:
            row = next((s for s in ev.scores if s.worker_id == ev.worker_id), None)
            m = ev.ttft_model
            done = (m.queue_done_tokens or 0) if m is not None else 0
            # A decision whose model had no decode term (before it existed) observes none; one
            # whose model had no step-squared cost observes the old features.
            self.ttft_fit.routed(rid, ev.worker_id, ev.phase, row, self._prompt_tokens[rid],
                                 self._block_size.get(rid, 0), now, done,
                                 m is not None and m.ms_per_decode_block_step is not None,
                                 m is not None and m.ms_per_step_token_sq is not None,
                                 m.chunk_tokens if m is not None else None,
                                 m.queue_tokens_per_ms if m is not None else None,
                                 (m.busy_steps or 0) if m is not None else 0)
            self.margin.routed(rid, ev.predicted_ttft_ms, now, ev.worker_id)
        hashes = self._hashes.get(rid)
        if hashes is None:
            return  # admitted before the folded range: its entry cannot be rebuilt
        prefill, blocks = ev.inflight_prefill_tokens, ev.inflight_blocks
        if prefill is None or blocks is None:
            prefill, blocks = _entry_from_row(ev, self._block_size.get(rid, 0), len(hashes))
        self.inflight.add(rid, ev.worker_id, hashes, prefill, blocks, now,
                          ev.inflight_ttl_s or self.default_ttl_s)
        if ev.phase is RequestPhase.PREFILL:
            self._prefill_worker[rid] = ev.worker_id

    def _prefill_completed(self, env: Envelope[Event]) -> None:
        at = env.occurred_at_ns / 1e9
        for w, since, tokens in self.inflight.prefill_done(env.data.request_id, at=at):  # type: ignore[attr-defined]
            self.ttft_fit.prefilled(w, since, at, tokens)
        # The router records it at the first token (aggregated serving; a prefill worker's,
        # in disaggregated serving, is not this router's event).
        self.margin.first_token(env.data.request_id, env.occurred_at_ns / 1e9)  # type: ignore[attr-defined]

    def _first_token(self, env: Envelope[Event]) -> None:
        rid, at = env.data.request_id, env.occurred_at_ns / 1e9  # type: ignore[attr-defined]
        self.margin.first_token(rid, at)
        hop = self._decode_hop.get(rid)
        if hop is not None and hop[0] is not None:  # the hand-off: decode decision to first token
            self.pair_fit.observe_hop(hop[0], hop[1], hop[3], (at - hop[2]) * 1000.0, at)
            self._decode_hop[rid] = (None, *hop[1:])

    def _failed(self, env: Envelope[Event]) -> None:
        ev: RequestFailed = env.data  # type: ignore[assignment]
        if ev.code == "worker_unreachable" and ev.worker_id:
            # A refused connection: that incarnation's KV is gone with it.
            self.inflight.drop_worker(ev.worker_id)
        self.inflight.complete(ev.request_id)
        if not ev.retried:
            self._forget(ev.request_id, env.occurred_at_ns / 1e9)

    def _completed(self, env: Envelope[Event]) -> None:
        ev: RequestCompleted = env.data  # type: ignore[assignment]
        hop = self._decode_hop.get(ev.request_id)
        if hop is not None and ev.worker_id == hop[1]:
            self.pair_fit.observe_itl(hop[1], hop[4], ev.itl_mean_ms, env.occurred_at_ns / 1e9)
        # The TTFT after the router's own queueing, as reconcile reads it.
        self.ttft_fit.completed(ev.request_id, ev.ttft_ms - self._queued_ms.get(ev.request_id, 0.0))
        self.margin.completed(ev.request_id, ev.ttft_ms - self._queued_ms.get(ev.request_id, 0.0),
                              env.occurred_at_ns / 1e9)
        self._ended(env)

    def _ended(self, env: Envelope[Event]) -> None:
        rid = env.data.request_id  # type: ignore[attr-defined]
        self.inflight.complete(rid)
        self._forget(rid, env.occurred_at_ns / 1e9)

    def _forget(self, rid: RequestId, at_s: float) -> None:
        self._hashes.pop(rid, None)
        self._block_size.pop(rid, None)
        self._prefill_worker.pop(rid, None)
        self._paired.pop(rid, None)
        self._release_pair(rid)
        self._decode_hop.pop(rid, None)
        self._queued_ms.pop(rid, None)
        self._prompt_tokens.pop(rid, None)
        self.ttft_fit.forget(rid)
        self.margin.forget(rid, at_s)

    # -- reads -------------------------------------------------------------------------------

    def ttft_model(self, worker: WorkerId, now: float, engine_steps: bool = True) -> TtftModel:
        """``worker``'s TTFT model for a decision at ``now``: the fit's, with the tokens of the
        queue ahead the worker has computed by then (:func:`~.ttft.queue_done` over this
        router's in-flight prefills there, from the end of the last prefill it saw end there,
        at the rate the worker's prefills were seen to go, ``TtftFit.drain_rate``, which the
        model then carries; before any, at the model's, its steps slowed by the blocks they
        hold), and whether the worker is computing (``TtftModel.busy_steps``: 1 while this
        router has prefills there not seen end, or requests holding KV blocks there (decoding):
        the request waits for the step under way).
        ``engine_steps`` False: the model as a decision recorded before
        ``TtftModel.ms_per_step_token_sq`` existed had it (without the field, in steps of the
        prior's then; drained from each request's routing at the rate of prompt tokens alone),
        which replay re-derives such a decision with."""
        model = self.ttft_fit.model(worker)
        pending = self.inflight.pending_prefills(worker)
        if not engine_steps:
            model = msgspec.structs.replace(model, ms_per_step_token_sq=None, chunk_tokens=_CHUNK_BEFORE_STEPS)
            done = queue_done(pending, now, model) if pending else 0
            return msgspec.structs.replace(model, queue_done_tokens=done)
        if pending:
            rate = self.ttft_fit.drain_rate(worker)
            done = queue_done(pending, now, model, self.inflight.load_for(worker).decode_blocks,
                              self.inflight.prefill_done_at(worker), rate)
            return msgspec.structs.replace(model, queue_done_tokens=done, queue_tokens_per_ms=rate, busy_steps=1)
        rate = self.ttft_fit.drain_rate(worker)
        busy = 1 if self.inflight.load_for(worker).decode_blocks > 0 else 0
        if rate is not None or busy:
            return msgspec.structs.replace(model, queue_done_tokens=0, queue_tokens_per_ms=rate, busy_steps=busy)
        # Bound even at 0 (a recorded model without it was decided before the drain existed);
        # kept while the fit's model is the same object.
        zero = self._bound_zero.get(worker)
        if zero is None or zero[0] is not model:
            zero = self._bound_zero[worker] = (model, msgspec.structs.replace(model, queue_done_tokens=0, busy_steps=0))
        return zero[1]

    def _release_pair(self, rid: RequestId) -> None:
        self._pair_pending.pop(rid, None)

    def pair_pending(self) -> dict[WorkerId, int]:
        """Per decode worker, the KV blocks of the requests paired with it and not handed off
        yet (in worker id order): the load its pairs will add, which no decode decision has
        put in the in-flight ledger yet (without it a burst's prefill decisions all pair with
        the same least loaded decode worker)."""
        out: dict[WorkerId, int] = {}
        for w, b in self._pair_pending.values():
            out[w] = out.get(w, 0) + b
        return dict(sorted(out.items()))

    def paired(self, request_id: RequestId) -> WorkerId:
        """The decode worker ``request_id``'s prefill decision chose with it ("" when none)."""
        return self._paired.get(request_id, "")

    def view(self, hashes: Sequence[BlockHash]) -> Mapping[WorkerId, InflightLoad]:
        return self.inflight.view(hashes)

    def load_for(self, worker: WorkerId) -> InflightLoad:
        return self.inflight.load_for(worker)

    def __len__(self) -> int:
        """In-flight entries (one per request and worker)."""
        return len(self.inflight)

    def open_requests(self) -> int:
        """Requests admitted and not ended."""
        return len(self._hashes)


#: The step size the models had before they formed the engine's steps (the prior's then).
_CHUNK_BEFORE_STEPS = TtftModel().chunk_tokens


#: The worker role that serves each request phase (found by the phase or its value: a str enum).
_ROLE_OF_PHASE = {RequestPhase.PREFILL: WorkerRole.PREFILL.value, RequestPhase.DECODE: WorkerRole.DECODE.value,
                  RequestPhase.AGGREGATED: WorkerRole.AGGREGATED.value}


def role_of_phase(phase: RequestPhase | str) -> str:
    """The worker role that serves a request phase (a dict lookup: twice per decision, where
    the enum's constructor cost several microseconds)."""
    try:
        return _ROLE_OF_PHASE[phase]
    except (KeyError, TypeError):
        return _ROLE_OF_PHASE[RequestPhase(phase)]  # not a phase: RequestPhase's ValueError


def _entry_from_row(ev: RequestRouted, block_size: int, n_hashes: int) -> tuple[int, int]:
    """(prefill tokens, blocks) of a ``RequestRouted`` written before it recorded them, from the
    chosen worker's score row: ``decode_blocks = active + request_blocks - shared`` gives the
    request's blocks, and ``prefill_blocks = (queued + prompt) / block_size - overlap`` the
    tokens left to compute (``prefill_blocks * block_size - queued``; none when it was clipped
    at 0, or in the decode phase)."""
    row = next((s for s in ev.scores if s.worker_id == ev.worker_id), None)
    if row is None:
        return 0, n_hashes
    blocks = int(row.decode_blocks) - row.active_decode_blocks + row.speculative_overlap
    if ev.phase is RequestPhase.DECODE or row.prefill_blocks <= 0.0 or block_size <= 0:
        return 0, max(blocks, n_hashes)
    prefill = max(round(row.prefill_blocks * block_size - row.queued_prefill_tokens), 0)
    return prefill, max(blocks, n_hashes)
