"""The TTFT model learned from the log (issue 39, item 2). Pure.

What is observed: for every request this router routed to a prefilling worker (aggregated or
prefill phase) and saw complete, the :func:`~.ttft.features` of the chosen row at the decision
(steps, tokens computed, attention term, decodes beside the steps, the steps' tokens squared)
and the TTFT the client got (``RequestCompleted.ttft_ms`` less the time the request queued in
the router before its first decision, as ``switchyard replay reconcile`` reads it), less the
wait for the full steps before the request's last when the decision's model priced them at the
rate seen (``TtftModel.queue_tokens_per_ms``; then the features are the last step's). So the fit maps
what the router *saw* to what happened: a queue the router misjudges or a handoff it does not
model is absorbed into the costs (``base_ms`` takes the handoff's mean).

That rate is measured, not fitted (:meth:`TtftFit.prefilled`, :meth:`TtftFit.drain_rate`):
every prefill the router sees end is its tokens over the worker's busy time, from the later of
its routing and the end of the prefill before it there.

The fit: ridge regression of the TTFT on the six features, each observation weighted by 1/TTFT
(the error judged is relative), per worker around its pool's fit
(every worker of this router), the pool's around :data:`~.ttft.PRIOR`. Each prior cost counts as
``PRIOR_WEIGHT`` mean observations of its feature, so a few observations leave the prior nearly
untouched (conservative) and a few hundred override it.
Costs come out >= 0 (a negative one is pinned at 0 and the rest re-solved). The model reports
its confidence as the observations behind it (``samples``, ``pool_samples``).

Why the fit is a fold that replay re-derives bit for bit:

* Sums are exact. Features are integers and the TTFT is taken in whole microseconds, so the
  normal equations' sums are Python integers: adding and removing an observation is exact and
  the sums do not depend on the order of the observations (order-independent by construction,
  not by the order of one router's events).
* A window, not a decay. An observation counts while its decision is at most
  :data:`FIT_WINDOW_S` older than ``now``; the window is shorter than the look-back replay folds
  before a range (``inflight_ttl_s`` + 60 s, at least 600 s), so a replay that starts mid-log
  holds the same observations as the live router did.
* Solving is a deterministic function of the sums (a 6x6 Gaussian elimination in floats, in the
  crate: ``native/src/ttft_fit.rs``, the same operations in the same order as the Python it
  replaced, ``tests/oracles/ttft_solve.py``, so old logs' fits re-derive bit for bit).
"""

from __future__ import annotations

import heapq

import switchyard_native

from schemas.events import CandidateScore, TtftModel
from schemas.types import RequestId, RequestPhase, WorkerId

from control_plane.router.ttft import PRIOR, cost_vector, features, rate_split, split

#: How far back (s, by decision time) an observation counts. At most replay's look-back.
FIT_WINDOW_S = 300.0
#: What each prior weighs, in mean observations.
PRIOR_WEIGHT = 4
#: Feature scales (a 2,048-token prompt in one step with no context: 1 request, 1 step, 2,048
#: tokens, 2,048^2 attention; one step beside 1,024 blocks of decodes; 2,048^2 step tokens
#: squared), for the conditioning of the solve.
_SCALE = (1.0, 1.0, 2048.0, 2048.0 * 2048.0, 1024.0, 2048.0 * 2048.0)
_N = 6
#: Prefills a worker's own measured rate needs before :meth:`TtftFit.drain_rate` prefers it to
#: the pool's.
RATE_MIN_OWN = 4

#: Numerator of an observation's integer weight 1/y (y in us, at least 1 ms): 2^62 keeps 13
#: significant digits at 10 s.
_REL_WEIGHT = 1 << 62


def _params(m: TtftModel) -> tuple[float, ...]:
    # A model without a decode term (or a step-squared one) is one whose cost for it is 0.
    return cost_vector(m)


#: Where ``X^T W X`` is kept: its upper triangle's (i, j), row by row; the position there of
#: each (i, j) of the whole matrix, row-major (what the crate reads), and of the diagonal's.
_UPPER = tuple((i, j) for i in range(_N) for j in range(i, _N))
_FULL = tuple(_UPPER.index((min(i, j), max(i, j))) for i in range(_N) for j in range(_N))
_DIAG = tuple(_UPPER.index((i, i)) for i in range(_N))


class _Sums:
    """Exact sums of one set of observations: n, X^T W X (its upper triangle, ``_UPPER``),
    X^T W y (y in us, W the integer weights 2^62 // y)."""

    __slots__ = ("n", "xx", "xy", "_solver")

    def __init__(self) -> None:
        self.n = 0
        self.xx = [0] * len(_UPPER)
        self.xy = [0] * _N
        self._solver: switchyard_native.TtftSolver | None = None

    def add(self, x: tuple[int, ...], y_us: int, sign: int, wait_us: int = 0) -> None:
        """One observation in (``sign`` 1) or out (-1) (:func:`_terms`)."""
        self.apply(sign, _terms(x, y_us, sign, wait_us))

    def apply(self, sign: int, terms: tuple[list[int], list[int]]) -> None:
        """One observation's :func:`_terms` in (``sign`` 1, the terms made with it) or out (-1)."""
        self.n += sign
        self._solver = None
        self.xx = list(map(int.__add__, self.xx, terms[0]))
        self.xy = list(map(int.__add__, self.xy, terms[1]))

    def floats(self) -> tuple[list[float], list[float], list[float]]:
        """What the crate's solve reads (:func:`_solver`): X^T W X whole, as floats; X^T W y
        over 1000 (y in ms; ``int / int`` rounds the exact quotient once); the prior weights."""
        xx = [float(v) for v in self.xx]
        return [xx[k] for k in _FULL], [v / 1000 for v in self.xy], _prior_weights(self)

    def solver(self) -> switchyard_native.TtftSolver:
        """The crate's solver of these sums (:func:`_solver`), kept until they change."""
        if self._solver is None:
            self._solver = _solver(self)
        return self._solver


def _terms(x: tuple[int, ...], y_us: int, sign: int, wait_us: int = 0) -> tuple[list[int], list[int]]:
    """What one observation adds to the sums (``sign`` 1) or takes off them (-1), computed once
    for its worker's and the pool's: ``y_us`` the TTFT, of which ``wait_us`` the wait behind the
    queue the prediction priced apart (``TtftModel.queue_tokens_per_ms``): the costs are fitted
    to the rest, the weight stays the whole TTFT's."""
    # Relative error is what is judged (a 70 ms TTFT predicted at 250 is as wrong as a 7 s one
    # at 25 s), but 1/y^2 lets noisy short requests set the costs of long ones: each
    # observation weighs 1/y (on the bench e2e logs, p90 error 0.94-0.98 against 1.16-1.24
    # unweighted and 0.68-0.87 at 1/y^2, p50 0.20-0.24 against 0.17-0.25 and 0.31-0.33),
    # as an integer so the sums stay exact.
    w = _REL_WEIGHT // max(y_us, 1000) * sign
    y = y_us - wait_us
    xw = [v * w for v in x]
    return [xw[i] * x[j] for i, j in _UPPER], [v * y for v in xw]


def _solver(s: _Sums) -> switchyard_native.TtftSolver:
    """``s`` reduced to floats (:meth:`_Sums.floats`, once per change) for the crate's solve
    (``native/src/ttft_fit.rs``): ridge around the prior it is given, minimising
    sum (y - x.theta)^2 + sum w_i ((theta_i - prior_i) s_i)^2 in the scaled space
    (theta_i s_i), with costs >= 0 (negative ones pinned at 0, re-solved over the others). For
    each set of free costs the fit is an affine function of the prior, from the sums alone (in
    the scaled space ``z = c + K p`` solves ``(A + D) z = b + D p``: ``A``, ``b`` the scaled
    sums, ``D`` the prior weights, ``p`` the scaled prior; a 6x6 Gaussian elimination with
    partial pivoting, one right-hand side for ``b`` and one per column of ``D``), which the
    solver keeps: a change of the pool's fit (a worker's prior, at every completion of any
    worker) then costs each worker a 6x6 product, not a solve
    (``benchmarks/router_ttft_path.py``)."""
    return switchyard_native.TtftSolver(*s.floats())


def _prior_weights(s: _Sums) -> list[float]:
    # Each cost's prior weighs PRIOR_WEIGHT mean observations of that feature (a diagonal
    # g-prior): n observations pull a cost n / (n + PRIOR_WEIGHT) of the way from the prior,
    # however large the requests were. A feature never seen keeps the reference scale.
    return [PRIOR_WEIGHT * (s.xx[d] / s.n / (_SCALE[i] * _SCALE[i]) if s.xx[d] > 0 and s.n > 0 else 1.0)
            for i, d in enumerate(_DIAG)]


class TtftFit:
    """The fit as a fold: :meth:`routed` and :meth:`completed` take the router's own events'
    facts, :meth:`expire` the decision time; :meth:`model` reads a worker's model.

    What is cached, and what a change invalidates: every decision reads every candidate's
    model, and every completion changes the pool's fit (every worker's prior) and one worker's
    own sums. So the pool's model is re-solved once per change, a worker's own sums are reduced
    to their affine maps (the crate's solver, :func:`_solver`, kept on the sums) only when that
    worker's observations change, and a worker's model is those maps applied to the pool's fit
    (a 6x6 product per step of the non-negativity loop), kept until the next change. Each is a
    function of the current sums only, so when it is recomputed does not change a bit of the
    result."""

    __slots__ = ("prior", "_pending", "_obs", "_expiry", "_by_worker", "_pool", "_models", "_pool_fit",
                 "_seq", "_rates", "_rate_pool", "_rate_expiry")

    def __init__(self, prior: TtftModel = PRIOR) -> None:
        self.prior = prior
        #: Request -> (worker, decided at, features, queue wait us) of its prefilling decision,
        #: until it ends.
        self._pending: dict[RequestId, tuple[WorkerId, float, tuple[int, ...], int]] = {}
        #: Observation id -> (worker, features, ttft us, queue wait us); a heap of (decided at,
        #: id) to expire.
        self._obs: dict[int, tuple[WorkerId, tuple[int, ...], int, int]] = {}
        self._expiry: list[tuple[float, int]] = []
        self._by_worker: dict[WorkerId, _Sums] = {}
        self._pool = _Sums()
        #: Worker -> its model, and the pool's model (both dropped at every change).
        self._models: dict[WorkerId, TtftModel] = {}
        self._pool_fit: TtftModel | None = None
        self._seq = 0
        #: The prefill rate seen: worker -> [prefills, tokens, busy us], the pool's, and a heap
        #: of (ended at, worker, tokens, busy us) to expire them (:meth:`prefilled`).
        self._rates: dict[WorkerId, list[int]] = {}
        self._rate_pool = [0, 0, 0]
        self._rate_expiry: list[tuple[float, WorkerId, int, int]] = []

    def routed(self, request_id: RequestId, worker: WorkerId, phase: RequestPhase, row: CandidateScore | None,
               prompt_tokens: int, block_size: int, decided_at_s: float, queue_done_tokens: int = 0,
               decode: bool = True, packed: bool = True, chunk_tokens: int | None = None,
               queue_rate: float | None = None, busy_steps: int = 0) -> None:
        """A decision: a prefilling phase's row (with the part of its queue the worker had
        computed, as the decision's model recorded it) becomes the request's pending
        observation. ``decode`` False: the decision's model had no decode term (a log written
        before it), so neither has its observation (its decode feature 0: a fit of such
        observations alone is the four-cost fit, bit for bit, with the decode cost at the
        prior's 0). ``packed`` False: nor had it the step-squared cost
        (``TtftModel.ms_per_step_token_sq``): its observation has the old features (the queue
        as one prompt), its step-squared feature 0. ``chunk_tokens``: the steps' size in the
        decision's model (None: the prior's). ``queue_rate``: the model waited for the full
        steps before the request's last at that rate (``TtftModel.queue_tokens_per_ms``): the
        observation is the last step's features, and the wait (whole microseconds) comes off
        its TTFT. ``busy_steps``: the steps under way on the worker that the decision's model
        charged (``TtftModel.busy_steps``; 0 for a model without it), in the steps feature."""
        if phase is RequestPhase.DECODE or row is None or prompt_tokens <= 0 or block_size <= 0:
            return
        chunk = chunk_tokens or self.prior.chunk_tokens
        at_rate = packed and queue_rate is not None
        wait_us = 0
        if at_rate:
            q, _, n = split(row, prompt_tokens, block_size, queue_done_tokens)
            wait_us = round(rate_split(q + n, chunk)[0] / queue_rate * 1000)
        self._pending[request_id] = (worker, decided_at_s, features(row, prompt_tokens, block_size, chunk,
                                                                    queue_done_tokens, decode, packed, at_rate,
                                                                    busy_steps if packed else 0),
                                     wait_us)

    def completed(self, request_id: RequestId, ttft_ms: float) -> None:
        """The request's first token came ``ttft_ms`` after its first decision (router queueing
        already taken off); a request without a pending decision, or with no TTFT (the
        simulator's virtual router records 0), is no observation."""
        p = self._pending.pop(request_id, None)
        if p is None or not ttft_ms > 0:
            return
        worker, at, x, wait = p
        y = round(ttft_ms * 1000)
        # The queue went faster than the rate measured (a prefill seen end late, the steps a
        # burst's last request shares): the costs are fitted to what is left of the TTFT, never
        # to a negative time, which pins them all at 0 (a bench e2e round robin log: its worker's
        # costs fell to 0 and it predicted 1-10 ms for 61-79 ms).
        wait = min(wait, y)
        self._seq += 1
        self._obs[self._seq] = (worker, x, y, wait)
        heapq.heappush(self._expiry, (at, self._seq))
        terms = _terms(x, y, 1, wait)
        self._by_worker.setdefault(worker, _Sums()).apply(1, terms)
        self._pool.apply(1, terms)
        self._changed(worker)

    def prefilled(self, worker: WorkerId, since_s: float, at_s: float, tokens: int) -> None:
        """``worker`` computed a prefill of ``tokens`` (as the router counted them: net of the
        cache hits it saw) between ``since_s`` and ``at_s`` (its routing, or the end of the
        prefill before it there if later: ``InflightLedger.prefill_done``). Integer sums (busy
        time in whole microseconds), expired like the observations."""
        if tokens <= 0 or not at_s >= since_s:
            return
        us = round((at_s - since_s) * 1e6)
        heapq.heappush(self._rate_expiry, (at_s, worker, tokens, us))
        self._rate_add(worker, tokens, us, 1)

    def _rate_add(self, worker: WorkerId, tokens: int, us: int, sign: int) -> None:
        own = self._rates.setdefault(worker, [0, 0, 0])
        for sums in (own, self._rate_pool):
            sums[0] += sign
            sums[1] += sign * tokens
            sums[2] += sign * us
        if not own[0]:
            del self._rates[worker]

    def drain_rate(self, worker: WorkerId) -> float | None:
        """Prompt tokens per ms a busy ``worker`` computes, as seen in the fit window: its own
        prefills' (at least :data:`RATE_MIN_OWN`), else the pool's, else None (none seen). What
        the queue ahead drains at (``ttft.queue_done``): measured, not the fitted costs', which
        take the prompt's tokens and the fixed costs apart far less surely than their sum."""
        own = self._rates.get(worker)
        sums = own if own is not None and own[0] >= RATE_MIN_OWN else self._rate_pool
        return sums[1] * 1000 / sums[2] if sums[0] and sums[2] > 0 else None

    def forget(self, request_id: RequestId) -> None:
        """The request ended without a TTFT (failed, rejected)."""
        self._pending.pop(request_id, None)

    def expire(self, now: float) -> None:
        """Drop the observations decided more than :data:`FIT_WINDOW_S` before ``now``."""
        horizon = now - FIT_WINDOW_S
        rates = self._rate_expiry
        while rates and rates[0][0] < horizon:
            _, worker, tokens, us = heapq.heappop(rates)
            self._rate_add(worker, tokens, us, -1)
        while self._expiry and self._expiry[0][0] < horizon:
            _, oid = heapq.heappop(self._expiry)
            worker, x, y, wait = self._obs.pop(oid)
            terms = _terms(x, y, -1, wait)
            sums = self._by_worker[worker]
            sums.apply(-1, terms)
            if not sums.n:
                del self._by_worker[worker]
            self._pool.apply(-1, terms)
            self._changed(worker)

    def _changed(self, worker: WorkerId) -> None:
        """``worker``'s observations (and so the pool's) changed."""
        self._models.clear()
        self._pool_fit = None

    def model(self, worker: WorkerId) -> TtftModel:
        """The worker's model: its own observations around the pool's fit; the pool's fit when
        it has none yet; the prior when the pool has none."""
        m = self._models.get(worker)
        if m is not None:
            return m
        pool = self._pool_model()
        sums = self._by_worker.get(worker)
        if sums is None:
            return pool
        b, st, t, cc, d, sq = sums.solver().solve(_params(pool))
        m = self._models[worker] = TtftModel(base_ms=b, step_ms=st, ms_per_token=t, ms_per_token_ctx=2 * cc,
                                             ms_per_decode_block_step=d, ms_per_step_token_sq=sq,
                                             chunk_tokens=self.prior.chunk_tokens, samples=sums.n,
                                             pool_samples=self._pool.n)
        return m

    def _pool_model(self) -> TtftModel:
        m = self._pool_fit
        if m is None:
            if not self._pool.n:
                m = self.prior
            else:
                b, st, t, c, d, sq = self._pool.solver().solve(_params(self.prior))
                m = TtftModel(base_ms=b, step_ms=st, ms_per_token=t, ms_per_token_ctx=2 * c, ms_per_decode_block_step=d,
                              ms_per_step_token_sq=sq,
                              chunk_tokens=self.prior.chunk_tokens, samples=0, pool_samples=self._pool.n)
            self._pool_fit = m
        return m

    def observations(self) -> int:
        return self._pool.n
