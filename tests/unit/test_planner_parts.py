"""Planner pieces around the core: predictors, the performance profile's queueing arithmetic,
the config validators, the admin-stream fold (pins, config changes), the virtual scaler's
fencing. Pure: no broker, no processes."""

from __future__ import annotations

import math

import pytest

from control_plane.planner import PlannerConfig, PlannerConfigError, PlannerState, PoolConfig, decide, flat_profile
from control_plane.planner.admin import AdminInputs
from control_plane.planner.load_view import NS, LoadSnapshot, PoolLoad, ReplicaCounts, WindowStats, stamp
from control_plane.planner.policy import PoolState
from control_plane.planner.predictors import forecast, holt_winters, kalman, moving_average, settle
from control_plane.planner.profile import derive_profile, erlang_c
from control_plane.planner.scalers import FileFence, VirtualScaler
from schemas.events import PlannerConfigChanged, PoolPinned, PoolUpdated, ScalingDecision
from schemas.types import WorkerRole

# ----------------------------------------------------------------------------------------------
# Predictors
# ----------------------------------------------------------------------------------------------


def test_moving_average_and_constant():
    assert moving_average([1, 2, 3, 4, 5], 2).value == 4.5
    assert forecast("constant", [3.0, 7.0]).value == 7.0
    assert forecast("moving_average", [], window=3).value == 0.0


def test_kalman_follows_a_ramp_and_extrapolates_it_over_the_horizon():
    """A rate rising by 1 per window (10, 11, ..., 29): the local linear trend filter's level is
    near 29 and its slope near 1, so 6 windows ahead it answers about 35, where a level-only
    forecast would stay at 29."""
    ramp = [10.0 + i for i in range(20)]
    one = kalman(ramp, horizon=1)
    six = kalman(ramp, horizon=6)
    assert one.value == pytest.approx(30, abs=1.0)
    assert six.value == pytest.approx(35, abs=1.5)
    assert "slope +1" in six.detail


def test_kalman_is_quiet_on_a_flat_noisy_series():
    series = [15.0 + (0.8 if i % 2 else -0.8) for i in range(60)]
    f = kalman(series, horizon=6)
    assert f.value == pytest.approx(15.0, abs=1.0) and f.samples > 2


def test_kalman_weights_reproduce_its_forecast():
    """The filter is linear in the history given its noise estimate: the weights it reports sum
    to 1 and, dotted with the history, give its forecast (no trend threshold: trend_z 0)."""
    series = [9.0, 10.4, 8.2, 9.6, 11.0, 7.8, 9.2, 10.0, 8.8, 9.4]
    for horizon in (1, 6):
        f = kalman(series, horizon=horizon)
        assert sum(f.weights) == pytest.approx(1.0)
        assert sum(w * x for w, x in zip(f.weights, series)) == pytest.approx(f.value)


def _poisson_windows(rates: list[float], seed: int, dur: float = 5.0) -> list[int]:
    import random

    rng = random.Random(seed)
    out = []
    for r in rates:
        n, t = 0, rng.expovariate(r)
        while t < dur:
            n, t = n + 1, t + rng.expovariate(r)
        out.append(n)
    return out


def test_settle_quiets_a_constant_load_and_passes_a_step():
    """9 req/s in 5 s windows (45 arrivals, sd 6.7): the Kalman forecast follows much of the
    counting noise; settled 1.5 sd of the noise of its difference from the 12-window mean, it
    sits on that mean (sd 9 / sqrt(540) = 0.13 req/s, against 1.34 for one window). A step to
    18 req/s is 6.7 sd of one window: two windows after it the settled forecast has moved by
    most of what the filter's has."""
    raw, calm = [], []
    for seed in range(40):
        counts = _poisson_windows([9.0] * 30, seed)
        rates = [c / 5.0 for c in counts]
        f = kalman(rates, trend_z=0.5)
        s = settle(f, counts, [5.0] * 30, 12, 1.5)
        raw.append(f.value)
        calm.append(s.value)
    sd = lambda xs: math.sqrt(sum((x - sum(xs) / len(xs)) ** 2 for x in xs) / len(xs))  # noqa: E731
    assert sd(calm) < 0.6 * sd(raw)
    counts = _poisson_windows([9.0] * 28 + [18.0] * 2, 7)
    rates = [c / 5.0 for c in counts]
    f = kalman(rates, trend_z=0.5)
    s = settle(f, counts, [5.0] * 30, 12, 1.5)
    mean = sum(counts[-12:]) / 60.0
    assert s.z > 1.5 and s.value - mean > 0.5 * (f.value - mean)
    assert settle(f, counts, [5.0] * 30, 12, 0.0).value == pytest.approx(f.value)
    assert settle(holt_winters(rates, 4), counts, [5.0] * 30, 12, 1.5) is None  # not linear: no weights


def test_holt_winters_falls_back_until_it_has_enough_points_and_looks_ahead():
    assert "fallback=moving_average" in holt_winters([1.0, 2.0], 4).detail
    rising = [float(i) for i in range(30)]
    assert holt_winters(rising, 4, horizon=5).value > holt_winters(rising, 4, horizon=1).value
    assert holt_winters([5.0] * 10, 4).detail == "flat history"


# ----------------------------------------------------------------------------------------------
# Profile arithmetic
# ----------------------------------------------------------------------------------------------


def test_erlang_c_examples():
    """C(1, a) = a (M/M/1: the probability of waiting is the utilisation); C(3, 2) = 4/9."""
    assert erlang_c(1, 0.6) == pytest.approx(0.6)
    assert erlang_c(3, 2.0) == pytest.approx(4 / 9)
    assert erlang_c(2, 2.5) == 1.0


def test_mocker_profile_numbers_of_the_docstring():
    p = derive_profile("mocker")
    assert p.prefill_tokens_per_s == pytest.approx(8192 / 169.1367 * 1000, rel=1e-4)
    assert p.prefill_time_ms(4096) == pytest.approx(85.76, abs=0.01)
    assert p.prefill_capacity(4096, 500).tokens_per_s == pytest.approx(41169, abs=1)
    d = p.best_decode(20, 4096)
    assert (d.seqs, round(d.itl_ms, 3), round(d.tokens_per_s)) == (79, 19.956, 3959)
    q = p.best_decode(20, 4096, quantile=0.9)
    assert q.tokens_per_s == pytest.approx(3959 * (79 - 1.2816 * math.sqrt(79)) / 79, rel=1e-3)


def test_a_pool_queues_less_than_its_replicas_would_alone():
    """Same utilisation, more replicas behind least-loaded routing: the M/G/k wait shrinks, so
    the tolerable utilisation (per-replica capacity) grows. Flat profile, ISL 2,000 (S = 200
    ms), cv 1, target 300 ms (slack 100 ms)."""
    p = flat_profile()
    caps = [p.prefill_capacity(2000, 300, cv=1.0, servers=k, max_utilization=0.99).utilization for k in (1, 2, 4, 8)]
    assert caps == sorted(caps) and caps[0] < 0.4 < caps[-1]


def test_quantile_example_of_the_docstring():
    """One replica, S = 200 ms, slack 800 ms, q = 0.9: rho * exp(-8*(1-rho)) <= 0.1 -> 0.748."""
    cap = flat_profile().prefill_capacity(2000, 1000, quantile=0.9)
    assert cap.utilization == pytest.approx(0.748, abs=0.001)


def test_an_infeasible_ttft_does_not_buy_replicas():
    """A target below the service time: no utilisation fixes it; capacity stays near the
    queue-free regime instead of collapsing to the minimum, and the answer says infeasible."""
    cap = flat_profile().prefill_capacity(2000, 150)
    assert cap.infeasible and cap.utilization > 0.3


# ----------------------------------------------------------------------------------------------
# Config validators explain themselves
# ----------------------------------------------------------------------------------------------


def _pool(**kw) -> PoolConfig:
    fields = {"name": "p", "role": "prefill", "ttft_slo_ms": 1000.0, "performance": flat_profile()}
    fields.update(kw)
    return PoolConfig(**fields)


@pytest.mark.parametrize("kwargs,match", [
    ({"pools": (_pool(min_replicas=5),), "gpu_budget": 4}, "could never satisfy both"),
    ({"scale_down_threshold": 1.0}, "keeps a constant load from oscillating"),
    ({"max_utilization": 1.0}, "unbounded queue"),
    ({"pins": {"nope": 1}}, "unknown pool"),
    ({"tumbling_s": 15.0}, "multiple of hop_step_s"),
    ({"startup_timeout_s": 5.0}, "time out before the next tick"),
])
def test_config_rejections_say_why(kwargs, match):
    fields = {"pools": (_pool(),), "gpu_budget": 8}
    fields.update(kwargs)
    with pytest.raises(PlannerConfigError, match=match):
        PlannerConfig(**fields)


def test_pool_rejections_say_why():
    with pytest.raises(PlannerConfigError, match="needs ttft_slo_ms"):
        PoolConfig(name="p", role="prefill")
    with pytest.raises(PlannerConfigError, match="needs itl_slo_ms"):
        PoolConfig(name="d", role="decode")
    with pytest.raises(PlannerConfigError, match="must name a prefill pool"):
        PlannerConfig(pools=(_pool(name="d", role="decode", ttft_slo_ms=None, itl_slo_ms=20.0, fed_by="x"),))


# ----------------------------------------------------------------------------------------------
# Decode demand measured upstream; a binding budget takes surplus, never need
# ----------------------------------------------------------------------------------------------


def _window(end: float, **kw) -> WindowStats:
    fields = {"start_ns": int((end - 10) * NS), "end_ns": int(end * NS), "arrivals": 100, "isl_mean": 2000.0,
              "osl_mean": 500.0}
    fields.update(kw)
    return WindowStats(**fields)


def test_decode_pool_fed_by_prefill_sizes_for_the_upstream_arrivals():
    """Prefill saturated: 400 requests arrived (40 req/s) but only 100 reached decode. Fed by the
    prefill pool, decode sizes for 40 req/s x 500 = 20,000 tokens/s (2 replicas at 10,000), not
    for the 5,000 it saw."""
    pre = _pool(name="pre", max_replicas=20)
    dec = _pool(name="dec", role="decode", ttft_slo_ms=None, itl_slo_ms=20.0, fed_by="pre")
    cfg = PlannerConfig(pools=(pre, dec), gpu_budget=32, cooldown_up_s=0.0, safety_z=0.0)
    snap = LoadSnapshot(now_ns=21 * NS, pools=(
        PoolLoad(pool="pre", replicas=ReplicaCounts(ready=4), windows=(_window(20, arrivals=400),)),
        PoolLoad(pool="dec", replicas=ReplicaCounts(ready=1), windows=(_window(20, arrivals=100),))))
    state = PlannerState(pools=(PoolState(pool="pre", target=4), PoolState(pool="dec", target=1)))
    d, _ = decide(21 * NS, snap, cfg, state)
    assert d.report("dec").input("decode_demand_tok_s") == 20000.0


def test_a_binding_budget_takes_a_holders_surplus_but_not_its_need():
    """Budget 10. Pool a holds 6 but needs only 3 (12 req/s x 2,000 = 24,000 tokens/s / 8,500 =
    2.82: inside its hysteresis band, so on its own it would hold); pool b at 2 sees 28 req/s =
    56,000 / 8,500 = 6.59 -> 7. 6 + 7 > 10: a offers its surplus above the high end of its noise
    band (2.82 x (1 + 2/sqrt(120)) = 3.34 -> 4: trading a replica on a noisy need would be
    churn), b grows into it: a drains to 4, b gets 6. The 2 replicas a drains hold their GPUs
    until they are gone, so b takes the 2 GPUs free now (6 + 4 = 10) and the other 2 once a's
    drains are through (b's 4 ready by then: nothing pending)."""
    a, b = _pool(name="a"), _pool(name="b")
    cfg = PlannerConfig(pools=(a, b), gpu_budget=10, cooldown_up_s=0.0, safety_z=0.0)
    snap = LoadSnapshot(now_ns=21 * NS, pools=(
        PoolLoad(pool="a", replicas=ReplicaCounts(ready=6), windows=(_window(20, arrivals=120),)),
        PoolLoad(pool="b", replicas=ReplicaCounts(ready=2), windows=(_window(20, arrivals=280, isl_mean=2000.0),))))
    state = PlannerState(pools=(PoolState(pool="a", target=6), PoolState(pool="b", target=2)))
    d, st = decide(21 * NS, snap, cfg, state)
    need_a = d.report("a").needed
    assert math.ceil(need_a) == 3
    assert {e.pool: e.to_replicas for e in d.effects} == {"a": 4, "b": 4}
    assert "waits for 2 GPUs that replicas drained now still hold" in d.report("b").reason
    assert d.report("b").input("binding") == "gpu_budget"
    snap = LoadSnapshot(now_ns=61 * NS, pools=(
        PoolLoad(pool="a", replicas=ReplicaCounts(ready=4), windows=(_window(60, arrivals=120),)),
        PoolLoad(pool="b", replicas=ReplicaCounts(ready=4), windows=(_window(60, arrivals=280, isl_mean=2000.0),))))
    d, st = decide(61 * NS, snap, cfg, st)
    assert {e.pool: e.to_replicas for e in d.effects} == {"b": 6}
    assert st.pool("a").target + st.pool("b").target == 10


def test_ticks_come_just_after_a_window_closes():
    """5 s windows closed 0.5 s after their end: a tick is due on a close + 1 ms, at least tick_s
    less half a window after the last. From 0: due 0 + 5 - 2.5 = 2.5 -> the first close after it,
    5.501; then 5.501 + 2.5 = 8.001 -> 10.501. A tick at 7.2 s (say, right after an election):
    due 9.7 -> 10.501, realigned. With 10 s ticks over 5 s windows: every other close."""
    cfg = PlannerConfig(pools=(_pool(),), tick_s=5.0, tumbling_s=5.0, hop_step_s=5.0, hopping_s=30.0, grace_s=0.5)
    assert cfg.next_tick_ns(0) == 5_501_000_000
    assert cfg.next_tick_ns(5_501_000_000) == 10_501_000_000
    assert cfg.next_tick_ns(7_200_000_000) == 10_501_000_000
    slow = cfg.replace(tick_s=10.0)
    assert slow.next_tick_ns(5_501_000_000) == 15_501_000_000


# ----------------------------------------------------------------------------------------------
# Admin stream fold
# ----------------------------------------------------------------------------------------------


def test_pins_and_config_changes_from_the_admin_stream():
    base = PlannerConfig(pools=(_pool(),), gpu_budget=8)
    admin = AdminInputs()
    assert admin.apply(stamp(PoolPinned(actor="alice", pool="p", replicas=5, reason="maintenance"), 1))
    assert admin.pins["p"].replicas == 5 and admin.pins["p"].by == "alice"
    admin.apply(stamp(PoolUpdated(actor="bob", pool="p", role=WorkerRole.PREFILL, ttft_slo_ms=900.0, min_replicas=2,
                                  max_replicas=6), 2))
    cfg = admin.effective_config(base)
    p = cfg.pool("p")
    assert (p.ttft_slo_ms, p.min_replicas, p.max_replicas) == (900.0, 2, 6) and p.performance is not None
    admin.apply(stamp(PlannerConfigChanged(actor="carol", config_version=9, config={
        "gpu_budget": 4, "pools": [{"name": "p", "role": "prefill", "ttft_slo_ms": 700.0}]}), 3))
    cfg = admin.effective_config(base)
    assert cfg.version == 9 and cfg.gpu_budget == 4 and cfg.pool("p").ttft_slo_ms == 900.0  # PoolUpdated on top
    assert admin.apply(stamp(PoolPinned(actor="alice", pool="p", replicas=None), 4)) and "p" not in admin.pins


def test_an_invalid_admin_config_is_refused_with_the_reason():
    admin = AdminInputs()
    admin.apply(stamp(PoolUpdated(actor="x", pool="p", role=WorkerRole.PREFILL, ttft_slo_ms=500.0, min_replicas=9,
                                  max_replicas=9), 1))
    with pytest.raises(PlannerConfigError, match="could never satisfy both"):
        admin.effective_config(PlannerConfig(pools=(_pool(),), gpu_budget=8))


def test_pin_decision_names_the_operator():
    cfg = PlannerConfig(pools=(_pool(),), gpu_budget=8)
    admin = AdminInputs()
    admin.apply(stamp(PoolPinned(actor="alice", pool="p", replicas=4, reason="load test"), 1))
    state = PlannerState(pools=(PoolState(pool="p", target=2),)).with_pins(admin.pins)
    snap = LoadSnapshot(now_ns=5 * NS, pools=(PoolLoad(pool="p", replicas=ReplicaCounts(ready=2)),))
    d, _ = decide(5 * NS, snap, cfg, state)
    assert d.effects[0].to_replicas == 4
    assert "pinned by operator alice to 4 (load test)" in d.effects[0].reason
    assert d.effects[0].event.inputs["pinned_by"] == "alice"


# ----------------------------------------------------------------------------------------------
# Fencing shared through a file
# ----------------------------------------------------------------------------------------------


def test_file_fence_is_shared_by_scalers_of_different_leaders(tmp_path):
    def dec(token: int, to: int) -> ScalingDecision:
        return ScalingDecision(pool="p", decision_id=f"d{token}", role=WorkerRole.PREFILL, from_replicas=0,
                               to_replicas=to, reason="t", config_version=1, fencing_token=token)

    old = VirtualScaler(fence=FileFence(tmp_path / "fence"))
    new = VirtualScaler(fence=FileFence(tmp_path / "fence"))
    assert old.apply(dec(3, 1), now_ns=0).success
    assert new.apply(dec(4, 2), now_ns=0).success
    late = old.apply(dec(3, 5), now_ns=1)
    assert not late.success and "stale fencing token 3 < newest seen 4" in late.error
    assert old.counts("p", 1).active == 1  # the stale decision changed nothing
