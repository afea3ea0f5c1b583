"""``control_plane.replay.reconcile``: the overlap a decision saw against what the engine cached,
and who is to blame for each shortfall. Pure folds over hand-built logs."""

from __future__ import annotations

import pytest

from schemas import EnvelopeFactory
from schemas.events import (
    BlockStored,
    CandidateScore,
    PrefillCompleted,
    RequestAdmitted,
    RequestCompleted,
    RequestRouted,
)
from schemas.types import RequestPhase, RoutingMode, Tier
from control_plane.replay.reconcile import KvRecord, reconcile

BS = 16
CHAIN = [1001, 1002, 1003, 1004]
KV_TOPIC = "t.kv"


class _Clock:
    def __init__(self) -> None:
        self.ns = 0

    def __call__(self) -> int:
        return self.ns


def _log(*, seen: int = 0, spec: int = 0, cached_blocks: int = 0, stored_blocks: int = 0, folded: bool = True,
         stored_before: bool = True, other_seen: int = 0):
    """One request routed to w0 (w1 the other candidate); optionally w0's KV store of the first
    ``stored_blocks`` blocks at offset 0 of partition 0, produced before or after the decision
    and folded or not at the decision's ``index_position``."""
    clock = _Clock()
    f = EnvelopeFactory("router", 1, clock)
    wf = EnvelopeFactory("w0", 1, clock)
    kv = []
    if stored_blocks and stored_before:
        clock.ns = 10
        kv.append(KvRecord(KV_TOPIC, 0, 0, wf.wrap(BlockStored(
            worker_id="w0", tier=Tier.DEVICE, block_hashes=CHAIN[:stored_blocks], block_size=BS, hash_algo="a"))))
    clock.ns = 20
    reqs = [f.wrap(RequestAdmitted(request_id="r1", model="m", prompt_tokens=BS * len(CHAIN), max_tokens=4,
                                   block_hashes=CHAIN, block_size=BS, hash_algo="a"))]
    clock.ns = 30
    reqs.append(f.wrap(RequestRouted(
        request_id="r1", worker_id="w0", phase=RequestPhase.AGGREGATED, mode=RoutingMode.KV, config_version=1,
        rng_seed=1, index_position={f"{KV_TOPIC}:0": 1 if folded else 0},
        scores=[CandidateScore(worker_id="w0", overlap_blocks=seen, speculative_overlap=spec),
                CandidateScore(worker_id="w1", overlap_blocks=other_seen)])))
    if stored_blocks and not stored_before:
        clock.ns = 40
        kv.append(KvRecord(KV_TOPIC, 0, 0, wf.wrap(BlockStored(
            worker_id="w0", tier=Tier.DEVICE, block_hashes=CHAIN[:stored_blocks], block_size=BS, hash_algo="a"))))
    clock.ns = 50
    reqs.append(f.wrap(PrefillCompleted(request_id="r1", worker_id="w0", prompt_tokens=BS * len(CHAIN),
                                        cached_tokens=BS * cached_blocks, duration_ms=1.0)))
    return reqs, kv


def _one(**kw):
    r = reconcile(*_log(**kw))
    assert r.unmatched == 0 and len(r.checks) == 1
    return r.checks[0]


def test_prediction_met_has_no_blame() -> None:
    c = _one(seen=3, cached_blocks=3, stored_blocks=3)
    assert (c.blame, c.predicted_blocks, c.cached_blocks, c.unfolded_blocks) == ("", 3, 3, 0)


def test_blocks_on_the_log_but_not_folded_blame_the_index() -> None:
    """The store (offset 0) was produced at t=10, the decision at t=30 had folded up to offset 0
    exclusive: the router decided on an index that lagged the log by that record."""
    c = _one(seen=0, cached_blocks=3, stored_blocks=3, folded=False)
    assert (c.blame, c.unfolded_blocks) == ("stale_index", 3)


def test_blocks_stored_after_the_decision_are_not_the_index_fault() -> None:
    c = _one(seen=0, cached_blocks=2, stored_blocks=2, stored_before=False, folded=False)
    assert (c.blame, c.unfolded_blocks) == ("stored_after_routing", 0)


def test_more_seen_than_cached() -> None:
    assert _one(seen=3, cached_blocks=1, stored_blocks=3).blame == "evicted_after_routing"
    assert _one(spec=4, cached_blocks=0).blame == "speculative_not_hit"


def test_summary_counts_a_choice_past_a_longer_cache() -> None:
    r = reconcile(*_log(seen=1, cached_blocks=1, stored_blocks=1, other_seen=4))
    s = r.summary()
    assert (s["requests"], s["exact"], s["routed_past_cache"], s["cached_tokens"]) == (1, 1, 1, BS)


def test_a_routed_request_without_outcome_is_unmatched() -> None:
    reqs, kv = _log(seen=1, cached_blocks=1)
    r = reconcile(reqs[:-1], kv)
    assert (len(r.checks), r.unmatched) == (0, 1)


def test_a_whole_prompt_hit_is_one_block_short() -> None:
    """4 of 4 blocks seen; the engine computes at least the last token, so it can hit (64 - 1) // 16
    = 3 blocks: 3 cached is the prediction met."""
    c = _one(seen=4, cached_blocks=3, stored_blocks=4)
    assert (c.predicted_blocks, c.blame) == (3, "")


def test_ttft_error_is_against_the_time_after_the_router_queue() -> None:
    """Predicted 120 ms; the request queued 20 ms in the router and saw its first token 170 ms
    after arrival, so 150 ms after the decision: |120 - 150| / 150 = 0.2."""
    import msgspec

    reqs, kv = _log(seen=1, cached_blocks=1, stored_blocks=1)
    routed = reqs[1]
    reqs[1] = msgspec.structs.replace(routed, data=msgspec.structs.replace(routed.data, predicted_ttft_ms=120.0,
                                                                            queued_ms=20.0))
    reqs.append(EnvelopeFactory("router", 1, lambda: 60).wrap(RequestCompleted(
        request_id="r1", worker_id="w0", prompt_tokens=BS * len(CHAIN), output_tokens=4, cached_tokens=BS,
        ttft_ms=170.0, e2e_ms=200.0)))
    r = reconcile(reqs, kv)
    assert r.checks[0].ttft_error == pytest.approx(0.2)
    s = r.summary()
    assert (s["ttft_predictions"], s["prediction_err_p50"], s["prediction_err_p90"]) == (1, r.checks[0].ttft_error,
                                                                                         r.checks[0].ttft_error)


@pytest.mark.parametrize(("samples", "seen", "cached_blocks", "queued", "blame"), [
    (None, 1, 1, 0, "prior"),      # recorded before the router fitted its model
    (0, 1, 1, 0, "prior"),         # the prior: no observation yet
    (5, 2, 1, 0, "overlap"),       # the router saw 2 blocks, the engine hit 1
    (5, 1, 1, 900, "queue"),       # work queued ahead (and the worker took it in the router's order)
    (5, 1, 1, 0, "own_prefill"),   # nothing else to blame
])
def test_a_ttft_error_is_put_on_one_source(samples, seen, cached_blocks, queued, blame) -> None:
    """Predicted 180 ms, observed 150 ms: +0.2, all of the error on the one source."""
    import msgspec

    from schemas.events import TtftModel

    reqs, kv = _log(seen=seen, cached_blocks=cached_blocks, stored_blocks=cached_blocks)
    routed = reqs[1]
    rows = [msgspec.structs.replace(s, queued_prefill_tokens=queued) for s in routed.data.scores]
    model = None if samples is None else TtftModel(samples=samples, pool_samples=samples)
    reqs[1] = msgspec.structs.replace(routed, data=msgspec.structs.replace(
        routed.data, predicted_ttft_ms=180.0, ttft_model=model, scores=rows))
    reqs.append(EnvelopeFactory("router", 1, lambda: 60).wrap(RequestCompleted(
        request_id="r1", worker_id="w0", prompt_tokens=BS * len(CHAIN), output_tokens=4, cached_tokens=BS,
        ttft_ms=150.0, e2e_ms=200.0)))
    r = reconcile(reqs, kv)
    assert r.checks[0].ttft_blame == blame
    assert r.summary()["ttft_error_by"] == {blame: {"n": 1, "err_p50": pytest.approx(0.2),
                                                    "bias_p50": pytest.approx(0.2), "share": 1.0}}


def _pd_log(routed_at: dict[str, int], taken_at: dict[str, int], worker_ms: float = 100.0):
    """Disaggregated prefills routed to w0 at ``routed_at`` (ms, the router's clock) that the
    prefill worker took at ``taken_at`` (ms, its clock), each ``worker_ms`` on it, and completed
    with their first token 150 ms after the decision."""
    clock = _Clock()
    f = EnvelopeFactory("router", 1, clock)
    wf = EnvelopeFactory("w0", 1, clock)
    reqs = []
    for rid in routed_at:
        clock.ns = 1
        reqs.append(f.wrap(RequestAdmitted(request_id=rid, model="m", prompt_tokens=BS * len(CHAIN), max_tokens=4,
                                           block_hashes=CHAIN, block_size=BS, hash_algo="a")))
    for rid, ms in routed_at.items():
        clock.ns = ms * 1_000_000
        reqs.append(f.wrap(RequestRouted(
            request_id=rid, worker_id="w0", phase=RequestPhase.PREFILL, mode=RoutingMode.KV, config_version=1,
            rng_seed=1, decided_at_s=ms / 1e3, scores=[CandidateScore(worker_id="w0")])))
    for rid, ms in sorted(taken_at.items(), key=lambda kv: kv[1]):  # each producer stamps in order
        clock.ns = round((ms + worker_ms) * 1_000_000)
        reqs.append(wf.wrap(PrefillCompleted(request_id=rid, worker_id="w0", prompt_tokens=BS * len(CHAIN),
                                             duration_ms=worker_ms)))
        reqs.append(f.wrap(RequestCompleted(request_id=rid, worker_id="w1", prompt_tokens=BS * len(CHAIN),
                                            output_tokens=4, ttft_ms=150.0, e2e_ms=200.0)))
    return reqs


def test_where_a_disaggregated_ttft_went() -> None:
    """Routed at 1,000 ms, taken by the prefill worker at 1,012 ms (its PrefillCompleted at 1,112
    ms says 100 ms there), first token 150 ms after the decision: 12 ms to the worker, 100 on it,
    38 after it."""
    r = reconcile(_pd_log({"r1": 1000}, {"r1": 1012}), [])
    c = r.checks[0]
    assert (c.to_worker_ms, c.worker_ms, c.after_worker_ms, c.reordered) == (
        pytest.approx(12.0), 100.0, pytest.approx(38.0), False)
    s = r.summary()
    assert (s["to_worker_ms_p50"], s["worker_ms_p90"], s["reordered"]) == (pytest.approx(12.0), 100.0, 0)


def test_requests_the_worker_took_out_of_the_routers_order_are_reordered() -> None:
    """r1, r2, r3 routed in that order 1 ms apart; the worker took r2 before r1 (the hop to it
    varies more than the gap): both waited behind a queue the router did not predict; r3, routed
    after both and taken after both, did not."""
    r = reconcile(_pd_log({"r1": 1000, "r2": 1001, "r3": 1002}, {"r1": 1030, "r2": 1010, "r3": 1040}), [])
    assert {c.request_id: c.reordered for c in r.checks} == {"r1": True, "r2": True, "r3": False}
    assert r.summary()["reordered"] == 2


def test_an_aggregated_phase_has_no_worker_timings() -> None:
    """In aggregated serving the router records the PrefillCompleted: the worker's time is not known."""
    c = _one(seen=1, cached_blocks=1, stored_blocks=1)
    assert (c.to_worker_ms, c.worker_ms, c.after_worker_ms, c.reordered) == (None, None, None, False)
