"""P/D pairs chosen together (issue 39, item 5). Pure.

In disaggregated serving a request has two workers: the prefill worker computes its prompt's KV,
which is then handed to a decode worker that generates the output. Without pairs each is chosen
by its own decision, the decode worker only once the prefill is done. With
``RouterConfig.pd_pairs`` the prefill decision chooses both, each candidate pair costing

    cost(p, d) = prefill TTFT(p) + hand-off(p, d) + ITL(d) + ITL penalty(d)

* ``prefill TTFT(p)``: the prefill row's ``predicted_ttft_ms`` (``ttft.py``);
* ``hand-off(p, d)``: the KV transfer from ``p`` to ``d`` and the decode worker's first step, a
  line in the prompt's tokens (:class:`LinearMs`) fitted per pair, around the pool of all pairs
  (weighing :data:`POOL_WEIGHT` observations), around a conservative prior (:data:`HOP_PRIOR`), from this router's own decode hops: from the
  decode decision to the request's first token (:class:`PairFit`; the workers' own
  ``KvTransferCompleted`` are not on the router's fold, which holds only its own events);
* ``ITL(d)``: the decode worker's inter-token latency once the request joins it, a line in the
  KV blocks it would then hold (the decode row's ``decode_blocks``, plus the blocks of requests
  already paired with it and not handed off yet: ``PairScore.paired_blocks``), fitted per decode
  worker from its requests' ``RequestCompleted.itl_mean_ms``, around the fit of all decode
  workers (weighing :data:`POOL_WEIGHT` observations), around :data:`ITL_PRIOR`;
* ``ITL penalty(d)``: ``(ITL(d) - itl_slo_ms) x expected output tokens`` when positive and the
  SLO is set: the time the output would lose to a decode worker slower than the SLO.

Pairs whose times tie go to the decode worker holding the fewest blocks, then the seed.
Measured in virtual time it does not beat the separate decisions (docs/routing-cost.md), so it
is off by default. Only decode workers the capacity guard leaves (those that can hold the request now) pair, unless
none can. With ``cost = "ttft"`` the pairs span the :data:`PAIR_PREFILLS` cheapest competing
prefill workers and the argmin picks both; with ``cost = "blocks"`` the prefill worker is the
blocks argmin and the pairs pick its decode worker (a time cannot be added to a block count).
Ties are broken by the decision's seed. The decode decision then takes the paired worker unless
the capacity guard or a failure excludes it (``decide(paired=...)``).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence

import msgspec

from control_plane.router.errors import InvalidRoutingInput
from schemas.events import CandidateScore, PairScore
from schemas.types import WorkerId

#: How many of the cheapest competing prefill workers pair with every decode worker (cost =
#: ttft): bounds a decision's pairs (and its recorded rows) at PAIR_PREFILLS x decode workers.
PAIR_PREFILLS = 4

#: An observation counts this long after it was made, like the TTFT fit's (``ttft_fit.py``):
#: replay folds 660 s before a range, so its fit equals the live one.
WINDOW_S = 300.0
#: Observations a pair (or a decode worker) needs before its own fit is used, and the weight of
#: the model it is fitted around, in observations.
MIN_OWN = 4
PRIOR_WEIGHT = 4
#: The weight, in observations, of the pool's fit that a pair's (or a decode worker's) own is
#: fitted around: strong, so that one pair's noise does not steer choices while identical
#: workers (every bench here) share one model; a pair truly slower for long moves it anyway.
POOL_WEIGHT = 64


class LinearMs(msgspec.Struct, frozen=True):
    """``base_ms + ms_per_unit x units``: a hand-off in prompt tokens, an ITL in KV blocks."""

    base_ms: float
    ms_per_unit: float

    def at(self, units: int) -> float:
        return self.base_ms + self.ms_per_unit * units


#: The hand-off's prior: 131 KB of KV per token (an 8B model, fp16) at 10 GB/s, and 10 ms of
#: fixed cost (the answer's way back, the decode decision, the decode worker's first step).
#: Conservative: NIXL over RDMA moves it several times faster.
HOP_PRIOR = LinearMs(10.0, 0.013)
#: The ITL's prior: 20 ms a token (conservative for an 8B model on one GPU), and 4 us more per KV
#: block the decode worker holds (a 64-token block of an 8B model, 8 MB, read each step at 2 TB/s).
ITL_PRIOR = LinearMs(20.0, 0.004)


def pair_key(prefill: WorkerId, decode: WorkerId) -> str:
    return f"{prefill}>{decode}"


class PairInputs(msgspec.Struct, kw_only=True):
    """What a prefill decision needs to pair (besides its own inputs): the decode candidates,
    and the hand-off and ITL models (a pair or worker missing here is predicted under the pool's
    or the prior)."""

    workers: list  # list[WorkerLoad] (decision_types imports this module's shapes lazily)
    hop: dict[str, LinearMs] = {}
    hop_pool: LinearMs = HOP_PRIOR
    itl: dict[str, LinearMs] = {}
    itl_pool: LinearMs = ITL_PRIOR
    #: Per decode worker, the blocks of requests already paired with it and not handed off yet
    #: (``RouterLedger.pair_pending``): its ITL is predicted with them joined too.
    pending: dict[str, int] = {}


class _Sums:
    """Exact integer sums of (x, y) observations: n, x, x^2, y (us), x y."""

    __slots__ = ("n", "sx", "sxx", "sy", "sxy")

    def __init__(self) -> None:
        self.n = self.sx = self.sxx = self.sy = self.sxy = 0

    def add(self, x: int, y: int, sign: int = 1) -> None:
        self.n += sign
        self.sx += sign * x
        self.sxx += sign * x * x
        self.sy += sign * y
        self.sxy += sign * x * y

    def fit(self, around: LinearMs, weight: int = PRIOR_WEIGHT) -> LinearMs:
        """Least squares over the observations and ``weight`` points of ``around`` (half
        at 0 units, half at the observations' mean), costs >= 0. A function of the sums alone:
        the same observations, in any order, give the same model."""
        if self.n <= 0:
            return around
        mean = self.sx / self.n
        k = weight / 2
        y0, y1 = around.base_ms * 1000.0, around.at(mean) * 1000.0
        n = self.n + 2 * k
        sx = self.sx + k * mean
        sxx = self.sxx + k * mean * mean
        sy = self.sy + k * (y0 + y1)
        sxy = self.sxy + k * mean * y1
        det = n * sxx - sx * sx
        slope = (n * sxy - sx * sy) / det if det > 0 else 0.0
        if slope < 0.0:
            slope = 0.0
        base = (sy - slope * sx) / n
        if base < 0.0:
            base = 0.0
        return LinearMs(base / 1000.0, slope / 1000.0)


class PairFit:
    """The hand-off and ITL fits: a fold of the router's own events, windowed by time
    (:data:`WINDOW_S`), in exact integer sums (order-independent, exact removal)."""

    def __init__(self) -> None:
        self._hop: dict[str, _Sums] = {}
        self._hop_pool = _Sums()
        self._itl: dict[str, _Sums] = {}
        self._itl_pool = _Sums()
        self._log: deque[tuple[float, str, str, int, int]] = deque()  # (at, kind, key, x, y_us)

    def observe_hop(self, prefill: WorkerId, decode: WorkerId, tokens: int, ms: float, at_s: float) -> None:
        if ms < 0.0 or tokens < 0:
            return
        y = round(ms * 1000.0)
        key = pair_key(prefill, decode)
        self._hop.setdefault(key, _Sums()).add(tokens, y)
        self._hop_pool.add(tokens, y)
        self._log.append((at_s, "hop", key, tokens, y))

    def observe_itl(self, decode: WorkerId, blocks: int, itl_ms: float, at_s: float) -> None:
        if itl_ms <= 0.0 or blocks < 0:
            return
        y = round(itl_ms * 1000.0)
        self._itl.setdefault(decode, _Sums()).add(blocks, y)
        self._itl_pool.add(blocks, y)
        self._log.append((at_s, "itl", decode, blocks, y))

    def expire(self, now_s: float) -> None:
        log = self._log
        while log and log[0][0] < now_s - WINDOW_S:
            _, kind, key, x, y = log.popleft()
            if kind == "hop":
                self._hop[key].add(x, y, -1)
                self._hop_pool.add(x, y, -1)
                if not self._hop[key].n:
                    del self._hop[key]
            else:
                self._itl[key].add(x, y, -1)
                self._itl_pool.add(x, y, -1)
                if not self._itl[key].n:
                    del self._itl[key]

    def inputs(self, workers: list, pending: dict[str, int] | None = None) -> PairInputs:
        """The models of a decision's pairs over decode ``workers``: each pair and decode worker
        with :data:`MIN_OWN` observations its own fit (around the pool's, around the prior)."""
        pool = self._hop_pool.fit(HOP_PRIOR) if self._hop_pool.n >= MIN_OWN else HOP_PRIOR
        hop = {k: s.fit(pool, POOL_WEIGHT) for k, s in self._hop.items() if s.n >= MIN_OWN}
        itl_pool = self._itl_pool.fit(ITL_PRIOR) if self._itl_pool.n >= MIN_OWN else ITL_PRIOR
        itl = {k: s.fit(itl_pool, POOL_WEIGHT) for k, s in self._itl.items() if s.n >= MIN_OWN}
        return PairInputs(workers=workers, hop=hop, hop_pool=pool, itl=itl, itl_pool=itl_pool, pending=pending or {})

    def observations(self) -> int:
        return len(self._log)


class PairChoice(msgspec.Struct, frozen=True):
    prefill: int  # position among the prefill candidates
    decode: WorkerId
    pairs: tuple[PairScore, ...]
    reason: str


def choose(prefills: Sequence[int], prefill_ids: Sequence[WorkerId], prefill_ttft: Sequence[float],
           decode_rows: Sequence[CandidateScore], decode_ok: Sequence[int], pair: PairInputs, prompt_tokens: int,
           expected_output_tokens: int, itl_slo_ms: float, rng_seed: int) -> PairChoice:
    """The cheapest pair of a prefill candidate (positions ``prefills``, their ids and predicted
    TTFTs by position) and a decode candidate (``decode_rows`` in id order; positions
    ``decode_ok`` pair); among pairs tied, those whose decode worker holds the fewest blocks
    (with the pending pairs'), then ``rng_seed``."""
    if not prefills or not decode_ok:
        raise InvalidRoutingInput("a pair needs a prefill and a decode candidate")
    rows: list[PairScore] = []
    where: list[tuple[int, WorkerId]] = []
    blocks: dict[WorkerId, int] = {}
    for j in decode_ok:
        drow = decode_rows[j]
        d = drow.worker_id
        pending = pair.pending.get(d, 0)
        blocks[d] = int(drow.decode_blocks) + pending
        itl = pair.itl.get(d, pair.itl_pool).at(int(drow.decode_blocks) + pending)
        over = itl - itl_slo_ms
        penalty = over * expected_output_tokens if itl_slo_ms > 0.0 and over > 0.0 else 0.0
        for i in prefills:
            p = prefill_ids[i]
            hop = pair.hop.get(pair_key(p, d), pair.hop_pool).at(prompt_tokens)
            t = prefill_ttft[i]
            rows.append(PairScore(p, d, t, hop, itl, penalty, t + hop + itl + penalty, pending))
            where.append((i, d))
    best = min(r.cost for r in rows)
    limit = best + 1e-9 * max(1.0, abs(best))
    tied = [k for k, r in enumerate(rows) if r.cost <= limit]
    if len(tied) > 1:  # equal times (an ITL fit without a slope yet): the emptier decode worker
        load = {k: blocks[where[k][1]] for k in tied}
        least = min(load.values())
        tied = [k for k in tied if load[k] == least]
    k = tied[0] if len(tied) == 1 else tied[random.Random(rng_seed).randrange(len(tied))]
    r = rows[k]
    reason = (f"pair {r.prefill_worker} -> {r.decode_worker} at {_ms(r.cost)} ms = prefill TTFT "
              f"{_ms(r.prefill_ttft_ms)} + hand-off {_ms(r.transfer_ms)} + ITL {_ms(r.itl_ms)}"
              + (f" + ITL penalty {_ms(r.itl_penalty_ms)}" if r.itl_penalty_ms else "")
              + f", of {len(rows)} pairs" + (f" ({len(tied)} tied, broken by rng_seed {rng_seed})"
                                            if len(tied) > 1 else ""))
    ordered = tuple(sorted(rows, key=lambda s: (s.prefill_worker, s.decode_worker)))
    return PairChoice(where[k][0], where[k][1], ordered, reason)


def recorded_inputs(workers: list, pairs: Sequence[PairScore]) -> PairInputs:
    """The pair models that predict exactly what ``pairs`` recorded (each hand-off and ITL
    pinned in the base, ``0 x units`` added: exact), for replay's table check."""
    hop = {pair_key(r.prefill_worker, r.decode_worker): LinearMs(r.transfer_ms, 0.0) for r in pairs}
    itl = {r.decode_worker: LinearMs(r.itl_ms, 0.0) for r in pairs}
    pending = {r.decode_worker: r.paired_blocks for r in pairs if r.paired_blocks}
    return PairInputs(workers=workers, hop=hop, itl=itl, pending=pending)


def _ms(x: float) -> str:
    return f"{x:.1f}"


__all__ = ["HOP_PRIOR", "ITL_PRIOR", "PAIR_PREFILLS", "LinearMs", "PairChoice", "PairFit", "PairInputs", "choose",
           "pair_key", "recorded_inputs"]
