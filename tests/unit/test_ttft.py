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
    """4,096 tokens in two 2,048-token steps under the default costs:
    2 + 2048 x (0.05 + 2e-6 x 1024) = 108.594304, then over 2,048 tokens of context
    2 + 2048 x (0.05 + 2e-6 x 3072) = 116.982912; 225.577216 ms, more than twice 2,048's."""
    m = TtftModel()
    assert m.prefill_ms(4096) == pytest.approx(225.577216)
    assert m.prefill_ms(4096) > 2 * m.prefill_ms(2048)
    assert m.prefill_ms(0) == 0.0


def test_the_queue_ahead_then_the_uncached_tokens() -> None:
    """A row with 2,048 queued tokens and 16 of 32 blocks (block size 64) cached, under the
    prior: the queue and the 1,024 new tokens packed into the engine's 8,192-token steps, 3,072
    tokens in one step (2 + 3,072 x 0.05 = 155.6), plus the request's attention over its
    context 2e-6 x 1,024 x (1,024 + 512) = 3.145728. A model written before the engine's steps
    (no ``ms_per_step_token_sq``): the queue as one prompt (108.594304 ms) then the request's
    own step, 2 + 1024 x (0.05 + 2e-6 x 1536) = 56.345728."""
    row = CandidateScore(worker_id="w", overlap_blocks=16, queued_prefill_tokens=2048)
    assert predict_ttft_ms(row, 2048, 64, RequestPhase.AGGREGATED) == pytest.approx(155.6 + 3.145728)
    before = msgspec.structs.replace(PRIOR, ms_per_step_token_sq=None)
    assert predict_ttft_ms(row, 2048, 64, RequestPhase.AGGREGATED, before) == pytest.approx(108.594304 + 56.345728)
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
    """Under the default costs a busy worker computes 2,048 tokens per 2 + 2,048 x 0.05 = 104.4
    ms (19.6169 tokens/ms). Routed: 4,096 tokens at t=0, 2,048 at t=0.1 s. By 0.1 s the first has
    1,961.69 done (2,134.31 left); at 0.15 s 4,182.31 - 980.84 = 3,201.47 are left of 6,144, so
    2,942 are done (the rest rounded up: never more done than the model allows)."""
    from control_plane.router.ttft import queue_done

    PRIOR = TtftModel()  # noqa: N806 - the arithmetic above
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
    behind 2,000 (3,024 tokens in one 8,192-token step instead of 1,024: 2,000 x 0.05 = 100 ms
    more); more done than queued waits behind nothing."""
    from control_plane.router.ttft import predict

    bound = msgspec.structs.replace(PRIOR, queue_done_tokens=1000)
    assert predict(3000, 0, 0, 1024, 64, bound) - predict(0, 0, 0, 1024, 64, PRIOR) == pytest.approx(100.0)
    assert predict(3000, 0, 0, 1024, 64, msgspec.structs.replace(PRIOR, queue_done_tokens=5000)) == predict(
        0, 0, 0, 1024, 64, PRIOR)
    with pytest.raises(ValueError):
        TtftModel(queue_done_tokens=-1)


def test_the_router_ledger_binds_the_drained_queue_to_the_decisions_model() -> None:
    """The fold's in-flight prefills on a worker, in routed order, drained at the worker's
    fitted rate (the prior's, 8,192 / (2 + 8,192 x 0.05) tokens/ms: 2,985 of 6,144 by 0.15 s);
    the prefill done drops out; the fold of the same events gives the same."""
    from control_plane.router.ledger import RouterLedger

    led = RouterLedger()
    led.inflight.add("x", "a", (1,), 4096, 2, now=0.0, ttl=600.0)
    led.inflight.add("y", "a", (2,), 2048, 2, now=0.1, ttl=600.0)
    led.inflight.add("z", "b", (3,), 1000, 2, now=0.1, ttl=600.0)
    assert led.inflight.pending_prefills("a") == [(0.0, 4096), (0.1, 2048)]
    assert led.ttft_model("a", 0.15).queue_done_tokens == 2985
    assert led.ttft_model("a", 0.15).busy_steps == 1
    led.inflight.add("d", "e", (4,), 0, 8, now=0.1, ttl=600.0)  # prefilled elsewhere, decoding on e
    assert led.ttft_model("e", 0.15).busy_steps == 1 and led.ttft_model("e", 0.15).queue_done_tokens == 0
    assert led.ttft_model("c", 0.15) == msgspec.structs.replace(led.ttft_fit.model("c"), queue_done_tokens=0,
                                                                busy_steps=0)
    led.inflight.prefill_done("x")
    assert led.inflight.pending_prefills("a") == [(0.1, 2048)]
    led.inflight.complete("y")
    assert led.inflight.pending_prefills("a") == [] and led.inflight.pending_prefills("b") == [(0.1, 1000)]


def test_the_engines_steps_packed_first_come_first_served() -> None:
    """10,000 tokens in 8,192-token steps: a full one and 1,808 (8,192^2 + 1,808^2 tokens
    squared); none, none."""
    from control_plane.router.ttft import packed_steps

    assert packed_steps(10_000, 8192) == (2, 8192 * 8192 + 1808 * 1808)
    assert packed_steps(8192, 8192) == (1, 8192 * 8192)
    assert packed_steps(0, 8192) == (0, 0)


def test_the_features_are_the_mocker_engines_step_cost() -> None:
    """Two requests of 5,000 and 3,000 tokens queued on an idle simulated worker (mocker
    profile: a step of T prompt tokens lasts c0 + c1 T + c2 T^2, 8,192 a step, no context term),
    then a 4,000-token one: its first token comes after the steps of 8,192 and 3,808 tokens. A
    model with the profile's numbers as its costs predicts that TTFT exactly (to float
    rounding): the queue ahead and the request packed into the engine's steps, each costing its
    tokens squared."""
    from control_plane.router.ttft import predict
    from data_plane.engines.core import EngineCore
    from data_plane.engines.request import EngineRequest

    eng = EngineCore("mocker")
    timing = eng.timing
    tokens = iter(range(1, 1 << 30))
    for rid, n in (("q0", 5000), ("q1", 3000), ("me", 4000)):
        eng.add_request(EngineRequest(request_id=rid, prompt=[next(tokens) for _ in range(n)], max_tokens=1))
    elapsed, ttft = 0.0, None
    while ttft is None:
        res = eng.step()
        elapsed += res.duration_ms
        if any(t.request_id == "me" for t in res.tokens):
            ttft = elapsed
    assert ttft == pytest.approx(timing.prefill_ms(8192) + timing.prefill_ms(3808), rel=1e-12)
    mocker = TtftModel(base_ms=0.0, step_ms=timing.prefill_c0, ms_per_token=timing.prefill_c1, ms_per_token_ctx=0.0,
                       ms_per_step_token_sq=timing.prefill_c2, ms_per_decode_block_step=0.0, chunk_tokens=8192)
    assert predict(8000, 0, 0, 4000, eng.profile.block_size, mocker) == pytest.approx(ttft, rel=1e-12)
    # the features of a model written before: two prompts apart, the queue squared as one
    before = msgspec.structs.replace(mocker, ms_per_step_token_sq=None)
    assert predict(8000, 0, 0, 4000, eng.profile.block_size, before) < 0.9 * ttft


def test_the_queue_drains_from_the_last_prefill_seen_end_at_the_rate_seen() -> None:
    """The drain starts no earlier than the end of the last prefill the router saw end on the
    worker (what was routed before it waited for it), at the rate the worker's prefills were
    seen to go: 4,096 tokens routed at 0 s to an idle worker, done at 0.2 s (20.48 tokens/ms);
    then 8,192 routed at 0.1 s (busy until 0.2 s), at 0.3 s 2,048 of them done."""
    from control_plane.router.ledger import RouterLedger
    from control_plane.router.ttft import queue_done

    led = RouterLedger()
    led.inflight.add("x", "a", (1,), 4096, 64, now=0.0, ttl=600.0)
    led.inflight.add("y", "a", (2,), 8192, 128, now=0.1, ttl=600.0)
    assert led.ttft_fit.drain_rate("a") is None
    for w, since, tokens in led.inflight.prefill_done("x", at=0.2):
        led.ttft_fit.prefilled(w, since, 0.2, tokens)
    assert led.inflight.prefill_done_at("a") == 0.2 and led.ttft_fit.drain_rate("a") == pytest.approx(20.48)
    assert led.ttft_model("a", 0.3).queue_done_tokens == 2048
    # the pending prefill alone, from its routing, at the model's rate, as before
    assert queue_done([(0.1, 8192)], 0.3, PRIOR) > 2048
    assert queue_done([(0.1, 8192)], 0.3, PRIOR, since_s=0.2, rate=20.48) == 2048
    # a worker with none seen takes the pool's rate
    assert led.ttft_fit.drain_rate("b") == pytest.approx(20.48)


def test_a_model_with_the_rate_seen_waits_behind_the_queue_at_it() -> None:
    """Bound with the rate the worker was seen to prefill at (40 tokens/ms): 10,000 queued and
    1,024 of its own are 11,024 tokens, a full 8,192-token step (8,192 / 40 = 204.8 ms at that
    rate) then the request's last step of 2,832 under the costs (2 + 2,832 x 0.05 + the
    request's attention 1e-6 x 1,024^2 = 144.648576). A queue and request within one step
    predict as without the rate."""
    from control_plane.router.ttft import predict, rate_split

    assert rate_split(11_024, 8192) == (8192, 2832) and rate_split(0, 8192) == (0, 0)
    seen = msgspec.structs.replace(PRIOR, queue_tokens_per_ms=40.0)
    assert predict(10_000, 0, 0, 1024, 64, seen) == pytest.approx(204.8 + 144.648576)
    assert predict(4000, 0, 0, 1024, 64, seen) == predict(4000, 0, 0, 1024, 64, PRIOR)
    with pytest.raises(ValueError):
        TtftModel(queue_tokens_per_ms=0.0)


def test_a_busy_worker_adds_the_step_under_way() -> None:
    """A model bound while the router had prefills on the worker not seen end
    (``busy_steps`` 1: the engine adds a request at a step boundary, so it waits for the step
    under way) costs one more ``step_ms`` (the prior's 2 ms), with or without the rate seen; a
    model without the field (decided before it) predicts as busy 0."""
    from control_plane.router.ttft import features, predict

    for m in (PRIOR, msgspec.structs.replace(PRIOR, queue_tokens_per_ms=40.0)):
        idle = predict(4000, 0, 0, 1024, 64, msgspec.structs.replace(m, busy_steps=0))
        assert predict(4000, 0, 0, 1024, 64, msgspec.structs.replace(m, busy_steps=1)) == pytest.approx(idle + 2.0)
        assert predict(4000, 0, 0, 1024, 64, m) == idle
    row = CandidateScore(worker_id="a", queued_prefill_tokens=4000)
    assert features(row, 1024, 64, 8192, packed=True, busy_steps=1)[1] == 2
    assert features(row, 1024, 64, 8192, packed=True, at_rate=True, busy_steps=1)[1] == 2
    with pytest.raises(ValueError):
        TtftModel(busy_steps=-1)
