"""``control_plane.router.ttft_fit``: the TTFT model fitted from the router's own events."""

from __future__ import annotations

import random

import msgspec
import pytest

from control_plane.router.ttft import PRIOR, TtftModel, predict_ttft_ms
from control_plane.router.ttft_fit import FIT_WINDOW_S, TtftFit
from schemas.events import CandidateScore
from schemas.types import RequestPhase

AGG = RequestPhase.AGGREGATED
#: A worker 3x faster than the prior, with a 40 ms handoff per request, whose steps cost their
#: tokens squared (the mocker's ``prefill_c2``) and whose prompts their context.
TRUE = TtftModel(base_ms=40.0, step_ms=1.0, ms_per_token=0.015, ms_per_token_ctx=1e-6, ms_per_step_token_sq=4e-7,
                 chunk_tokens=PRIOR.chunk_tokens)
#: The same costs under the features of a model without ``ms_per_step_token_sq`` (logs written
#: before it: the queue as one prompt).
TRUE_OLD = TtftModel(base_ms=40.0, step_ms=1.0, ms_per_token=0.015, ms_per_token_ctx=1e-6)


def _requests(n: int, seed: int = 7) -> list[tuple[str, CandidateScore, int]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = rng.randrange(64, 8192)
        row = CandidateScore(worker_id="w-1", overlap_blocks=rng.randrange(0, prompt // 64 + 1),
                             queued_prefill_tokens=rng.choice([0, 0, rng.randrange(0, 16384)]))
        out.append((f"r-{i}", row, prompt))
    return out


def _fold(fit: TtftFit, reqs, truth: TtftModel = TRUE, t0: float = 0.0) -> None:
    packed = truth.ms_per_step_token_sq is not None
    for k, (rid, row, prompt) in enumerate(reqs):
        fit.routed(rid, row.worker_id, AGG, row, prompt, 64, t0 + k * 0.01, packed=packed, chunk_tokens=truth.chunk_tokens)
        fit.completed(rid, predict_ttft_ms(row, prompt, 64, AGG, truth))


def test_no_observation_is_the_prior() -> None:
    fit = TtftFit()
    assert fit.model("w-1") == PRIOR and fit.model("w-1").samples == 0
    fit.routed("r", "w-1", AGG, CandidateScore(worker_id="w-1"), 100, 64, 0.0)
    fit.completed("r", 0.0)  # no TTFT recorded: no observation
    fit.completed("unknown", 50.0)  # never routed here: no observation
    assert fit.model("w-1") == PRIOR and fit.observations() == 0


def test_converges_to_a_synthetic_profile() -> None:
    """2,000 requests timed exactly by TRUE: the fitted model predicts others within 3%
    (the prior's pull fades as observations add up)."""
    fit = TtftFit()
    _fold(fit, _requests(2000))
    m = fit.model("w-1")
    assert m.samples == 2000 and m.pool_samples == 2000
    for _, row, prompt in _requests(50, seed=99):
        want = predict_ttft_ms(row, prompt, 64, AGG, TRUE)
        assert predict_ttft_ms(row, prompt, 64, AGG, m) == pytest.approx(want, rel=0.03)


def test_a_log_before_the_engines_steps_fits_the_old_features() -> None:
    """Decisions whose models had no ``ms_per_step_token_sq`` (a log written before it) observe
    the old features (the queue as one prompt): their fit learns the old-feature worker within
    3% (read as such a model, the field None) and keeps the step-squared cost at the prior's 0."""
    fit = TtftFit()
    _fold(fit, _requests(2000), TRUE_OLD)
    m = fit.model("w-1")
    assert m.ms_per_step_token_sq == 0.0
    old = msgspec.structs.replace(m, ms_per_step_token_sq=None)
    for _, row, prompt in _requests(50, seed=99):
        want = predict_ttft_ms(row, prompt, 64, AGG, TRUE_OLD)
        assert predict_ttft_ms(row, prompt, 64, AGG, old) == pytest.approx(want, rel=0.03)


def test_few_observations_stay_near_the_prior() -> None:
    """Conservative: two observations move the prediction toward the profile, not all the way
    (each cost's prior weighs 4 mean observations; correlated features pull further than 2/6)."""
    fit = TtftFit()
    _fold(fit, _requests(2))
    _, row, prompt = _requests(1, seed=3)[0]
    prior, true = (predict_ttft_ms(row, prompt, 64, AGG, m) for m in (PRIOR, TRUE))
    got = predict_ttft_ms(row, prompt, 64, AGG, fit.model("w-1"))
    assert true < got < prior and abs(got - prior) < 0.8 * abs(true - prior)


def test_a_worker_without_observations_gets_the_pool_fit() -> None:
    fit = TtftFit()
    _fold(fit, _requests(100))
    other = fit.model("w-2")
    assert other.samples == 0 and other.pool_samples == 100 and other != PRIOR


def test_the_fold_is_order_independent_and_exact() -> None:
    """Integer sums: any order of the same observations gives the same model, bit for bit,
    and adding then expiring observations leaves exactly the state without them."""
    reqs = _requests(200)
    a, b = TtftFit(), TtftFit()
    _fold(a, reqs)
    shuffled = list(reqs)
    random.Random(1).shuffle(shuffled)
    _fold(b, shuffled)
    assert a.model("w-1") == b.model("w-1")
    c = TtftFit()
    _fold(c, _requests(50, seed=5), t0=-10 * FIT_WINDOW_S)  # old, then expired
    _fold(c, reqs)
    c.expire(FIT_WINDOW_S / 2)
    assert c.model("w-1") == a.model("w-1")


def test_costs_stay_non_negative() -> None:
    """A profile with a TTFT that does not grow with the prompt: no cost turns negative."""
    fit = TtftFit()
    for k, (rid, row, prompt) in enumerate(_requests(200)):
        fit.routed(rid, "w-1", AGG, row, prompt, 64, k * 0.01)
        fit.completed(rid, 50.0)
    m = fit.model("w-1")
    assert min(m.base_ms, m.step_ms, m.ms_per_token, m.ms_per_token_ctx) >= 0
    assert predict_ttft_ms(CandidateScore(worker_id="w-1"), 2048, 64, AGG, m) == pytest.approx(50, rel=0.2)


def test_decode_phase_is_no_observation() -> None:
    fit = TtftFit()
    fit.routed("r", "w-1", RequestPhase.DECODE, CandidateScore(worker_id="w-1"), 100, 64, 0.0)
    fit.completed("r", 50.0)
    assert fit.observations() == 0


def test_reading_between_changes_gives_the_same_models_bit_for_bit() -> None:
    """The caches (a worker's affine maps, kept until its own observations change; the models,
    until any change) hold functions of the current sums only: a fit read after every event
    and one read only at the end give the same models, the uncached solve's, bit for bit."""
    from control_plane.router.ttft_fit import _params, _solver

    reqs = [(rid, msgspec_replace(row, worker_id=f"w-{k % 3}"), p) for k, (rid, row, p) in enumerate(_requests(300))]
    read_often, read_once = TtftFit(), TtftFit()
    for k, (rid, row, prompt) in enumerate(reqs):
        for fit in (read_often, read_once):
            fit.routed(rid, row.worker_id, AGG, row, prompt, 64, k * 0.01)
            fit.completed(rid, predict_ttft_ms(row, prompt, 64, AGG, TRUE))
        for w in ("w-0", "w-1", "w-2", "w-3"):
            read_often.model(w)
    for w in ("w-0", "w-1", "w-2", "w-3"):
        assert read_often.model(w) == read_once.model(w)
    m = read_once.model("w-1")
    solved = _solver(read_once._by_worker["w-1"]).solve(_params(read_once.model("w-3")))
    assert _params(m) == solved


def msgspec_replace(row: CandidateScore, **changes) -> CandidateScore:
    import msgspec

    return msgspec.structs.replace(row, **changes)


def test_the_fit_learns_on_the_queue_left_after_what_was_done() -> None:
    """An observation's queue is the row's less the ``queue_done_tokens`` its decision's model
    recorded: the same integer sums, so the same model bit for bit, as rows that showed the
    drained queue themselves, in any order."""
    reqs = _requests(200)
    done = [min(row.queued_prefill_tokens, 700 * k % 5000) for k, (_, row, _) in enumerate(reqs)]
    a, b = TtftFit(), TtftFit()
    for k, ((rid, row, prompt), d) in enumerate(zip(reqs, done)):
        a.routed(rid, row.worker_id, AGG, row, prompt, 64, k * 0.01, d)
        left = CandidateScore(worker_id=row.worker_id, overlap_blocks=row.overlap_blocks,
                              queued_prefill_tokens=row.queued_prefill_tokens - d)
        b.routed(rid, row.worker_id, AGG, left, prompt, 64, k * 0.01)
        y = predict_ttft_ms(left, prompt, 64, AGG, TRUE)
        a.completed(rid, y)
        b.completed(rid, y)
    assert a.model("w-1") == b.model("w-1") != TtftFit().model("w-1")
    # and in any order, bit for bit
    c = TtftFit()
    order = list(range(len(reqs)))
    random.Random(3).shuffle(order)
    for k in order:
        rid, row, prompt = reqs[k]
        c.routed(rid, row.worker_id, AGG, row, prompt, 64, k * 0.01, done[k])
        left = CandidateScore(worker_id=row.worker_id, overlap_blocks=row.overlap_blocks,
                              queued_prefill_tokens=row.queued_prefill_tokens - done[k])
        c.completed(rid, predict_ttft_ms(left, prompt, 64, AGG, TRUE))
    assert c.model("w-1") == a.model("w-1")


#: TRUE with decodes sharing its steps: each step slower by 3 us per block they hold (the
#: mocker's decode term, 54 ms at a full 16,384 x 64-token device, is ~3.3 us a block).
TRUE_D = TtftModel(base_ms=40.0, step_ms=1.0, ms_per_token=0.015, ms_per_token_ctx=1e-6,
                   ms_per_decode_block_step=0.003, ms_per_step_token_sq=4e-7, chunk_tokens=PRIOR.chunk_tokens)


def _decoding(n: int, seed: int = 11) -> list[tuple[str, CandidateScore, int]]:
    rng = random.Random(seed)
    return [(rid, CandidateScore(worker_id="w-1", overlap_blocks=row.overlap_blocks,
                                 queued_prefill_tokens=row.queued_prefill_tokens,
                                 active_decode_blocks=rng.choice([0, rng.randrange(0, 20000)])), prompt)
            for rid, row, prompt in _requests(n, seed)]


def test_learns_the_decode_term() -> None:
    """Steps slowed by the decodes beside them: the fit finds the decode cost (3 us a block per
    step, within 5%) and predicts within 3%, where the same observations without the decode
    feature (decisions of a model without it) leave predictions off by more."""
    fit, blind = TtftFit(), TtftFit()
    for k, (rid, row, prompt) in enumerate(_decoding(2000)):
        for f, decode in ((fit, True), (blind, False)):
            f.routed(rid, "w-1", AGG, row, prompt, 64, k * 0.01, decode=decode)
            f.completed(rid, predict_ttft_ms(row, prompt, 64, AGG, TRUE_D))
    m, b = fit.model("w-1"), blind.model("w-1")
    assert m.ms_per_decode_block_step == pytest.approx(0.003, rel=0.05)
    assert b.ms_per_decode_block_step == 0.0  # never observed: the prior's
    worst_m = worst_b = 0.0
    for _, row, prompt in _decoding(50, seed=99):
        want = predict_ttft_ms(row, prompt, 64, AGG, TRUE_D)
        worst_m = max(worst_m, abs(predict_ttft_ms(row, prompt, 64, AGG, m) / want - 1))
        worst_b = max(worst_b, abs(predict_ttft_ms(row, prompt, 64, AGG, b) / want - 1))
    assert worst_m < 0.03 < worst_b


def test_without_the_decode_term_the_fit_is_the_four_cost_fit() -> None:
    """A log written before the decode term: its decisions observe no decode feature, so the
    fit is bit for bit the one of rows with no decode blocks (the decode cost decoupled at the
    prior's 0), and a model without the field predicts as if the worker held none."""
    old, zero = TtftFit(), TtftFit()
    for k, (rid, row, prompt) in enumerate(_decoding(300)):
        y = predict_ttft_ms(row, prompt, 64, AGG, TRUE_D)
        old.routed(rid, "w-1", AGG, row, prompt, 64, k * 0.01, decode=False)
        old.completed(rid, y)
        bare = CandidateScore(worker_id="w-1", overlap_blocks=row.overlap_blocks,
                              queued_prefill_tokens=row.queued_prefill_tokens)
        zero.routed(rid, "w-1", AGG, bare, prompt, 64, k * 0.01)
        zero.completed(rid, y)
    assert old.model("w-1") == zero.model("w-1")
    row = _decoding(1, seed=5)[0][1]
    without = TtftModel(base_ms=TRUE_D.base_ms, step_ms=1.0, ms_per_token=0.015, ms_per_token_ctx=1e-6,
                        ms_per_step_token_sq=4e-7, chunk_tokens=PRIOR.chunk_tokens)
    assert (predict_ttft_ms(row, 4000, 64, AGG, without)
            == predict_ttft_ms(CandidateScore(worker_id="w-1", overlap_blocks=row.overlap_blocks,
                                              queued_prefill_tokens=row.queued_prefill_tokens), 4000, 64, AGG, TRUE_D))


def test_the_drain_rate_is_the_prefills_seen_exact_and_expired() -> None:
    """Tokens over busy time, summed as integers (tokens, microseconds): a worker's own after
    RATE_MIN_OWN prefills, the pool's before; observations leave with the fit window."""
    from control_plane.router.ttft_fit import RATE_MIN_OWN

    fit = TtftFit()
    fit.prefilled("w-1", 0.0, 0.1, 2000)  # 20 tokens/ms
    fit.prefilled("w-2", 0.0, 0.1, 4000)  # 40
    assert fit.drain_rate("w-1") == fit.drain_rate("w-3") == pytest.approx(30.0)
    for k in range(RATE_MIN_OWN - 1):
        fit.prefilled("w-1", 1.0 + k, 1.05 + k, 1000)
    assert fit.drain_rate("w-1") == pytest.approx((2000 + 1000 * (RATE_MIN_OWN - 1)) / (100 + 50 * (RATE_MIN_OWN - 1)))
    fit.expire(FIT_WINDOW_S + 0.5)  # the first two (ended at 0.1 s) leave
    assert fit.drain_rate("w-2") == pytest.approx(20.0)
    fit.expire(10 * FIT_WINDOW_S)
    assert fit.drain_rate("w-1") is None


def test_with_the_rate_seen_the_fit_learns_the_requests_own_costs() -> None:
    """Decisions whose models waited for the full steps ahead at the rate seen (25 tokens/ms):
    each observation's wait comes off its TTFT (whole microseconds) and its features are its
    last step's, so the fit finds the worker's step costs and predicts within 3%."""
    seen = msgspec.structs.replace(TRUE, queue_tokens_per_ms=25.0)
    fit = TtftFit()
    for k, (rid, row, prompt) in enumerate(_requests(2000)):
        fit.routed(rid, row.worker_id, AGG, row, prompt, 64, k * 0.01, queue_rate=25.0)
        fit.completed(rid, predict_ttft_ms(row, prompt, 64, AGG, seen))
    m = msgspec.structs.replace(fit.model("w-1"), queue_tokens_per_ms=25.0)
    for _, row, prompt in _requests(50, seed=99):
        want = predict_ttft_ms(row, prompt, 64, AGG, seen)
        assert predict_ttft_ms(row, prompt, 64, AGG, m) == pytest.approx(want, rel=0.03)


def test_a_queue_faster_than_the_rate_seen_does_not_pin_the_costs_at_zero() -> None:
    """The worker's steps as ``TRUE``, but the rate measured (5 tokens/ms) far slower than its
    queues went: the wait at that rate exceeds the TTFT of every queued request. Those are fitted
    with nothing left of their TTFT, not a negative time (which pinned every cost at 0: a request
    alone predicted 0 ms), so the idle requests' costs survive: 4,096 tokens alone, 117.5 ms by
    ``TRUE``, predicted within 20%."""
    fit = TtftFit()
    for k, (rid, row, prompt) in enumerate(_requests(400)):
        fit.routed(rid, row.worker_id, AGG, row, prompt, 64, k * 0.01, queue_rate=5.0)
        fit.completed(rid, predict_ttft_ms(row, prompt, 64, AGG, TRUE))
    alone = CandidateScore(worker_id="w-1")
    want = predict_ttft_ms(alone, 4096, 64, AGG, TRUE)
    assert predict_ttft_ms(alone, 4096, 64, AGG, fit.model("w-1")) == pytest.approx(want, rel=0.2)


def test_the_step_under_way_is_learned_apart_from_the_base() -> None:
    """Under the rate seen every observation's steps feature is its last step (1, the base's
    column) plus the steps under way it waited for (``busy_steps``): a worker whose step under
    way costs 60 ms (``TRUE`` with ``step_ms`` 60 and ``base_ms`` 10), half the requests
    finding it busy. The fit tells the two apart: a request on the idle worker is predicted
    within 5% (a fit without the flag puts the busy ones' mean wait in everyone's base)."""
    truth = msgspec.structs.replace(TRUE, base_ms=10.0, step_ms=60.0, queue_tokens_per_ms=25.0)
    fit = TtftFit()
    for k, (rid, row, prompt) in enumerate(_requests(2000)):
        busy = k % 2
        fit.routed(rid, row.worker_id, AGG, row, prompt, 64, k * 0.01, queue_rate=25.0, busy_steps=busy)
        fit.completed(rid, predict_ttft_ms(row, prompt, 64, AGG, msgspec.structs.replace(truth, busy_steps=busy)))
    m = fit.model("w-1")
    alone = CandidateScore(worker_id="w-1")
    for busy in (0, 1):
        want = predict_ttft_ms(alone, 512, 64, AGG, msgspec.structs.replace(truth, busy_steps=busy))
        bound = msgspec.structs.replace(m, queue_tokens_per_ms=25.0, busy_steps=busy)
        got = predict_ttft_ms(alone, 512, 64, AGG, bound)
        assert got == pytest.approx(want, rel=0.05)
