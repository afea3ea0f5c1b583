"""Routing predictions against outcomes: the overlap a decision saw on the worker it chose, against
the cached tokens that worker reported, with a blame for each shortfall and the TTFT it predicted there
(``RequestRouted.predicted_ttft_ms``, ``control_plane/router/ttft.py``) against the one observed
(issue 39, item 3; no Prometheus metrics yet).

Pure: :func:`reconcile` folds the request events and the KV records (with their positions) of a
log; the caller reads them (``switchyard replay reconcile``). For each routed phase that did a
prefill (aggregated or prefill), the last attempt's ``RequestRouted`` row of the chosen worker
gives what the router saw (the index's matched blocks and the speculative overlap of its own
in-flight requests) and the cached tokens that worker reported what the engine found: the prefill
worker's ``PrefillCompleted`` in disaggregated serving, the ``RequestCompleted`` (which carries the
worker's usage) in aggregated serving. The blame:

* ``stale_index``: the engine had more blocks than the router saw, and the KV events storing them
  were on the log before the decision but beyond the position the router had folded
  (``RequestRouted.index_position``): the router decided on an index that lagged the log;
* ``stored_after_routing``: the engine had more, stored by events produced after the decision (a
  request that finished in between, or one another router sent);
* ``speculative_not_hit``: the router counted blocks its in-flight requests were writing, the
  engine did not hit them (the request was scheduled before those blocks were computed);
* ``evicted_after_routing``: the index said the worker held blocks the engine no longer had.

``routed_past_cache`` counts decisions where another eligible candidate showed more overlap than
the chosen one: a choice made on load, not a prediction that failed.

Where a disaggregated request's TTFT went, from the prefill worker's own ``PrefillCompleted``
(published when it ends, ``duration_ms`` after the worker took the request): the hop to the worker
(the decision to the worker taking it), the worker's time (its engine's queue and steps, the
staging fill and the publish) and the rest (the answer's way back, the decode decision, the
transfer and the decode worker's first step). And whether the request reached its worker in the
order the router routed it: a request the router sent after another to the same worker that
the worker took first (or the other way round) waited behind a queue the router did not predict
(``reordered``; each side's order is read from its own clock, so a skew between hosts does not
make one).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

import msgspec

from schemas.envelope import Envelope
from schemas.events import BlockStored, PrefillCompleted, RequestAdmitted, RequestCompleted, RequestRouted
from schemas.types import RequestPhase

from control_plane.router.ttft import queue_ahead

BLAMES = ("stale_index", "stored_after_routing", "speculative_not_hit", "evicted_after_routing")


class KvRecord(msgspec.Struct, frozen=True):
    """A ``kv`` record as the reconciliation needs it: where it sits and what it says."""

    topic: str
    partition: int
    offset: int
    env: Envelope


class OverlapCheck(msgspec.Struct, frozen=True, kw_only=True):
    """One routed prefill: what the router saw on the chosen worker and what the engine found."""

    request_id: str
    worker_id: str
    phase: str
    prompt_tokens: int
    block_size: int
    #: The index's matched blocks (every tier) and the ledger's speculative overlap, chosen row.
    seen_blocks: int
    speculative_blocks: int
    #: Cached tokens the engine reported for this phase, and in whole blocks.
    cached_tokens: int
    cached_blocks: int
    #: The largest overlap (index or speculative) among the other eligible candidates (with
    #: the same cap as ``predicted_blocks``).
    best_other_blocks: int
    #: Prompt blocks stored on the chosen worker by KV records produced before the decision that
    #: the router had not folded when it decided.
    unfolded_blocks: int
    #: What the engine can hit of what the router saw: max(seen, speculative), at most
    #: ``(prompt_tokens - 1) // block_size`` (an engine computes at least the prompt's last token,
    #: so a whole-prompt hit reports one block less, as vLLM does).
    predicted_blocks: int
    blame: str = ""
    #: The TTFT the router predicted on the chosen worker (None before it recorded one, or for
    #: a decode phase) and the one observed: ``RequestCompleted.ttft_ms`` less the time the
    #: request queued in the router before its first decision. In disaggregated serving the
    #: observed time includes the transfer and the decode worker's first step, which the
    #: prediction does not model yet.
    predicted_ttft_ms: float | None = None
    observed_ttft_ms: float | None = None
    #: Prefill tokens the chosen row's prediction waited behind (``ttft.queue_ahead`` less the
    #: model's ``queue_done_tokens``), and the observations behind the model that
    #: predicted (``RequestRouted.ttft_model``; -1 for the prior recorded before models were).
    queued_tokens: int = 0
    model_samples: int = -1
    #: A prefill phase's time (ms) from the decision to the prefill worker taking the request,
    #: the worker's own (``PrefillCompleted.duration_ms``), and the rest of the observed TTFT
    #: (the way back, the decode decision, the transfer, the decode worker's first step); None
    #: when not known (an aggregated phase: the router records its ``PrefillCompleted``).
    to_worker_ms: float | None = None
    worker_ms: float | None = None
    after_worker_ms: float | None = None
    #: The worker took this request and another one routed there in the other order than the
    #: router routed them (see the module docstring).
    reordered: bool = False

    @property
    def ttft_blame(self) -> str:
        """Where a TTFT prediction's error is put, first that applies: ``prior`` (no
        observation behind the model yet), ``overlap`` (the cached tokens were not what the
        router saw: the overlap blame), ``queue`` (work was queued ahead, whose time and size
        the router estimates), else ``own_prefill`` (the request's own prefill and handoff)."""
        if self.model_samples <= 0:
            return "prior"
        if self.blame:
            return "overlap"
        if self.reordered:
            return "reordered"
        return "queue" if self.queued_tokens > 0 else "own_prefill"

    @property
    def ttft_error(self) -> float | None:
        """|predicted - observed| / observed, when both are known."""
        if self.predicted_ttft_ms is None or not self.observed_ttft_ms:
            return None
        return abs(self.predicted_ttft_ms - self.observed_ttft_ms) / self.observed_ttft_ms


class Reconciliation(msgspec.Struct, frozen=True, kw_only=True):
    checks: tuple[OverlapCheck, ...]
    #: Routed prefills without a reported outcome (failed, or the log ends before it).
    unmatched: int

    def summary(self) -> dict:
        c = self.checks
        blames = Counter(x.blame for x in c if x.blame)
        bs = {x.block_size for x in c} or {1}
        out = {
            "requests": len(c),
            "unmatched": self.unmatched,
            "block_size": min(bs),
            "predicted_blocks": sum(x.predicted_blocks for x in c),
            "cached_blocks": sum(x.cached_blocks for x in c),
            "prompt_tokens": sum(x.prompt_tokens for x in c),
            "cached_tokens": sum(x.cached_tokens for x in c),
            "exact": sum(not x.blame for x in c),
            "routed_past_cache": sum(x.best_other_blocks > x.predicted_blocks for x in c),
            "blocks_left_elsewhere": sum(max(x.best_other_blocks - x.predicted_blocks, 0) for x in c),
        }
        out.update({b: blames.get(b, 0) for b in BLAMES})
        errs = sorted(e for x in c if (e := x.ttft_error) is not None)
        out["ttft_predictions"] = len(errs)
        out["prediction_err_p50"] = _quantile(errs, 0.5)
        out["prediction_err_p90"] = _quantile(errs, 0.9)
        out["ttft_error_by"] = _error_by(c)
        out["reordered"] = sum(x.reordered for x in c)
        obs = sorted(x.observed_ttft_ms for x in c if x.observed_ttft_ms is not None)
        out["observed_ttft_p50"] = _quantile(obs, 0.5)
        for name in ("to_worker_ms", "worker_ms", "after_worker_ms"):
            xs = sorted(v for x in c if (v := getattr(x, name)) is not None)
            out[f"{name}_p50"], out[f"{name}_p90"] = _quantile(xs, 0.5), _quantile(xs, 0.9)
        out["missed_blocks"] = {b: sum(x.cached_blocks - x.predicted_blocks for x in c if x.blame == b)
                                for b in ("stale_index", "stored_after_routing")}
        return out


def _error_by(checks: Sequence[OverlapCheck]) -> dict:
    """Per :attr:`OverlapCheck.ttft_blame`: predictions, error p50, signed error p50 (> 0: the
    prediction was slower than observed) and the share of the summed absolute error."""
    groups: dict[str, list[OverlapCheck]] = {}
    for x in checks:
        if x.ttft_error is not None:
            groups.setdefault(x.ttft_blame, []).append(x)
    total = sum(x.ttft_error for g in groups.values() for x in g) or 1.0
    out = {}
    for name, g in sorted(groups.items()):
        errs = sorted(x.ttft_error for x in g)
        signed = sorted((x.predicted_ttft_ms - x.observed_ttft_ms) / x.observed_ttft_ms for x in g)
        out[name] = {"n": len(g), "err_p50": _quantile(errs, 0.5), "bias_p50": _quantile(signed, 0.5),
                     "share": sum(errs) / total}
    return out


def _quantile(xs: Sequence[float], q: float) -> float | None:
    """The nearest-rank quantile of sorted ``xs``; None when empty."""
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))] if xs else None


def _blame(seen: int, spec: int, predicted: int, cached: int, unfolded: int) -> str:
    if cached > predicted:
        return "stale_index" if unfolded > predicted else "stored_after_routing"
    if cached < predicted:
        return "speculative_not_hit" if spec > seen else "evicted_after_routing"
    return ""


def reconcile(requests: Iterable[Envelope], kv: Sequence[KvRecord]) -> Reconciliation:
    """Fold the ``requests`` stream's envelopes and the ``kv`` records (any order within each)."""
    admitted: dict[str, RequestAdmitted] = {}
    routed: dict[str, tuple[Envelope, RequestRouted]] = {}
    outcome: dict[tuple[str, str], int] = {}
    #: (request, worker) -> (the worker took it at, s of its clock; its time there, ms), from a
    #: prefill worker's PrefillCompleted.
    took: dict[tuple[str, str], tuple[float, float]] = {}
    completed: dict[tuple[str, str], int] = {}
    ttft: dict[str, float] = {}
    queued: dict[str, float] = {}
    for env in requests:
        ev = env.data
        if isinstance(ev, RequestAdmitted):
            admitted[ev.request_id] = ev
        elif isinstance(ev, RequestRouted) and ev.phase is not RequestPhase.DECODE:
            queued[ev.request_id] = max(queued.get(ev.request_id, 0.0), ev.queued_ms)
            prev = routed.get(ev.request_id)
            if prev is None or ev.attempt >= prev[1].attempt:
                routed[ev.request_id] = (env, ev)
        elif isinstance(ev, PrefillCompleted):
            outcome[(ev.request_id, ev.worker_id)] = ev.cached_tokens
            took[(ev.request_id, ev.worker_id)] = (env.occurred_at_ns / 1e9 - ev.duration_ms / 1e3, ev.duration_ms)
        elif isinstance(ev, RequestCompleted):
            completed[(ev.request_id, ev.worker_id)] = ev.cached_tokens
            ttft[ev.request_id] = ev.ttft_ms
    # Per worker, the KV stores in log order with the time they were produced.
    stores: dict[str, list[tuple[str, int, int, int, tuple]]] = {}
    for r in kv:
        ev = r.env.data
        if isinstance(ev, BlockStored):
            stores.setdefault(ev.worker_id, []).append(
                (r.topic, r.partition, r.offset, r.env.occurred_at_ns, tuple(ev.block_hashes)))
    reordered = _reordered({rid: (ev.worker_id, _decided_at(env), took[(rid, ev.worker_id)][0])
                            for rid, (env, ev) in routed.items()
                            if ev.phase is RequestPhase.PREFILL and (rid, ev.worker_id) in took})
    checks: list[OverlapCheck] = []
    unmatched = 0
    for rid, (env, ev) in sorted(routed.items()):
        adm = admitted.get(rid)
        key = (rid, ev.worker_id)
        # A prefill worker publishes its own PrefillCompleted with the cached tokens; in
        # aggregated serving the router records PrefillCompleted at the first token, before the
        # worker's usage (and its cached tokens) arrives with the RequestCompleted.
        if ev.phase is RequestPhase.PREFILL:
            cached = outcome.get(key, completed.get(key))
        else:
            cached = completed.get(key, outcome.get(key))
        if adm is None or cached is None:
            unmatched += 1
            continue
        rows = {s.worker_id: s for s in ev.scores}
        mine = rows.get(ev.worker_id)
        seen = mine.overlap_blocks if mine else 0
        spec = mine.speculative_overlap if mine else 0
        others = [max(s.overlap_blocks, s.speculative_overlap) for s in ev.scores
                  if s.worker_id != ev.worker_id and s.eligible]
        unfolded = _unfolded(stores.get(ev.worker_id, ()), ev.index_position, env.occurred_at_ns, adm.block_hashes)
        cached_blocks = cached // adm.block_size
        reachable = max(adm.prompt_tokens - 1, 0) // adm.block_size
        predicted = min(max(seen, spec), reachable)
        observed = ttft[rid] - queued.get(rid, 0.0) if rid in ttft else None
        hop = work = rest = None
        if ev.phase is RequestPhase.PREFILL and key in took:
            at, work = took[key]
            hop = (at - _decided_at(env)) * 1e3
            rest = None if observed is None else observed - hop - work
        checks.append(OverlapCheck(
            request_id=rid, worker_id=ev.worker_id, phase=ev.phase.value, prompt_tokens=adm.prompt_tokens,
            block_size=adm.block_size, seen_blocks=seen, speculative_blocks=spec, cached_tokens=cached,
            cached_blocks=cached_blocks, best_other_blocks=min(max(others, default=0), reachable), unfolded_blocks=unfolded,
            predicted_blocks=predicted, blame=_blame(seen, spec, predicted, cached_blocks, unfolded),
            predicted_ttft_ms=ev.predicted_ttft_ms,
            observed_ttft_ms=observed,
            queued_tokens=max(queue_ahead(mine) - ((ev.ttft_model.queue_done_tokens or 0) if ev.ttft_model else 0), 0)
            if mine else 0,
            model_samples=-1 if ev.ttft_model is None else ev.ttft_model.samples + ev.ttft_model.pool_samples,
            to_worker_ms=hop, worker_ms=work, after_worker_ms=rest, reordered=rid in reordered))
    return Reconciliation(checks=tuple(checks), unmatched=unmatched)


def _decided_at(env: Envelope) -> float:
    """A decision's time (s): its ``decided_at_s``, or when it was published (events before it)."""
    return env.data.decided_at_s or env.occurred_at_ns / 1e9


def _reordered(taken: Mapping[str, tuple[str, float, float]]) -> set[str]:
    """The requests of ``taken`` (request -> (worker, decided at by the router's clock, taken at
    by the worker's)) that their worker took in the other order than the router routed them
    relative to at least one other request there: one taken before a request routed earlier,
    or after one routed later."""
    by_worker: dict[str, list[tuple[float, float, str]]] = {}
    for rid, (worker, decided, at) in taken.items():
        by_worker.setdefault(worker, []).append((decided, at, rid))
    out: set[str] = set()
    for rows in by_worker.values():
        rows.sort()
        latest = -math.inf  # the latest taking among the requests routed before
        for _, at, rid in rows:
            if latest > at:
                out.add(rid)
            latest = max(latest, at)
        earliest = math.inf  # the earliest taking among the requests routed after
        for _, at, rid in reversed(rows):
            if earliest < at:
                out.add(rid)
            earliest = min(earliest, at)
    return out


def _unfolded(stores: Iterable[tuple[str, int, int, int, tuple]], position: Mapping[str, int], at_ns: int,
              chain: Sequence) -> int:
    """The leading blocks of ``chain`` stored by records produced before ``at_ns`` (folded or
    not), if any of them lay beyond ``position``; else 0 (the router had read every one)."""
    want = {h: i for i, h in enumerate(chain)}
    held: set[int] = set()
    late = False
    for topic, partition, offset, produced, hashes in stores:
        if produced > at_ns:
            continue
        hit = [want[h] for h in hashes if h in want]
        if hit:
            held.update(hit)
            late |= offset >= position.get(f"{topic}:{partition}", 0)
    if not late:
        return 0
    depth = 0
    while depth in held:
        depth += 1
    return depth
