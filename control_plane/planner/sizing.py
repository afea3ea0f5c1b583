"""Sizing (step 4 of ``policy.py``): forecast, then the replicas a demand estimate needs
and its noise band, on the short and the long horizon; ``needed_replicas`` for a known load.
Pure."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from control_plane.planner.config import PlannerConfig, PoolConfig
from control_plane.planner.errors import PlannerConfigError
from control_plane.planner.load_view import NS, PoolLoad
from control_plane.planner.overload import _overload_need
from control_plane.planner.policy_types import _EPS, MAX_HIT_RATE, InputValue, Observation, PoolState
from control_plane.planner.predictors import forecast, settle
from control_plane.planner.profile import PerformanceProfile
from control_plane.planner.trends import _fall, _rise, fall_level, headroom, rise_fit
from schemas.types import WorkerRole


@dataclass(frozen=True, slots=True)
class _Sizing:
    needed: float
    low: float
    high: float
    text: str


def _need(rate: float, isl: float, osl: float, hit: float, n_eff: float, isl_cv: float, osl_cv: float,
          pc: PoolConfig, cfg: PlannerConfig, prof: PerformanceProfile, ps: PoolState, role: WorkerRole,
          inputs: dict[str, InputValue] | None, backlog: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float, list[str]]:
    """Replicas needed for one demand estimate, and the estimate's relative noise.

    Noise: the demand over a window is a compound Poisson sum (Poisson arrivals, each with a
    random length), whose relative standard deviation is ``sqrt(1 + cv^2) / sqrt(n)`` for ``n``
    arrivals and a length coefficient of variation ``cv``. ``backlog`` (prefill tokens/s, decode
    tokens/s) is the rate that drains what is already queued in ``backlog_drain_s``: measured,
    not forecast, so it adds no noise.
    """
    parts: list[str] = []
    needed = 0.0
    noise = 0.0
    root_n = math.sqrt(n_eff) if n_eff > 0 else 0.0
    if role is not WorkerRole.DECODE:
        isl_eff = isl * (1 - hit)
        demand = rate * isl_eff
        need_p, cap, k = _prefill_need(demand + backlog[0], isl_eff, isl_cv, pc, cfg, prof, ps.ttft_correction)
        per = cap.tokens_per_s
        needed += need_p
        noise += demand / per * (math.sqrt(1 + isl_cv**2) / root_n if root_n else 1.0) if per > 0 else 0.0
        if inputs is not None:
            inputs.update(prefill_demand_tok_s=round(demand, 1), prefill_tok_s_per_replica=round(per, 1),
                          prefill_service_ms=round(cap.service_ms, 2),
                          prefill_utilization=round(cap.utilization, 4), prefill_needed=round(need_p, 4),
                          prefill_pool_size=k)
            if cap.infeasible:
                inputs["ttft_slo_infeasible"] = 1
        parts.append(
            f"prefill {rate:.2f} req/s x {isl_eff:,.0f} new tokens (ISL {isl:,.0f}, hit {hit:.2f}) = "
            f"{demand:,.0f} tok/s" + (f" + backlog {backlog[0]:,.0f} tok/s" if backlog[0] else "")
            + f" / {per:,.0f} tok/s per replica in a pool of {k} (TTFT {pc.ttft_slo_ms:g}/{ps.ttft_correction:.2f} ms, "
            f"service {cap.service_ms:.0f} ms, ISL cv {isl_cv:.2f}, rho {cap.utilization:.2f}) = {need_p:.2f}")
    if role is not WorkerRole.PREFILL:
        context = isl + osl / 2
        target = (pc.itl_slo_ms or 0.0) / ps.itl_correction
        # the ITL SLO is on each request's mean ITL: the mean step time over its life, so the
        # step time at the slo_quantile of the concurrency keeps that fraction inside it
        dc = prof.best_decode(target, context, quantile=cfg.slo_quantile)
        demand = rate * osl
        need_d = (demand + backlog[1]) / dc.tokens_per_s if dc.tokens_per_s > 0 else 0.0
        needed += need_d
        noise += (demand / dc.tokens_per_s * (math.sqrt(1 + osl_cv**2) / root_n if root_n else 1.0)
                  if dc.tokens_per_s > 0 else 0.0)
        if inputs is not None:
            inputs.update(decode_demand_tok_s=round(demand, 1), decode_tok_s_per_replica=round(dc.tokens_per_s, 1),
                          decode_seqs_per_replica=dc.seqs, decode_itl_ms=round(dc.itl_ms, 3),
                          decode_context=round(context, 1), decode_needed=round(need_d, 4))
            if dc.infeasible:
                inputs["itl_slo_infeasible"] = 1
        parts.append(
            f"decode {rate:.2f} req/s x OSL {osl:,.0f} = {demand:,.0f} tok/s"
            + (f" + backlog {backlog[1]:,.0f} tok/s" if backlog[1] else "") + f" / {dc.tokens_per_s:,.0f} tok/s "
            f"per replica ({dc.seqs} seqs at {context:,.0f} context, ITL {dc.itl_ms:.1f} <= "
            f"{pc.itl_slo_ms:g}/{ps.itl_correction:.2f} ms) = {need_d:.2f}")
    rel = noise / needed if needed > 0 else 0.0
    return needed, rel, parts


def _prefill_need(demand: float, isl_eff: float, cv: float, pc: PoolConfig, cfg: PlannerConfig,
                  prof: PerformanceProfile, correction: float):
    """Fractional prefill replicas for ``demand`` tokens/s: the smallest pool size ``k`` whose
    per-replica capacity (M/G/k: it grows with ``k``) carries the demand, as ``demand /
    capacity(k)`` but never below ``k - 1`` (``k - 1`` replicas did not suffice). The TTFT
    correction scales the latency model (target / correction), not the throughput."""
    target = (pc.ttft_slo_ms or 0.0) / correction

    def cap_at(k: int):
        return prof.prefill_capacity(isl_eff, target, cv=cv, quantile=cfg.slo_quantile, servers=k,
                                     min_utilization=cfg.min_utilization, max_utilization=cfg.max_utilization)

    if demand <= 0:
        return 0.0, cap_at(1), 1
    k = max(1, math.floor(demand / (cfg.max_utilization * prof.prefill_tokens_per_s)))
    while True:
        cap = cap_at(k)
        need = demand / cap.tokens_per_s
        if need <= k + _EPS or k >= 4096:
            return max(need, k - 1 + 1e-6 if k > 1 and demand / cap_at(k - 1).tokens_per_s > k - 1 else 0.0), cap, k
        k += 1


def _cv(mean: float | None, sd: float | None) -> float:
    return sd / mean if mean and sd is not None and mean > 0 else 0.0


def _backlog(load: PoolLoad, cfg: PlannerConfig, osl: float) -> tuple[float, float]:
    """Drain rates of what the ready workers report queued: prefill tokens, decode requests."""
    if cfg.backlog_drain_s is None:
        return 0.0, 0.0
    ready = [w for w in load.workers if w.state == "ready"]
    return (sum(w.queued_prefill_tokens for w in ready) / cfg.backlog_drain_s,
            sum(w.waiting for w in ready) * osl / cfg.backlog_drain_s)


def _pooled(tail: Sequence[Observation], get: Callable[[Observation], tuple[float | None, float | None]]
            ) -> tuple[float, float]:
    """(mean, coefficient of variation) of a length over ``tail``'s windows pooled
    (arrival-weighted mean and second moment): one window of a few heavy-tailed requests says
    little. (0, 0) without data."""
    pts = [(o.arrivals, get(o)) for o in tail if o.arrivals > 0 and get(o)[0] is not None]
    w = sum(a for a, _ in pts)
    if not w:
        return 0.0, 0.0
    m = sum(a * v[0] for a, v in pts) / w
    ex2 = sum(a * ((v[1] or 0.0) ** 2 + v[0] ** 2) for a, v in pts) / w
    return m, _cv(m, math.sqrt(max(ex2 - m * m, 0.0)))


def _lengths(hist: Sequence[Observation], pc: PoolConfig, cfg: PlannerConfig
             ) -> tuple[float, float, float, float, float]:
    """(ISL, OSL, prefix hit rate, ISL cv, OSL cv) the short horizon sizes with: pooled over
    the last ``length_windows`` windows (the hit rate weighted by prompt tokens), or
    ``length_predictor`` over the per-window means and the last window's cv."""
    if cfg.length_windows is not None:
        tail = hist[-cfg.length_windows:]
        isl, isl_cv = _pooled(tail, lambda o: (o.isl, o.isl_sd))
        osl, osl_cv = _pooled(tail, lambda o: (o.osl, o.osl_sd))
        pts = [(o.arrivals * (o.isl or 1.0), o.hit_rate) for o in tail if o.hit_rate is not None and o.arrivals > 0]
        w = sum(a for a, _ in pts)
        hit = sum(a * h for a, h in pts) / w if w else 0.0
        return isl, osl, min(hit, MAX_HIT_RATE), isl_cv, osl_cv

    def length(values: list[float]) -> float | None:
        if not values:
            return None
        return forecast(cfg.length_predictor, values, window=pc.predictor_window,
                        history_limit=cfg.history_limit).value

    isl = length([o.isl for o in hist if o.isl is not None]) or 0.0
    osl = length([o.osl for o in hist if o.osl is not None]) or 0.0
    hit = min(length([o.hit_rate for o in hist if o.hit_rate is not None]) or 0.0, MAX_HIT_RATE)
    last = hist[-1]
    return isl, osl, hit, _cv(last.isl, last.isl_sd), _cv(last.osl, last.osl_sd)


def _safety(hist: Sequence[Observation], cfg: PlannerConfig, role: WorkerRole) -> float:
    """The **safety stock** (``safety_z``): the work that arrives within one start-up
    (``lead_time_s``) is a compound Poisson sum, ``n = rate * lead_time_s`` requests whose
    lengths vary with ``cv`` (prefill: ISL; decode: OSL; aggregated: the larger), so its relative
    sd is ``sqrt(1 + cv^2) / sqrt(n)``; the pool is sized ``safety_z`` of those above the
    forecast (at most ``max_headroom``). It is what inventory control keeps against demand
    over a replenishment lead time: a load of few, heavy-tailed requests (long prompts) brings
    bursts of work no order can meet in time; a load of many short ones needs next to none.

    Both inputs are the quiet ones, so that under a constant load it is nearly a constant (the
    bench's constant shape: 0.09-0.10 prefill, 0.07-0.08 decode): the rate is the last
    ``confirm_windows`` windows' (not the forecast's), the cv pooled over every window kept (a
    few heavy-tailed prompts move a short window's cv a lot). It raises the level the noise band
    sits at, so a constant load's need must hold still for it (the settled rate and pooled
    lengths of ``_size``): before them it made the constant load reverse (docs/planner-bench.md)."""
    tail = hist[-cfg.confirm_windows:]
    dur = sum(o.duration_s for o in tail)
    n = sum(o.arrivals for o in tail) / dur * max(cfg.lead_time_s, cfg.tumbling_s) if dur > 0 else 0.0
    if cfg.safety_z <= 0 or n <= 0:
        return 0.0
    isl_cv = _pooled(hist, lambda o: (o.isl, o.isl_sd))[1] if role is not WorkerRole.DECODE else 0.0
    osl_cv = _pooled(hist, lambda o: (o.osl, o.osl_sd))[1] if role is not WorkerRole.PREFILL else 0.0
    cv = max(isl_cv, osl_cv)
    return min(cfg.safety_z * math.sqrt(1 + cv * cv) / math.sqrt(n), cfg.max_headroom)


def _size(ps: PoolState, pc: PoolConfig, cfg: PlannerConfig, prof: PerformanceProfile, role: WorkerRole,
          inputs: dict[str, InputValue], load: PoolLoad, overload: bool = False,
          others_gpus: float = 0.0) -> tuple[_Sizing, PoolState]:
    """Forecast, then size twice: on the forecast (short horizon: reacts fast, noisy) and on the
    average of the last ``confirm_windows`` windows (long horizon: slow, quiet). The low end
    (``needed * (1 - margin)``, margin = ``noise_z`` x relative noise, capped) of either proves a
    scale-up; a scale-down needs the high end of both to fit."""
    hist = ps.history
    # a trend is extrapolated over the horizon only once rising windows confirm it (then in
    # full, over the horizon of stacked orders); unconfirmed, only the next window's (its slope
    # beyond trend_z sd)
    rising, run_start = _rise(hist, cfg)
    # a fall the windows themselves confirm (the rise's CUSUM mirrored); the later change point
    # wins: a burst's rise stays confirmed long after its plateau (the reference lags), its fall
    # is the news
    falling, fall_start = _fall(hist, cfg) if cfg.release_on_fall else (False, len(hist))
    falling = falling and not (rising and run_start >= fall_start)
    rising = rising and not falling
    horizon = max(1, math.ceil((cfg.rise_horizon_s if rising else cfg.horizon_s) / cfg.tumbling_s - _EPS))
    rate_f = forecast(pc.predictor, [o.rate for o in hist], window=pc.predictor_window,
                      history_limit=cfg.history_limit, seasonal_periods=pc.seasonal_periods,
                      horizon=horizon if rising else 1, trend_z=0.0 if rising else cfg.trend_z)
    inputs["trend_confirmed"] = int(rising)
    fit = rise_fit(hist, run_start, cfg, horizon) if rising and cfg.trend_fit_z is not None else None
    if fit is not None:
        # the rising windows' own slope (beyond its noise): the predictor's learns a ramp late
        inputs.update(trend_fit_rate=round(fit[0], 4), trend_fit_slope=round(fit[1], 4),
                      trend_fit_slope_sd=round(fit[2], 4))
        if fit[0] > rate_f.value:
            rate_f = replace(rate_f, value=fit[0], detail=(rate_f.detail + "; " if rate_f.detail else "")
                             + f"the rising windows' line: {fit[1]:.2f} +- {fit[2]:.2f} req/s per window")

    last = hist[-1]
    k = max(1, min(len(hist), math.ceil(rate_f.samples)))
    n_short = rate_f.samples * sum(o.arrivals for o in hist[-k:]) / k
    settled = (settle(rate_f, [o.arrivals for o in hist], [o.duration_s for o in hist], cfg.settle_windows,
                      cfg.settle_z) if cfg.settle_z > 0 and not rising else None)
    if settled is not None:
        inputs.update(settle_mean_rate=round(settled.mean, 4), settle_forecast_z=round(settled.z, 3),
                      unsettled_rate=round(rate_f.value, 4))
        rate_f = replace(rate_f, value=settled.value, detail=(rate_f.detail + "; " if rate_f.detail else "")
                         + f"settled on the {min(cfg.settle_windows, len(hist))}-window mean {settled.mean:.2f} "
                         f"({settled.z:+.1f} sd, {cfg.settle_z:g} sd dropped)")
        n_short = settled.arrivals
    # a confirmed fall: the rate is what the falling windows' line measures at the last window
    # (never extrapolated further down), where the settled mean and the long horizon still
    # remember the peak
    inputs["fall_confirmed"] = int(falling)
    level = fall_level(hist, fall_start, cfg) if falling else None
    if level is not None and level[0] < rate_f.value:
        inputs.update(fall_level_rate=round(level[0], 4), unfallen_rate=round(rate_f.value, 4))
        rate_f = replace(rate_f, value=level[0], detail=(rate_f.detail + "; " if rate_f.detail else "")
                         + f"the falling windows' line at the last window: {level[0]:.2f} req/s")
        n_short = level[1]
    isl, osl, hit, isl_cv, osl_cv = _lengths(hist, pc, cfg)
    made = tuple(f for f in ps.horizon_forecasts if f[0] != last.window_end_ns)
    ps = replace(ps, horizon_forecasts=made + (
        (last.window_end_ns, last.window_end_ns + horizon * int(round(cfg.tumbling_s * NS)), rate_f.value, n_short),))
    room = headroom(ps, cfg)
    rate = rate_f.value * (1 + room)
    ps = replace(ps, forecast_rate=rate_f.value, forecast_for_ns=last.window_end_ns + int(round(cfg.tumbling_s * NS)))
    inputs.update(forecast_rate=round(rate_f.value, 4), forecast_horizon_s=round(horizon * cfg.tumbling_s, 3),
                  headroom=round(room, 4), startup_allowance_s=cfg.lead_time_s,
                  horizon_error_scored=ps.horizon_scored, predicted_rate=round(rate, 4), predicted_isl=round(isl, 1), predicted_osl=round(osl, 1),
                  predicted_hit_rate=round(hit, 4), observed_rate=round(last.rate, 4),
                  window_end_ms=last.window_end_ns // 1_000_000, predictor=pc.predictor.value)
    if rate_f.detail:
        inputs["predictor_detail"] = rate_f.detail
    backlog = _backlog(load, cfg, osl)
    if role is WorkerRole.DECODE:
        backlog = (0.0, backlog[1])
    elif role is WorkerRole.PREFILL:
        backlog = (backlog[0], 0.0)
    if any(backlog):
        inputs.update(backlog_prefill_tok_s=round(backlog[0], 1), backlog_decode_tok_s=round(backlog[1], 1))
    safety = _safety(hist, cfg, role)
    if safety > 0:
        rate = rate_f.value * (1 + room + safety)
        inputs.update(safety_stock=round(safety, 4), predicted_rate=round(rate, 4))
    need_f, rel_f, parts = _need(rate, isl, osl, hit, n_short, isl_cv, osl_cv, pc, cfg, prof, ps, role, inputs,
                                 backlog)
    standing = cfg.standing_headroom if pc.standing_headroom is None else pc.standing_headroom
    if standing > room and need_f * pc.gpus_per_replica + others_gpus >= cfg.standing_headroom_from * cfg.gpu_budget:
        # near the budget: a standing headroom (a ramp caught late cannot be caught up with)
        room = standing
        rate = rate_f.value * (1 + room + safety)
        inputs.update(headroom=round(room, 4), predicted_rate=round(rate, 4), standing_headroom=1)
        need_f, rel_f, parts = _need(rate, isl, osl, hit, n_short, isl_cv, osl_cv, pc, cfg, prof, ps, role, inputs,
                                     backlog)
    # the band is the sampling noise only: a trend is not taken from a band its own
    # extrapolation widens but from rising windows (_rising)
    m_f = min(cfg.noise_z * rel_f, cfg.max_noise_margin)
    if rate_f.spread > 0:
        inputs["forecast_spread"] = round(rate_f.spread, 4)
    p_need, d_need = float(inputs.get("prefill_needed", 0.0)), float(inputs.get("decode_needed", 0.0))
    inputs["binding_slo"] = ("ttft" if role is WorkerRole.PREFILL else "itl" if role is WorkerRole.DECODE
                             else "ttft" if p_need >= d_need else "itl")

    # long horizon: arrival-weighted averages over the last confirm_windows windows
    tail = hist[-cfg.confirm_windows:]
    if falling and len(hist) - fall_start >= 2:
        tail = hist[max(fall_start, len(hist) - cfg.confirm_windows):]  # the fall's windows only
    n_long = sum(o.arrivals for o in tail)
    dur = sum(o.duration_s for o in tail)
    need_l, m_l = need_f, m_f
    if n_long > 0 and dur > 0:
        isl_l, isl_cv_l = _pooled(tail, lambda o: (o.isl, o.isl_sd))
        osl_l, osl_cv_l = _pooled(tail, lambda o: (o.osl, o.osl_sd))
        need_l, rel_l, _ = _need(n_long / dur, isl_l or isl, osl_l or osl, hit, n_long, isl_cv_l, osl_cv_l,
                                 pc, cfg, prof, ps, role, None, backlog)
        m_l = min(cfg.noise_z * rel_l, cfg.max_noise_margin)
    low = max(need_f * (1 - m_f), need_l * (1 - m_l))
    high = max(need_f * (1 + m_f), need_l * (1 + m_l))
    inputs.update(noise_margin=round(m_f, 4), long_needed=round(need_l, 4), long_margin=round(m_l, 4),
                  long_windows=len(tail))
    text = (" + ".join(parts) + f" -> needed {need_f:.2f} replicas ({pc.predictor.value}, +-{m_f:.0%} noise over "
            f"{n_short:.0f} arrivals; {len(tail)}-window average {need_l:.2f} +-{m_l:.0%}) "
            f"-> low {low:.2f}, high {high:.2f}")
    if overload:
        # measured, not forecast: no noise band; the larger of the two sizings stands
        # measured arrivals (the larger of the last two windows), not the forecast: the loop
        # acts on what came
        seen = max(o.rate for o in hist[-2:])
        need_o, text_o = _overload_need(seen, isl, osl, hit, load, pc, cfg, prof, ps, role, inputs)
        text += f"; overload sizing: {text_o} -> {need_o:.2f}"
        need_f, low, high = max(need_f, need_o), max(low, need_o), max(high, need_o)
    return _Sizing(need_f, low, high, text), ps




def needed_replicas(pc: PoolConfig, cfg: PlannerConfig, rate: float, isl: float, osl: float, hit: float = 0.0, *,
                    isl_cv: float = 0.0, ttft_correction: float = 1.0, itl_correction: float = 1.0) -> float:
    """Replicas of ``pc`` a known load needs (the sizing of step 4 without noise or forecast):
    backtests and benchmarks judge a plan against the load that really came."""
    if pc.performance is None:
        raise PlannerConfigError(f"pool {pc.name}: performance profile not resolved")
    ps = PoolState(pool=pc.name, ttft_correction=ttft_correction, itl_correction=itl_correction)
    need, _, _ = _need(rate, isl, osl, min(hit, MAX_HIT_RATE), 0.0, isl_cv, 0.0, pc, cfg, pc.performance, ps,
                       WorkerRole(pc.role), None)
    return need
