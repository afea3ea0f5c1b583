"""Planner decision core: worked examples, stability over long runs, budget/bounds properties.

Core-only, no mocks: every test builds plain inputs with the ``_make_*`` builders and calls
``decide``. Unless a test says otherwise the profile is :func:`flat_profile`: prefill of ``n``
tokens takes ``n / 10,000`` s and saturates at 10,000 tokens/s; decode runs up to 100
sequences at a flat 10 ms ITL, i.e. 10,000 tokens/s per replica. Windows are 10 s, ticks come
1 s after a window closes (the grace period), the scale-down threshold is 0.8 over 3 ticks.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from control_plane.planner import PlannerConfig, PlannerState, decide
from control_plane.planner.load_view import (
    NS,
    LoadSnapshot,
    PoolLoad,
    PoolWorker,
    ReplicaCounts,
)
from control_plane.planner.scalers import VirtualScaler
from schemas.events import ScalingDecision
from tests.support.planner import WINDOW_S, make_config, make_pool, make_window

# ----------------------------------------------------------------------------------------------
# Builders
# ----------------------------------------------------------------------------------------------


def _make_snapshot(now_s: float, *, pool: str = "p", windows=(), ready: int = 2, starting: int = 0,
                   workers: tuple[PoolWorker, ...] | None = None, **overrides) -> LoadSnapshot:
    if workers is None:
        workers = tuple(PoolWorker(worker_id=f"{pool}-{i}", pool=pool, role="prefill", state="ready",
                                   registered_at_ns=i) for i in range(ready)) + tuple(
            PoolWorker(worker_id=f"{pool}-s{i}", pool=pool, role="prefill", state="starting",
                       registered_at_ns=100 + i) for i in range(starting))
    pl = PoolLoad(pool=pool, role="prefill", replicas=ReplicaCounts(ready=ready, starting=starting),
                  workers=workers, windows=tuple(windows))
    fields = {"now_ns": int(now_s * NS), "pools": (pl,)}
    fields.update(overrides)
    return LoadSnapshot(**fields)


def _tick(now_s: float, config: PlannerConfig, state: PlannerState, **snap):
    return decide(int(now_s * NS), _make_snapshot(now_s, **snap), config, state)


def _state(target: int, **pool_fields) -> PlannerState:
    from control_plane.planner.policy import PoolState

    return PlannerState(pools=(PoolState(pool="p", target=target, **pool_fields),))


# ----------------------------------------------------------------------------------------------
# Worked examples
# ----------------------------------------------------------------------------------------------


def test_prefill_sizing_worked_example():
    """10 req/s x ISL 2,000 = 20,000 prefill tokens/s. One prompt takes S = 2,000 / 10,000 s =
    200 ms; TTFT 1,000 ms leaves slack 800 ms, so rho = 2*800 / (200 + 2*800) = 0.889, capped at
    max_utilization 0.85: 8,500 tokens/s per replica. Needed 20,000 / 8,500 = 2.353. Noise: 100
    arrivals of one length (cv 0): relative sd 1/sqrt(100) = 0.1, margin 2 x 0.1 = 0.2, low end
    2.353 x 0.8 = 1.88 > 1 replica: scale up 1 -> ceil(2.353) = 3."""
    d, st_ = _tick(21, make_config(), _state(1), ready=1, windows=[make_window(20)])
    (eff,) = d.effects
    assert (eff.from_replicas, eff.to_replicas) == (1, 3)
    assert eff.event.inputs["noise_margin"] == 0.2 and eff.event.inputs["needed_low"] == round(20000 / 8500 * 0.8, 4)
    ev = eff.event
    assert isinstance(ev, ScalingDecision)
    assert ev.inputs["prefill_tok_s_per_replica"] == 8500.0
    assert ev.inputs["prefill_demand_tok_s"] == 20000.0
    assert ev.inputs["needed_replicas"] == round(20000 / 8500, 4)
    assert ev.predictor == "constant" and ev.config_version == 1
    assert "20,000 tok/s / 8,500 tok/s per replica" in ev.reason
    assert st_.pool("p").target == 3 and st_.pool("p").pending_since_ns == 21 * NS


def test_decode_sizing_worked_example():
    """Decode pool, 10 req/s x OSL 500 = 5,000 tokens/s; one replica decodes 100 sequences at
    10 ms = 10,000 tokens/s (ITL target 20 ms, context 2,000 + 250 fits). Needed 0.5 -> 1:
    from 3, down = ceil(0.5 / 0.8) = 1 < 3, so after 3 ticks below it scales 3 -> 1."""
    cfg = make_config(make_pool(role="decode", ttft_slo_ms=None, itl_slo_ms=20.0))
    state = _state(3)
    actions = []
    for k in range(3):
        end = 20 + WINDOW_S * k
        d, state = _tick(end + 1, cfg, state, ready=3, windows=[make_window(end)])
        actions.append([(e.from_replicas, e.to_replicas) for e in d.effects])
        rep = d.report("p")
        assert rep.input("decode_tok_s_per_replica") == 10000.0
        assert rep.input("needed_replicas") == 0.5
    assert actions == [[], [], [(3, 1)]]
    assert "below 80% of capacity for 3 ticks" in d.effects[0].reason


def test_aggregated_pool_adds_prefill_and_decode_load():
    """Aggregated: prefill 20,000 / 8,500 = 2.353 plus decode 5,000 / 10,000 = 0.5 -> 2.853;
    low end 2.853 x 0.8 = 2.28 > 1 -> 3 replicas."""
    cfg = make_config(make_pool(role="aggregated", itl_slo_ms=20.0))
    d, _ = _tick(21, cfg, _state(1), windows=[make_window(20)])
    assert d.effects[0].to_replicas == 3
    assert d.report("p").needed == 20000 / 8500 + 0.5


def test_prefix_hits_reduce_prefill_demand():
    """Hit rate 0.5 (cached 1,000 of 2,000 prompt tokens): new tokens 1,000 per request, S = 100
    ms, rho = 2*900/(100+1800) = 0.947 -> 0.85: 8,500 tokens/s. Needed 10 x 1,000 / 8,500 = 1.18
    -> 2 (high end 1.18 x 1.2 = 1.41 fits 80% of 2): holds at 2."""
    w = make_window(20, prompt_tokens=2000, cached_tokens=1000)
    d, _ = _tick(21, make_config(), _state(2), windows=[w])
    assert not d.effects
    assert d.report("p").input("predicted_hit_rate") == 0.5


def test_hysteresis_band_holds_between_thresholds():
    """At target 3 a need of 2.5 (margin 0.2): low 2.0 is not above 3, and the high end 3.0
    needs ceil(3.0 / 0.8) = 4 replicas: neither moves."""
    # 2.5 replicas = 21,250 tokens/s = 10.625 req/s of ISL 2,000 -> 106.25 arrivals; use ISL to tune
    w = make_window(20, arrivals=100, isl_mean=2125.0)  # 10 x 2,125 = 21,250 tok/s; S = 212.5 ms
    cfg = make_config()
    state = _state(3)
    for k in range(10):
        d, state = _tick(21 + WINDOW_S * k, cfg, state, ready=3,
                         windows=[make_window(20 + WINDOW_S * k, arrivals=100, isl_mean=2125.0)])
        assert not d.effects, d.report("p").reason
    assert d.report("p").input("desired_up") == 3
    del w


def test_scale_down_waits_for_cooldown_after_a_change():
    """cooldown_down 120 s: a scale-up at t=21 blocks scale-downs until t=141 even when the load
    vanished right after it."""
    cfg = make_config(cooldown_down_s=120.0, scale_down_ticks=1)
    d, state = _tick(21, cfg, _state(1), ready=1, windows=[make_window(20)])
    assert d.effects[0].to_replicas == 3
    for k in range(1, 14):
        now = 21 + WINDOW_S * k
        d, state = _tick(now, cfg, state, ready=3, windows=[make_window(now - 1, arrivals=0)])
        moved = [(e.from_replicas, e.to_replicas) for e in d.effects]
        if now < 141:
            assert moved == [], (now, d.report("p").reason)
        else:
            assert moved == [(3, 1)]
            break
    else:
        raise AssertionError("never scaled down")


def test_pending_scale_up_blocks_further_additions():
    """Scale 1 -> 3 at t=21; one new replica stays 'starting' (slow node). The load doubles at
    t=31 (needed 4.71, low end 4.71 x (1 - 2/sqrt(200)) = 4.04 > 3) but no replica is added
    while 1 of 3 is pending; once it is ready (t=51) the planner adds the rest in one step.
    (Headroom off: the doubling would add 50% on top; that has its own test.)"""
    cfg = make_config(max_headroom=0.0)
    d, state = _tick(21, cfg, _state(1), ready=1, windows=[make_window(20)])
    assert d.effects[0].to_replicas == 3
    for now in (31, 41):
        d, state = _tick(now, cfg, state, ready=2, starting=1, windows=[make_window(now - 1, arrivals=200)])
        assert not d.effects
        assert "still pending" in d.report("p").reason
    d, state = _tick(51, cfg, state, ready=3, windows=[make_window(50, arrivals=200)])
    assert [(e.from_replicas, e.to_replicas) for e in d.effects] == [(3, 5)]


def test_pending_scale_up_times_out():
    """startup_timeout 60 s: a replica that never becomes ready stops blocking at t = 21 + 60.
    (Headroom off, as above.)"""
    cfg = make_config(startup_timeout_s=60.0, max_headroom=0.0)
    d, state = _tick(21, cfg, _state(1), ready=1, windows=[make_window(20)])
    for now in range(31, 101, 10):
        d, state = _tick(now, cfg, state, ready=2, starting=1, windows=[make_window(now - 1, arrivals=200)])
        if now - 21 <= 60:
            assert not d.effects
        else:
            assert d.effects[0].to_replicas == 5
            assert "was not applied within 60s" in d.effects[0].reason
            return
    raise AssertionError("never timed out")


EXPECTED_TTFT_MS = 200 + 4 / 9 * 200 / (3 * (1 - 2 / 3)) / 2
"""What the M/G/k model expects at 10 req/s of ISL 2,000 on 3 ready replicas: S = 200 ms,
utilisation 20,000 / 30,000 = 2/3, offered load a = 2; Erlang C(3, 2) = (2^3/3! * 3/(3-2)) /
(1 + 2 + 2^2/2! + 4) = 4/9; wait = C * S / (k*(1-rho)) * (1+cv^2)/2 = 4/9 * 200 / 1 * 1/2 =
44.4 ms; TTFT 244.4 ms."""


def test_slow_new_workers_do_not_inflate_the_correction():
    """A new replica serves at 3x the TTFT for its warm-up. The window's overall TTFT mean is
    high, but its *steady* mean (warmed-up workers only) matches the model's expectation (244.4
    ms, see EXPECTED_TTFT_MS), so the correction stays 1.0 and nothing scales."""
    cfg = make_config()
    state = _state(3)
    windows = []
    for k in range(6):
        end = 20 + WINDOW_S * k
        windows.append(make_window(end, completions=100, ttft_mean=1200.0, steady_ttft_mean=EXPECTED_TTFT_MS,
                                    steady_samples=60))
        d, state = _tick(end + 1, cfg, state, ready=3, windows=windows)
        assert not d.effects, d.report("p").reason
    assert round(state.pool("p").ttft_correction, 9) == 1.0


def test_correction_follows_a_slower_fleet():
    """Warmed-up workers twice as slow as the model (steady TTFT 488.9 vs 244.4 ms): ratio 2,
    so the correction moves with weight 0.3: 1 -> 1.3 -> 1.51 -> 1.657. It learns only from
    windows that start a full window after the pool settled (first tick, t=21, so from t=31 on):
    [40, 50) is the first. The correction divides the TTFT target the queueing model must meet
    (500 ms here): the tolerable utilisation, hence the capacity per replica, falls as it grows,
    and the needed replicas rise."""
    cfg = make_config(make_pool(ttft_slo_ms=500.0))
    windows = []
    state = _state(3)
    corrections, capacity, needed = [], [], []
    for end in (20, 30, 40, 50, 60, 70):
        windows.append(make_window(end, completions=100, steady_ttft_mean=2 * EXPECTED_TTFT_MS, steady_samples=60))
        d, state = _tick(end + 1, cfg, state, ready=3, windows=windows)
        corrections.append(round(state.pool("p").ttft_correction, 6))
        capacity.append(d.report("p").input("prefill_tok_s_per_replica"))
        needed.append(d.report("p").needed)
    assert corrections == [1.0, 1.0, 1.0, 1.3, 1.51, 1.657]
    assert capacity[:4] == [8500.0] * 4  # rho 0.85 still meets 500 / 1.3 = 385 ms
    assert capacity[5] < capacity[4] < capacity[3] and needed[5] > needed[3]


def test_corrections_do_not_learn_from_a_backlog():
    """A burst left 40,000 queued prompt tokens per worker (4 s of work at 10,000 tokens/s, above
    the 1 s TTFT target): TTFTs measured now are the backlog's age, not the hardware's speed, so
    the pool is not settled and the correction stays 1.0."""
    cfg = make_config()
    busy = tuple(PoolWorker(worker_id=f"p-{i}", pool="p", role="prefill", state="ready",
                            queued_prefill_tokens=40_000) for i in range(3))
    state = _state(3)
    windows = []
    for end in (20, 30, 40, 50):
        windows.append(make_window(end, completions=100, steady_ttft_mean=5000.0, steady_samples=60))
        _, state = _tick(end + 1, cfg, state, ready=3, workers=busy, windows=windows)
    assert state.pool("p").ttft_correction == 1.0 and state.pool("p").settled_since_ns is None


def test_pin_overrides_the_load():
    """A pin sets the replicas whatever the load says (clamped to the bounds), and the decision
    says who decided."""
    cfg = make_config()
    state = _state(2).with_pins({"p": 7})
    d, state = _tick(21, cfg, state, windows=[make_window(20, arrivals=0)])
    assert d.effects[0].to_replicas == 7
    assert "pinned by operator to 7" in d.effects[0].reason
    assert d.effects[0].event.inputs["pinned"] == 7
    d, state = _tick(31, cfg, state.with_pins({"p": 50}), ready=7, windows=[make_window(30)])
    assert d.effects[0].to_replicas == 10 and "clamped" in d.effects[0].reason


def test_gpu_budget_is_shared_by_unmet_fraction():
    """Two pools at 2 replicas each want 5 (20 req/s of ISL 2,000: 40,000 / 8,500 = 4.7 -> 5),
    budget 8 GPUs: base 2 + 2 = 4, 4 left. Both miss 3/5; 'a' (name order) gets one (2/5 unmet
    left), then 'b', then 'a', then 'b': 4 and 4."""
    a, b = make_pool(name="a"), make_pool(name="b")
    cfg = make_config(a, b, gpu_budget=8)
    from control_plane.planner.policy import PoolState

    state = PlannerState(pools=(PoolState(pool="a", target=2), PoolState(pool="b", target=2)))
    snap = LoadSnapshot(now_ns=21 * NS, pools=tuple(
        PoolLoad(pool=n, replicas=ReplicaCounts(ready=2), windows=(make_window(20, arrivals=200),))
        for n in ("a", "b")))
    d, _ = decide(21 * NS, snap, cfg, state)
    assert sorted((e.pool, e.to_replicas) for e in d.effects) == [("a", 4), ("b", 4)]
    assert all("GPU budget: 5 -> 4" in e.reason for e in d.effects)


def test_scale_down_drains_starting_then_least_loaded():
    """Victims: the starting worker first, then the ready one with the fewest running+waiting."""
    workers = (PoolWorker(worker_id="w-busy", pool="p", role="prefill", state="ready", running=9),
               PoolWorker(worker_id="w-idle", pool="p", role="prefill", state="ready", running=1),
               PoolWorker(worker_id="w-new", pool="p", role="prefill", state="starting"))
    cfg = make_config(scale_down_ticks=1)
    d, _ = _tick(21, cfg, _state(3), ready=2, starting=1, workers=workers,
                 windows=[make_window(20, arrivals=0)])
    (eff,) = d.effects
    assert (eff.from_replicas, eff.to_replicas) == (3, 1)
    assert eff.drain == ("w-new", "w-idle")
    assert eff.event.inputs["drain_workers"] == "w-new,w-idle"


def test_first_tick_adopts_observed_replicas_and_enforces_bounds():
    """No state yet: the observed count (0 here) is the starting point, and min_replicas 2 is
    enforced at once even before any window closed."""
    cfg = make_config(make_pool(min_replicas=2))
    d, state = decide(5 * NS, _make_snapshot(5, ready=0), cfg, PlannerState())
    assert [(e.from_replicas, e.to_replicas) for e in d.effects] == [(0, 2)]
    assert "brought into bounds [2, 10]" in d.effects[0].reason


def test_decisions_are_deterministic_and_carry_the_fencing_token():
    cfg = make_config()
    snap = _make_snapshot(21, windows=[make_window(20)])
    a = decide(21 * NS, snap, cfg, _state(1).with_token(7))
    b = decide(21 * NS, snap, cfg, _state(1).with_token(7))
    assert a == b
    assert a[0].effects[0].event.fencing_token == 7
    assert a[0].effects[0].event.decision_id == "p-21000-0"


def test_forecast_error_is_scored_against_the_window_it_predicted():
    """Constant predictor: after 10 req/s it predicts 10 for the next window; 20 arrives, so the
    relative error is |10 - 20| / 20 = 0.5 (first score: the average starts there)."""
    cfg = make_config()
    _, state = _tick(21, cfg, _state(3), ready=3, windows=[make_window(20)])
    assert state.pool("p").forecast_rate == 10.0
    _, state = _tick(31, cfg, state, ready=3, windows=[make_window(20), make_window(30, arrivals=200)])
    assert state.pool("p").forecast_error == 0.5 and state.pool("p").forecast_scored == 1


# ----------------------------------------------------------------------------------------------
# Long runs in a virtual world (VirtualScaler: replicas become ready after a start-up delay)
# ----------------------------------------------------------------------------------------------


def _run(cfg: PlannerConfig, rates, *, startup_s: float = 20.0, isl: float = 2000.0, start: int = 2,
         seed: int = 0, poisson: bool = True):
    """Tick once per window (1 s after it closes); arrivals per window are Poisson(rate x 10 s).
    Returns the effects per tick and the replica targets per tick."""
    rng = np.random.default_rng(seed)
    pools = [p.name for p in cfg.pools]
    scaler = VirtualScaler(startup_s=startup_s, drain_s=5.0)
    for p in cfg.pools:
        scaler.seed(p.name, p.role, start, now_ns=0)
    state = PlannerState().with_token(1)
    effects, targets = [], []
    for k, rate in enumerate(rates):
        end = (k + 1) * WINDOW_S
        now = int((end + 1) * NS)
        loads = []
        for name in pools:
            n = int(rng.poisson(rate * WINDOW_S)) if poisson else int(round(rate * WINDOW_S))
            w = make_window(end, arrivals=n, isl_mean=isl)
            loads.append(PoolLoad(pool=name, replicas=scaler.counts(name, now), workers=scaler.workers(name, now),
                                  windows=(w,)))
        d, state = decide(now, LoadSnapshot(now_ns=now, pools=tuple(loads)), cfg, state)
        for e in d.effects:
            scaler.apply(e.event, now_ns=now)
        effects.append(d.effects)
        targets.append({p: state.pool(p).target for p in pools})
    return effects, targets


def test_constant_load_does_not_oscillate_over_1000_ticks():
    """15 req/s of ISL 2,000 = 30,000 tokens/s = 3.53 replicas: one scale-up 2 -> 4, then
    nothing for 999 ticks although Poisson noise moves each window's rate by 1/sqrt(150) = 8.2%
    (sd). Adding a 5th replica needs the low end above 4: needed > 4 / (1 - 0.163) = 4.78, a
    4.3 sd window (or a 6-window average 6.5 sd high); removing one needs the high end to fit
    80% of 3: needed < 2.4 / 1.163 = 2.06."""
    cfg = make_config()
    effects, targets = _run(cfg, [15.0] * 1000)
    changes = [(k, e.from_replicas, e.to_replicas) for k, es in enumerate(effects) for e in es]
    assert changes == [(0, 2, 4)]
    assert all(t["p"] == 4 for t in targets)


def test_constant_load_does_not_oscillate_with_every_predictor():
    for predictor in ("moving_average", "kalman", "holt_winters"):
        cfg = make_config(make_pool(predictor=predictor))
        effects, _ = _run(cfg, [15.0] * (30 if predictor == "holt_winters" else 1000), seed=1)
        changes = [(e.from_replicas, e.to_replicas) for es in effects for e in es]
        assert len(changes) <= 1, (predictor, changes)


def test_load_step_is_followed_within_three_ticks():
    """The rate jumps from 5 to 20 req/s *inside* window 11 (half of it at each level, 12.5
    req/s on average). Needed: 5 -> 1.18, 12.5 -> 2.94 (low end 2.41 > 2: 3), 20 -> 4.71 (5).
    Constant predictor: tick 10 (after window 11) goes to 3; tick 11 waits for that replica
    (20 s start-up: never add while an addition is pending); tick 12 goes to 5: 2 ticks after
    the step, within the documented 3. (Headroom off: the missed step would add up to 18% on
    top of 12.5 and 20; that has its own test.) Without the rising windows' line
    (``trend_fit_z`` None): a step inside a window reads, in its two windows (12.5, 20), exactly
    as a ramp of 7.5 req/s a window would; with it (the default) the line is extrapolated and
    the step costs 7 replicas for a need of 5, held by the scale-down band (the price of
    catching a ramp within two windows; ``test_a_step_inside_a_window_reads_as_a_ramp``)."""
    rates = [5.0] * 10 + [12.5] + [20.0] * 20
    cfg = make_config(max_headroom=0.0, trend_fit_z=None)
    effects, targets = _run(cfg, rates, poisson=False, start=2)
    first_full = next(k for k, t in enumerate(targets) if t["p"] >= 5)
    assert first_full - 10 <= 3
    assert targets[9]["p"] == 2 and targets[first_full]["p"] == 5


def test_a_step_inside_a_window_reads_as_a_ramp():
    """The same step with the rising windows' line on (the default): the CUSUM confirms at once
    (12.5 req/s against 5: 10.6 sd), the line needs two windows: at tick 11 (12.5 and 20 req/s)
    its 7.5 req/s a window is extrapolated: the step is followed as fast, but to 7 replicas
    (need 4.71), and 7 are kept (the band's high end, about 4.9, over 80% asks for 7). What the
    two-window catch costs."""
    rates = [5.0] * 10 + [12.5] + [20.0] * 20
    effects, targets = _run(make_config(max_headroom=0.0), rates, poisson=False, start=2)
    first_full = next(k for k, t in enumerate(targets) if t["p"] >= 5)
    assert first_full - 10 <= 3 and targets[first_full]["p"] == 7 and targets[-1]["p"] == 7


def test_moving_average_follows_a_step_within_its_window_plus_three():
    """Moving average of 4: the full level is seen 4 windows after the step at the latest."""
    rates = [5.0] * 10 + [20.0] * 20
    cfg = make_config(make_pool(predictor="moving_average", predictor_window=4))
    _, targets = _run(cfg, rates, poisson=False)
    first_full = next(k for k, t in enumerate(targets) if t["p"] >= 5)
    assert first_full - 10 <= 3 + 3


def test_slow_starting_workers_do_not_trigger_extra_scale_up():
    """Start-up takes 60 s (6 ticks) while the load steps 5 -> 25 req/s (needed 5.88 -> 6): one
    scale-up to 6, none while its replicas start (the load stays above what is ready), none
    after (the load did not change). (Headroom off, as above.)"""
    rates = [5.0] * 5 + [25.0] * 40
    cfg = make_config(startup_timeout_s=300.0, max_headroom=0.0)
    effects, targets = _run(cfg, rates, startup_s=60.0, poisson=False)
    ups = [(k, e.from_replicas, e.to_replicas) for k, es in enumerate(effects) for e in es]
    assert ups == [(5, 2, 6)], ups


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    budget=st.integers(2, 12),
    mins=st.tuples(st.integers(0, 2), st.integers(0, 2)),
    spans=st.tuples(st.integers(0, 6), st.integers(0, 6)),
    gpus=st.tuples(st.integers(1, 2), st.integers(1, 2)),
    rates=st.lists(st.floats(0, 60), min_size=5, max_size=40),
    pin=st.one_of(st.none(), st.integers(0, 20)),
    startup=st.sampled_from([0.0, 15.0, 45.0]),
)
def test_budget_and_bounds_always_hold(budget, mins, spans, gpus, rates, pin, startup):
    """Whatever the load, every decision and every target stays in [min, max] and all pools
    together stay within the GPU budget, counting the replicas still draining (they hold their
    GPUs until gone, also those drained in the tick another pool grows)."""
    if mins[0] * gpus[0] + mins[1] * gpus[1] > budget:
        mins = (0, 0)
    pools = (make_pool(name="a", min_replicas=mins[0], max_replicas=mins[0] + spans[0], gpus_per_replica=gpus[0]),
             make_pool(name="b", role="decode", ttft_slo_ms=None, itl_slo_ms=20.0, min_replicas=mins[1],
                        max_replicas=mins[1] + spans[1], gpus_per_replica=gpus[1]))
    cfg = make_config(*pools, gpu_budget=budget, pins={"a": pin} if pin is not None else {},
                       cooldown_up_s=10.0, scale_down_ticks=2)
    state = PlannerState().with_pins(cfg.pins)
    scaler = VirtualScaler(startup_s=startup, drain_s=5.0)
    for k, rate in enumerate(rates):
        end = (k + 1) * WINDOW_S
        now = int((end + 1) * NS)
        loads = tuple(PoolLoad(pool=p.name, replicas=scaler.counts(p.name, now), workers=scaler.workers(p.name, now),
                               windows=(make_window(end, arrivals=int(rate * WINDOW_S)),)) for p in pools)
        d, state = decide(now, LoadSnapshot(now_ns=now, pools=loads), cfg, state)
        for e in d.effects:
            pc = cfg.pool(e.pool)
            assert pc.min_replicas <= e.to_replicas <= pc.max_replicas
            scaler.apply(e.event, now_ns=now)
        used = held = 0
        for p in pools:
            t = state.pool(p.name).target
            assert p.min_replicas <= t <= p.max_replicas
            used += t * p.gpus_per_replica
            c = scaler.counts(p.name, now)
            held += (c.starting + c.ready + c.draining) * p.gpus_per_replica
        assert used <= budget
        assert held <= budget
        assert math.isfinite(sum(r.needed or 0 for r in d.reports))
