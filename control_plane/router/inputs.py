"""The one path to a routing decision. Pure.

A decision is ``decide(inputs, config)``; this module is the only place that builds its inputs
and the only place that turns its result into the ``RequestRouted`` that records it. The live
router (:mod:`.proxy`), replay's verify and what-if, and the cluster simulator
(:mod:`control_plane.simulation`, behind the routing and planner benchmarks) all call it, so
"the live router, replay and the simulator decide with the same code" holds by construction.

Inputs come from two places:

* a :class:`CandidateSource`: the routable workers of the phase's role with their last reported
  load, and the prefix index's match per worker. The router's :class:`~.view.RouterView` is one
  (folded from the log); the simulator's view (folded from the simulated engines' events) is
  another;
* the router's own state, :class:`~.ledger.RouterLedger` (a fold of the events the router
  published): the in-flight loads and speculative overlap, and the round-robin cursor.

The seed rule lives here too: a decision's RNG seed is a hash of (request, phase, attempt), so
a re-executed decision draws the same tie-break.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

import msgspec
import xxhash

from control_plane.router.config import RouterConfig
from control_plane.router.decision import NO_OVERLAP, Decision, RoutingRequest, WorkerLoad, WorkerOverlap, decide
from control_plane.router.errors import NoEligibleWorker
from control_plane.router.ledger import InflightLoad, RouterLedger, role_of_phase
from control_plane.router.pairs import PairInputs
from control_plane.router.ttft import PRIOR, predict_ttft_ms
from schemas.events import AdmissionTerms, RequestRouted, TtftModel
from schemas.types import BlockHash, RequestPhase, WorkerId


class CandidateSource(Protocol):
    """What a decision reads from the world besides the router's own ledger."""

    def candidates(self, role: str) -> list[WorkerLoad]:
        """Routable workers of ``role``, with their last reported load."""
        ...

    def overlaps(self, hashes: Sequence[BlockHash]) -> Mapping[WorkerId, WorkerOverlap]:
        """The prefix index's match for ``hashes``, per worker."""
        ...


class DecisionInputs(msgspec.Struct, kw_only=True):
    """Everything ``decide`` takes besides the config (a value: replay keeps it to re-score)."""

    request: RoutingRequest
    workers: list[WorkerLoad]
    overlaps: dict[str, WorkerOverlap]
    #: The ledger's view for the prompt when the decision was made (a dict, or the native
    #: ledger's read-only ``InflightView``).
    inflight: Mapping[str, InflightLoad]
    rr_cursor: str | None = None
    rng_seed: int = 0
    #: The TTFT model of each candidate (the ledger's fit, ``ttft_fit.py``); a worker missing
    #: here is predicted under the prior.
    ttft_models: dict[str, TtftModel] = {}
    #: P/D pairs (``RouterConfig.pd_pairs``): a prefill decision's decode candidates and pair
    #: models; a decode decision's paired worker (its prefill decision's choice).
    pair: PairInputs | None = None
    paired: str = ""
    #: The request's session (``RequestRouted.session``) and the worker of its previous turn as
    #: the session fold gave it (``RouterLedger.sessions``, within ``session_ttl_s``).
    session: str = ""
    session_worker: str = ""


def router_seed(request_id: str, phase: RequestPhase | str, attempt: int) -> int:
    """The decision's RNG seed: 63 bits of xxh64("<request>:<phase>:<attempt>")."""
    phase = RequestPhase(phase).value
    return xxhash.xxh64_intdigest(f"{request_id}:{phase}:{attempt}".encode()) & 0x7FFF_FFFF_FFFF_FFFF


def decision_inputs(
    source: CandidateSource,
    ledger: RouterLedger,
    *,
    request_id: str,
    prompt_tokens: int,
    block_hashes: Sequence[BlockHash],
    block_size: int,
    expected_output_tokens: int,
    phase: RequestPhase,
    attempt: int,
    now: float,
    excluded: Collection[str] = (),
    peer_reach: bool = False,
    engine_steps: bool = True,
    pairs: bool = False,
    session: str = "",
    session_ttl_s: float = 0.0,
) -> DecisionInputs:
    """The inputs of one decision (``peer_reach``: credit each worker with the prefix a peer
    holds, :func:`with_peer_reach`; on when the config's ``tier_weights.peer`` is above 0;
    ``engine_steps`` False: the TTFT models as before the engine's steps were modelled,
    ``RouterLedger.ttft_model``, for replay of a decision recorded then; ``pairs``: the config's
    ``pd_pairs``, a prefill phase then reads the decode candidates and the ledger's pair fit, a
    decode phase the worker its prefill decision paired it with; ``session``: the client's
    session id, whose previous turn's worker the fold gives within ``session_ttl_s`` (0: none
    read; a decode phase reads none). Prepares the ledger for it (expiry at ``now``; a decode phase
    releases its prefill entry), exactly as folding the decision's ``RequestRouted`` will.

    Raises :class:`NoEligibleWorker`, with the ledger untouched, when the phase's role has no
    routable worker left (every candidate is eligible for ``decide``, so a decision follows).
    """
    role = role_of_phase(phase)
    workers = source.candidates(role)
    if excluded:
        workers = [w for w in workers if w.worker_id not in excluded]
    if not workers:
        # Before the ledger is touched: no RequestRouted will follow to repeat its preparation,
        # so preparing here would change the live ledger without an event.
        raise NoEligibleWorker(f"no {role} worker available"
                               + (f" (excluded after failures: {sorted(excluded)})" if excluded else ""))
    ledger.prepare(request_id, phase, now)
    hashes = tuple(block_hashes)
    overlaps = dict(source.overlaps(hashes)) if phase is not RequestPhase.DECODE else {}
    if peer_reach and overlaps:
        overlaps = with_peer_reach(overlaps, workers)
    request = RoutingRequest(request_id=request_id, prompt_tokens=prompt_tokens, block_size=block_size,
                             block_hashes=hashes, expected_output_tokens=expected_output_tokens, phase=phase)
    models = ({} if phase is RequestPhase.DECODE
              else {w.worker_id: ledger.ttft_model(w.worker_id, now, engine_steps) for w in workers})
    pair, paired = None, ""
    if pairs and phase is RequestPhase.PREFILL:
        decode = [w for w in source.candidates(role_of_phase(RequestPhase.DECODE)) if w.worker_id not in excluded]
        pair = ledger.pair_fit.inputs(decode, ledger.pair_pending())
    elif pairs and phase is RequestPhase.DECODE:
        paired = ledger.paired(request_id)
    return DecisionInputs(request=request, workers=workers, overlaps=overlaps, inflight=ledger.view(hashes),
                          rr_cursor=ledger.rr_cursor.get(role), rng_seed=router_seed(request_id, phase, attempt),
                          ttft_models=models, pair=pair, paired=paired, session=session,
                          session_worker=(ledger.sessions.worker(session, now, session_ttl_s)
                                          if session_ttl_s > 0 and phase is not RequestPhase.DECODE else ""))


def with_peer_reach(overlaps: Mapping[WorkerId, WorkerOverlap], workers: Sequence[WorkerLoad]
                    ) -> dict[WorkerId, WorkerOverlap]:
    """Each candidate's overlap plus what a peer could send it: the prompt blocks beyond its own
    match that the best holder among the other candidates has in device or host memory (the
    tiers a peer serves; its match's leading tiers, laid fastest first). The holder is the one
    with the longest such run, ties to the lowest id; it must be registered, not draining, and
    its view not stale. Pure: the same candidates and matches give the same reach."""
    holders: list[tuple[int, WorkerId]] = []
    for w in workers:
        ov = overlaps.get(w.worker_id)
        if ov is None or ov.stale or not w.registered or w.draining:
            continue
        t = ov.tiers
        reach = sum(t[:2])
        if reach:
            holders.append((-reach, w.worker_id))
    if not holders:
        return dict(overlaps)
    holders.sort()
    out = dict(overlaps)
    for w in workers:
        wid = w.worker_id
        best = next(((-neg, hid) for neg, hid in holders[:2] if hid != wid), None)
        if best is None:
            continue
        ov = overlaps.get(wid, NO_OVERLAP)
        depth = sum(ov.tiers)
        if best[0] > depth:
            out[wid] = msgspec.structs.replace(ov, peer=best[0] - depth, peer_from=best[1])
    return out


class _Recorded:
    """An ``InflightView`` over the loads captured in ``DecisionInputs``."""

    __slots__ = ("loads",)

    def __init__(self, loads: Mapping[str, InflightLoad]) -> None:
        self.loads = loads

    def view(self, hashes: Sequence[BlockHash]) -> Mapping[str, InflightLoad]:
        return self.loads


def execute(inputs: DecisionInputs, config: RouterConfig, rng_seed: int | None = None) -> Decision:
    """``decide`` over ``inputs`` (with their own seed unless one is given)."""
    return decide(inputs.request, inputs.workers, config,
                  rng_seed=inputs.rng_seed if rng_seed is None else rng_seed, overlaps=inputs.overlaps,
                  inflight=_Recorded(inputs.inflight), rr_cursor=inputs.rr_cursor, ttft_models=inputs.ttft_models,
                  pair=inputs.pair, paired=inputs.paired, session_worker=inputs.session_worker)


def routed_event(
    decision: Decision,
    inputs: DecisionInputs,
    config: RouterConfig,
    *,
    router_id: str = "",
    attempt: int = 0,
    index_position: Mapping[str, int] | None = None,
    view_state: str = "",
    excluded: Collection[str] = (),
    decided_at_s: float = 0.0,
    queued_ms: float = 0.0,
    admission: AdmissionTerms | None = None,
) -> RequestRouted:
    """The ``RequestRouted`` that records ``decision``: its score table and reason, what it was
    decided on (position, config version, seed, cursor, exclusions, ``now``), what the
    ledger holds for it, and the TTFT budget test's terms (``admission``) when one ran."""
    # The other candidates' models are not recorded (RequestRouted.ttft_models is deprecated):
    # they are the fold's, which replay re-derives, and their rows carry their predictions.
    predicted, model = _predicted_ttft(decision, inputs)
    return msgspec.structs.replace(
        decision.to_event(index_position=index_position, router_id=router_id, attempt=attempt),
        rr_cursor=inputs.rr_cursor, guards=list(decision.guards),
        expected_output_tokens=inputs.request.expected_output_tokens, view_state=view_state,
        excluded_workers=sorted(excluded), decided_at_s=decided_at_s, queued_ms=queued_ms,
        inflight_prefill_tokens=decision.prefill_tokens, inflight_blocks=decision.decode_blocks,
        inflight_ttl_s=config.inflight_ttl_s, predicted_ttft_ms=predicted, ttft_model=model, admission=admission,
        session=inputs.session, session_worker=inputs.session_worker)


def _predicted_ttft(decision: Decision, inputs: DecisionInputs) -> tuple[float | None, TtftModel | None]:
    """The chosen row's predicted TTFT (``control_plane/router/ttft.py``) and the model it used
    (the chosen worker's fit); None, None for a decode phase."""
    req = inputs.request
    if req.phase is RequestPhase.DECODE:
        return None, None
    for row in decision.scores:
        if row.worker_id == decision.worker_id:
            model = inputs.ttft_models.get(row.worker_id, PRIOR)
            if row.predicted_ttft_ms is not None:  # every row carries it (decide computed it)
                return row.predicted_ttft_ms, model
            return predict_ttft_ms(row, req.prompt_tokens, req.block_size, req.phase, model), model
    return None, None
