"""What the console's pages show, computed from the log's projections. Pure: no I/O.

The score table's arithmetic is the router's own (``cost = prefill_load_scale x prefill_blocks +
decode_blocks``, docs/router.md "The kv cost"): the console prints each row's terms and checks
that they add up to the recorded cost, it never recomputes a decision. Re-execution and what-if
go through the replay package's table check (:func:`control_plane.replay.verify.check_table`,
:func:`control_plane.replay.verify.inputs_from_scores` and the router's ``execute``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import msgspec

from control_plane.replay.verify import DecisionRecord, check_table, inputs_from_scores
from control_plane.router import NoEligibleWorker, RouterConfig
from control_plane.router.errors import RoutingError
from control_plane.router.inputs import execute
from schemas.events import CandidateScore, RequestAdmitted, RequestRouted

#: How close a row's terms must add up to its recorded cost (the cost is a float sum).
COST_TOLERANCE = 1e-6


@dataclass(frozen=True)
class ScoreRow:
    """One row of a decision's score table as the page shows it."""

    worker_id: str
    chosen: bool
    eligible: bool
    excluded: str
    overlap_blocks: int
    overlap_by_tier: dict[str, int]
    speculative_overlap: int
    queued_prefill_tokens: int
    active_decode_blocks: int
    inflight_requests: int
    stale: bool
    scale: float
    prefill_blocks: float
    decode_blocks: float
    cost: float | None
    probability: float | None

    @property
    def terms_sum(self) -> float:
        return self.scale * self.prefill_blocks + self.decode_blocks

    @property
    def adds_up(self) -> bool | None:
        """The row's terms add up to its cost (None when the mode records no cost)."""
        if self.cost is None:
            return None
        return math.isclose(self.terms_sum, self.cost, rel_tol=COST_TOLERANCE, abs_tol=COST_TOLERANCE)


def score_rows(routed: RequestRouted, config: RouterConfig) -> list[ScoreRow]:
    """The decision's rows with the scale of the config it was made under, cheapest first."""
    rows = [ScoreRow(worker_id=s.worker_id, chosen=s.worker_id == routed.worker_id, eligible=s.eligible,
                     excluded=s.excluded, overlap_blocks=s.overlap_blocks, overlap_by_tier=dict(s.overlap_by_tier),
                     speculative_overlap=s.speculative_overlap, queued_prefill_tokens=s.queued_prefill_tokens,
                     active_decode_blocks=s.active_decode_blocks, inflight_requests=s.inflight_requests,
                     stale=s.stale, scale=config.prefill_load_scale, prefill_blocks=s.prefill_blocks,
                     decode_blocks=s.decode_blocks, cost=s.cost, probability=s.probability)
            for s in routed.scores]
    return sorted(rows, key=lambda r: (not r.eligible, math.inf if r.cost is None else r.cost, r.worker_id))


@dataclass(frozen=True)
class CacheLedger:
    """What the router predicted of the prompt's cache against what happened."""

    block_size: int
    prompt_tokens: int
    #: The chosen worker's index overlap (blocks) at the (prefill or aggregated) decision.
    predicted_blocks: int | None
    predicted_speculative_blocks: int | None
    #: ``cached_tokens`` the engine reported (PrefillCompleted, else RequestCompleted).
    engine_cached_tokens: int | None
    #: Blocks the KV transfers moved (completed ones), and how many transfers failed.
    nixl_blocks: int | None
    transfers_failed: int = 0

    @property
    def predicted_tokens(self) -> int | None:
        if self.predicted_blocks is None:
            return None
        return min(self.predicted_blocks * self.block_size, self.prompt_tokens)


def cache_ledger(events: list[dict[str, Any]]) -> CacheLedger:
    """From a request's events (``{"type", "payload"}`` in time order)."""
    bs = prompt = 0
    predicted = spec = cached = nixl = None
    failed = 0
    for e in events:
        p, t = e["payload"], e["type"]
        if t == "RequestAdmitted":
            bs, prompt = p.get("block_size", 0), p.get("prompt_tokens", 0)
        elif t == "RequestRouted" and p.get("phase", "aggregated") != "decode":
            row = next((s for s in p.get("scores", []) if s.get("worker_id") == p.get("worker_id")), None)
            predicted = row.get("overlap_blocks", 0) if row is not None else 0
            spec = row.get("speculative_overlap", 0) if row is not None else 0
        elif t == "PrefillCompleted":
            cached = p.get("cached_tokens", 0)
        elif t == "RequestCompleted" and cached is None:
            cached = p.get("cached_tokens", 0)
        elif t == "KvTransferCompleted":
            nixl = (nixl or 0) + p.get("blocks", 0)
        elif t == "KvTransferFailed":
            failed += 1
    return CacheLedger(block_size=bs, prompt_tokens=prompt, predicted_blocks=predicted,
                       predicted_speculative_blocks=spec, engine_cached_tokens=cached, nixl_blocks=nixl,
                       transfers_failed=failed)


# -- re-execution and what-if ---------------------------------------------------------------------


def decision_record(routed_event: dict[str, Any], admitted_event: dict[str, Any] | None) -> DecisionRecord:
    """A replay record from the audit projection's rows (``EventPublic`` dumps)."""
    routed = msgspec.convert(routed_event["payload"], RequestRouted, strict=False)
    admitted = None if admitted_event is None else msgspec.convert(admitted_event["payload"], RequestAdmitted,
                                                                    strict=False)
    return DecisionRecord(routed=routed, admitted=admitted, at_ns=routed_event["occurred_at_ns"],
                          producer=routed_event["producer"], epoch=routed_event["epoch"],
                          position=f"{routed_event['topic']}:{routed_event['partition']}:{routed_event['offset']}",
                          event_id=routed_event["event_id"])


@dataclass
class Verdict:
    """Re-execution of one recorded decision from its score table."""

    outcome: str
    recorded_worker: str
    replayed_worker: str | None
    diffs: list[str] = field(default_factory=list)


def verify_decision(rec: DecisionRecord, config: RouterConfig) -> Verdict:
    outcome, d, diffs = check_table(rec, config)
    return Verdict(outcome=outcome, recorded_worker=rec.routed.worker_id,
                   replayed_worker=None if d is None else d.worker_id, diffs=diffs)


@dataclass
class WhatIfOutcome:
    recorded_worker: str
    recorded_reason: str
    alternative_worker: str | None
    alternative_reason: str
    alternative_rows: list[ScoreRow]
    error: str = ""

    @property
    def changed(self) -> bool:
        return self.alternative_worker is not None and self.alternative_worker != self.recorded_worker


def whatif_decision(rec: DecisionRecord, recorded: RouterConfig, alternative: RouterConfig) -> WhatIfOutcome:
    """The decision re-scored under ``alternative`` (inputs rebuilt from the recorded rows under
    the recorded config, as ``switchyard replay whatif`` does; same seed)."""
    r = rec.routed
    try:
        inputs = inputs_from_scores(rec, recorded)
        d = execute(inputs, alternative, r.rng_seed)
    except (RoutingError, NoEligibleWorker, ValueError) as e:
        return WhatIfOutcome(r.worker_id, r.reason, None, "", [], error=str(e).splitlines()[0])
    alt_event = msgspec.structs.replace(r, worker_id=d.worker_id, scores=list(d.scores))
    return WhatIfOutcome(r.worker_id, r.reason, d.worker_id, d.reason, score_rows(alt_event, alternative))


def parse_router_config(text: str, version: int) -> RouterConfig:
    """An edited router config (JSON object) as the router would load it; ValueError with the
    reason when it breaks a rule."""
    try:
        raw = msgspec.json.decode(text.encode() if text.strip() else b"{}")
    except msgspec.DecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError("the router config must be a JSON object")
    raw = {**raw, "version": version}
    try:
        return msgspec.convert(raw, RouterConfig)
    except (msgspec.ValidationError, RoutingError) as e:
        raise ValueError(f"router config rejected: {e}") from None


def config_json(config: RouterConfig) -> str:
    d = msgspec.to_builtins(config)
    d.pop("version", None)
    return msgspec.json.format(msgspec.json.encode(d), indent=2).decode()


def as_score(row: dict[str, Any]) -> CandidateScore:
    return msgspec.convert(row, CandidateScore, strict=False)
