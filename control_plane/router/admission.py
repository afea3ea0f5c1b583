"""Admission control: a bounded FCFS queue in front of the routing decision.

Why: a router that forwards every request at once turns a burst into seconds of queueing inside
the workers, where nobody can see it or bound it, and into connect timeouts when the box runs
out of CPU. Here a request is dispatched only while some worker of the entry pool has room; the
rest wait at the router, in arrival order, where the wait is measured, recorded and bounded.

Policy (stated, configurable through :class:`AdmissionConfig`):

* A worker of the entry pool (prefill when disaggregated, else aggregated) has room while its
  pending prefill tokens are below ``busy_prefill_tokens``. Pending is what this router's
  in-flight ledger has sent it (prompt tokens not yet past their first token), plus the tokens
  of requests this router has released but not yet routed. The load report is not used for
  this: it lags by its interval and would hold a drained worker busy. With several router
  replicas each gates its own share, so a worker may see up to replicas x the threshold.
* Decode workers are busy while their active decode blocks fill ``busy_kv_fraction`` of their
  device capacity; a disaggregated request also waits while every decode worker is busy.
* The queue is FCFS: the head is dispatched first, and nothing overtakes it. At most
  ``queue_max`` requests wait; one more is refused with 429 (``queue_full``). A request that
  waited ``queue_timeout_s`` is refused with 503 (``queue_timeout``). Both carry Retry-After.

The room test (:func:`has_room`) is a pure function of the view and the ledger, so a replay can
tell why a request waited.

After the decision, the promise (issue 39 step 4, :func:`over_budget` on :func:`budget_terms`):
when even the best eligible candidate's predicted TTFT, times the margin recent predictions fell
short by (:class:`PromiseMargin`), plus what the request already spent in the router and the
router's own loop lag, exceeds the budget (``RouterConfig.ttft_slo_ms``, off at 0), the request
is refused at once with 429 (``ttft_budget``) and Retry-After, instead of being accepted and
served late. The terms are typed data in the log (``AdmissionTerms``: ``RequestRejected.admission``,
and ``RequestRouted.admission`` for the requests it admitted), so replay re-executes the test. A
request waits in the queue no longer than its budget allows.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from math import ceil

import msgspec

from schemas.events import AdmissionTerms, CandidateScore

#: The error codes of a refusal before any worker was asked (the router shedding load, not a
#: failure): the queue full or timed out, the router's own loop lagging, the TTFT budget. A load
#: generator counts these as rejections (``ops/demo/loadgen.py``).
ADMISSION_CODES = frozenset({"queue_full", "queue_timeout", "router_overloaded", "ttft_budget"})


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """Bounds of the router's admission queue (see the module docstring)."""

    #: Pending prefill tokens at which a worker stops taking new requests (0: no limit).
    busy_prefill_tokens: int = 65536
    #: Fraction of a decode worker's device blocks in active use at which it is busy.
    busy_kv_fraction: float = 0.95
    #: Requests that may wait at the router; one more gets 429.
    queue_max: int = 1024
    #: Longest wait in the queue before a 503.
    queue_timeout_s: float = 60.0
    #: Re-check interval while requests wait (load reports arrive without a wake-up).
    poll_interval_s: float = 0.02

    def __post_init__(self) -> None:
        if self.busy_prefill_tokens < 0:
            raise ValueError("busy_prefill_tokens must be >= 0")
        if not 0 < self.busy_kv_fraction <= 1:
            raise ValueError("busy_kv_fraction must be in (0, 1]")
        if self.queue_max < 0:
            raise ValueError("queue_max must be >= 0")
        if self.queue_timeout_s <= 0:
            raise ValueError("queue_timeout_s must be > 0")


@dataclass(frozen=True, slots=True)
class PoolLoad:
    """One worker as the admission test sees it."""

    worker_id: str
    #: Pending prefill tokens (max of the load report and this router's ledger).
    prefill_tokens: int = 0
    active_decode_blocks: int = 0
    kv_capacity_blocks: int = 0


def has_room(entry: Iterable[PoolLoad], decode: Iterable[PoolLoad] | None, cfg: AdmissionConfig,
             granted_tokens: int = 0) -> bool:
    """True when a new request may be dispatched now.

    ``granted_tokens``: prompt tokens released from the queue that the ledger does not show yet;
    they are charged to the least loaded entry worker, so one wake-up cannot release a crowd.
    """
    loads = sorted(w.prefill_tokens for w in entry)
    if not loads:
        return True  # no worker at all: let the decision say "no worker" with its own reason
    if cfg.busy_prefill_tokens and loads[0] + granted_tokens >= cfg.busy_prefill_tokens:
        return False
    if decode is not None:
        dec = list(decode)
        if dec and all(d.kv_capacity_blocks and d.active_decode_blocks >= cfg.busy_kv_fraction * d.kv_capacity_blocks
                       for d in dec):
            return False
    return True


class QueueRefused(Exception):
    """The request is refused at admission (``status`` 429 or 503, with ``retry_after_s``)."""

    def __init__(self, message: str, status: int, code: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.retry_after_s = retry_after_s


@dataclass
class _Waiter:
    tokens: int
    future: asyncio.Future
    #: Monotonic time it joined the queue.
    since: float = 0.0


class AdmissionQueue:
    """The FCFS queue. ``room(granted_tokens)`` is the router's :func:`has_room` over its view."""

    def __init__(self, cfg: AdmissionConfig, room: Callable[[int], bool]) -> None:
        self.cfg = cfg
        self._room = room
        self._waiting: deque[_Waiter] = deque()
        #: Tokens released to requests that have not been routed yet (see ``routed``).
        self.granted_tokens = 0
        self._pump_task: asyncio.Task | None = None
        self.admitted = 0
        self.refused_full = 0
        self.timed_out = 0
        #: Refused because the wait would have spent the request's TTFT budget.
        self.over_budget = 0

    def __len__(self) -> int:
        return len(self._waiting)

    def oldest_wait_s(self, now: float) -> float:
        """How long the head of the queue has waited at ``now`` (monotonic); 0 when empty."""
        return max(0.0, now - self._waiting[0].since) if self._waiting else 0.0

    async def acquire(self, tokens: int, budget_s: float | None = None) -> float:
        """Wait for room; returns the seconds waited. Raises :class:`QueueRefused`.

        ``budget_s``: how long the request can wait here and still meet its TTFT budget (None:
        no budget). It waits at most that long, then is refused with 429 ``ttft_budget``: served
        later, it would be served late."""
        if not self._waiting and self._room(self.granted_tokens):
            self._grant(tokens)
            return 0.0
        if budget_s is not None and budget_s <= 0:
            self.over_budget += 1
            raise QueueRefused(f"every worker is at its busy threshold and the request's TTFT budget is already "
                               f"spent ({-budget_s * 1000:.0f} ms over): it cannot wait in the router queue",
                               429, "ttft_budget", retry_after_s=1)
        if len(self._waiting) >= self.cfg.queue_max:
            self.refused_full += 1
            raise QueueRefused(f"router queue full ({len(self._waiting)} requests waiting, limit "
                               f"{self.cfg.queue_max}): every worker is at its busy threshold",
                               429, "queue_full", retry_after_s=max(1, int(self.cfg.queue_timeout_s / 10)))
        t0 = time.monotonic()
        w = _Waiter(tokens, asyncio.get_running_loop().create_future(), t0)
        self._waiting.append(w)
        self._ensure_pump()
        limit_s = self.cfg.queue_timeout_s if budget_s is None else min(self.cfg.queue_timeout_s, budget_s)
        try:
            await asyncio.wait_for(asyncio.shield(w.future), limit_s)
        except TimeoutError:
            if w.future.done() and not w.future.cancelled():
                return time.monotonic() - t0  # granted at the last moment: keep it
            self._remove(w)
            if limit_s < self.cfg.queue_timeout_s:
                self.over_budget += 1
                raise QueueRefused(f"waited {limit_s * 1000:.0f} ms in the router queue, all the request's TTFT "
                                   f"budget had left: served now, it would be served late", 429, "ttft_budget",
                                   retry_after_s=max(1, ceil(limit_s))) from None
            self.timed_out += 1
            raise QueueRefused(f"waited {self.cfg.queue_timeout_s:g}s in the router queue without a "
                               f"worker below its busy threshold", 503, "queue_timeout",
                               retry_after_s=max(1, int(self.cfg.queue_timeout_s / 10))) from None
        except asyncio.CancelledError:
            if w.future.done() and not w.future.cancelled():
                self.routed(tokens)  # granted, but the client left before it was routed
            self._remove(w)
            raise
        return time.monotonic() - t0

    def routed(self, tokens: int) -> None:
        """The granted request reached the ledger (or ended): stop counting it here."""
        self.granted_tokens = max(0, self.granted_tokens - tokens)

    def poke(self) -> None:
        """Capacity may have freed (a first token, a completion): try the head now."""
        if self._waiting:
            self._drain()

    # -- internals ---------------------------------------------------------------------------

    def _grant(self, tokens: int) -> None:
        self.granted_tokens += tokens
        self.admitted += 1

    def _remove(self, w: _Waiter) -> None:
        try:
            self._waiting.remove(w)
        except ValueError:
            pass

    def _drain(self) -> None:
        while self._waiting and self._room(self.granted_tokens):
            w = self._waiting.popleft()
            if w.future.done():
                continue
            self._grant(w.tokens)
            w.future.set_result(None)

    def _ensure_pump(self) -> None:
        if self._pump_task is None or self._pump_task.done():
            self._pump_task = asyncio.get_running_loop().create_task(self._pump(), name="admission-pump")

    async def _pump(self) -> None:
        while self._waiting:
            self._drain()
            if not self._waiting:
                break
            await asyncio.sleep(self.cfg.poll_interval_s)


#: How far back (s, by decision time) an observed/predicted ratio counts toward the margin.
MARGIN_WINDOW_S = 30.0
#: Ratios needed before the margin departs from 1 (fewer: the prediction is taken as it is).
MARGIN_MIN_SAMPLES = 8
#: The quantile of the window's ratios the margin is (nearest rank), and its ceiling.
MARGIN_QUANTILE = 0.9
MARGIN_MAX = 10.0
#: Requests in flight past their prediction needed before their lateness raises the margin on
#: its own: the margin is at least the ``MARGIN_OVERDUE``-th largest of their lower bounds (one
#: straggler alone does not shed a router's traffic; two late at once say the model runs low now).
MARGIN_OVERDUE = 2
#: How far back (s) the busy time per first token of :meth:`PromiseMargin.queue_ms` looks, and
#: the first tokens it needs in that window before it says anything.
QUEUE_WINDOW_S = 3.0
QUEUE_MIN_FIRSTS = 3
#: Each request waiting for its first token counts this many times in :meth:`PromiseMargin.queue_ms`
#: (itself, and about one admitted behind it that shares its batch); terms recorded before
#: ``AdmissionTerms.chosen`` were computed with 1 (:func:`queue_headroom`).
QUEUE_PER_WAITING = 2


#: The version of the budget test's rule that :func:`budget_terms` writes into
#: ``AdmissionTerms.rule`` (see :func:`terms_rule` for the older ones).
RULE = 4
#: How many times rule 3 (and it alone) counts the router's smoothed loop lag: a request meets
#: it on its way in (the router reads it that late) and its first token meets it again on its
#: way out. Rule 4 counts it once again: in the chaos runs of rule 3 no miss had a large way in
#: or out (1-62 ms), and offline the second count removed none of rule 2's misses while it
#: refused quiet traffic (2 of seed 2's 15 quiet refusals; docs/admission.md).
LOOP_LAG_TIMES = 2


#: Rule 3: the offered load (:meth:`PromiseMargin.offered`) above which a router is overloaded,
#: and what its budget test then multiplies the expected TTFT by. Why: the estimate (the
#: prediction x the p90 margin, or the queue) aims at about the p90 of what an admitted request
#: will see; on an overloaded box the p99 of the router's TTFT from admission ran to 1.55-2.27x
#: the estimate (four chaos runs, docs/admission.md). With more offered than served, the queue
#: is the admission test's to bound, and a tighter edge costs little throughput (the workers stay
#: busy with fewer waiting) while the first tokens come sooner. Below it (quiet traffic, about
#: 0.2-0.4 in chaos runs) nothing changes, so healthy traffic is not shed for it.
OVERLOAD_OFFERED = 1.0
OVERLOAD_SPREAD = 1.6


def folded_terms(margin: PromiseMargin, at_s: float, terms: AdmissionTerms | None) -> tuple[float, float, float]:
    """(margin, queue_ms, spread) of ``terms`` as the router's ledger fold (``margin``, folded
    to ``at_s``) gives them by the terms' own rule: what replay compares the recorded ones with."""
    rule = terms_rule(terms)
    others = terms.others_waiting if terms is not None else 0
    return (margin.factor(at_s, margin_worker(terms)), margin.queue_ms(at_s, queue_headroom(terms), others),
            margin.spread(at_s) if rule >= 3 else 1.0)


def terms_rule(terms: AdmissionTerms | None) -> int:
    """The rule recorded ``terms`` were computed and are re-executed with: ``AdmissionTerms.rule``,
    or, in terms written before that field, 2 when they judged the chosen row and 1 when the best
    (None: the current rule). 1: best row, the queue's waiting once, the loop lag once; 2: the
    chosen row, the waiting twice (:data:`QUEUE_PER_WAITING`); 3: as 2, the loop lag
    :data:`LOOP_LAG_TIMES` times and the margin the judged worker's own (:func:`margin_worker`);
    4: as 3, the loop lag once, and the queue counts the other replicas' requests waiting for
    their first token (``AdmissionTerms.others_waiting``, :meth:`PromiseMargin.queue_ms`)."""
    if terms is None:
        return RULE
    return terms.rule or (2 if terms.chosen else 1)


def margin_worker(terms: AdmissionTerms | None) -> str | None:
    """The worker whose own margin (:meth:`PromiseMargin.factor`) recorded ``terms`` were judged
    with: the judged row's from rule 3, None (every worker's) before it."""
    return None if terms is None or terms_rule(terms) < 3 else terms.worker_id


def queue_headroom(terms: AdmissionTerms | None) -> int:
    """The ``per_waiting`` of :meth:`PromiseMargin.queue_ms` that recorded ``terms`` were computed
    with, so replay re-derives old logs' queue terms by their own rule."""
    return 1 if terms_rule(terms) == 1 else QUEUE_PER_WAITING


def loop_lag_share_ms(loop_lag_ms: float, rule: int = RULE) -> float:
    """What the router's smoothed loop lag adds to the TTFT its budget test expects, by ``rule``
    (:func:`terms_rule`): :data:`LOOP_LAG_TIMES` times in rule 3, once in every other. Why rule 3
    counted it twice: in a chaos overload phase of rule 2, the time between the client's send and
    the router's admission plus the first token's way back was 370-600 ms for requests the router
    saw within the SLO, while its smoothed lag was 133-216 ms. Why rule 4 dropped it: see
    :data:`LOOP_LAG_TIMES` (docs/admission.md)."""
    return max(loop_lag_ms, 0.0) * (LOOP_LAG_TIMES if rule == 3 else 1)


class PromiseMargin:
    """The observed/predicted TTFT ratio of this router's recent requests, as a fold of its own
    events (``RouterLedger`` feeds it: the first prefilling decision's ``predicted_ttft_ms``,
    then ``RequestCompleted.ttft_ms`` less the router queueing), so replay re-derives it.

    Why: under load the prediction runs low (it sees this router's own queue, not another
    replica's; the handoff and the router's own loop add to what it models), and a promise made
    on a low prediction is broken. The budget test multiplies the prediction by :meth:`factor`:
    the :data:`MARGIN_QUANTILE` of the ratios of requests decided in the last
    :data:`MARGIN_WINDOW_S` (at least 1, at most :data:`MARGIN_MAX`; 1 with fewer than
    :data:`MARGIN_MIN_SAMPLES`). A window by decision time, not a count, so a replay starting
    mid-log holds the same ratios as the live router did.

    A completion comes a TTFT after its decision: in a burst, every request of its first second
    would be admitted on the old margin. So a request still waiting for its prefill counts too,
    until its first token, once it is already late: (now - decided) / predicted is a lower
    bound of its ratio (until the first token, not the prefill: under a saturated box the decode
    hop, the handoff and the decode worker's first step, was where the time went). Those
    lower bounds are not pooled with the window's ratios: pooled, they moved the p90 only once
    a tenth of the window (a minute of quiet traffic's ratios near 1) was late, a second or more
    into a burst. They are evidence about *now*, so the margin is at least the
    :data:`MARGIN_OVERDUE`-th largest of them, whatever the window holds (measured: in a chaos
    overload phase the requests admitted in its first 2 s were served 1-4.6 s from admission on
    predictions of 84-361 ms)."""

    __slots__ = ("_pending", "_prefilled", "_obs", "_seq", "_busy_since", "_busy", "_firsts", "_arrivals")

    def __init__(self) -> None:
        #: Request -> (decided at, predicted ms, worker) of its first prefilling decision.
        self._pending: dict[str, tuple[float, float, str]] = {}
        #: Pending requests past their first token (no longer a lower bound; still awaited).
        self._prefilled: set[str] = set()
        #: (decided at, seq, ratio, worker) heap of the window's observations.
        self._obs: list[tuple[float, int, float, str]] = []
        self._seq = 0
        #: Since when some request has been waiting for its first token (None: none is).
        self._busy_since: float | None = None
        #: The closed busy periods (start, end) and the first tokens' times of the queue window.
        self._busy: deque[tuple[float, float]] = deque()
        self._firsts: deque[float] = deque()
        #: When this router's requests arrived (``RequestAdmitted``), over the queue window.
        self._arrivals: deque[float] = deque()

    def waiting(self) -> int:
        """Requests routed and still waiting for their first token."""
        return len(self._pending) - len(self._prefilled)

    def routed(self, request_id: str, predicted_ms: float | None, decided_at_s: float, worker_id: str = "") -> None:
        """Its first prefilling decision: ``predicted_ms`` on the chosen worker ``worker_id``."""
        if predicted_ms is not None and predicted_ms > 0 and request_id not in self._pending:
            if self.waiting() == 0:
                self._busy_since = decided_at_s
            self._pending[request_id] = (decided_at_s, predicted_ms, worker_id)

    def first_token(self, request_id: str, at_s: float) -> None:
        """Its first token reached the router at ``at_s`` (``FirstToken``, or the router's own
        ``PrefillCompleted`` in aggregated serving): its wait is over, its ratio comes with its
        completion."""
        if request_id in self._pending and request_id not in self._prefilled:
            self._left(at_s, True)
            self._prefilled.add(request_id)

    def completed(self, request_id: str, observed_ms: float, at_s: float) -> None:
        if request_id in self._pending and request_id not in self._prefilled:
            self._left(at_s, True)  # a completion had its first token
        self._prefilled.discard(request_id)
        p = self._pending.pop(request_id, None)
        if p is not None and observed_ms > 0:
            self._seq += 1
            heapq.heappush(self._obs, (p[0], self._seq, observed_ms / p[1], p[2]))

    def forget(self, request_id: str, at_s: float) -> None:
        if request_id in self._pending and request_id not in self._prefilled:
            self._left(at_s, False)
        self._pending.pop(request_id, None)
        self._prefilled.discard(request_id)

    def _left(self, at_s: float, first_token: bool) -> None:
        """One request stops waiting at ``at_s`` (called before the sets change)."""
        if first_token:
            self._firsts.append(at_s)
        if self.waiting() == 1 and self._busy_since is not None:
            self._busy.append((self._busy_since, max(at_s, self._busy_since)))
            self._busy_since = None

    def expire(self, now: float) -> None:
        while self._obs and self._obs[0][0] < now - MARGIN_WINDOW_S:
            heapq.heappop(self._obs)
        while self._busy and self._busy[0][1] < now - QUEUE_WINDOW_S:
            self._busy.popleft()
        while self._firsts and self._firsts[0] < now - QUEUE_WINDOW_S:
            self._firsts.popleft()
        while self._arrivals and self._arrivals[0] < now - QUEUE_WINDOW_S:
            self._arrivals.popleft()

    def arrived(self, at_s: float) -> None:
        """A request reached this router at ``at_s`` (``RequestAdmitted``), refused later or not."""
        self._arrivals.append(at_s)

    def factor(self, now: float | None = None, worker: str | None = None) -> float:
        """The margin at ``now`` (decision time, unix s; None: completed requests only): of the
        router's requests on every worker (``worker`` None: the rule of terms before rule 3), or
        of those routed to ``worker`` alone (rule 3, :func:`margin_worker`): its own ratios and
        its own late requests, 1 with fewer than :data:`MARGIN_MIN_SAMPLES` of its ratios.

        Why per worker: in chaos runs one prefill worker took all the traffic (cache affinity),
        and the margin its late completions taught multiplied the other, idle worker's row too,
        so the detour (:func:`budget_detour`) never sent it the overflow; and where both served,
        the ratios of the worker the model ran low on were pooled with the other's."""
        q = 1.0
        ratios = sorted(r for _, _, r, w in self._obs if worker is None or w == worker)
        if len(ratios) >= MARGIN_MIN_SAMPLES:
            q = ratios[max(0, ceil(MARGIN_QUANTILE * len(ratios)) - 1)]
        if now is not None:
            late = sorted((r for rid, (at, ms, w) in self._pending.items()
                           if rid not in self._prefilled and (worker is None or w == worker)
                           and (r := (now - at) * 1000 / ms) > 1.0), reverse=True)
            if len(late) >= MARGIN_OVERDUE:
                q = max(q, late[MARGIN_OVERDUE - 1])
        return min(max(q, 1.0), MARGIN_MAX)

    def queue_ms(self, now: float, per_waiting: int = QUEUE_PER_WAITING, others: int = 0) -> float:
        """The TTFT this router's own queue implies for one more request at ``now`` (ms):
        ``per_waiting`` (:data:`QUEUE_PER_WAITING`) x the requests waiting for their first
        token, plus ``others`` (rule 4: the other router replicas' requests waiting for theirs,
        ``AdmissionTerms.others_waiting``), plus one, times the busy time per first token over
        the last :data:`QUEUE_WINDOW_S` (busy: some request was waiting); 0 with fewer than
        :data:`QUEUE_MIN_FIRSTS` first tokens in the window.

        Why the others, once each: the busy time per first token is this router's, measured
        while the other replicas' requests shared the box, so under a steady overload it already
        counts them (each first token of this router's costs about the replicas' count x the
        box's service time). At the onset of a burst it does not: it is still the quiet
        traffic's, and each replica saw only its own share of the burst (measured: 5 of a chaos
        run's 6 misses were admitted in the first 0.3 s of its x8 phase, 5 by one router and 4
        by the other, each on its own queue of 302-791 ms, and served in 1.36-1.68 s).

        Why: the prediction and its margin learn from outcomes, a TTFT after the fact; a burst
        is admitted in full before the first of them is late. The busy time per first token is
        the box's service time as this router sees it, whatever slows it (the other replica's
        traffic, a saturated CPU); each request admitted adds to the queue at once, so a burst
        meets the budget after a few requests instead of a second later. Twice the ones ahead:
        the workers batch their prefill steps, so a request shares the box with the ones ahead
        of it and with about as many admitted behind it before its first token (with ``waiting
        + 1`` alone, in a chaos overload phase, a wave admitted to the budget's edge was served
        1.2-2.7 s). At light load the queue is 0 (no headroom: the quiet traffic is not shed)
        and the busy time per first token is about one TTFT."""
        return (per_waiting * self.waiting() + max(others, 0) + 1) * self._per_first_s(now) * 1000

    def _per_first_s(self, now: float, min_firsts: int = QUEUE_MIN_FIRSTS) -> float:
        """The busy time per first token over the last :data:`QUEUE_WINDOW_S` (s; 0 with fewer
        than ``min_firsts`` first tokens; with none, the busy time itself): the box's service
        time as this router sees it."""
        lo = now - QUEUE_WINDOW_S
        firsts = sum(1 for t in self._firsts if t >= lo)
        if firsts < min_firsts:
            return 0.0
        busy = sum(max(0.0, min(e, now) - max(b, lo)) for b, e in self._busy)
        if self._busy_since is not None:
            busy += max(0.0, now - max(self._busy_since, lo))
        return busy / max(firsts, 1)

    def offered(self, now: float) -> float:
        """The load offered to this router at ``now``: its arrivals over the last
        :data:`QUEUE_WINDOW_S` times its busy time per first token, over the window (1: it is
        sent as much as its box serves). Any first token counts, and busy with none yet counts
        as one: a router that sheds nearly everything has few first tokens, and a measured
        chaos overload phase served 2 of its misses while ``queue_ms`` (3 first tokens needed)
        said nothing."""
        lo = now - QUEUE_WINDOW_S
        return sum(1 for t in self._arrivals if lo <= t <= now) * self._per_first_s(now, 0) / QUEUE_WINDOW_S

    def overloaded(self, now: float) -> bool:
        """The load offered to this router exceeds :data:`OVERLOAD_OFFERED` (:meth:`offered`)."""
        return self.offered(now) > OVERLOAD_OFFERED

    def spread(self, now: float) -> float:
        """:data:`OVERLOAD_SPREAD` while :meth:`overloaded`, else 1: what rule 3's budget test
        multiplies its expected TTFT by (:func:`over_budget`)."""
        return OVERLOAD_SPREAD if self.overloaded(now) else 1.0


def budget_terms(scores: Iterable[CandidateScore], budget_ms: float, spent_ms: float = 0.0,
                 loop_lag_ms: float = 0.0, margin: float = 1.0, idle: bool = False,
                 at_s: float = 0.0, queue_ms: float = 0.0, chosen: str | None = None,
                 rule: int | None = None, spread: float = 1.0, others_waiting: int = 0) -> AdmissionTerms | None:
    """The terms of the budget test for a decision's ``scores`` (None: the budget is off, 0):
    the predicted TTFT and worker of the row the decision chose (``chosen``: its worker id), or,
    with ``chosen`` None (the rule of the terms recorded before ``AdmissionTerms.chosen``), the
    best eligible row's; None when that row carries no prediction (a decode phase). With what the
    router measured, and the ``rule`` it is judged by (``AdmissionTerms.rule``; None: :data:`RULE`
    when ``chosen`` is given, else 0, the rule of terms written before the field) and its
    ``spread`` (rule 3: :meth:`PromiseMargin.spread`) and ``others_waiting`` (rule 4: the other
    replicas' requests waiting for a first token, in ``queue_ms``). Recorded in ``RequestRouted.admission`` /
    ``RequestRejected.admission``; :func:`over_budget` is the test itself.

    Why the chosen row: the promise is about the request as routed, and the margin is the
    observed/predicted ratio of the chosen workers' predictions. Judged on the best row, a
    router whose cost is not the TTFT (``cost=blocks``, the default) admitted requests it then
    sent to a worker predicted 2-4x slower (measured in a chaos overload phase: 90 of 225
    admitted requests, 10 of the 25 served over the SLO)."""
    if budget_ms <= 0:
        return None
    rows = [(r.predicted_ttft_ms, r.worker_id) for r in scores
            if r.eligible and r.predicted_ttft_ms is not None and (chosen is None or r.worker_id == chosen)]
    best = min(rows, default=(None, ""))
    return AdmissionTerms(budget_ms=budget_ms, predicted_ttft_ms=best[0], worker_id=best[1], margin=margin,
                          spent_ms=spent_ms, loop_lag_ms=loop_lag_ms, idle=idle, at_s=at_s, queue_ms=queue_ms,
                          chosen=chosen is not None,
                          rule=(RULE if chosen is not None else 0) if rule is None else rule, spread=spread,
                          others_waiting=others_waiting)


def over_budget(t: AdmissionTerms) -> tuple[str, int] | None:
    """(reason, Retry-After seconds) when the TTFT the client would see exceeds ``t.budget_ms``;
    None when it does not, when the budget is off (0), when the router is ``idle`` or when no
    row carried a prediction (a decode phase).

    The TTFT the client would see: the chosen row's predicted TTFT (the best eligible row's in
    terms recorded before ``chosen``) times the ``margin``
    (:class:`PromiseMargin`: how far recent predictions fell short), or ``queue_ms`` when
    larger (:meth:`PromiseMargin.queue_ms`: what the router's own queue implies), plus ``spent_ms`` (what
    the request already spent in this router since it arrived: its body, its tokens, the
    admission queue), plus ``loop_lag_ms`` (the router's own event-loop lag, smoothed: the
    request waited about that long before the router read it, and its first token meets it
    again on the way back; counted twice in rule 3, :func:`loop_lag_share_ms`). From rule 3 the
    larger of the prediction x margin and the queue is multiplied by ``spread`` first
    (:data:`OVERLOAD_SPREAD` while the router is overloaded). Retry-After: the excess, in whole
    seconds, at least 1 (the queue ahead drains at about the rate it was predicted).

    ``idle``: the router has nothing in flight and its model was fitted from observations. Then
    the request is never refused: the fit and the margin learn only from requests served, so a
    router that refused everything after a stall would keep its stale, pessimistic prediction
    for the whole fit window (measured: a chaos run whose first seconds ran slow then shed 62%
    of the traffic outside the overload phase). One request at a time per router is the
    evidence that corrects it. (The prior, with no observation behind it, is not stale: it is
    held to the budget.)"""
    if t.budget_ms <= 0 or t.idle or t.predicted_ttft_ms is None:
        return None
    ms, margin = t.predicted_ttft_ms, t.margin
    expected = ms * max(margin, 1.0)
    rule = terms_rule(t)
    spread = max(t.spread, 1.0) if rule >= 3 else 1.0
    total = max(expected, t.queue_ms) * spread + max(t.spent_ms, 0.0) + loop_lag_share_ms(t.loop_lag_ms, rule)
    if total <= t.budget_ms:
        return None
    times = f" x {margin:.2f} (recent observed/predicted)" if margin > 1.0 else ""
    what = f"predicted TTFT {ms:.0f} ms on the {'chosen' if t.chosen else 'best'} candidate ({t.worker_id}){times}"
    if t.queue_ms > expected:
        others = f", {t.others_waiting} waiting at the other replicas counted" if t.others_waiting else ""
        what = f"{t.queue_ms:.0f} ms for this router's own queue{others} (above the {what})"
    if spread > 1.0:
        what = f"{what} x {spread:.2f} (overloaded: offered more than its box serves)"
    lag = (f"{t.loop_lag_ms:.0f} ms of its event-loop lag" if rule != 3
           else f"{LOOP_LAG_TIMES} x {t.loop_lag_ms:.0f} ms of its event-loop lag (in and out)")
    return (f"{what} + {t.spent_ms:.0f} ms already spent in the router + {lag} = {total:.0f} ms exceeds the budget "
            f"of {t.budget_ms:g} ms", max(1, ceil((total - t.budget_ms) / 1000)))


def budget_detour(scores: Iterable[CandidateScore], t: AdmissionTerms,
                  margin_of: Callable[[str], float] | None = None) -> str | None:
    """The worker to decide again without, or None: when the chosen row's terms ``t`` break the
    budget (:func:`over_budget`) and another eligible row of ``scores``, with the same queue,
    time spent and loop lag, keeps it, the decision's choice is the one to exclude. That row's
    margin: ``margin_of(its worker)`` from rule 3 (each worker its own), else ``t.margin``
    (then the best row keeps it if any does).

    Why: the promise fails on the chosen worker, not on the request. Issue 39 refuses a request
    when *even the best* candidate breaks its budget; judged on the chosen row alone, a router
    whose cost is not the TTFT (``cost=blocks``: cache affinity) refused requests that another,
    idle worker would have served in time (measured: in two of three chaos runs every request
    went to one of the two prefill workers, the overload phase's too). The exclusion is recorded
    in ``RequestRouted.excluded_workers``, so replay re-executes the second decision as is."""
    if not t.chosen or over_budget(t) is None:
        return None
    own = margin_of is not None and terms_rule(t) >= 3
    for r in scores:
        if r.eligible and r.predicted_ttft_ms is not None and r.worker_id != t.worker_id:
            alt = msgspec.structs.replace(t, predicted_ttft_ms=r.predicted_ttft_ms, worker_id=r.worker_id,
                                          margin=margin_of(r.worker_id) if own else t.margin)
            if over_budget(alt) is None:
                return t.worker_id
    return None


def over_ttft_budget(scores: Iterable[CandidateScore], budget_ms: float, spent_ms: float = 0.0,
                     loop_lag_ms: float = 0.0, margin: float = 1.0, idle: bool = False,
                     chosen: str | None = None) -> tuple[str, int] | None:
    """:func:`over_budget` on the :func:`budget_terms` of ``scores``."""
    t = budget_terms(scores, budget_ms, spent_ms, loop_lag_ms, margin, idle, chosen=chosen)
    return None if t is None else over_budget(t)
