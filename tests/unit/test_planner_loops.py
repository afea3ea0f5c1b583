"""Issue 35's loops in the planner core: the overload loop on what users feel, trends confirmed
by rising windows, the budget going where the SLO fails, the service rate learned while
saturated.

Core-only, no mocks: plain inputs built with ``tests/support/planner.py`` and ``decide``. The
profile is ``flat_profile``: prefill saturates at 10,000 tokens/s per replica; decode runs up to
100 sequences at a flat 10 ms ITL (10,000 tokens/s per replica). No cooldowns, 10 s windows.
"""

from __future__ import annotations

import pytest

from control_plane.planner import PlannerState, decide
from control_plane.planner.errors import PlannerConfigError
from control_plane.planner.load_view import NS, LoadSnapshot, PoolLoad, PoolWorker, ReplicaCounts
from control_plane.planner.policy import PoolState
from tests.support.planner import WINDOW_S, make_config, make_pool, make_window


def _workers(pool: str, role: str, ready: int, starting: int = 0, **fields) -> tuple[PoolWorker, ...]:
    return tuple(PoolWorker(worker_id=f"{pool}-{i}", pool=pool, role=role, state="ready", registered_at_ns=i,
                            ready_at_ns=0, **fields) for i in range(ready)) + tuple(
        PoolWorker(worker_id=f"{pool}-s{i}", pool=pool, role=role, state="starting", registered_at_ns=100 + i)
        for i in range(starting))


def _pool(name: str, role: str, windows, ready: int, starting: int = 0, **worker_fields) -> PoolLoad:
    return PoolLoad(pool=name, role=role, replicas=ReplicaCounts(ready=ready, starting=starting),
                    workers=_workers(name, role, ready, starting, **worker_fields), windows=tuple(windows))


def _snap(now_s: float, *pools: PoolLoad) -> LoadSnapshot:
    return LoadSnapshot(now_ns=int(now_s * NS), pools=pools)


def test_overload_sizes_for_the_backlog_and_stacks_on_starting_replicas():
    """Target 4: 2 ready, 2 still starting (the decision is pending). Each ready worker reports
    300,000 prefill tokens queued: 600,000 / (2 x 10,000 tok/s) = 30 s of work > the 1 s TTFT,
    a breach. Overload sizing: arrivals 10 req/s x 2,000 = 20,000 tok/s at 85% plus the backlog
    (no lead time here) drained in 20 s: (20,000 / 0.85 + 600,000 / 20) / 10,000 = 5.35 -> 6.
    The pending gate would hold the model's order; the loop orders on top of the 2 starting."""
    cfg = make_config(overload_drain_s=20.0)
    state = PlannerState(pools=(PoolState(pool="p", target=4, pending_since_ns=1 * NS, last_window_end_ns=10 * NS),))
    load = _pool("p", "prefill", [make_window(20)], ready=2, starting=2, queued_prefill_tokens=300_000)
    d, state = decide(21 * NS, _snap(21, load), cfg, state)
    (eff,) = d.effects
    assert (eff.from_replicas, eff.to_replicas) == (4, 6)
    assert eff.event.binding == "overload"
    assert eff.reason.startswith("scale up 4 -> 6: overload loop (600,000 prefill tokens queued, 30.0 s of work > TTFT 1 s)")
    assert "stacked on 2 starting" in eff.reason
    assert eff.event.inputs["overload_prefill_backlog"] == 600_000
    assert eff.event.inputs["overload_prefill_needed"] == round((20_000 / 0.85 + 600_000 / 20) / 10_000, 4)
    assert state.pool("p").overload_since_ns == 21 * NS


def test_overload_is_left_only_after_clean_windows_and_never_scales_down_meanwhile():
    """In overload since 21 s, target 6, all ready, the queue gone and the load light (the model
    needs 2.35, +20% noise, at 80%: 4): the pool holds 6 while fewer than
    ``overload_exit_windows`` (3) windows have passed without a breach, then leaves the mode;
    only then does the usual scale-down run."""
    cfg = make_config(overload_exit_windows=3, scale_down_ticks=1)
    state = PlannerState(pools=(PoolState(pool="p", target=6, overload_since_ns=21 * NS, last_window_end_ns=20 * NS),))
    seen = []
    for k in range(4):
        end = 30 + WINDOW_S * k
        load = _pool("p", "prefill", [make_window(end, completions=100, good=100, ttft_mean=300.0)], ready=6)
        d, state = decide(int((end + 1) * NS), _snap(end + 1, load), cfg, state)
        seen.append((state.pool("p").overload_since_ns is not None, [(e.from_replicas, e.to_replicas) for e in d.effects]))
    assert seen == [(True, []), (True, []), (False, [(6, 4)]), (False, [])]


def test_trend_is_extrapolated_only_when_rising_windows_confirm_it():
    """Kalman pool. 30 windows of 100 arrivals: never confirmed (a CUSUM of excesses of 0 less
    k = 1 sd stays at 0). Then +30 arrivals a window (3 sd of 100): the excesses over the lagged
    reference, less 1 sd, pass h = 4 sd by the third rising window."""
    cfg = make_config(make_pool(predictor="kalman"), lead_time_s=30.0)
    state = PlannerState(pools=(PoolState(pool="p", target=10),))
    windows = []
    confirmed = []
    for k in range(36):
        end = WINDOW_S * (k + 1)
        windows.append(make_window(end, arrivals=100 + 30 * max(0, k - 29)))
        load = _pool("p", "prefill", windows[-12:], ready=10)
        d, state = decide(int((end + 1) * NS), _snap(end + 1, load), cfg, state)
        confirmed.append(d.report("p").input("trend_confirmed"))
    assert confirmed[:31] == [0] * 31
    assert confirmed[33] == 1


def test_a_pool_with_a_wide_margin_yields_below_its_need_to_a_failing_one():
    """Budget 8. Prefill (4 ready) is failing: 600,000 tokens queued (30 s of work > 1 s TTFT),
    it wants 6. Decode (4 ready) needs 800 x 500 / 10 s / 10,000 tok/s = 4.0, but its requests'
    mean ITL is 4 ms against a 20 ms SLO (ratio 0.2 <= yield_margin 0.5): it keeps max(0.2 / 0.5,
    0.75) = 75% of its need, 3 replicas. Prefill takes that GPU once the drained replica is gone
    (a drained replica holds its GPU until then): this tick it waits for it."""
    pre = make_pool(name="pre", max_replicas=8)
    dec = make_pool(name="dec", role="decode", ttft_slo_ms=None, itl_slo_ms=20.0, max_replicas=8)
    cfg = make_config(pre, dec, gpu_budget=8, overload_drain_s=20.0)
    state = PlannerState(pools=(PoolState(pool="dec", target=4), PoolState(pool="pre", target=4)))
    loads = (_pool("pre", "prefill", [make_window(20)], ready=4, queued_prefill_tokens=150_000),
             _pool("dec", "decode", [make_window(20, arrivals=800, completions=800, good=800, itl_mean=4.0)], ready=4))
    d, state = decide(21 * NS, _snap(21, *loads), cfg, state)
    moves = {e.pool: (e.from_replicas, e.to_replicas) for e in d.effects}
    assert moves == {"dec": (4, 3)}
    assert d.report("dec").input("latency_over_slo") == 0.2
    assert "waits for 1 GPUs that replicas drained now still hold" in d.report("pre").reason
    loads = (_pool("pre", "prefill", [make_window(30)], ready=4, queued_prefill_tokens=150_000),
             _pool("dec", "decode", [make_window(30, arrivals=800, completions=800, good=800, itl_mean=4.0)], ready=3))
    d, state = decide(31 * NS, _snap(31, *loads), cfg, state)
    assert {e.pool: (e.from_replicas, e.to_replicas) for e in d.effects} == {"pre": (4, 5)}


def test_service_rate_is_measured_in_saturated_windows():
    """Two ready workers, each with at least a second of the profile's work (10,000 tokens)
    queued at every tick (saturated since the tick at 21 s). The window 30-40 s lies wholly
    inside that: 120,000 new prompt tokens / (2 workers x 10 s) = 6,000 tokens/s per replica,
    learned as is (the first measurement)."""
    cfg = make_config()
    state = PlannerState(pools=(PoolState(pool="p", target=2),))
    measured = []
    for end in (20, 30, 40):
        w = make_window(end, arrivals=30, prompt_tokens=120_000, cached_tokens=0)
        load = _pool("p", "prefill", [w], ready=2, queued_prefill_tokens=10_000)
        d, state = decide(int((end + 1) * NS), _snap(end + 1, load), cfg, state)
        measured.append(d.report("p").input("measured_tok_s_per_replica"))
    assert measured == [None, None, 6000.0]


def _ramp_state(cfg, ticks: int):
    """The trend test's load (30 windows of 100 arrivals, then +30 a window), ``ticks`` ticks of
    it decided with every target ready at once; the state and the windows so far."""
    state = PlannerState(pools=(PoolState(pool="p", target=3),))
    windows = []
    for k in range(ticks):
        end = WINDOW_S * (k + 1)
        windows.append(make_window(end, arrivals=100 + 30 * max(0, k - 29)))
        target = state.pool("p").target
        load = _pool("p", "prefill", windows[-12:], ready=target)
        _, state = decide(int((end + 1) * NS), _snap(end + 1, load), cfg, state)
    return state, windows


def _pending_tick(cfg, k: int, target: int = 4):
    """Tick ``k`` of the ramp with a scale-up to ``target`` ordered 4 s before it still starting
    (one replica of it)."""
    from dataclasses import replace

    state, windows = _ramp_state(cfg, k)
    end = WINDOW_S * (k + 1)
    windows.append(make_window(end, arrivals=100 + 30 * max(0, k - 29)))
    state = PlannerState(pools=(replace(state.pool("p"), target=target, pending_since_ns=int((end - 4) * NS),
                                        last_up_ns=int((end - 4) * NS)),))
    load = _pool("p", "prefill", windows[-12:], ready=target - 1, starting=1)
    return decide(int((end + 1) * NS), _snap(end + 1, load), cfg, state)[0]


def test_a_confirmed_rise_stacks_the_models_order_on_a_pending_scale_up():
    """The trend test's ramp, confirmed from tick 33 (220 arrivals: 22 req/s x 2,000 = 44,000
    tok/s, about 5 replicas before the trend). A scale-up 3 -> 4 is still starting there: the
    model's next order stacks on it (``stack_on_rise``), where the pending gate would hold it;
    with ``stack_on_rise`` off it waits as before."""
    cfg = make_config(make_pool(predictor="kalman"), lead_time_s=30.0)
    d = _pending_tick(cfg, 33)
    assert d.report("p").input("trend_confirmed") == 1
    (eff,) = d.effects
    assert eff.from_replicas == 4 and eff.to_replicas > 5
    assert "stacked on 1 starting (a rise confirmed by rising windows)" in eff.reason
    held = _pending_tick(cfg.replace(stack_on_rise=False), 33)
    assert not held.effects and "still pending" in held.report("p").reason


def test_an_unconfirmed_rise_still_waits_for_a_pending_scale_up():
    """Tick 30 of the same ramp, a scale-up 1 -> 2 still starting: the first rising window (130
    arrivals, 3 sd above the reference, less k = 1: a CUSUM of 2 < 4) is not yet confirmed,
    though even its low end needs more than 2: the pending gate holds the order (one noisy window
    must not stack orders)."""
    cfg = make_config(make_pool(predictor="kalman"), lead_time_s=30.0)
    d = _pending_tick(cfg, 30, target=2)
    r = d.report("p")
    assert r.input("trend_confirmed") == 0 and r.input("needed_low") > 2
    assert not d.effects and "still pending" in r.reason


def test_startup_reserve_bounds_a_scale_down():
    """6 ready, 10 req/s x 2,000 tokens: needed 2.35 (the overload test's), the band's high end
    at 80% asks for 4. With ``startup_reserve`` 1.0 (the load may double within one start-up) the
    scale-down keeps ceil(2.35 x 2) = 5; without it, 4."""
    def down(**over) -> tuple[tuple[int, int], ...]:
        cfg = make_config(scale_down_ticks=1, **over)
        state = PlannerState(pools=(PoolState(pool="p", target=6),))
        load = _pool("p", "prefill", [make_window(20)], ready=6)
        d, _ = decide(21 * NS, _snap(21, load), cfg, state)
        return tuple((e.from_replicas, e.to_replicas, e.event.inputs.get("startup_reserve_keeps")) for e in d.effects)

    assert down() == ((6, 4, None),)
    assert down(startup_reserve=1.0) == ((6, 5, 5),)


def test_startup_reserve_never_orders_replicas():
    """The same load on 4 replicas: the reserve would keep 5, but it only bounds scale-downs, so
    the pool holds 4 (the need, 2.35 +- its noise, is well inside 4)."""
    cfg = make_config(scale_down_ticks=1, startup_reserve=1.0)
    state = PlannerState(pools=(PoolState(pool="p", target=4),))
    d, _ = decide(21 * NS, _snap(21, _pool("p", "prefill", [make_window(20)], ready=4)), cfg, state)
    assert not d.effects and d.report("p").action == "hold"


def test_a_pool_with_a_margin_still_grows_while_the_proposals_fit():
    """Budget 16. Decode (2 ready) is failing: 1,000 requests wait on 2 workers; it grows. Prefill
    (2 ready) has a wide TTFT margin (100 ms mean against 1,000 ms: ratio 0.1) but its load, 30
    req/s x 2,000 tokens = 60,000 tok/s, needs more than 2 replicas of 10,000 tok/s. Both
    proposals fit 16 GPUs, so the margin rule (which yields to a failing pool in a squeeze)
    holds nobody back: prefill grows beside decode."""
    pre = make_pool(name="pre", max_replicas=12)
    dec = make_pool(name="dec", role="decode", ttft_slo_ms=None, itl_slo_ms=20.0, max_replicas=12)
    cfg = make_config(pre, dec, overload_drain_s=20.0)
    state = PlannerState(pools=(PoolState(pool="dec", target=2), PoolState(pool="pre", target=2)))
    loads = (_pool("pre", "prefill", [make_window(20, arrivals=300, completions=300, good=300, ttft_mean=100.0)],
                   ready=2),
             _pool("dec", "decode", [make_window(20, arrivals=300)], ready=2, waiting=500))
    d, _ = decide(21 * NS, _snap(21, *loads), cfg, state)
    moves = {e.pool: (e.from_replicas, e.to_replicas) for e in d.effects}
    assert moves["dec"][1] > 2 and moves["pre"][1] > 2
    assert sum(to for _f, to in moves.values()) <= 16


def test_a_pool_in_overload_with_its_queue_drained_yields_to_a_failing_one():
    """Budget 8. Decode entered overload at 1 s and holds 6 (its last change 10 s ago, inside a
    60 s cooldown); its queue is gone, only its last window still breaches (attainment 0.5, the
    requests that waited earlier). Its need: 10 req/s x 500 tokens = 5,000 tok/s of 10,000 per
    replica: 1. Prefill (2 ready) fails now: 300,000 tokens queued each, 30 s of work > 1 s. In
    the squeeze decode may yield down to its need (1) despite the cooldown: prefill's overload
    sizing wants 6 ((20,000 / 0.85 + 600,000 / 20) / 10,000 = 5.35), decode keeps the other 2 of
    8, and prefill takes the 4 GPUs once the drained replicas are gone."""
    pre = make_pool(name="pre", max_replicas=7)
    dec = make_pool(name="dec", role="decode", ttft_slo_ms=None, itl_slo_ms=20.0, max_replicas=7)
    cfg = make_config(pre, dec, gpu_budget=8, overload_drain_s=20.0, cooldown_down_s=60.0)
    state = PlannerState(pools=(PoolState(pool="dec", target=6, overload_since_ns=1 * NS, last_change_ns=11 * NS),
                                PoolState(pool="pre", target=2)))
    loads = (_pool("pre", "prefill", [make_window(20)], ready=2, queued_prefill_tokens=300_000),
             _pool("dec", "decode", [make_window(20, completions=100, good=50, itl_mean=10.0)], ready=6))
    d, _ = decide(21 * NS, _snap(21, *loads), cfg, state)
    moves = {e.pool: (e.from_replicas, e.to_replicas) for e in d.effects}
    assert moves == {"dec": (6, 2)}
    assert d.report("dec").input("drained_yield_to") == 1
    assert "waits for 4 GPUs that replicas drained now still hold" in d.report("pre").reason


def _tick_on(cfg, arrivals: list[int]):
    """The report of the last tick over windows of ``arrivals`` (one tick per window, every
    target ready at once), starting at 3 replicas."""
    state = PlannerState(pools=(PoolState(pool="p", target=3),))
    windows = []
    d = None
    for k, n in enumerate(arrivals):
        end = WINDOW_S * (k + 1)
        windows.append(make_window(end, arrivals=n))
        load = _pool("p", "prefill", windows[-12:], ready=state.pool("p").target)
        d, state = decide(int((end + 1) * NS), _snap(end + 1, load), cfg, state)
    return d.report("p")


def test_a_confirmed_ramp_is_forecast_from_its_own_windows():
    """30 windows of 100 arrivals, then 130, 160 (+3 req/s a window): the CUSUM confirms at the
    second rising window (excesses 3 and 6 sd less k = 1: 2 + 5 = 7 > 3) and its run is those two
    windows. Their line: slope 3 req/s per window, sd sqrt((0.25 x 1.3 + 0.25 x 1.6) / 0.5^2) =
    1.703; beyond trend_fit_z = 0.5 sd, 3 - 0.851 = 2.149, over the horizon of a confirmed rise,
    4 windows (30 s start-up + 10 s tick: the next order stacks), from 16 req/s: 16 + 4 x 2.149
    = 24.60 req/s (the ramp reaches 28 there). Off, the Kalman slope alone forecasts less."""
    ramp = [100] * 30 + [130, 160]
    cfg = make_config(make_pool(predictor="kalman"), lead_time_s=30.0, trend_fit_z=0.5)
    r = _tick_on(cfg, ramp)
    assert r.input("trend_confirmed") == 1
    assert abs(r.input("trend_fit_slope") - 3.0) < 1e-9 and abs(r.input("trend_fit_slope_sd") - 1.7029) < 1e-3
    assert abs(r.input("trend_fit_rate") - 24.596) < 0.01
    assert abs(r.input("forecast_rate") - 24.596) < 0.01 and r.input("forecast_horizon_s") == 40.0
    off = _tick_on(cfg.replace(trend_fit_z=None), ramp)
    assert off.input("trend_fit_rate") is None and off.input("forecast_rate") < 24.5


def test_a_confirmed_step_is_not_extrapolated_by_the_fit():
    """A step from 100 to 160 arrivals a window, held: confirmed as well (6 - 1 = 5 > 3 at once),
    but its run's windows are level (slope 0 < 0.5 sd): the fit extrapolates nothing, the
    forecast is the predictor's."""
    cfg = make_config(make_pool(predictor="kalman"), lead_time_s=30.0, trend_fit_z=0.5)
    r = _tick_on(cfg, [100] * 30 + [160, 160])
    assert r.input("trend_confirmed") == 1 and r.input("trend_fit_rate") is None


def _after_down(ratio: float, *, up: bool = False, **over):
    """6 ready, needing 2.35 (the start-up reserve test's load: a scale-down to 4), the last
    change 10 s ago (a scale-down, or with ``up`` a scale-up), the observed latency ``ratio`` of
    the SLO; a 60 s scale-down cooldown."""
    cfg = make_config(scale_down_ticks=1, cooldown_down_s=60.0, **over)
    ps = PoolState(pool="p", target=6, last_change_ns=11 * NS, last_up_ns=11 * NS if up else None,
                   latency_ratio=ratio)
    d, _ = decide(21 * NS, _snap(21, _pool("p", "prefill", [make_window(20)], ready=6)), cfg,
                  PlannerState(pools=(ps,)))
    return tuple((e.from_replicas, e.to_replicas) for e in d.effects)


def test_a_step_down_after_a_step_down_is_released_on_a_wide_margin():
    """``release_on_margin``: after a scale-down, latency at 0.3 of the SLO (<= yield_margin 0.5)
    is the evidence: the next step down needs its scale_down_ticks only, not the 60 s cooldown.
    At 0.7 of the SLO, after a scale-up, or with the knob off, the cooldown holds."""
    assert _after_down(0.3, release_on_margin=True) == ((6, 4),)
    assert _after_down(0.7, release_on_margin=True) == ()
    assert _after_down(0.3, up=True, release_on_margin=True) == ()
    assert _after_down(0.3, release_on_margin=False) == ()


def test_a_standing_headroom_from_zero_stands_at_any_load():
    """100 req/s x 200 tokens needs 2.35 replicas, 2.35 of a 16-GPU budget: far below the
    default threshold (half the budget), so a standing headroom of 0.5 stands nowhere and 3
    replicas hold. From 0 it always stands: 150 req/s needs 3.53, beyond 3 even at the low end
    of its noise (1,000 arrivals), so 3 -> 4."""
    def tick(**over):
        cfg = make_config(standing_headroom=0.5, **over)
        state = PlannerState(pools=(PoolState(pool="p", target=3),))
        window = make_window(20, arrivals=1000, isl_mean=200.0)
        d, _ = decide(21 * NS, _snap(21, _pool("p", "prefill", [window], ready=3)), cfg, state)
        return tuple((e.from_replicas, e.to_replicas, e.event.inputs.get("standing_headroom")) for e in d.effects)

    assert tick() == ()
    assert tick(standing_headroom_from=0.0) == ((3, 4, 1),)


def test_a_pool_s_own_standing_headroom_overrides_the_planner_s():
    """The same 100 req/s x 200 tokens as above (2.35 replicas; 3.53 at the planner's standing
    0.5 from 0, so 3 -> 4): a pool whose own standing headroom is 0.1 needs 2.35 x 1.1 = 2.59, so
    3 hold; one whose own is 0.8 needs 4.24, so 3 -> 5. None: the planner's. Out of [0, 1]:
    refused."""
    def tick(own):
        cfg = make_config(make_pool(standing_headroom=own), standing_headroom=0.5, standing_headroom_from=0.0)
        state = PlannerState(pools=(PoolState(pool="p", target=3),))
        window = make_window(20, arrivals=1000, isl_mean=200.0)
        d, _ = decide(21 * NS, _snap(21, _pool("p", "prefill", [window], ready=3)), cfg, state)
        return tuple((e.from_replicas, e.to_replicas) for e in d.effects)

    assert tick(None) == ((3, 4),)
    assert tick(0.1) == ()
    assert tick(0.8) == ((3, 5),)
    with pytest.raises(PlannerConfigError, match="standing_headroom must be in"):
        make_pool(standing_headroom=1.5)


def test_the_safety_stock_is_the_work_one_start_up_brings_beyond_the_forecast():
    """``safety_z`` 1.645, a 30 s start-up. Few long prompts: 20 arrivals in 10 s (2 req/s) of
    ISL 10,000 with sd 12,000 (cv 1.2): the 60 requests one start-up brings carry a relative sd
    of sqrt(1 + 1.44) / sqrt(60) = 0.2017, so the pool is sized 1.645 x that = 0.3317 above the
    forecast. The same work as 200 arrivals of 1,000 tokens, all alike: 1.645 / sqrt(600) =
    0.0672. Off (0): none, and the forecast is sized as it is."""
    def inputs(arrivals: int, isl: float, sd: float, z: float) -> dict:
        cfg = make_config(safety_z=z, lead_time_s=30.0)
        state = PlannerState(pools=(PoolState(pool="p", target=3),))
        window = make_window(20, arrivals=arrivals, isl_mean=isl, isl_sd=sd)
        d, _ = decide(21 * NS, _snap(21, _pool("p", "prefill", [window], ready=3)), cfg, state)
        (rep,) = d.reports
        return dict(rep.inputs)

    few = inputs(20, 10_000.0, 12_000.0, 1.645)
    assert few["safety_stock"] == round(1.645 * (1 + 1.2**2) ** 0.5 / 60**0.5, 4) == 0.3317
    assert few["forecast_rate"] == 2.0 and few["headroom"] == 0.0
    assert few["predicted_rate"] == pytest.approx(2.0 * 1.3317, abs=2e-4)
    many = inputs(200, 1_000.0, 0.0, 1.645)
    assert many["safety_stock"] == round(1.645 / 600**0.5, 4) == 0.0672
    off = inputs(20, 10_000.0, 12_000.0, 0.0)
    assert "safety_stock" not in off
    assert off["predicted_rate"] == 2.0


def test_a_constant_load_sizes_on_a_settled_rate_and_pooled_lengths():
    """Kalman pool, 60 windows of a constant 4.5 req/s (45 Poisson arrivals a 10 s window, sd
    6.7) whose prompts' mean swings by +-15% from window to window (heavy-tailed prompts: a
    window's mean of 45 says little). Unsettled and from a 4-window average (the old inputs),
    the need swings with both; settled on the 12-window mean (``settle_z`` 1.5) and pooled over
    12 windows (``length_windows``), it swings less than half as much. The windows' own rates
    are the same in both runs, and the settled rate stays within counting noise of 4.5."""
    import random
    import statistics

    from tests.unit.test_planner_parts import _poisson_windows

    counts = _poisson_windows([4.5] * 60, 3, dur=WINDOW_S)
    rng = random.Random(5)
    isl = [2000.0 * (1 + rng.choice((-0.15, 0.0, 0.15))) for _ in counts]

    def needs(**over) -> list[float]:
        cfg = make_config(make_pool(predictor="kalman"), **over)
        state = PlannerState(pools=(PoolState(pool="p", target=3),))
        windows, out = [], []
        for k, (n, m) in enumerate(zip(counts, isl)):
            end = WINDOW_S * (k + 1)
            windows = (windows + [make_window(end, arrivals=n, isl_mean=m, isl_sd=m)])[-64:]
            d, state = decide(int((end + 1) * NS), _snap(end + 1, _pool("p", "prefill", windows, ready=3)), cfg, state)
            out.append(float(dict(d.reports[0].inputs)["needed_replicas"]))
        return out[20:]

    before = needs(settle_z=0.0, length_windows=None)
    after = needs()
    assert statistics.pstdev(after) < 0.5 * statistics.pstdev(before)
    assert abs(statistics.mean(after) - statistics.mean(before)) < 0.1 * statistics.mean(before)


def _fall_run(cfg, arrivals: list[int]):
    """(fall_confirmed per tick, (tick, from, to) of every scale-down) over windows of
    ``arrivals`` (one tick per window, every target ready at once), starting at 10 replicas."""
    state = PlannerState(pools=(PoolState(pool="p", target=10),))
    windows, confirmed, downs = [], [], []
    for k, n in enumerate(arrivals):
        end = WINDOW_S * (k + 1)
        windows.append(make_window(end, arrivals=n))
        load = _pool("p", "prefill", windows[-12:], ready=state.pool("p").target)
        d, state = decide(int((end + 1) * NS), _snap(end + 1, load), cfg, state)
        confirmed.append(d.report("p").input("fall_confirmed"))
        downs += [(k, e.from_replicas, e.to_replicas) for e in d.effects if e.to_replicas < e.from_replicas]
    return confirmed, downs


def test_a_fall_confirmed_by_falling_windows_releases_without_the_cooldown():
    """Kalman pool, 30 windows of 400 arrivals (40 req/s of 2,000 tokens: 9.4 replicas), then
    -40 arrivals a window (4 req/s, 2 sd of 400). The rise's CUSUM mirrored (each window's
    shortfall under the lagged reference, less k = 1 sd) passes h = 4 sd by the third falling
    window; the rate is then the falling windows' own line at the last window, and the pool
    steps down after ``fall_down_ticks`` (2) ticks to the band's high end (10 -> 8 at the fourth
    falling window, 8 -> 7 two later), not waiting out its 4 ``scale_down_ticks`` and a 60 s
    cooldown per step. Off, no step down within the seven falling windows (the 6-window
    average's high end still needs 80% of 10). A constant load never confirms a fall (its
    shortfalls are 0, less k)."""
    fall = [400] * 30 + [400 - 40 * k for k in range(1, 8)]
    cfg = make_config(make_pool(predictor="kalman"), scale_down_ticks=4, cooldown_down_s=60.0)
    confirmed, downs = _fall_run(cfg, fall)
    assert confirmed[:31] == [0] * 31 and confirmed[32] == 1
    off_confirmed, off_downs = _fall_run(cfg.replace(release_on_fall=False), fall)
    assert downs == [(33, 10, 8), (35, 8, 7)]
    assert set(off_confirmed) == {0} and off_downs == []
    constant, _ = _fall_run(cfg, [400] * 40)
    assert set(constant) == {0}


def test_fall_down_ticks_below_one_is_refused():
    from control_plane.planner.errors import PlannerConfigError

    with pytest.raises(PlannerConfigError, match="fall_down_ticks must be >= 1"):
        make_config(fall_down_ticks=0)
