"""``control_plane.router.ttft``: the predicted TTFT recorded with each routing decision."""

from __future__ import annotations

import pytest

from control_plane.router.config import RouterConfig
from control_plane.router.decision import RoutingRequest, WorkerLoad, WorkerOverlap, decide
from control_plane.router.inputs import DecisionInputs, routed_event
from control_plane.router.ttft import PRIOR, TtftModel, predict_ttft_ms
from schemas.events import CandidateScore
from schemas.types import RequestPhase


def test_prefill_goes_chunk_by_chunk_and_grows_faster_than_the_prompt() -> None:
    """4,096 tokens in two 2,048-token steps under the prior:
    2 + 2048 x (0.05 + 2e-6 x 1024) = 108.594304, then over 2,048 tokens of context
    2 + 2048 x (0.05 + 2e-6 x 3072) = 116.982912; 225.577216 ms, more than twice 2,048's."""
    assert PRIOR.prefill_ms(4096) == pytest.approx(225.577216)
    assert PRIOR.prefill_ms(4096) > 2 * PRIOR.prefill_ms(2048)
    assert PRIOR.prefill_ms(0) == 0.0


def test_the_queue_ahead_then_the_uncached_tokens() -> None:
    """A row with 2,048 queued tokens and 16 of 32 blocks (block size 64) cached: the queue
    (108.594304 ms) then 1,024 new tokens over 1,024 cached:
    2 + 1024 x (0.05 + 2e-6 x 1536) = 56.345728."""
    row = CandidateScore(worker_id="w", overlap_blocks=16, queued_prefill_tokens=2048)
    assert predict_ttft_ms(row, 2048, 64, RequestPhase.AGGREGATED) == pytest.approx(108.594304 + 56.345728)
    # the in-flight overlap counts when it is longer; a whole-prompt hit still computes a token
    whole = CandidateScore(worker_id="w", speculative_overlap=32)
    assert predict_ttft_ms(whole, 2048, 64, RequestPhase.AGGREGATED) == pytest.approx(
        PRIOR.prefill_ms(1, 2047))
    assert predict_ttft_ms(row, 2048, 64, RequestPhase.DECODE) == 0.0
    slow = TtftModel(ms_per_token=0.075)
    assert predict_ttft_ms(row, 2048, 64, RequestPhase.AGGREGATED, slow) > predict_ttft_ms(
        row, 2048, 64, RequestPhase.AGGREGATED)


def test_request_routed_records_the_chosen_rows_prediction() -> None:
    req = RoutingRequest(request_id="r1", prompt_tokens=1024, block_hashes=tuple(range(1, 17)), block_size=64,
                         expected_output_tokens=16)
    workers = [WorkerLoad(worker_id="a", queued_prefill_tokens=4096), WorkerLoad(worker_id="b")]
    overlaps = {"a": WorkerOverlap.of(device=16)}
    inputs = DecisionInputs(request=req, workers=workers, overlaps=overlaps, inflight=None, rr_cursor=None,
                            rng_seed=7)
    config = RouterConfig()
    d = decide(req, workers, config, rng_seed=7, overlaps=overlaps)
    ev = routed_event(d, inputs, config)
    row = next(s for s in d.scores if s.worker_id == d.worker_id)
    assert ev.predicted_ttft_ms == predict_ttft_ms(row, 1024, 64, RequestPhase.AGGREGATED) > 0


@pytest.mark.parametrize("new,ctx,chunk", [(1, 0, 2048), (2048, 0, 2048), (5000, 777, 512), (100_000, 3, 8192)])
def test_closed_form_is_the_sum_of_the_steps(new: int, ctx: int, chunk: int) -> None:
    m = TtftModel(chunk_tokens=chunk)
    total, done = 0.0, 0
    while done < new:
        n = min(chunk, new - done)
        total += m.step_ms + n * (m.ms_per_token + m.ms_per_token_ctx * (ctx + done + n / 2))
        done += n
    assert m.prefill_ms(new, ctx) == pytest.approx(total, rel=1e-12)


def test_the_prediction_waits_behind_the_routers_own_queue_not_the_report() -> None:
    """Worker a reports 50,000 queued tokens (a report up to its interval old); the ledger holds
    one request of this router with 3,000 tokens still to prefill there. The row keeps the
    combined load for the kv cost and records the 47,000 only the report adds, which the
    prediction leaves out; b's ledger covers its queue (nothing recorded); a row written before
    the column is predicted behind the combined figure."""
    from control_plane.router.ledger import InflightLedger
    from control_plane.router.ttft import predict, queue_ahead

    req = RoutingRequest(request_id="r1", prompt_tokens=1024, block_hashes=tuple(range(1, 17)), block_size=64,
                         expected_output_tokens=16)
    workers = [WorkerLoad(worker_id="a", queued_prefill_tokens=50_000), WorkerLoad(worker_id="b")]
    ledger = InflightLedger()
    ledger.add("other", "a", (99,), 3000, 40, now=0.0, ttl=600.0)
    d = decide(req, workers, RouterConfig(), rng_seed=7, inflight=ledger, ttft_models={})
    a, b = sorted(d.scores, key=lambda s: s.worker_id)
    assert (a.queued_prefill_tokens, a.report_only_prefill_tokens, queue_ahead(a)) == (50_000, 47_000, 3000)
    assert (b.queued_prefill_tokens, b.report_only_prefill_tokens) == (0, 0)
    assert a.predicted_ttft_ms == predict(3000, 0, 0, 1024, 64) == predict_ttft_ms(a, 1024, 64, RequestPhase.AGGREGATED)
    old = CandidateScore(worker_id="a", queued_prefill_tokens=50_000)
    assert queue_ahead(old) == 50_000
