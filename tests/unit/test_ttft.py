"""``control_plane.router.ttft``: the predicted TTFT recorded with each routing decision."""

from __future__ import annotations

import msgspec
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


def test_the_queue_drains_first_come_first_served_at_the_models_rate() -> None:
    """Under the prior a busy worker computes 2,048 tokens per 2 + 2,048 x 0.05 = 104.4 ms
    (19.6169 tokens/ms). Routed: 4,096 tokens at t=0, 2,048 at t=0.1 s. By 0.1 s the first has
    1,961.69 done (2,134.31 left); at 0.15 s 4,182.31 - 980.84 = 3,201.47 are left of 6,144, so
    2,942 are done (the rest rounded up: never more done than the model allows)."""
    from control_plane.router.ttft import queue_done

    rate = 2048 / 104.4
    assert PRIOR.tokens_per_ms() == pytest.approx(rate)
    pending = [(0.0, 4096), (0.1, 2048)]
    left = 4096 - rate * 100 + 2048 - rate * 50
    assert queue_done(pending, 0.15, PRIOR) == 6144 - int(left) - 1 == 2942
    # nothing routed; nothing elapsed; an idle worker long after: all done
    assert queue_done([], 5.0, PRIOR) == 0
    assert queue_done([(1.0, 500)], 1.0, PRIOR) == 0
    assert queue_done(pending, 60.0, PRIOR) == 6144
    # a worker idle in between does not bank the idle time: 500 tokens at 0, done by 0.1 s;
    # 4,096 at 10 s, 0.05 s later 980.84 of them done
    assert queue_done([(0.0, 500), (10.0, 4096)], 10.05, PRIOR) == 500 + 980
    # a model that gives tokens no cost: everything routed before now is done
    free = TtftModel(base_ms=5.0, step_ms=0.0, ms_per_token=0.0)
    assert queue_done(pending, 0.1000001, free) == 6144


def test_the_prediction_waits_behind_what_is_left_of_the_queue() -> None:
    """The decision's model carries ``queue_done_tokens``: 3,000 queued with 1,000 done waits
    behind 2,000 (one 2,048-token step: 2 + 2000 x (0.05 + 2e-6 x 1000) = 106 ms); more done
    than queued waits behind nothing."""
    from control_plane.router.ttft import predict

    bound = msgspec.structs.replace(PRIOR, queue_done_tokens=1000)
    assert predict(3000, 0, 0, 1024, 64, bound) - predict(0, 0, 0, 1024, 64, PRIOR) == pytest.approx(106.0)
    assert predict(3000, 0, 0, 1024, 64, msgspec.structs.replace(PRIOR, queue_done_tokens=5000)) == predict(
        0, 0, 0, 1024, 64, PRIOR)
    with pytest.raises(ValueError):
        TtftModel(queue_done_tokens=-1)


def test_the_router_ledger_binds_the_drained_queue_to_the_decisions_model() -> None:
    """The fold's in-flight prefills on a worker, in routed order, drained at the worker's
    fitted rate; the prefill done drops out; the fold of the same events gives the same."""
    from control_plane.router.ledger import RouterLedger

    led = RouterLedger()
    led.inflight.add("x", "a", (1,), 4096, 2, now=0.0, ttl=600.0)
    led.inflight.add("y", "a", (2,), 2048, 2, now=0.1, ttl=600.0)
    led.inflight.add("z", "b", (3,), 1000, 2, now=0.1, ttl=600.0)
    assert led.inflight.pending_prefills("a") == [(0.0, 4096), (0.1, 2048)]
    assert led.ttft_model("a", 0.15).queue_done_tokens == 2942
    assert led.ttft_model("c", 0.15) == msgspec.structs.replace(led.ttft_fit.model("c"), queue_done_tokens=0)
    led.inflight.prefill_done("x")
    assert led.inflight.pending_prefills("a") == [(0.1, 2048)]
    led.inflight.complete("y")
    assert led.inflight.pending_prefills("a") == [] and led.inflight.pending_prefills("b") == [(0.1, 1000)]
