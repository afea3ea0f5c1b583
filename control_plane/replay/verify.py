"""Re-executing recorded routing decisions. Pure: recorded events and rebuilt state in, verdicts out.

A ``RequestRouted`` records what its decision was made on: the view's position
(``index_position``), the score table (every candidate's load, overlap and speculative
overlap as the router combined them), the config version, the RNG seed, the round-robin cursor
and the workers excluded by earlier attempts. Each decision is checked twice:

1. **table**: rebuild ``decide``'s inputs from the recorded score rows alone and run it again.
   This checks the decision function, the config and the seed against the recorded choice,
   costs and reason, independently of any rebuilt state.
2. **state**: rebuild the inputs from the log through the router's own decision path
   (:func:`control_plane.router.inputs.decision_inputs`): the router view folded to
   ``index_position`` (worker registry, reported loads, prefix overlaps), the router's
   :class:`~control_plane.router.ledger.RouterLedger` folded from the router's own events up
   to the decision (the same fold the live router applies as it publishes), the request from
   its ``RequestAdmitted``. Run ``decide`` and compare everything; when it differs, the
   differing *inputs* (score-row columns the router fed in) are listed next to the differing
   outputs.

Both must reproduce the recorded event bit for bit (floats included: the same operations in
the same order give the same doubles).
"""

from __future__ import annotations

import msgspec

from control_plane.router import (
    Decision,
    InflightLoad,
    NoEligibleWorker,
    RouterConfig,
    RoutingError,
    RoutingRequest,
    WorkerLoad,
    WorkerOverlap,
)
from control_plane.router.admission import budget_terms, over_budget
from control_plane.router.inputs import DecisionInputs, execute, routed_event
from control_plane.router.ledger import role_of_phase
from control_plane.router.pairs import recorded_inputs
from schemas.events import CandidateScore, RequestAdmitted, RequestRejected, RequestRouted, TtftModel
from schemas.types import RequestPhase, WorkerRole

#: Score-row columns that are *inputs* of the decision (as the router combined them).
INPUT_COLUMNS = ("queued_prefill_tokens", "active_decode_blocks", "inflight_requests", "overlap_blocks",
                 "overlap_by_tier", "stale", "speculative_overlap", "kv_capacity_blocks", "peer_from",
                 "report_only_prefill_tokens")
#: Columns that are outputs (computed from the inputs and the config).
OUTPUT_COLUMNS = ("prefill_blocks", "decode_blocks", "cost", "probability", "eligible", "excluded",
                  "predicted_ttft_ms")


class DecisionRecord(msgspec.Struct, kw_only=True):
    """One recorded decision with what replay needs around it."""

    routed: RequestRouted
    admitted: RequestAdmitted | None
    at_ns: int
    producer: str
    epoch: int
    #: "topic:partition:offset" of the RequestRouted record.
    position: str
    event_id: str


class DecisionCheck(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The verdict on one recorded decision."""

    request_id: str
    phase: str
    attempt: int
    router: str
    position: str
    at_ns: int
    recorded_worker: str
    config_version: int
    #: "match", "mismatch", or "error: ..." (could not re-execute).
    table: str
    state: str
    table_worker: str | None = None
    state_worker: str | None = None
    #: Output fields that differ (recorded vs re-executed), for each check.
    table_diffs: list[str] = []
    state_diffs: list[str] = []
    #: Input columns that differ between the recorded rows and the rebuilt ones.
    input_diffs: list[str] = []
    #: The rng_seed is not what the router's seed rule gives for (request, phase, attempt).
    seed_rule_ok: bool = True
    config_assumed: bool = False
    notes: list[str] = []

    @property
    def matched(self) -> bool:
        return self.table == "match" and self.state == "match"


def routing_request(rec: DecisionRecord) -> RoutingRequest:
    adm = rec.admitted
    if adm is None:
        raise ValueError(f"request {rec.routed.request_id}: its RequestAdmitted is not in the replayed range")
    r = rec.routed
    return RoutingRequest(request_id=r.request_id, prompt_tokens=adm.prompt_tokens, block_size=adm.block_size,
                          block_hashes=tuple(adm.block_hashes),
                          expected_output_tokens=r.expected_output_tokens or adm.max_tokens, phase=r.phase)


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------


def _row_load(row: CandidateScore, phase: RequestPhase, config: RouterConfig) -> tuple[WorkerLoad, InflightLoad | None]:
    """A candidate as ``decide`` saw it, from its recorded row.

    The row holds the *combined* loads (report and ledger, by ``load_combine``). Feeding them
    as the report with an empty ledger gives the same numbers, except where the ledger's
    speculative overlap matters (it also flags "has requests in flight"): then one in-flight
    request carrying the overlap is fed, and under ``sum`` it is taken off the reported count.
    """
    role = WorkerRole(role_of_phase(phase))
    draining, registered = False, True
    ex = row.excluded
    if ex == "draining":
        draining = True
    elif ex == "not registered":
        registered = False
    elif ex.startswith("role "):
        role = WorkerRole(ex.split()[1])
    r = row.inflight_requests
    mine = None
    # The ledger's prefill tokens (the queue the TTFT prediction waits behind: the combined figure
    # less what only the report adds) are fed as its own, under max as under sum. A row without
    # requests in flight has no ledger (its queue is the report's: a row written before
    # report_only_prefill_tokens existed).
    q = row.queued_prefill_tokens
    own = q - row.report_only_prefill_tokens if r > 0 else 0
    if row.speculative_overlap or own:
        mine = InflightLoad(own, 0, 1, row.speculative_overlap)
        if config.load_combine == "sum":
            r -= 1
            q -= own
    load = WorkerLoad(worker_id=row.worker_id, role=role, registered=registered, draining=draining,
                      queued_prefill_tokens=q,
                      active_decode_blocks=row.active_decode_blocks, inflight_requests=r,
                      kv_capacity_blocks=row.kv_capacity_blocks)
    return load, mine


def inputs_from_scores(rec: DecisionRecord, config: RouterConfig,
                       rows: list[CandidateScore] | None = None) -> DecisionInputs:
    """``decide``'s inputs rebuilt from the recorded score table (or the ``rows`` given)."""
    r = rec.routed
    workers, overlaps, inflight = [], {}, {}
    for row in (r.scores if rows is None else rows):
        load, mine = _row_load(row, r.phase, config)
        workers.append(load)
        if mine is not None:
            inflight[row.worker_id] = mine
        if row.overlap_blocks or row.stale or row.overlap_by_tier:
            overlaps[row.worker_id] = WorkerOverlap.from_tiers(row.overlap_by_tier, stale=row.stale,
                                                               peer_from=row.peer_from)
    # The predictions' models: the chosen worker's as recorded, and for every other row with a
    # prediction the model that predicts exactly what the row recorded (``_pinned``): like the
    # row's loads, the prediction is taken as the router saw it, and the state check re-derives
    # the models themselves from the log. Logs that carried the other models
    # (``RequestRouted.ttft_models``, deprecated) use them.
    models = dict(r.ttft_models)
    for row in (r.scores if rows is None else rows):
        if row.predicted_ttft_ms is not None and row.worker_id not in models:
            models[row.worker_id] = _pinned(row.predicted_ttft_ms)
    if r.ttft_model is not None:
        models[r.worker_id] = r.ttft_model
    # P/D pairs: the decode candidates from their recorded rows, the pair models pinned to the
    # times each pair recorded (the state check re-derives the fits from the log).
    pair = None
    if r.phase is RequestPhase.PREFILL and r.decode_scores:
        decode = []
        for row in r.decode_scores:
            load, mine = _row_load(row, RequestPhase.DECODE, config)
            decode.append(load)
            if mine is not None:
                inflight[row.worker_id] = mine
        pair = recorded_inputs(decode, r.pairs)
    return DecisionInputs(request=routing_request(rec), workers=workers, overlaps=overlaps, inflight=inflight,
                          rr_cursor=r.rr_cursor, rng_seed=r.rng_seed, ttft_models=models, pair=pair,
                          paired=r.paired_worker_id if r.phase is RequestPhase.DECODE else "",
                          session=r.session, session_worker=r.session_worker)


def _pinned(predicted_ttft_ms: float) -> TtftModel:
    """The model whose prediction is ``predicted_ttft_ms`` whatever the row: all of it in the
    base, every other cost 0 (``ttft.predict`` adds ``0.0`` twice to the base: exact)."""
    return TtftModel(base_ms=predicted_ttft_ms, step_ms=0.0, ms_per_token=0.0, ms_per_token_ctx=0.0)


# ----------------------------------------------------------------------------------------------
# Comparison
# ----------------------------------------------------------------------------------------------


def replayed_event(rec: DecisionRecord, d: Decision, inputs: DecisionInputs, config: RouterConfig) -> RequestRouted:
    """The event the router would have recorded for decision ``d`` over ``inputs`` (what only the
    live moment knows, position, view state, ``now``, queueing, is copied from ``rec``)."""
    r = rec.routed
    if r.ttft_model is None:  # written before the router fitted its model: the prior predicted
        inputs = msgspec.structs.replace(inputs, ttft_models={})
    ev = routed_event(d, inputs, config, router_id=r.router_id, attempt=r.attempt, index_position=r.index_position,
                      view_state=r.view_state, excluded=r.excluded_workers, decided_at_s=r.decided_at_s,
                      queued_ms=r.queued_ms)
    if r.inflight_blocks is None:  # written before the router recorded its ledger entry
        ev = msgspec.structs.replace(ev, inflight_prefill_tokens=None, inflight_blocks=None, inflight_ttl_s=None)
    if r.predicted_ttft_ms is None:  # written before the router recorded its prediction
        ev = msgspec.structs.replace(ev, predicted_ttft_ms=None)
    if r.ttft_model is None:  # written before the router fitted and recorded its model
        ev = msgspec.structs.replace(ev, ttft_model=None)
    if r.ttft_models:  # written when the event carried the other rows' models (deprecated)
        ev = msgspec.structs.replace(ev, ttft_models=r.ttft_models)
    if (t := r.admission) is not None:
        # The budget test re-executed on the replayed rows with what only the live moment knew
        # (the time spent, the loop lag, idle; the margin, which the state check re-derives).
        ev = msgspec.structs.replace(ev, admission=budget_terms(ev.scores, t.budget_ms, t.spent_ms, t.loop_lag_ms,
                                                                t.margin, t.idle, t.at_s, t.queue_ms,
                                                                ev.worker_id if t.chosen else None, t.rule,
                                                                t.spread, t.others_waiting))
    if r.scores and all(row.predicted_ttft_ms is None for row in r.scores):
        # written before every row carried its prediction (or a decode phase, which has none)
        ev = msgspec.structs.replace(ev, ttft_models={}, scores=[
            msgspec.structs.replace(row, predicted_ttft_ms=None) for row in ev.scores])
    return ev


def decision_diffs(recorded: RequestRouted, replayed: RequestRouted) -> list[str]:
    """Fields that differ, as ``field: recorded -> replayed`` (scores row by row); and a
    decision the router admitted under a TTFT budget whose re-executed test refuses it."""
    a = msgspec.to_builtins(recorded)
    b = msgspec.to_builtins(replayed)
    out: list[str] = []
    if replayed.admission is not None and (over := over_budget(replayed.admission)) is not None:
        out.append(f"admission: admitted -> refused ({over[0]})")
    for k in sorted(set(a) | set(b)):
        if k == "scores":
            out.extend(_row_diffs(recorded.scores, replayed.scores, INPUT_COLUMNS + OUTPUT_COLUMNS))
        elif a.get(k) != b.get(k):
            out.append(f"{k}: {_short(a.get(k))} -> {_short(b.get(k))}")
    return out


def input_diffs(recorded: list[CandidateScore], replayed: list[CandidateScore]) -> list[str]:
    """Input columns that differ between recorded and rebuilt rows, and missing/extra workers."""
    return _row_diffs(recorded, replayed, INPUT_COLUMNS)


def _row_diffs(recorded, replayed, columns) -> list[str]:
    # asdict, not to_builtins: the structs omit defaults on the wire, the comparison must not.
    a = {s.worker_id: msgspec.structs.asdict(s) for s in recorded}
    b = {s.worker_id: msgspec.structs.asdict(s) for s in replayed}
    out = []
    for wid in sorted(set(a) | set(b)):
        if wid not in b:
            out.append(f"scores[{wid}]: recorded, not a candidate on replay")
            continue
        if wid not in a:
            out.append(f"scores[{wid}]: a candidate on replay, not recorded")
            continue
        for col in columns:
            va, vb = a[wid][col], b[wid][col]
            if va != vb:
                out.append(f"scores[{wid}].{col}: {_short(va)} -> {_short(vb)}")
    return out


def _short(v, n: int = 160) -> str:
    s = repr(v)
    return s if len(s) <= n else s[: n - 3] + "..."


def check_table(rec: DecisionRecord, config: RouterConfig) -> tuple[str, Decision | None, list[str]]:
    try:
        inputs = inputs_from_scores(rec, config)
        d = execute(inputs, config)
    except (RoutingError, NoEligibleWorker, ValueError) as e:
        return f"error: {e}", None, []
    diffs = decision_diffs(rec.routed, replayed_event(rec, d, inputs, config))
    return ("match" if not diffs else "mismatch"), d, diffs


def check_rejection(rejected: RequestRejected, margin: tuple[float, float, float] | None) -> str:
    """A TTFT budget refusal re-executed from its recorded terms (``RequestRejected.admission``):
    "match" when the test refuses it again with the recorded reason and ``margin`` (the margin,
    the queue's TTFT and the spread from the router's ledger folded to the test's ``at_s``; None: not
    re-derived) is the recorded one, else
    "mismatch: ..."; "unverifiable" without a prediction in the terms (a request that waited out
    its budget in the queue: that test is a timer, not a rule over the log)."""
    t = rejected.admission
    if t is None or t.predicted_ttft_ms is None:
        return "unverifiable"
    over = over_budget(t)
    if over is None:
        return "mismatch: the recorded terms admit it"
    if over[0] != rejected.reason:
        return f"mismatch: reason {_short(rejected.reason)} -> {_short(over[0])}"
    if margin is not None and margin != (t.margin, t.queue_ms, t.spread):
        return (f"mismatch: margin, queue_ms, spread {(t.margin, t.queue_ms, t.spread)!r} -> {margin!r} "
                "(the ledger's fold)")
    return "match"


def check_state(rec: DecisionRecord, inputs: DecisionInputs, config: RouterConfig,
                margin: tuple[float, float, float] | None = None) -> tuple[str, Decision | None, list[str], list[str]]:
    m = rec.routed.ttft_model
    if m is not None and m.queue_done_tokens is None and inputs.ttft_models:
        # Decided before the queue's drain existed (TtftModel.queue_done_tokens): its models
        # waited behind the whole queue.
        inputs = msgspec.structs.replace(inputs, ttft_models={
            w: msgspec.structs.replace(x, queue_done_tokens=None) for w, x in inputs.ttft_models.items()})
    if m is not None and m.ms_per_decode_block_step is None and inputs.ttft_models:
        # Decided before the decode term existed (TtftModel.ms_per_decode_block_step): the fit
        # saw no decode feature in those decisions (its cost stays the prior's 0), and their
        # models had no such field.
        inputs = msgspec.structs.replace(inputs, ttft_models={
            w: msgspec.structs.replace(x, ms_per_decode_block_step=None) for w, x in inputs.ttft_models.items()})
    if m is not None and m.ms_per_step_token_sq is None and inputs.ttft_models:
        # Decided before the engine's steps were formed (TtftModel.ms_per_step_token_sq): the
        # fit saw the old features in those decisions, and their models had no such field.
        inputs = msgspec.structs.replace(inputs, ttft_models={
            w: msgspec.structs.replace(x, ms_per_step_token_sq=None) for w, x in inputs.ttft_models.items()})
    if m is not None and m.busy_steps is None and inputs.ttft_models:
        # Decided before the step under way was charged (TtftModel.busy_steps): the request's
        # own steps only, and the fit saw no such step in those decisions.
        inputs = msgspec.structs.replace(inputs, ttft_models={
            w: msgspec.structs.replace(x, busy_steps=None) for w, x in inputs.ttft_models.items()})
    try:
        d = execute(inputs, config, rec.routed.rng_seed)
    except (RoutingError, NoEligibleWorker, ValueError) as e:
        return f"error: {e}", None, [], []
    ev = replayed_event(rec, d, inputs, config)
    if margin is not None and ev.admission is not None:  # the margin and queue as the ledger's fold gives them
        ev = msgspec.structs.replace(ev, admission=msgspec.structs.replace(ev.admission, margin=margin[0],
                                                                           queue_ms=margin[1], spread=margin[2]))
    diffs = decision_diffs(rec.routed, ev)
    return ("match" if not diffs else "mismatch"), d, diffs, input_diffs(rec.routed.scores, ev.scores)


class VerifyReport(msgspec.Struct, kw_only=True):
    """The outcome of ``replay verify`` over a range."""

    range_from: str
    range_to: str
    decisions: int = 0
    table_matches: int = 0
    state_matches: int = 0
    identical: int = 0
    unverifiable: int = 0
    config_versions: list[int] = []
    configs_assumed: list[int] = []
    configs_from_log: list[int] = []
    notes: list[str] = []
    routers: list[str] = []
    mismatches: list[DecisionCheck] = []
    checks: list[DecisionCheck] = []
    seconds: float = 0.0
    records_read: int = 0
    #: TTFT budget refusals with their terms (``RequestRejected.admission``) re-executed
    #: (:func:`check_rejection`): how many, how many matched, the others' verdicts.
    rejections: int = 0
    rejections_matched: int = 0
    rejection_mismatches: list[str] = []

    @property
    def identical_ratio(self) -> float:
        return self.identical / self.decisions if self.decisions else 1.0

    def summary(self) -> dict:
        return {"from": self.range_from, "to": self.range_to, "decisions": self.decisions,
                "identical": self.identical, "identical_pct": round(100 * self.identical_ratio, 3),
                "table_matches": self.table_matches, "state_matches": self.state_matches,
                "mismatches": len(self.mismatches), "unverifiable": self.unverifiable,
                "config_versions": self.config_versions, "configs_assumed": self.configs_assumed,
                "configs_from_log": self.configs_from_log, "notes": self.notes,
                "routers": self.routers, "rejections": self.rejections,
                "rejections_matched": self.rejections_matched,
                "rejection_mismatches": self.rejection_mismatches[:10],
                "records_read": self.records_read, "seconds": round(self.seconds, 3)}
