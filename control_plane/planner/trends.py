"""Trends and headroom (step 3 of ``policy.py``): the CUSUM that confirms a rise from the
windows themselves (``_rising``), and the headroom learned by scoring horizon forecasts
(``_score_horizon``, ``headroom``). Pure."""

from __future__ import annotations

import math
from dataclasses import replace

from control_plane.planner.config import PlannerConfig
from control_plane.planner.load_view import NS
from control_plane.planner.policy_types import _RATE_FLOOR, _SCORE_Z, Observation, PoolState


def _score_horizon(ps: PoolState, history: list[Observation], cfg: PlannerConfig) -> PoolState:
    """Score every horizon forecast whose horizon has closed against the mean rate observed in
    it after the lead time (what the replicas ordered then had to carry): ``u = actual /
    forecast - 1``, less ``_SCORE_Z`` sd of Poisson noise (``sqrt(1/arrivals in
    the span + 1/arrivals the forecast averaged)``: the noise band covers that), clamped to [-1, 1]. The tracked error ``e`` moves toward ``u`` by ``alpha *
    tau * (u - e)`` when the forecast fell short of ``u``'s estimate (``u > e``), by ``alpha *
    (1 - tau) * (u - e)`` otherwise: an asymmetric EWMA, converging to the ``tau`` expectile of
    ``u``. A miss raises it at once, hits lower it slowly, and one outlier cannot inflate a
    variance for long. Each forecast weighs ``alpha / windows in its horizon``: overlapping
    horizons all see the same surprise, which must count about once."""
    if not ps.horizon_forecasts:
        return ps
    lead_ns = int(cfg.lead_time_s * NS)
    keep: list[tuple[int, int, float, float]] = []
    e, n = ps.horizon_error, ps.horizon_scored
    a, tau = cfg.headroom_alpha, cfg.headroom_quantile
    for made, due, f, n_f in ps.horizon_forecasts:
        if due > ps.last_window_end_ns:
            keep.append((made, due, f, n_f))
            continue
        span = [o for o in history if made + lead_ns < o.window_end_ns <= due] or [
            o for o in history if made < o.window_end_ns <= due]
        if not span:
            continue  # the windows are gone (history limit): nothing to score against
        actual = sum(o.rate for o in span) / len(span)
        u = actual / max(f, _RATE_FLOOR) - 1.0
        # what Poisson sampling noise explains (the span's and the forecast's own) is the noise
        # band's business, not the forecast's: only the excess beyond _SCORE_Z sd counts
        noise = _SCORE_Z * math.sqrt(1 / max(sum(o.arrivals for o in span), 1) + 1 / max(n_f, 1))
        u = min(max(math.copysign(max(abs(u) - noise, 0.0), u), -1.0), 1.0)
        # horizons overlap: one surprise is scored by every forecast whose horizon it falls in,
        # so each forecast moves the estimate by 1/windows of the weight
        windows = max(1.0, (due - made) / (cfg.tumbling_s * NS))
        e += a / windows * (tau if u > e else 1 - tau) * (u - e)
        n += 1
    return replace(ps, horizon_forecasts=tuple(keep), horizon_error=e, horizon_scored=n)


def _rising(hist: tuple[Observation, ...], cfg: PlannerConfig) -> bool:
    """A rise the windows themselves confirm (see :func:`_rise`)."""
    return _rise(hist, cfg)[0]


def _rise(hist: tuple[Observation, ...], cfg: PlannerConfig) -> tuple[bool, int]:
    """(confirmed, first window of the run): a one-sided CUSUM of the window rates against a
    lagged reference. Each window's excess over the mean of the ``2 * confirm_windows`` windows
    that ended ``trend_confirm_windows`` windows before it, in sd of Poisson noise (``sqrt(reference
    arrivals)``), less ``trend_confirm_k``, accumulates (floored at 0); the trend is confirmed
    while the sum exceeds ``trend_confirm_z``. The run is the windows since the sum last stood at
    0 (the change point: where the rise began). Recomputed from the history each tick (no state).
    With k = 1 and h = 3, a constant load of 45 arrivals a 5 s window confirms by chance about
    0.27 times in 10 minutes (325 arrivals: 0.2); a ramp of one sd per window is confirmed in a
    median 3 windows, a ramp of 3 sd per window in 2 (h = 4: 0.08 times, 4 and 2 windows;
    seeded Monte Carlo of this function, 200 runs; docs/planner.md)."""
    return _cusum(hist, cfg, 1.0)


def _fall(hist: tuple[Observation, ...], cfg: PlannerConfig) -> tuple[bool, int]:
    """(confirmed, first window of the run) of a fall: :func:`_rise`'s CUSUM mirrored (each
    window's *shortfall* under the lagged reference accumulates), with the same thresholds, so
    a constant load confirms a fall by chance as rarely as a rise. The ramp-down's evidence."""
    return _cusum(hist, cfg, -1.0)


def _cusum(hist: tuple[Observation, ...], cfg: PlannerConfig, sign: float) -> tuple[bool, int]:
    """The one-sided CUSUM of :func:`_rise` (``sign`` 1) and :func:`_fall` (``sign`` -1)."""
    lag, ref_n = cfg.trend_confirm_windows, 2 * cfg.confirm_windows
    s = 0.0
    start = len(hist)
    for i in range(max(0, len(hist) - 4 * (lag + ref_n)), len(hist)):
        ref = hist[max(0, i - lag - ref_n + 1):i - lag + 1]
        if len(ref) < min(3, ref_n):
            continue
        n = sum(o.arrivals for o in ref)
        dur = sum(o.duration_s for o in ref)
        if dur <= 0:
            continue
        o = hist[i]
        expected = n / dur * o.duration_s
        was = s
        s = max(0.0, s + sign * (o.arrivals - expected) / math.sqrt(max(expected, 1.0)) - cfg.trend_confirm_k)
        if s > 0 and was <= 0:
            start = i
        elif s <= 0:
            start = len(hist)
    return s > cfg.trend_confirm_z, start


def rise_fit(hist: tuple[Observation, ...], start: int, cfg: PlannerConfig,
             horizon: int) -> tuple[float, float, float] | None:
    """The largest rate over ``horizon`` windows that a confirmed rise's own windows measure:
    (forecast req/s, slope req/s per window, its sd), or None when they prove no slope.

    The least-squares line through the rates of the run's windows (since the CUSUM's change
    point, at most ``trend_fit_windows`` of the latest, at least 2), extrapolated from its value
    at the last window with only the part of its slope beyond ``trend_fit_z`` sd of Poisson noise
    (``sqrt(arrivals) / duration`` per window). A step has no slope in its run (only a level:
    the line is flat, within noise), so only a ramp is extrapolated; a Kalman filter's slope,
    by contrast, learns a ramp windows late (chat:1's ramp of 10 req/s per window read 2.3 at its
    second window) and runs on past its end."""
    line = _line(hist[max(start, len(hist) - cfg.trend_fit_windows):], cfg)
    if line is None:
        return None
    last, b, sd = line
    trend = b - cfg.trend_fit_z * sd
    if trend <= 0:
        return None
    return max(last, 0.0) + trend * horizon, b, sd


def fall_level(hist: tuple[Observation, ...], start: int, cfg: PlannerConfig) -> tuple[float, float] | None:
    """The rate a confirmed fall's own windows measure now: (req/s, the arrivals a rate as
    noisy rests on), the
    least-squares line through the run's windows (the latest ``trend_fit_windows``, at least 2)
    at its last window, never extrapolated further down (a release is never ahead of the
    evidence), or None without two windows."""
    run = hist[max(start, len(hist) - cfg.trend_fit_windows):]
    line = _line(run, cfg)
    if line is None or line[0] <= 0:
        return None
    # the line's end is noisier than the run's mean: its Poisson variance (weights 1/n +
    # (t_last - tm)(t_i - tm)/sxx) as the arrivals a rate that noisy rests on
    t = [o.window_end_ns / NS / cfg.tumbling_s for o in run]
    tm = sum(t) / len(t)
    sxx = sum((x - tm) ** 2 for x in t)
    var = sum((1 / len(run) + (t[-1] - tm) * (x - tm) / sxx) ** 2 * max(o.arrivals, 1) / max(o.duration_s, 1e-9) ** 2
              for x, o in zip(t, run))
    return line[0], line[0] ** 2 / var if var > 0 else float(sum(o.arrivals for o in run))


def _line(run: tuple[Observation, ...], cfg: PlannerConfig) -> tuple[float, float, float] | None:
    """The least-squares line through ``run``'s window rates: (its value at the last window,
    slope req/s per window, the slope's sd of Poisson noise), or None under 2 windows."""
    if len(run) < 2:
        return None
    t = [o.window_end_ns / NS / cfg.tumbling_s for o in run]
    y = [o.rate for o in run]
    tm, ym = sum(t) / len(t), sum(y) / len(y)
    sxx = sum((x - tm) ** 2 for x in t)
    if sxx <= 0:
        return None
    b = sum((x - tm) * (v - ym) for x, v in zip(t, y)) / sxx
    var = sum((x - tm) ** 2 * max(o.arrivals, 1) / max(o.duration_s, 1e-9) ** 2 for x, o in zip(t, run)) / sxx**2
    return ym + b * (t[-1] - tm), b, math.sqrt(var)


def headroom(ps: PoolState, cfg: PlannerConfig) -> float:
    """The fraction added to the rate forecast: the tracked expectile of the horizon forecast's
    measured relative under-forecast, in [0, max_headroom] (0 until a horizon has been scored:
    until then the noise band alone guards the forecast)."""
    return min(max(ps.horizon_error, 0.0), cfg.max_headroom)
