"""Planning ahead of start-up: core-only, no mocks.

Every test drives :func:`decide` with plain inputs (the ``_make_*`` builders) and the
:class:`VirtualScaler` (replicas ready ``startup_s`` after they are ordered, drained ones gone 5 s
after the order). Profile: :func:`flat_profile`: a prefill replica of a TTFT 1,000 ms pool
carries 8,500 tokens/s (utilisation capped at 0.85 of 10,000), so ISL 2,000 costs 4.25 req/s per
replica; decode runs up to 100 sequences at a flat 10 ms ITL, 10,000 tokens/s per replica.
Windows and ticks are 10 s; a tick comes 1 s after its window closes.
"""

from __future__ import annotations

import math

import numpy as np

from control_plane.planner import PlannerConfig, PlannerState, PoolConfig, decide
from control_plane.planner.load_view import (
    NS,
    LoadSnapshot,
    PoolLoad,
    ReplicaCounts,
    WindowStats,
)
from control_plane.planner.policy import PoolState, headroom
from control_plane.planner.scalers import VirtualScaler
from tests.support.planner import WINDOW_S, make_config, make_pool, make_window

PER_REPLICA = 8500 / 2000  # req/s of ISL 2,000 one prefill replica carries


def _make_pool(**overrides) -> PoolConfig:
    return make_pool(**{"max_replicas": 20, "predictor": "kalman", **overrides})


def _make_config(*pools: PoolConfig, **overrides) -> PlannerConfig:
    """Start-up takes a lead time: 30 s lead, 120 s start-up timeout, a 60 s scale-down cooldown."""
    fields = {"gpu_budget": 20, "tumbling_s": WINDOW_S, "hop_step_s": WINDOW_S, "cooldown_up_s": 0.0,
              "cooldown_down_s": 60.0, "lead_time_s": 30.0, "startup_timeout_s": 120.0, "noise_z": 1.0}
    fields.update(overrides)
    return make_config(*(pools or (_make_pool(),)), **fields)


def _make_window(end_s: float, **overrides) -> WindowStats:
    return make_window(end_s, **{"osl_mean": 100.0, **overrides})


def _run(cfg: PlannerConfig, rates, *, startup_s: float = 30.0, start: int = 2, seed: int = 0,
         poisson: bool = True, after=None):
    """One tick per window; arrivals Poisson(rate x 10 s) per pool. Returns per tick: the effects,
    the targets, the ready counts and the replicas the window's actual rate needed. ``after(scaler,
    now)`` is called once each tick's effects are applied."""
    rng = np.random.default_rng(seed)
    scaler = VirtualScaler(startup_s=startup_s, drain_s=5.0)
    for p in cfg.pools:
        scaler.seed(p.name, p.role, start, now_ns=0)
    state = PlannerState().with_token(1)
    out = []
    for k, rate in enumerate(rates):
        end = (k + 1) * WINDOW_S
        now = int((end + 1) * NS)
        n = int(rng.poisson(rate * WINDOW_S)) if poisson else int(round(rate * WINDOW_S))
        loads = tuple(PoolLoad(pool=p.name, role=p.role, replicas=scaler.counts(p.name, now),
                               workers=scaler.workers(p.name, now), windows=(_make_window(end, arrivals=n),))
                      for p in cfg.pools)
        snap = LoadSnapshot(now_ns=now, pools=loads)
        d, state = decide(now, snap, cfg, state)
        for e in d.effects:
            scaler.apply(e.event, now_ns=now)
        if after is not None:
            after(scaler, now)
        out.append((d, {p.name: state.pool(p.name).target for p in cfg.pools},
                    {p.name: scaler.counts(p.name, now).ready for p in cfg.pools}, rate / PER_REPLICA, snap))
    return out


def _reversals(ticks, pool: str = "p") -> int:
    last, n = 0, 0
    for d, *_ in ticks:
        for e in d.effects:
            if e.pool != pool:
                continue
            step = 1 if e.to_replicas > e.from_replicas else -1
            n += last != 0 and step != last
            last = step
    return n


def test_a_ramp_faster_than_start_up_is_met():
    """4 -> 28 req/s over 120 s (+2 req/s a window), held; start-up 30 s (3 windows). Within one
    start-up the load grows by 6 req/s = 1.4 replicas, 150% of where it started. Needed: 4 /
    4.25 = 0.94 replicas before, 28 / 4.25 = 6.59 (7) on the plateau.

    Ours forecasts 2 x 30 + 10 = 70 s (7 windows) ahead, and once rising windows confirm a
    trend 30 + 10 = 40 s (4 windows: the next tick's order stacks, ``rise_horizon_s``). At
    window 13 (8 req/s) the rising windows 12-13 confirm the ramp and their own line
    (``trend_fit_z``: 2 req/s a window, beyond 0.5 sd of its noise) forecasts it 40 s ahead:
    2 -> 4, ready at 16; the next orders stack on the replicas still starting
    (``stack_on_rise``): 5 at 15, 6 at 16, 7 at 18, 8 at 19, 9 at 21, 10 at 23, each sized for
    the next start-up and tick only (70 s ahead they overshot: 2 -> 5, 7, 9, 10). Short of the
    window's need only in windows 14-15; from window 16 on (40 s after the ramp began: one
    start-up for the first order, one tick), every window is covered. With the Kalman slope
    alone (``trend_fit_z`` None: it learns the ramp late) windows 14-17; with every order also
    waiting for the last (``stack_on_rise`` off) 14-18. A planner that only follows the load
    (constant predictor, no fit, same rules otherwise) is short in 12 windows."""
    rates = [4.0] * 12 + [4.0 + 2 * i for i in range(1, 13)] + [28.0] * 15

    def short(ticks) -> list[int]:
        return [k for k, t in enumerate(ticks) if t[2]["p"] < t[3]]

    ours = _run(_make_config(), rates, poisson=False)
    assert short(ours) == [14, 15]
    assert short(_run(_make_config(trend_fit_z=None), rates, poisson=False)) == [14, 15, 16, 17]
    assert short(_run(_make_config(trend_fit_z=None, stack_on_rise=False), rates, poisson=False)) == [
        14, 15, 16, 17, 18]
    reactive = _run(_make_config(_make_pool(predictor="constant"), trend_fit_z=None), rates, poisson=False)
    assert len(short(reactive)) >= 2 * len(short(ours))
    up = next(t[0].effects[0].event for t in ours if t[0].effects)
    assert up.forecast_horizon_s == 40.0 and up.startup_allowance_s == 30.0
    assert [(e.from_replicas, e.to_replicas) for t in ours for e in t[0].effects][:3] == [(2, 4), (4, 5), (5, 6)]
    assert up.forecast_rate > rates[12] and up.binding == "ttft" and up.headroom is not None


def test_no_reversal_under_constant_load():
    """15 req/s of ISL 2,000 = 3.53 replicas, Poisson (150 arrivals a window: sd 8.2%), 2 hours
    (720 ticks), starting at 2. One scale-up to cover it, then no direction reversal: a window
    would have to be ~4 sd high to prove another replica (the low end of the band: needed x
    (1 - 8.2%), with the Kalman trend extrapolated 7 windows ahead only beyond 0.5 sd of its
    slope and its own uncertainty widening the band), and a scale-down needs the high end of
    both the forecast and the 6-window average to fit 80% of fewer replicas (needed < 2.4 / 1.08
    = 2.2, a 10-sd window). Headroom stays small: only errors beyond 2 sd of Poisson noise count
    as the forecast's."""
    ticks = _run(_make_config(), [15.0] * 720, seed=3)
    assert _reversals(ticks) == 0
    changes = [(e.from_replicas, e.to_replicas) for d, *_ in ticks for e in d.effects]
    assert 1 <= len(changes) <= 2 and all(b > a for a, b in changes), changes
    assert max(t[0].report("p").input("headroom") for t in ticks) < 0.1


def test_the_gpu_budget_is_never_exceeded_counting_draining_replicas():
    """Budget 8 over prefill and decode pools, a load that swings between 4 and 40 req/s (each
    pool alone would want up to 10 prefill / 8 decode replicas). At every tick the targets of
    both pools plus the replicas still draining (they hold their GPUs until gone) fit 8: a
    decode scale-down at t frees its GPUs for prefill only once the drain is over, also when
    both happen in one tick: right after every tick's decisions are applied, the replicas that
    exist (starting, ready or draining) fit 8."""
    pools = (_make_pool(name="pre", max_replicas=10),
             _make_pool(name="dec", role="decode", ttft_slo_ms=None, itl_slo_ms=20.0, max_replicas=10))
    cfg = _make_config(*pools, gpu_budget=8, cooldown_down_s=0.0, scale_down_ticks=1)
    rates = ([4.0] * 6 + [40.0] * 8 + [4.0] * 6) * 4
    held: list[int] = []
    ticks = _run(cfg, rates, startup_s=20.0, start=1, seed=1, after=lambda scaler, now: held.append(
        sum(c.starting + c.ready + c.draining for c in (scaler.counts(p.name, now) for p in pools))))
    assert max(held) <= 8
    for _d, targets, *_ in ticks:
        assert sum(targets.values()) <= 8
    # draining counted: after a tick that drained, the next targets leave room for the drains
    for (d0, t0, *_), (d1, t1, _r, _n, snap1) in zip(ticks, ticks[1:]):
        draining = sum(pl.replicas.draining for pl in snap1.pools)
        grew = any(e.to_replicas > e.from_replicas for e in d1.effects)
        if grew:
            assert sum(t1.values()) + draining <= 8, (t1, draining)


def test_nothing_is_decided_while_a_scale_is_pending():
    """Scale-up 2 -> k at t=11; its replicas take 30 s. While any is still starting, no decision
    for the pool, whatever the load does (here it doubles, then vanishes): up, down, or through
    the budget. Then a scale-down: while its drained replica is draining (5 s; here the
    snapshot says it still is for 2 ticks), again nothing."""
    cfg = _make_config(cooldown_down_s=0.0, scale_down_ticks=1)
    state = PlannerState(pools=(PoolState(pool="p", target=2),))

    def tick(now_s, arrivals, **counts):
        reps = ReplicaCounts(**counts)
        snap = LoadSnapshot(now_ns=int(now_s * NS), pools=(
            PoolLoad(pool="p", role="prefill", replicas=reps, windows=(_make_window(now_s - 1, arrivals=arrivals),)),))
        return decide(int(now_s * NS), snap, cfg, state)

    d, state = tick(11, 300, ready=2)  # 30 req/s: 7.06 replicas
    assert [(e.from_replicas, e.to_replicas) for e in d.effects] == [(2, 8)]
    d, state = tick(21, 600, ready=5, starting=3)  # 60 req/s: wants 15
    assert not d.effects and "still pending" in d.report("p").reason
    d, state = tick(31, 0, ready=7, starting=1)
    assert not d.effects, d.report("p").reason
    d, state = tick(41, 0, ready=8)  # applied; the load is gone: scale down
    assert d.effects and d.effects[0].to_replicas < 8
    to = d.effects[0].to_replicas
    for now in (51, 61):
        d, state = tick(now, 600, ready=to, draining=8 - to)  # 60 req/s, but the drain is pending
        assert not d.effects, d.report("p").reason
    d, state = tick(71, 600, ready=to)
    assert d.effects and d.effects[0].to_replicas > to


def test_headroom_follows_the_forecasts_measured_error():
    """A constant predictor that saw 10 req/s (100 arrivals) forecasts 10 over its horizon of
    2 x 5 + 10 = 20 s (lead 5 s): 2 windows. 20 req/s come instead in both (400 arrivals).
    u = 20 / 10 - 1 = 1.0, less 2 sd of Poisson noise (2 x sqrt(1/400 + 1/100) = 0.224): 0.776.
    The expectile (tau 0.9, weight 0.2 / 2 windows) moves 0.1 x 0.9 x 0.776 = 0.070 toward it
    from 0: the next forecast is sized for 1.070 x its value."""
    cfg = _make_config(_make_pool(predictor="constant"), lead_time_s=5.0, max_headroom=0.5)
    state = PlannerState(pools=(PoolState(pool="p", target=3),))
    wins = [_make_window(10.0)]
    snap = LoadSnapshot(now_ns=11 * NS, pools=(PoolLoad(pool="p", replicas=ReplicaCounts(ready=3), windows=tuple(wins)),))
    _, state = decide(11 * NS, snap, cfg, state)
    for end in (20.0, 30.0):
        wins.append(_make_window(end, arrivals=200))
        snap = LoadSnapshot(now_ns=int((end + 1) * NS), pools=(
            PoolLoad(pool="p", replicas=ReplicaCounts(ready=3), windows=tuple(wins)),))
        d, state = decide(int((end + 1) * NS), snap, cfg, state)
    ps = state.pool("p")
    assert ps.horizon_scored >= 1
    noise = 2 * math.sqrt(1 / 400 + 1 / 100)
    assert headroom(ps, cfg) == pytest_approx(0.2 / 2 * 0.9 * (1.0 - noise))


def pytest_approx(x: float):
    import pytest

    return pytest.approx(x, rel=1e-6)
