"""The admission test and queue (control_plane/router/admission.py), core only."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from control_plane.router.admission import (RULE, AdmissionConfig, AdmissionQueue, PoolLoad, PromiseMargin,
                                            QueueRefused, budget_detour, budget_terms, folded_terms, margin_worker,
                                            over_budget,
                                            has_room, over_ttft_budget, queue_headroom, terms_rule)
from schemas.events import AdmissionTerms, CandidateScore


def _cfg(**kw) -> AdmissionConfig:  # noqa: ANN003
    return AdmissionConfig(**{"busy_prefill_tokens": 1000, "queue_max": 2, "queue_timeout_s": 5.0, **kw})


def test_room_while_the_least_loaded_worker_is_below_the_threshold():
    """Workers at 900 and 1200 pending tokens, threshold 1000: 900 < 1000, room. 100 granted
    tokens on top: 900 + 100 = 1000 >= 1000, no room."""
    entry = [PoolLoad("a", 900), PoolLoad("b", 1200)]
    assert has_room(entry, None, _cfg())
    assert not has_room(entry, None, _cfg(), granted_tokens=100)
    assert has_room(entry, None, _cfg(busy_prefill_tokens=0), granted_tokens=10**9)  # 0: no limit


def test_decode_pool_full_holds_disaggregated_requests():
    """Decode capacity 100 blocks, busy at 0.95: 96 >= 95 busy, 94 not."""
    entry = [PoolLoad("p", 0)]
    busy = [PoolLoad("d0", active_decode_blocks=96, kv_capacity_blocks=100)]
    free = [PoolLoad("d1", active_decode_blocks=94, kv_capacity_blocks=100)]
    assert not has_room(entry, busy, _cfg())
    assert has_room(entry, busy + free, _cfg())
    assert has_room([], None, _cfg())  # no worker: the decision reports it, not admission


def test_config_refuses_what_cannot_work():
    for bad in ({"busy_prefill_tokens": -1}, {"busy_kv_fraction": 0}, {"queue_max": -1}, {"queue_timeout_s": 0}):
        with pytest.raises(ValueError):
            AdmissionConfig(**bad)


async def test_fcfs_grants_in_order_and_bounds_the_queue():
    room = {"open": False}
    q = AdmissionQueue(_cfg(poll_interval_s=0.001), lambda granted: room["open"] and granted == 0)
    order: list[str] = []

    async def take(name: str) -> None:
        await q.acquire(10)
        order.append(name)
        q.routed(10)

    a = asyncio.ensure_future(take("a"))
    b = asyncio.ensure_future(take("b"))
    while len(q) < 2:
        await asyncio.sleep(0.001)
    with pytest.raises(QueueRefused) as full:
        await q.acquire(10)
    assert full.value.status == 429 and full.value.code == "queue_full"
    room["open"] = True
    await asyncio.gather(a, b)
    assert order == ["a", "b"] and q.granted_tokens == 0 and q.admitted == 2


async def test_waiting_longer_than_the_timeout_is_a_503():
    q = AdmissionQueue(_cfg(queue_timeout_s=0.05, poll_interval_s=0.01), lambda granted: False)
    with pytest.raises(QueueRefused) as late:
        await q.acquire(10)
    assert late.value.status == 503 and late.value.code == "queue_timeout" and len(q) == 0


def _row(wid: str, predicted: float | None, eligible: bool = True) -> CandidateScore:
    return CandidateScore(worker_id=wid, overlap_blocks=0, prefill_blocks=1, decode_blocks=0, cost=0.0,
                          eligible=eligible, predicted_ttft_ms=predicted)


def test_the_budget_counts_what_the_request_spent_in_the_router_and_its_loop_lag():
    """Best eligible row 300 ms (the 100 ms one is not eligible), budget 1000 ms: 300 + 400 spent
    + 200 of loop lag = 900, kept; + 400 of lag = 1100, refused, Retry-After ceil(0.1) = 1; 300 +
    2900 spent = 3200: Retry-After 3."""
    rows = [_row("a", 300.0), _row("b", 100.0, eligible=False), _row("c", 500.0)]
    assert over_ttft_budget(rows, 1000.0, spent_ms=400.0, loop_lag_ms=200.0) is None
    reason, retry = over_ttft_budget(rows, 1000.0, spent_ms=400.0, loop_lag_ms=400.0)
    assert retry == 1 and reason == ("predicted TTFT 300 ms on the best candidate (a) + 400 ms already spent in the "
                                     "router + 400 ms of its event-loop lag = 1100 ms exceeds the budget of 1000 ms")
    assert over_ttft_budget(rows, 1000.0, spent_ms=2900.0)[1] == 3
    assert over_ttft_budget(rows, 0.0, spent_ms=10**6) is None  # off
    assert over_ttft_budget([_row("d", None)], 1.0, spent_ms=10**6) is None  # no prediction: a decode phase


def test_the_promise_is_judged_on_the_worker_the_decision_chose():
    """Rows a 300 ms and c 500 ms; margin 2.5, 100 ms spent. The decision chose c (a block-count
    cost does not pick the fastest): 500 x 2.5 + 100 = 1350 > 1000, refused, though a's 300 x 2.5 +
    100 = 850 would fit; chose a: kept. Terms written before the field (``chosen`` False) keep
    the best row's rule, so replay re-executes them as they ran."""
    rows = [_row("a", 300.0), _row("c", 500.0)]
    reason, _ = over_ttft_budget(rows, 1000.0, spent_ms=100.0, margin=2.5, chosen="c")
    assert reason.startswith("predicted TTFT 500 ms on the chosen candidate (c) x 2.50")
    assert over_ttft_budget(rows, 1000.0, spent_ms=100.0, margin=2.5, chosen="a") is None
    old = budget_terms(rows, 1000.0, 100.0, margin=2.5)
    assert (old.worker_id, old.predicted_ttft_ms, old.chosen, over_budget(old)) == ("a", 300.0, False, None)
    new = budget_terms(rows, 1000.0, 100.0, margin=2.5, chosen="c")
    assert (new.worker_id, new.predicted_ttft_ms, new.chosen) == ("c", 500.0, True)


def test_a_chosen_worker_that_breaks_the_promise_another_keeps_is_decided_around():
    """Rows a 300 ms and c 500 ms, margin 2.5, 100 ms spent, budget 1000. Chosen c: 1350 ms, over;
    the best row a: 850 ms, kept: decide again without c. Chosen a: nothing to do. Margin 4: a
    is 1300 ms too, even the best breaks it: refused, no detour. Idle (the probe), or terms
    written before ``chosen``: never a detour."""
    rows = [_row("a", 300.0), _row("c", 500.0)]
    terms = budget_terms(rows, 1000.0, 100.0, margin=2.5, chosen="c")
    assert budget_detour(rows, terms) == "c"
    assert budget_detour(rows, budget_terms(rows, 1000.0, 100.0, margin=2.5, chosen="a")) is None
    assert budget_detour(rows, budget_terms(rows, 1000.0, 100.0, margin=4.0, chosen="c")) is None
    assert budget_detour(rows, budget_terms(rows, 1000.0, 100.0, margin=2.5, idle=True, chosen="c")) is None
    assert budget_detour(rows, budget_terms(rows, 1000.0, 100.0, margin=2.5)) is None


async def test_a_request_waits_in_the_queue_no_longer_than_its_budget_allows():
    """Queue timeout 5 s, 50 ms of budget left: refused 429 ttft_budget after ~50 ms, not 503
    after 5 s; none left at all (and no room): refused at once; room: granted whatever is left."""
    q = AdmissionQueue(_cfg(poll_interval_s=0.01), lambda granted: False)
    with pytest.raises(QueueRefused) as late:
        await q.acquire(10, budget_s=0.05)
    assert (late.value.status, late.value.code, len(q), q.over_budget, q.timed_out) == (429, "ttft_budget", 0, 1, 0)
    with pytest.raises(QueueRefused) as spent:
        await q.acquire(10, budget_s=-0.2)
    assert spent.value.code == "ttft_budget" and "200 ms over" in str(spent.value) and q.over_budget == 2
    open_q = AdmissionQueue(_cfg(), lambda granted: True)
    assert await open_q.acquire(10, budget_s=-1.0) == 0.0


def test_the_margin_is_the_p90_of_recent_observed_over_predicted_and_forgets_old_decisions():
    """Ten requests decided at 1000..1009 s, each predicted 100 ms and observed 100..1000 ms:
    ratios 1..10, nearest-rank p90 = the 9th = 9. Fewer than 8 ratios: 1 (the prediction as it
    is). At 1036.5 the window (30 s) keeps those decided from 1006.5: 3 left, so 1 again. A ratio
    below 1 never shrinks a prediction; one far above is capped at 10."""
    m = PromiseMargin()
    for i in range(10):
        m.routed(f"r{i}", 100.0, 1000.0 + i)
        assert m.factor() == 1.0 or i >= 8
        m.completed(f"r{i}", 100.0 * (i + 1), 1000.0 + i + 1)
    assert m.factor() == 9.0
    m.expire(1036.5)
    assert m.factor() == 1.0
    fast, slow = PromiseMargin(), PromiseMargin()
    for i in range(8):
        fast.routed(f"f{i}", 100.0, 2000.0)
        fast.completed(f"f{i}", 50.0, 2000.1)
        slow.routed(f"s{i}", 10.0, 2000.0)
        slow.completed(f"s{i}", 10_000.0, 2010.0)
    assert (fast.factor(), slow.factor()) == (1.0, 10.0)
    # Rejected or failed before a token: no observation.
    m.routed("x", 100.0, 1040.0)
    m.forget("x", 1040.1)
    m.completed("x", 5000.0, 1045.0)
    assert m.factor() == 1.0


def test_the_margin_multiplies_the_prediction_before_the_budget_test():
    """300 ms predicted x 2.5 = 750, + 100 spent + 100 lag = 950 <= 1000: kept; x 3 = 1100: refused."""
    rows = [_row("a", 300.0)]
    assert over_ttft_budget(rows, 1000.0, 100.0, 100.0, margin=2.5) is None
    reason, _ = over_ttft_budget(rows, 1000.0, 100.0, 100.0, margin=3.0)
    assert "300 ms on the best candidate (a) x 3.00 (recent observed/predicted) + 100 ms" in reason


def test_a_router_with_nothing_in_flight_admits_whatever_the_prediction():
    """Predicted 5 s against a 1 s budget: refused while the router has requests in flight;
    admitted when it has none and its model was fitted (the one request whose outcome corrects
    a stale model; the proxy passes ``idle`` only then)."""
    rows = [_row("a", 5000.0)]
    assert over_ttft_budget(rows, 1000.0) is not None
    assert over_ttft_budget(rows, 1000.0, idle=True) is None


def test_requests_already_late_for_their_first_token_raise_the_margin_before_they_complete():
    """Eight requests decided at t=100 s, each predicted 100 ms, no first token yet. At 100.05 s
    they are not late (0.5 < 1): margin 1. At 100.4 s each is at least 4x late: margin 4. Past
    their first token they no longer count; completed, their real ratios do."""
    m = PromiseMargin()
    for i in range(8):
        m.routed(f"r{i}", 100.0, 100.0)
    assert m.factor(100.05) == 1.0
    assert m.factor(100.4) == pytest.approx(4.0)
    assert m.factor() == 1.0  # completed requests only
    for i in range(8):
        m.first_token(f"r{i}", 100.4)
    assert m.factor(100.4) == 1.0
    for i in range(8):
        m.completed(f"r{i}", 300.0, 100.5)
    assert m.factor(100.4) == pytest.approx(3.0)


def test_two_requests_late_for_their_prefill_set_the_margin_whatever_the_window_holds():
    """A minute of quiet traffic: 60 ratios of 1.0 in the window (p90 = 1). Then requests decided
    at 100 s predicted 100 ms, still without their first token. At 100.3 s one is 3x late: one straggler
    alone, margin 1. A second one decided at 100.1 s: 2x late at 100.3; the margin is the second
    largest lower bound, 2 (pooled with the 60 window ratios, the p90 would stay 1). At 100.5 s:
    5x and 4x, margin 4. Once one of them has its first token, the window's margin again."""
    m = PromiseMargin()
    for i in range(60):
        m.routed(f"q{i}", 100.0, 40.0 + i)
        m.completed(f"q{i}", 100.0, 40.1 + i)
    m.routed("a", 100.0, 100.0)
    assert m.factor(100.3) == 1.0
    m.routed("b", 100.0, 100.1)
    assert m.factor(100.3) == pytest.approx(2.0)
    assert m.factor(100.5) == pytest.approx(4.0)
    m.first_token("a", 100.5)
    assert m.factor(100.5) == 1.0


def test_the_routers_own_queue_implies_a_ttft_from_its_busy_time_per_first_token():
    """Four requests decided at 10.0, 10.2, 10.4, 10.6 s (predicted 100 ms), their first tokens
    at 10.3, 10.5, 10.7, 10.9: busy from 10.0 to 10.9 (0.9 s) for 4 first tokens, 225 ms each.
    With none waiting, one more would take 225 ms (no headroom on an empty queue). Then five are
    routed at 11.0 and none has its first token yet at 11.2: busy 0.9 + 0.2 s over 4 first
    tokens, times (2 x 5 + 1) (the five ahead, and as many admitted behind it sharing the
    batch): 3,025 ms, though none is late enough for the margin (2 x its prediction). A request forgotten
    (rejected, failed) stops waiting without a first token. Fewer than 3 first tokens: 0."""
    m = PromiseMargin()
    assert m.queue_ms(10.0) == 0.0
    m.routed("a0", 100.0, 10.0)
    for i in range(1, 4):  # in time order: each routed before the previous one's first token
        m.routed(f"a{i}", 100.0, 10.0 + 0.2 * i)
        m.first_token(f"a{i - 1}", 10.1 + 0.2 * i)
    m.first_token("a3", 10.9)
    assert m.waiting() == 0 and m.queue_ms(10.95) == pytest.approx(225.0)
    for i in range(5):
        m.routed(f"b{i}", 100.0, 11.0)
    assert m.waiting() == 5 and m.queue_ms(11.2) == pytest.approx(11 * 1100.0 / 4)
    # Terms recorded before the headroom (``chosen`` False) re-derive with (5 + 1): 1,650 ms.
    old, new = AdmissionTerms(budget_ms=1000.0), AdmissionTerms(budget_ms=1000.0, chosen=True)
    assert m.queue_ms(11.2, queue_headroom(old)) == pytest.approx(6 * 1100.0 / 4)
    assert m.queue_ms(11.2, queue_headroom(new)) == m.queue_ms(11.2)
    assert m.factor(11.2) == pytest.approx(2.0)
    reason, _ = over_budget(budget_terms([_row("w", 100.0)], 1000.0, 10.0, 5.0, m.factor(11.2),
                                         queue_ms=m.queue_ms(11.2), chosen="w"))
    assert reason.startswith("3025 ms for this router's own queue (above the predicted TTFT 100 ms on the chosen "
                             "candidate (w) x 2.00")
    for i in range(5):
        m.forget(f"b{i}", 11.3)
    assert m.waiting() == 0 and m.queue_ms(11.3) == pytest.approx(1.2 / 4 * 1000)
    m.expire(25.0)
    assert m.queue_ms(25.0) == 0.0


def test_rule_3_alone_counts_the_loop_lag_on_the_way_in_and_on_the_way_out():
    """Chosen row 300 ms, 300 ms spent, loop lag 250 ms, budget 1000: rule 3 300 + 300 + 2 x 250
    = 1100, refused; rule 4 (what the router writes now) counts the lag once: 850, kept; lag 450:
    1050, refused. Terms recorded before the field re-execute by their own rule, the lag once:
    850, kept (``chosen``: rule 2; without it, rule 1)."""
    rows = [_row("a", 300.0)]
    new = budget_terms(rows, 1000.0, 300.0, 250.0, chosen="a")
    assert (new.rule, terms_rule(new)) == (RULE, 4) and over_budget(new) is None
    reason, _ = over_budget(msgspec.structs.replace(new, rule=3))
    assert reason == ("predicted TTFT 300 ms on the chosen candidate (a) + 300 ms already spent in the router + "
                      "2 x 250 ms of its event-loop lag (in and out) = 1100 ms exceeds the budget of 1000 ms")
    reason, _ = over_ttft_budget(rows, 1000.0, spent_ms=300.0, loop_lag_ms=450.0, chosen="a")
    assert reason == ("predicted TTFT 300 ms on the chosen candidate (a) + 300 ms already spent in the router + "
                      "450 ms of its event-loop lag = 1050 ms exceeds the budget of 1000 ms")
    before = msgspec.structs.replace(new, rule=0)
    assert terms_rule(before) == 2 and over_budget(before) is None
    assert terms_rule(msgspec.structs.replace(before, chosen=False)) == 1
    assert [queue_headroom(t) for t in (new, before, msgspec.structs.replace(before, chosen=False))] == [2, 2, 1]


def test_from_rule_3_each_worker_has_its_own_margin():
    """Worker a: 8 requests served at 3x their prediction; worker b: 8 at 1x (window p90 of all
    16: 3). a's own margin 3, b's 1; a worker with fewer than 8 ratios: 1. Two of b's requests
    late at once (5x, 4x) raise b's margin to 4 and leave a's at 3. The terms say whose margin:
    the judged worker's from rule 3, every worker's before."""
    m = PromiseMargin()
    for i in range(8):
        m.routed(f"a{i}", 100.0, 10.0 + i, "a")
        m.completed(f"a{i}", 300.0, 10.5 + i)
        m.routed(f"b{i}", 100.0, 10.0 + i, "b")
        m.completed(f"b{i}", 100.0, 10.5 + i)
    assert (m.factor(20.0), m.factor(20.0, "a"), m.factor(20.0, "b"), m.factor(20.0, "c")) == (3.0, 3.0, 1.0, 1.0)
    m.routed("late1", 100.0, 20.0, "b")
    m.routed("late2", 100.0, 20.1, "b")
    assert m.factor(20.5, "b") == pytest.approx(4.0) and m.factor(20.5, "a") == 3.0
    t = budget_terms([_row("b", 100.0)], 1000.0, chosen="b")
    assert margin_worker(t) == "b" and margin_worker(msgspec.structs.replace(t, rule=2)) is None


def test_the_detour_judges_each_other_row_with_its_own_margin():
    """Rows a 300 ms (chosen; its margin 3: 900 + 200 spent = 1100, over) and b 400 ms (its own
    margin 1: 600, kept): decide again without a. With b's margin 2.5 too (1200): refused, no
    detour. Terms of rule 2 judge b with a's margin (1,400): no detour."""
    rows = [_row("a", 300.0), _row("b", 400.0)]
    margins = {"a": 3.0, "b": 1.0}
    terms = budget_terms(rows, 1000.0, 200.0, margin=3.0, chosen="a")
    assert budget_detour(rows, terms, margins.__getitem__) == "a"
    assert budget_detour(rows, terms, {"a": 3.0, "b": 2.5}.__getitem__) is None
    assert budget_detour(rows, msgspec.structs.replace(terms, rule=2), margins.__getitem__) is None


def test_an_overloaded_router_holds_its_expected_ttft_to_a_tighter_edge():
    """First tokens at 10.1 .. 10.9 s (busy 10.0-10.9 s: 9 first tokens, 100 ms each). 6 arrivals
    in the 3 s window: offered 6 x 0.1 / 3 = 0.2, spread 1. 40 more arrivals: 46 x 0.1 / 3 = 1.53
    > 1, spread 1.6. A 500 ms expected TTFT + 100 spent + 2 x 20 of lag: 640 ms, kept at spread 1;
    500 x 1.6 + 140 = 940, kept; 600 x 1.6 + 140 = 1,100, refused, and the reason says why. Terms
    before rule 3 ignore a spread; the ledger's fold gives (margin, queue, spread) by the rule."""
    m = PromiseMargin()
    for i in range(9):
        m.routed(f"a{i}", 100.0, 10.0 + 0.1 * i)
        m.first_token(f"a{i}", 10.1 + 0.1 * i)
    for i in range(6):
        m.arrived(10.0 + 0.1 * i)
    assert m.offered(11.0) == pytest.approx(0.2) and m.spread(11.0) == 1.0
    for i in range(40):
        m.arrived(10.5 + 0.01 * i)
    assert m.offered(11.0) == pytest.approx(46 * 0.1 / 3) and m.spread(11.0) == 1.6
    rows = [_row("w", 500.0)]
    assert over_ttft_budget(rows, 1000.0, 100.0, 20.0, chosen="w") is None
    assert over_budget(budget_terms(rows, 1000.0, 100.0, 20.0, chosen="w", spread=1.6)) is None
    reason, _ = over_budget(budget_terms([_row("w", 600.0)], 1000.0, 100.0, 20.0, chosen="w", spread=1.6))
    assert reason.startswith("predicted TTFT 600 ms on the chosen candidate (w) x 1.60 (overloaded: offered more "
                             "than its box serves) + 100 ms")
    old = budget_terms([_row("w", 600.0)], 1000.0, 100.0, 20.0, chosen="w", rule=2, spread=1.6)
    assert over_budget(old) is None
    assert folded_terms(m, 11.0, old)[2] == 1.0 and folded_terms(m, 11.0, None) == (1.0, m.queue_ms(11.0), 1.6)
    m.expire(14.0)
    assert m.offered(14.0) == 0.0  # the window's first tokens and busy time have lapsed


def test_a_router_that_sheds_nearly_everything_still_counts_as_overloaded():
    """One request routed at 20 s, no first token by 22 s; 30 arrivals since. Too few first
    tokens for the queue (0 ms), but busy 2 s with none: 2 s per first token, offered 30 x 2 / 3
    = 20: overloaded, spread 1.6. One first token at 22 s: 2 s per first token still. Quiet: 3
    arrivals and 0.3 s busy for 1 first token, 0.3: not overloaded."""
    m = PromiseMargin()
    m.routed("a", 100.0, 20.0)
    for i in range(30):
        m.arrived(20.0 + i * 0.05)
    assert m.queue_ms(22.0) == 0.0 and m.offered(22.0) == pytest.approx(20.0)
    assert m.overloaded(22.0) and m.spread(22.0) == 1.6
    m.first_token("a", 22.0)
    assert m.offered(22.0) == pytest.approx(20.0)
    q = PromiseMargin()
    q.routed("b", 100.0, 50.0)
    q.first_token("b", 50.3)
    for i in range(3):
        q.arrived(49.0 + i)
    assert q.offered(51.0) == pytest.approx(0.3) and not q.overloaded(51.0) and q.spread(51.0) == 1.0


def test_from_rule_4_the_queue_counts_the_other_replicas_waiting_once_each():
    """First tokens at 10.1 .. 10.9 s (busy 10.0-10.9 s: 9 first tokens, 100 ms each). At 11.0 s
    this router has 4 requests waiting (routed at 10.95), the other replica 4: rule 4's queue is
    (2 x 4 + 4 + 1) x 1.05 / 9 s = 1,517 ms (its own alone, rule 3: (2 x 4 + 1) -> 1,050). A
    500 ms prediction + 20 spent + 20 lag: refused on the queue, and the reason counts the
    others. Replay folds the queue with the recorded count; terms without it (rule 3) fold 1,050."""
    m = PromiseMargin()
    for i in range(9):
        m.routed(f"a{i}", 100.0, 10.0 + 0.1 * i)
        m.first_token(f"a{i}", 10.1 + 0.1 * i)
    for i in range(4):
        m.routed(f"b{i}", 100.0, 10.95)
    per_first = (0.9 + 0.05) / 9 * 1000
    assert m.queue_ms(11.0) == pytest.approx(9 * per_first)
    assert m.queue_ms(11.0, others=4) == pytest.approx(13 * per_first)
    t = budget_terms([_row("w", 500.0)], 1000.0, 20.0, 20.0, chosen="w", queue_ms=m.queue_ms(11.0, others=4),
                     others_waiting=4, at_s=11.0)
    reason, _ = over_budget(t)
    assert reason.startswith(f"{13 * per_first:.0f} ms for this router's own queue, 4 waiting at the other "
                             "replicas counted (above the predicted TTFT 500 ms")
    assert folded_terms(m, 11.0, t)[1] == pytest.approx(13 * per_first)
    old = msgspec.structs.replace(t, rule=3, others_waiting=0)
    assert folded_terms(m, 11.0, old)[1] == pytest.approx(9 * per_first)
    assert over_budget(msgspec.structs.replace(t, others_waiting=0, queue_ms=9 * per_first)) is None
