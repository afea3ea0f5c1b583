"""The router's request path, independent of HTTP framing: admit, decide, record, proxy, retry.

One :class:`Router` per process. Its state is the :class:`RouterView` (folded from the log by
the log's tail on the same event loop) and its :class:`~control_plane.router.ledger.RouterLedger`
(in-flight ledger and round-robin cursor), which is a fold of the events this router publishes:
every fact goes through :meth:`Router._record`, which publishes it and applies the stamped
envelope, so replay rebuilds the same state by folding the same events. Every decision goes
through :mod:`control_plane.router.inputs` (inputs, seed, ``RequestRouted``), the path replay
and the simulator take too; what it was decided on (score table, config version, seed, view
position and state, ledger entry) is recorded in ``RequestRouted``.

Admission: before its first decision a request passes the router's own load
(:mod:`control_plane.router.loop_lag`: 503 ``router_overloaded`` while its event loop lags over
``RouterConfig.max_loop_lag_ms``), then the bounded FCFS queue of
:mod:`control_plane.router.admission` (429 when the queue is full, 503 after its timeout).

Failure handling: any worker failure before the first token reached the client (connection
refused or timed out, reset, read timeout, 5xx, a malformed answer) is recorded as
``RequestFailed(retried=True)`` and the request is routed again without that worker (at most
``max_attempts``). When no attempt is left, or no eligible worker, the client gets 503 with a
reason and Retry-After, and ``RequestFailed(retried=False)`` records why. After a token reached
the client, the stream ends with an error event and ``RequestFailed``; nothing ever hangs:
every read has a timeout.
"""

from __future__ import annotations

import logging
import statistics
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from control_plane.router.admission import (RULE, AdmissionConfig, AdmissionQueue, PoolLoad, QueueRefused,
                                            budget_detour, budget_terms, has_room, loop_lag_share_ms, over_budget)
from control_plane.router.config import RouterConfig
from control_plane.router.decision import Decision
from control_plane.router.errors import NoEligibleWorker
from control_plane.router.inputs import DecisionInputs, decision_inputs, execute, routed_event
from control_plane.router.ledger import RouterLedger
from control_plane.router.limits import new_request_id
from control_plane.router.loop_lag import LoopLag, overloaded
from control_plane.router.view import RouterView, WorkerState
from control_plane.router.worker_calls import (
    SSE_BAD,
    SSE_CHUNK,
    SSE_DONE,
    SSE_ERROR,
    CallFailed,
    HttpWorkerCalls,
    Unsendable,
    WorkerCalls,
    sse_events,
)
from control_plane.router.prompt import block_hashes, encode_json
from common.hashing import HashConfig
from common.log.sink import EventSink
from schemas.envelope import Envelope
from schemas.events import (
    AdmissionTerms,
    FirstToken,
    Event,
    PrefillCompleted,
    RequestAdmitted,
    RequestCompleted,
    RequestFailed,
    RequestRejected,
    RequestRouted,
)
from schemas.types import RequestPhase, WorkerRole

log = logging.getLogger(__name__)


class RouterRejected(Exception):
    """The request cannot be served (no eligible worker, bad input, admission). ``status`` is
    HTTP; ``retry_after_s`` becomes a Retry-After header. Whether its end is already on the log
    is the request's state (:attr:`Admission.end`), not the exception's."""

    def __init__(self, message: str, status: int = 503, code: str = "no_workers",
                 retry_after_s: int | None = None, admission: AdmissionTerms | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        #: The TTFT budget test's terms when it refused (recorded in ``RequestRejected``).
        self.admission = admission
        self.retry_after_s = retry_after_s if retry_after_s is not None else (1 if status in (429, 503) else None)


@dataclass
class Admission:
    request_id: str
    model: str
    #: The prompt's ids: a list, or the client's JSON array read natively (``PromptIds``).
    tokens: Sequence[int]
    hashes: list[int]
    max_tokens: int
    stream: bool
    endpoint: str
    received_at: float = field(default_factory=time.monotonic)
    #: When the router first held the request (monotonic; before its body was read and its
    #: prompt tokenized); what its TTFT budget counts as already spent. Defaults to ``received_at``.
    arrived_at: float | None = None
    #: Seconds spent in the admission queue.
    queued_s: float = 0.0
    #: The client's session id (``serving._session``; ``docs/sessions.md``), "" without one.
    session: str = ""
    #: Released by the admission queue and not routed yet (its tokens are counted there).
    granted: bool = False
    #: The event that ended the request (``RequestCompleted``, ``RequestFailed``,
    #: ``RequestRejected``), once :meth:`Router.end` recorded it; None while it is open.
    end: Event | None = None
    #: The client's own TTFT budget (ms, the ``x-ttft-budget-ms`` header), or None.
    ttft_budget_ms: float | None = None


@dataclass
class Chunk:
    """One token (or a final usage record) coming back from the worker."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Relayed:
    """A non-streaming request's answer, read to its end by the crate (``Reply.relay``): its
    text, finish reason and usage, and how many chunks carried it (``chunks``: every chunk read,
    a usage record's too)."""

    text: str
    finish_reason: str | None
    usage: dict | None
    chunks: int
    error: None = None


@dataclass(frozen=True, slots=True)
class _FirstTokenAt:
    """A relayed answer's first token came, at ``at`` (the crate's clock, ``time.monotonic()``'s)."""

    at: float


class WorkerFailed(Exception):
    """A worker failed this attempt; ``code`` says how (see :func:`_failure`). ``tokens_sent``:
    the token chunks a relayed answer had carried when it failed."""

    def __init__(self, code: str, detail: str, worker_id: str | None = None, tokens_sent: int | None = None) -> None:
        super().__init__(detail)
        self.code = code
        self.worker_id = worker_id
        self.tokens_sent = tokens_sent


#: The worker call's body: encoded once, straight to bytes (a 32K-token prompt is ~200 KB; a
#: prompt read natively is written as the bytes the client sent: control_plane/router/prompt.py).
_json = encode_json
#: A worker's JSON (an SSE event's data, a prefill answer), decoded without a str in between.
_decode = msgspec.json.decode

# Failures where the request never reached the worker: a prefill hold made for it is still there.
NEVER_REACHED = frozenset({"worker_unreachable", "connect_timeout"})


def _unsendable(e: Exception) -> RouterRejected | None:
    """The request itself could not be put on the wire (an illegal header or URL): the request's
    fault, not the worker's, so no worker is blamed or excluded and nothing is retried."""
    if isinstance(e, Unsendable):
        return RouterRejected(f"the request could not be sent to a worker: {e}", 400, "invalid_request")
    return None


def _failure(e: Exception, what: str, worker_id: str) -> WorkerFailed:
    """One code per way an HTTP call to a worker can fail (all are retried before a token): the
    transport's (:class:`~control_plane.router.worker_calls.CallFailed`: ``connect_timeout``,
    ``worker_unreachable``, ``timeout``, ``worker_lost``), or ``bad_response`` for an answer
    that is not what a worker sends."""
    if isinstance(e, CallFailed):
        code = e.code
    elif isinstance(e, OSError):
        code = "worker_lost"
    else:  # a body we could not parse
        code = "bad_response"
    return WorkerFailed(code, f"{what}: {type(e).__name__}: {e}".rstrip(": "), worker_id)


@dataclass
class Outcome:
    worker_id: str
    ttft_ms: float
    itls_ms: list[float]
    e2e_ms: float
    output_tokens: int
    cached_tokens: int
    finish_reason: str


class Router:
    def __init__(
        self,
        *,
        router_id: str,
        view: RouterView,
        producer: EventSink,
        config: RouterConfig,
        hash_config: HashConfig,
        health=None,  # () -> RouterHealth
        max_attempts: int = 3,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float = 60.0,
        metrics=None,
        admission: AdmissionConfig | None = None,
        workers: WorkerCalls | None = None,
        worker_credential: str | None = None,
        loop_lag: Callable[[], LoopLag] | None = None,
        others_waiting: Callable[[], int] | None = None,
    ) -> None:
        self.router_id = router_id
        self.view = view
        self.producer = producer
        self.config = config
        self.hash_config = hash_config
        #: In-flight ledger and round-robin cursors: the fold of this router's own events.
        self.ledger = RouterLedger(config.inflight_ttl_s)
        self.max_attempts = max_attempts
        self._health = health
        self.metrics = metrics
        #: The calls to workers (unit tests pass in-memory workers). Every call carries the
        #: bearer of the worker it calls, derived from the cluster's worker secret
        #: (``worker_credential``) when there is one: the workers' routes require it.
        self.workers = workers or HttpWorkerCalls(connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s,
                                                  credential=worker_credential)
        self.admission = AdmissionQueue(admission or AdmissionConfig(), self._has_room)
        #: This process's event-loop lag (the probe's current state); None: not measured.
        self.loop_lag = loop_lag
        #: The other replicas' requests waiting for a first token (``shared_gate.SharedWaiting``);
        #: None: not shared (admission rule 4 then counts this replica's alone).
        self.others_waiting = others_waiting

    async def close(self) -> None:
        await self.workers.close()

    def _record(self, payload: Event, request_id: str) -> Envelope[Event]:
        """Publish one fact of this router and fold it into its own state (the only way the
        ledger changes, so the live state is exactly the fold of what the log holds)."""
        env = self.producer.publish(payload, correlation_id=request_id)
        self.ledger.apply(env)
        return env

    # -- admission --------------------------------------------------------------------------

    def admit(self, *, request_id: str | None, model: str, tokens: Sequence[int], max_tokens: int,
              stream: bool, endpoint: str, client_request_id: str | None = None) -> Admission:
        """Record the request's admission. ``request_id`` is the router's own (see
        :mod:`.limits`: never a client's); ``client_request_id`` is kept as metadata."""
        rid = request_id or new_request_id(endpoint)
        hashes = block_hashes(tokens, self.hash_config)
        adm = Admission(rid, model, tokens, hashes, max_tokens, stream, endpoint)
        self._record(RequestAdmitted(
            request_id=rid, model=model, prompt_tokens=len(tokens), max_tokens=max_tokens, stream=stream,
            block_hashes=hashes, block_size=self.hash_config.block_size, hash_algo=self.hash_config.hash_algo,
            endpoint=endpoint, client_request_id=client_request_id), rid)
        return adm

    def _has_room(self, granted_tokens: int) -> bool:
        """The admission test over the view and this router's ledger (see ``admission``)."""
        disagg = self._serving_mode() == "disaggregated"
        entry_role = "prefill" if disagg else "aggregated"

        def load(w: WorkerState) -> PoolLoad:
            # Prefill: this router's own ledger, which drops a request the moment its prompt is
            # done. The load report lags by up to its interval, so gating on it would keep a
            # worker "busy" for a second after it drained (measured: a quarter of the model's
            # throughput in the demo). Decode blocks: the larger of report and ledger.
            mine = self.ledger.load_for(w.worker_id)
            return PoolLoad(w.worker_id, mine.prefill_tokens,
                            max(w.active_decode_blocks, mine.decode_blocks), w.device_capacity_blocks)

        entry = [load(w) for w in self.view.routable(entry_role)]
        decode = [load(w) for w in self.view.routable("decode")] if disagg else None
        return has_room(entry, decode, self.admission.cfg, granted_tokens)

    def budget_ms(self, adm: Admission) -> float:
        """The request's TTFT budget (ms; 0: none): the router's ``ttft_slo_ms``, tightened (never
        loosened) by the client's own."""
        budget = self.config.ttft_slo_ms
        if adm.ttft_budget_ms is not None:
            budget = min(budget, adm.ttft_budget_ms) if budget > 0 else adm.ttft_budget_ms
        return budget

    def spent_ms(self, adm: Admission) -> float:
        """What the request has spent in this router so far (ms), since it arrived."""
        return (time.monotonic() - (adm.arrived_at if adm.arrived_at is not None else adm.received_at)) * 1000

    def loop_lag_ms(self) -> float:
        """This router's event-loop lag (smoothed, ms; 0 when not measured)."""
        return self.loop_lag().smoothed_s * 1000 if self.loop_lag is not None else 0.0

    async def queue(self, adm: Admission) -> None:
        """Wait in the admission queue. Raises :class:`RouterRejected` (429/503) when refused:
        at once, without queueing, while this router's own loop lags over its limit; and once
        waiting longer would spend the request's TTFT budget (what it spent already and the
        router's loop lag counted)."""
        if self.loop_lag is not None and (over := overloaded(self.loop_lag(), self.config.max_loop_lag_ms)):
            raise RouterRejected(over[0], 503, "router_overloaded", retry_after_s=over[1])
        budget = self.budget_ms(adm)
        left_s = (budget - self.spent_ms(adm) - loop_lag_share_ms(self.loop_lag_ms())) / 1000 if budget > 0 else None
        try:
            adm.queued_s = await self.admission.acquire(len(adm.tokens), left_s)
        except QueueRefused as e:
            # A request that waited out its budget: the terms it was refused on, no prediction.
            terms = (budget_terms((), budget, self.spent_ms(adm), self.loop_lag_ms(), at_s=time.time(), rule=RULE)
                     if e.code == "ttft_budget" else None)
            raise RouterRejected(str(e), e.status, e.code, e.retry_after_s, admission=terms) from None
        adm.granted = True

    def _routed(self, adm: Admission) -> None:
        if adm.granted:
            adm.granted = False
            self.admission.routed(len(adm.tokens))

    def end(self, adm: Admission, payload: RequestCompleted | RequestFailed | RequestRejected) -> bool:
        """Record the request's end, once: the only way a request ends on the log (completed,
        failed for good, rejected, or its client gone). False, and nothing recorded, when it
        has ended already (a rejection after the last attempt's ``RequestFailed``)."""
        if adm.end is not None:
            return False
        adm.end = payload
        self._record(payload, adm.request_id)
        self.admission.poke()
        return True

    def fail(self, adm: Admission, reason: str, code: str) -> bool:
        """End a request that failed inside the router itself (recorded, ledger cleared)."""
        return self.end(adm, RequestFailed(request_id=adm.request_id, reason=reason, code=code))

    def reject(self, adm: Admission, reason: str, code: str, status: int,
               admission: AdmissionTerms | None = None) -> bool:
        """End a request refused before its first token (unless it already ended);
        ``admission``: the TTFT budget test's terms when it refused."""
        return self.end(adm, RequestRejected(request_id=adm.request_id, reason=reason, code=code,
                                             http_status=status, admission=admission))

    # -- decision ---------------------------------------------------------------------------

    def _serving_mode(self) -> str:
        roles = {w.role for w in self.view.routable()}
        if WorkerRole.AGGREGATED.value in roles or not roles:
            return "aggregated"
        if WorkerRole.PREFILL.value in roles and WorkerRole.DECODE.value in roles:
            return "disaggregated"
        return "aggregated"

    def decide(self, adm: Admission, phase: RequestPhase, excluded: set[str], attempt: int) -> tuple[RequestRouted, WorkerState]:
        # Wall-clock seconds, recorded as ``decided_at_s``: the ledger's expiry runs on it.
        now = time.time()

        def decided(excluded: set[str]) -> tuple[DecisionInputs, Decision]:
            try:
                inputs = decision_inputs(
                    self.view, self.ledger, request_id=adm.request_id, prompt_tokens=len(adm.tokens),
                    block_hashes=adm.hashes, block_size=self.hash_config.block_size,
                    expected_output_tokens=adm.max_tokens, phase=phase, attempt=attempt, now=now,
                    excluded=excluded, peer_reach=self.config.tier_weights.peer > 0, pairs=self.config.pd_pairs,
                    session=adm.session, session_ttl_s=self.config.session_ttl_s)
                return inputs, execute(inputs, self.config)
            except NoEligibleWorker as e:
                raise RouterRejected(str(e)) from None

        t0 = time.perf_counter()
        inputs, d = decided(excluded)
        if self.metrics:
            self.metrics.decision_seconds.observe(time.perf_counter() - t0)
        budget = self.budget_ms(adm) if attempt == 0 else 0.0
        terms = None
        if budget > 0:  # only then: the margin sorts its window's ratios
            # The probe that keeps the router's own SLO from locking itself out
            # (``over_ttft_budget``): nothing in flight, a fitted model, and no tighter deadline of
            # the client's own (a client that set one asked to be refused rather than served late).
            # Not while the router is offered more than its box serves (``PromiseMargin.overloaded``):
            # then an idle moment is the shedding's, not a stale model's (measured: in a chaos
            # overload phase 95 such probes were served, 2 of them over the SLO, 1.2 and 2.0 s).
            # Nor while the other replicas have requests waiting on the box (rule 4).
            others = self.others_waiting() if self.others_waiting is not None else 0
            queue_ms, spread = self.ledger.margin.queue_ms(now, others=others), self.ledger.margin.spread(now)
            probe = (not len(self.ledger.inflight) and self.ledger.ttft_fit.observations() > 0 and spread == 1.0
                     and not others
                     and (adm.ttft_budget_ms is None or adm.ttft_budget_ms >= self.config.ttft_slo_ms > 0))

            def margin(worker: str) -> float:  # each worker's own (rule 3, ``PromiseMargin.factor``)
                return self.ledger.margin.factor(now, worker)

            terms = budget_terms(d.scores, budget, self.spent_ms(adm), self.loop_lag_ms(), margin(d.worker_id),
                                 idle=probe, at_s=now, queue_ms=queue_ms, chosen=d.worker_id, spread=spread,
                                 others_waiting=others)
            while (detour := budget_detour(d.scores, terms, margin)) is not None:
                # The chosen worker breaks the promise another keeps: decide again without it
                # (recorded in ``excluded_workers``; the caller's set, its failures, is not touched).
                excluded = excluded | {detour}
                inputs, d = decided(excluded)
                terms = budget_terms(d.scores, budget, self.spent_ms(adm), self.loop_lag_ms(), margin(d.worker_id),
                                     idle=probe, at_s=now, queue_ms=queue_ms, chosen=d.worker_id, spread=spread,
                                     others_waiting=others)
            over = over_budget(terms)
            if over is not None:
                # The promise cannot be kept: refused now (serving records RequestRejected), not served late.
                raise RouterRejected(over[0], 429, "ttft_budget", retry_after_s=over[1], admission=terms)
        queued_ms = adm.queued_s * 1000 if adm.granted else 0.0
        self._routed(adm)
        health = self._health() if self._health else None
        ev = routed_event(d, inputs, self.config, router_id=self.router_id, attempt=attempt,
                          index_position={f"{t}:{p}": o for (t, p), o in self.view.positions.items()},
                          view_state=health.state if health else "", excluded=excluded, decided_at_s=now,
                          queued_ms=queued_ms, admission=terms)
        self._record(ev, adm.request_id)
        return ev, self.view.workers[d.worker_id]

    # -- serving ----------------------------------------------------------------------------

    async def serve(self, adm: Admission) -> AsyncIterator[Chunk]:
        """Tokens for the client. Retries on another worker until a token was yielded."""
        excluded: set[str] = set()
        finished = False
        try:
            async for chunk in self._attempts(adm, excluded):
                if chunk.error:
                    finished = True
                yield chunk
            finished = True
        except Exception:
            # A refusal or an error inside the router: whoever drives the request ends it
            # (:mod:`control_plane.router.serving`: rejected, or failed).
            finished = True
            raise
        finally:
            self._routed(adm)
            self.admission.poke()
            if not finished:
                # The client went away mid-stream: the request ends here, and says so.
                self.end(adm, RequestFailed(request_id=adm.request_id, reason="client disconnected",
                                            code="client_cancelled"))

    async def _attempts(self, adm: Admission, excluded: set[str]) -> AsyncIterator[Chunk]:
        sent = 0
        last_error = ""
        # A finished prefill whose decode worker was never reached is still held on the prefill
        # worker under this request id: the next attempt hands the same KV to another decode
        # worker instead of prefilling again (a second prefill of the same id is refused while
        # the hold lives).
        handoff: list[tuple[str, dict | None]] = []
        for attempt in range(self.max_attempts):
            worker = None
            try:
                disagg = self._serving_mode() == "disaggregated"
                if disagg:
                    stream, worker = await self._disaggregated(adm, excluded, attempt, handoff)
                else:
                    ev, worker = self.decide(adm, RequestPhase.AGGREGATED, excluded, attempt)
                    stream = self._stream_from(worker, adm, self._peer_params(ev), ev.decided_at_s)
                outcome = _Tracker(worker.worker_id, adm.received_at)
                async for chunk in stream:
                    if type(chunk) is _FirstTokenAt:  # a relayed answer: what its first token starts
                        self._first_token(adm, worker.worker_id, record=not disagg, at=chunk.at)
                        sent = 1
                        continue
                    if type(chunk) is tuple:  # a relayed answer, whole: (Relayed, the crate's record)
                        sent = outcome.absorb(chunk[1], chunk[0].usage)
                        yield chunk[0]
                        continue
                    if chunk.token_ids or chunk.text:
                        if outcome.first_token():
                            self._first_token(adm, worker.worker_id, record=not disagg)
                        sent += 1
                    outcome.observe(chunk)
                    yield chunk
                self._completed(adm, outcome)
                return
            except WorkerFailed as e:
                if e.tokens_sent is not None:
                    sent = e.tokens_sent
                wid = e.worker_id or (worker.worker_id if worker else None)
                retry = sent == 0 and attempt + 1 < self.max_attempts
                failed = RequestFailed(request_id=adm.request_id, worker_id=wid, reason=str(e), code=e.code,
                                       tokens_sent=sent, retried=retry)
                if retry:  # not the request's end: it is routed again
                    self._record(failed, adm.request_id)
                    self.admission.poke()
                else:
                    self.end(adm, failed)
                if self.metrics:
                    self.metrics.failures.labels(code=e.code, retried=str(retry).lower()).inc()
                last_error = f"{wid}: {e}"
                if wid:
                    excluded.add(wid)
                if not (handoff and e.code in NEVER_REACHED and wid != handoff[0][0]):
                    handoff.clear()
                if not retry:
                    if sent:
                        yield Chunk(error=f"worker failed after {sent} tokens: {e}")
                        return
                    raise RouterRejected(f"all {attempt + 1} attempts failed before the first token; last error: "
                                         f"{last_error}", 503, "all_attempts_failed") from None
                log.warning("request %s: %s failed before any token (%s); retrying elsewhere", adm.request_id, wid, e)
            except RouterRejected as e:
                if attempt == 0 or e.status < 500:
                    raise  # serving records it (RequestRejected), which ends its ledger entries
                self.end(adm, RequestFailed(request_id=adm.request_id, reason=f"{e}; last error: {last_error}",
                                            code="no_workers_left", tokens_sent=sent))
                if sent:
                    yield Chunk(error=f"{e}; last error: {last_error}")
                    return
                raise RouterRejected(f"{e}; last error: {last_error}", 503, "no_workers_left") from None

    async def _disaggregated(self, adm: Admission, excluded: set[str], attempt: int,
                             handoff: list[tuple[str, dict | None]]):
        if handoff:
            _, decode = self.decide(adm, RequestPhase.DECODE, excluded, attempt)
            self.admission.poke()
            return self._stream_from(decode, adm, handoff[0][1]), decode
        routed, prefill = self.decide(adm, RequestPhase.PREFILL, excluded, attempt)
        body = {"model": adm.model, "prompt": adm.tokens, "max_tokens": 1, "stream": False,
                "request_id": adm.request_id, "kv_transfer_params": {"do_remote_decode": True},
                "routed_at_s": routed.decided_at_s}
        wid = prefill.worker_id
        try:
            async with self.workers.post(f"{prefill.endpoint}/v1/completions", _json(body), adm.request_id,
                                         wid) as r:
                answer = await r.read()
            if r.status >= 500:
                raise WorkerFailed("worker_error", f"prefill {wid}: HTTP {r.status}: {_text(answer, 200)}", wid)
            if r.status >= 400:
                raise RouterRejected(f"prefill worker refused the request: {_text(answer, 300)}", r.status,
                                     "bad_request")
            params = _decode(answer).get("kv_transfer_params")
        except (CallFailed, Unsendable, OSError, ValueError, AttributeError) as e:
            raise _unsendable(e) or _failure(e, f"prefill {wid}", wid) from None
        handoff.append((wid, params))
        # The decode decision releases the prefill entry (the KV is handed off) before it reads
        # the ledger; replay does the same when it folds the decode phase's RequestRouted.
        _, decode = self.decide(adm, RequestPhase.DECODE, excluded, attempt)
        self.admission.poke()
        return self._stream_from(decode, adm, params), decode

    def _peer_params(self, ev: RequestRouted) -> dict | None:
        """``kv_transfer_params`` naming the peer the chosen worker pulls its prefix from, when
        the decision credited it with a peer's blocks (``CandidateScore.peer_from``)."""
        row = next((r for r in ev.scores if r.worker_id == ev.worker_id), None)
        if row is None or not row.peer_from:
            return None
        holder = self.view.workers.get(row.peer_from)
        if holder is None or not holder.endpoint:
            return None
        u = urllib.parse.urlsplit(holder.endpoint)
        if not u.hostname or not u.port:
            return None
        return {"peer_fetch": {"worker_id": row.peer_from, "host": u.hostname, "port": u.port,
                               "blocks": row.overlap_blocks + row.overlap_by_tier.get("peer", 0)}}

    async def _stream_from(self, worker: WorkerState, adm: Admission, kv_params: dict | None,
                           routed_at_s: float | None = None) -> AsyncIterator[Chunk]:
        body = {"model": adm.model, "prompt": adm.tokens, "max_tokens": adm.max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "request_id": adm.request_id}
        if routed_at_s is not None:
            # The worker's engine takes a step's arrivals in the router's order (``EngineRequest.router_order``).
            body["routed_at_s"] = routed_at_s
        if kv_params is not None:
            body["kv_transfer_params"] = kv_params
        url = f"{worker.endpoint}/v1/completions"
        wid = worker.worker_id
        relay = not adm.stream
        try:
            async with self.workers.post(url, _json(body), adm.request_id, wid, relay) as r:
                if r.status >= 500:
                    raise WorkerFailed("worker_error", f"HTTP {r.status}: {(await r.read())[:200]!r}", wid)
                if r.status >= 400:
                    raise RouterRejected(f"worker refused the request: {_text(await r.read(), 300)}",
                                         r.status, "bad_request")
                if relay:
                    # Read to its end by the crate: this loop is woken at its first token and at its end.
                    answer = r.relay()
                    if (at := await answer.first_token()) is not None:
                        yield _FirstTokenAt(at)
                    whole = await answer.end()
                    _relay_failure(whole, wid)
                    usage = None if whole.usage is None else _decode(whole.usage)
                    yield Relayed(whole.text, whole.finish_reason, usage, whole.chunks), whole
                    return
                done = False
                async for ev in sse_events(r.chunks()):  # read by the crate (native/src/sse.rs)
                    kind = ev[0]
                    if kind == SSE_CHUNK:
                        yield Chunk(ev[1], ev[2], ev[3], None if ev[4] is None else _decode(ev[4]))
                    elif kind == SSE_DONE:
                        done = True
                        break
                    elif kind == SSE_ERROR:
                        raise WorkerFailed("worker_error", str(_decode(ev[1]))[:300], worker.worker_id)
                    elif kind == SSE_BAD:
                        raise ValueError(ev[1])
                    else:  # SSE_USAGE
                        yield Chunk(usage=_decode(ev[1]))
                if not done:
                    raise WorkerFailed("worker_lost", "stream ended without [DONE]", worker.worker_id)
        except (CallFailed, Unsendable, OSError, ValueError) as e:
            # A refused connection is recorded as ``worker_unreachable``: folding that drops
            # everything this router sent to the worker (its KV is gone with it).
            raise _unsendable(e) or _failure(e, worker.worker_id, worker.worker_id) from None

    def _first_token(self, adm: Admission, worker_id: str, record: bool, at: float | None = None) -> None:
        """The prompt's KV now exists on the worker: its queued prefill leaves the ledger. Recorded
        as PrefillCompleted (by the router, in aggregated serving) so replays see it too. ``at``:
        when the token came (monotonic; now when not given)."""
        now = time.monotonic() if at is None else at
        if record:  # disaggregated: the decode entry has no prefill tokens; the prefill worker
            # recorded its own PrefillCompleted
            self._record(PrefillCompleted(
                request_id=adm.request_id, worker_id=worker_id, prompt_tokens=len(adm.tokens),
                duration_ms=(now - adm.received_at) * 1000), adm.request_id)
        else:  # the decode hop's end, which the TTFT margin waits for (``PromiseMargin``)
            self._record(FirstToken(request_id=adm.request_id, worker_id=worker_id,
                                    ttft_ms=(now - adm.received_at) * 1000), adm.request_id)
        self.admission.poke()

    def _completed(self, adm: Admission, t: "_Tracker") -> None:
        itls = t.itls_ms
        itls_sorted = sorted(itls)
        self.end(adm, RequestCompleted(
            request_id=adm.request_id, worker_id=t.worker_id, prompt_tokens=len(adm.tokens),
            output_tokens=t.tokens, cached_tokens=t.cached_tokens, ttft_ms=t.ttft_ms,
            itl_mean_ms=statistics.fmean(itls) if itls else 0.0,
            itl_p50_ms=itls_sorted[len(itls_sorted) // 2] if itls else 0.0,
            itl_p99_ms=itls_sorted[min(len(itls_sorted) - 1, int(0.99 * len(itls_sorted)))] if itls else 0.0,
            e2e_ms=((t.end_at or time.monotonic()) - adm.received_at) * 1000,
            finish_reason=t.finish_reason or "length"))
        if self.metrics:
            self.metrics.ttft_seconds.observe(t.ttft_ms / 1000)
            for x in itls:
                self.metrics.itl_seconds.observe(x / 1000)


def _relay_failure(whole, wid: str) -> None:
    """Raises what a relayed answer that did not end with ``[DONE]`` failed of, worded as the
    streamed reading words it (``Router._stream_from``), with the token chunks it carried."""
    end, sent = whole.end, whole.token_chunks
    if end == 0:
        return
    if end == 1:
        raise WorkerFailed("worker_error", str(_decode(whole.detail))[:300], wid, sent)
    if end == 3:
        raise WorkerFailed("worker_lost", "stream ended without [DONE]", wid, sent)
    e = ValueError(whole.detail) if end == 2 else CallFailed(whole.code, whole.detail)
    f = _failure(e, wid, wid)
    f.tokens_sent = sent
    raise f


def _text(body: bytes, limit: int) -> str:
    """The start of a worker's answer, for a message."""
    return body[:limit].decode(errors="replace")


class _Tracker:
    def __init__(self, worker_id: str, start: float) -> None:
        self.worker_id = worker_id
        self.start = start
        self.last: float | None = None
        self.ttft_ms = 0.0
        self.itls_ms: list[float] = []
        self.tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        #: When a relayed answer ended (the crate's clock); None: when it is recorded.
        self.end_at: float | None = None

    def absorb(self, whole, usage: dict | None) -> int:
        """A relayed answer's record (``switchyard_native.RelayedAnswer``, its usage decoded), as
        :meth:`observe` would have seen its chunks one by one; its token chunks."""
        if whole.first_at is not None:
            self.ttft_ms = (whole.first_at - self.start) * 1000
            self.last = whole.first_at
        self.itls_ms = list(whole.itls_ms)
        self.tokens = whole.tokens
        self.finish_reason = whole.finish_reason
        self.end_at = whole.end_at
        if usage:
            self.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0)
            self.tokens = int(usage.get("completion_tokens", whole.tokens_at_usage)) + whole.tokens - whole.tokens_at_usage
        return whole.token_chunks

    def first_token(self) -> bool:
        return self.last is None

    def observe(self, c: Chunk) -> None:
        now = time.monotonic()
        if c.token_ids or c.text:
            if self.last is None:
                self.ttft_ms = (now - self.start) * 1000
            else:
                self.itls_ms.append((now - self.last) * 1000)
            self.last = now
            self.tokens += max(len(c.token_ids), 1)
        if c.finish_reason:
            self.finish_reason = c.finish_reason
        if c.usage:
            self.cached_tokens = int((c.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0)
            self.tokens = int(c.usage.get("completion_tokens", self.tokens))
