"""Load predictors: the next window's value from the windows observed so far. Pure functions.

Each predictor is a function of the observation history only (no hidden state): the planner
keeps a bounded history per pool in its state, so any past forecast can be recomputed from the
recorded inputs. Forecasts are clamped at 0 (a rate or a length is never negative).

* ``constant``: the last observation (Dynamo's "constant"). Follows a step in one window; passes
  all noise through (hysteresis in the core absorbs it).
* ``moving_average``: mean of the last ``window`` observations. Follows a step in ``window``
  windows, noise shrinks by ``sqrt(window)``.
* ``holt_winters``: statsmodels ``ExponentialSmoothing`` with an additive damped trend (and an
  additive season when ``seasonal_periods`` is set), fitted on the last ``history`` points; with
  a ``horizon`` of h windows it answers the largest of the next h forecasts (a rising load must
  still be carried when replicas ordered now are ready).
  Needs ``max(4, 2*seasonal_periods)`` points; before that (or if the fit fails) it answers the
  moving average and says so in ``detail``.
* ``kalman``: a local linear trend Kalman filter (level and slope, each a random walk, plus
  measurement noise). The noise variance ``r`` is estimated from the history (variance of
  successive differences / 2); process variances are ``0.1 r`` (level) and ``0.05 r`` (slope).
  With a ``horizon`` of h windows it answers the largest of ``level + i*slope``, i = 1..h. With
  ``trend_z`` > 0 only the part of the slope beyond ``trend_z`` standard deviations (the
  filter's own slope variance) is extrapolated (soft threshold): over a long horizon, noise read
  as a trend would be multiplied by the horizon and make a constant load look like a ramp.

:func:`settle` moves a linear forecast (one that reports its ``weights``) toward the
arrival-weighted mean of the latest windows by a number of sd of the Poisson noise of their
difference: what the sizing uses while no trend is confirmed.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum


class PredictorKind(str, Enum):
    CONSTANT = "constant"
    MOVING_AVERAGE = "moving_average"
    HOLT_WINTERS = "holt_winters"
    KALMAN = "kalman"


@dataclass(frozen=True, slots=True)
class Forecast:
    value: float
    #: What the predictor actually did ("fallback=moving_average (3 points)", gain, ...).
    detail: str = ""
    #: How many observations the forecast effectively averages (its noise is that of one
    #: observation divided by sqrt(samples)): 1 for constant and Holt-Winters, the window for a
    #: moving average, (2 - K) / K for a Kalman filter of steady gain K.
    samples: float = 1.0
    #: Standard deviation of the forecast *as the model sees it* beyond the sampling noise of
    #: the observations (a trend extrapolated over a long horizon is uncertain by the slope's
    #: sd times the horizon); 0 when the model does not say.
    spread: float = 0.0
    #: The forecast as a linear combination of the history it saw (oldest first, one weight a
    #: point; the soft trend threshold left out), so that its Poisson noise can be computed
    #: (:func:`settle`); empty when the model is not linear (Holt-Winters).
    weights: tuple[float, ...] = ()


def constant(history: Sequence[float]) -> Forecast:
    if not history:
        return Forecast(0.0)
    return Forecast(max(history[-1], 0.0), weights=(0.0,) * (len(history) - 1) + (1.0,))


def moving_average(history: Sequence[float], window: int) -> Forecast:
    if not history:
        return Forecast(0.0)
    tail = history[-window:]
    w = (0.0,) * (len(history) - len(tail)) + (1.0 / len(tail),) * len(tail)
    return Forecast(max(sum(tail) / len(tail), 0.0), f"mean of {len(tail)}", float(len(tail)), weights=w)


def kalman(history: Sequence[float], process_ratio: float = 0.1, horizon: int = 1,
           trend_ratio: float = 0.05, trend_z: float = 0.0) -> Forecast:
    """Local linear trend Kalman filter: state (level, slope), ``level += slope`` each window.
    Measurement variance ``r`` from the history (variance of successive differences / 2);
    process variances ``process_ratio * r`` (level) and ``trend_ratio * r`` (slope). Answers the
    largest forecast ``level + h*slope`` for h = 1..horizon (a level-only filter for horizon 1
    would lag a ramp by its whole reaction time). ``trend_z``: extrapolate only the part of the
    slope beyond that many of its standard deviations."""
    if not history:
        return Forecast(0.0)
    if len(history) < 3:
        return moving_average(history, len(history))
    diffs = [b - a for a, b in zip(history, history[1:])]
    mean_d = sum(diffs) / len(diffs)
    r = max(sum((d - mean_d) ** 2 for d in diffs) / len(diffs) / 2.0, 1e-12)
    ql, qs = process_ratio * r, trend_ratio * r
    n = len(history)
    lvl, slope = history[0], 0.0
    # the state as weights on the history: given r the gains do not depend on the data, so the
    # filter is linear in it (what settle() needs for the forecast's Poisson noise)
    wl, ws = [1.0] + [0.0] * (n - 1), [0.0] * n
    p00, p01, p11 = r, 0.0, r  # covariance
    k0 = 0.0
    for j, z in enumerate(history[1:], 1):
        # predict: x = F x, P = F P F' + Q  with F = [[1, 1], [0, 1]]
        lvl += slope
        wl = [a + b for a, b in zip(wl, ws)]
        p00, p01, p11 = p00 + 2 * p01 + p11 + ql, p01 + p11, p11 + qs
        # update with z = level + noise
        s = p00 + r
        k0, k1 = p00 / s, p01 / s
        e = z - lvl
        lvl += k0 * e
        slope += k1 * e
        we = [-a for a in wl]
        we[j] += 1.0
        wl = [a + k0 * b for a, b in zip(wl, we)]
        ws = [a + k1 * b for a, b in zip(ws, we)]
        p00, p01, p11 = (1 - k0) * p00, (1 - k0) * p01, p11 - k1 * p01
    h = max(horizon, 1)
    slope_sd = math.sqrt(max(p11, 0.0))
    # soft threshold: the part of the slope beyond trend_z sd (continuous in the data, so a
    # slope growing out of the noise raises the forecast gradually, not in one jump)
    trend = math.copysign(max(abs(slope) - trend_z * slope_sd, 0.0), slope)
    i_best = max(range(1, h + 1), key=lambda i: lvl + i * trend)
    value = lvl + i_best * trend
    spread = math.sqrt(max(p00 + 2 * i_best * p01 + i_best * i_best * p11, 0.0)) if trend else 0.0
    samples = (2 - k0) / k0 if k0 > 0 else float(len(history))
    note = "" if trend == slope else f" (sd {slope_sd:.3g}: {trend:+.3g} extrapolated)"
    weights = tuple(a + i_best * b for a, b in zip(wl, ws)) if trend else tuple(wl)
    return Forecast(max(value, 0.0), f"level {lvl:.3g}, slope {slope:+.3g}/window{note}, gain {k0:.3f}, "
                    f"max of {h} ahead", samples, spread, weights)


def holt_winters(history: Sequence[float], window: int, seasonal_periods: int | None = None,
                 horizon: int = 1) -> Forecast:
    need = max(4, 2 * seasonal_periods) if seasonal_periods else 4
    if len(history) < need:
        f = moving_average(history, window)
        return Forecast(f.value, f"fallback=moving_average ({len(history)} < {need} points)", f.samples,
                        weights=f.weights)
    import numpy as np
    from statsmodels.tsa.holtwinters import ExponentialSmoothing

    y = np.asarray(history, dtype=float)
    if float(np.ptp(y)) < 1e-12:
        return Forecast(max(float(y[-1]), 0.0), "flat history")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = ExponentialSmoothing(
                y, trend="add", damped_trend=True,
                seasonal="add" if seasonal_periods else None, seasonal_periods=seasonal_periods,
                initialization_method="estimated")
            fit = model.fit(optimized=True, use_brute=False)
            # the largest of the next `horizon` steps: capacity ordered now must still carry the
            # load when it is ready
            value = float(max(fit.forecast(max(horizon, 1))))
    except Exception as e:  # statsmodels raises a zoo of numerical errors on odd series
        f = moving_average(history, window)
        return Forecast(f.value, f"fallback=moving_average (fit failed: {type(e).__name__})", f.samples)
    if not math.isfinite(value):
        f = moving_average(history, window)
        return Forecast(f.value, "fallback=moving_average (non-finite forecast)", f.samples)
    return Forecast(max(value, 0.0), f"holt-winters on {len(y)} points, max of {max(horizon, 1)} steps ahead")


def forecast(kind: PredictorKind | str, history: Sequence[float], *, window: int = 6,
             history_limit: int = 64, seasonal_periods: int | None = None,
             process_ratio: float = 0.1, horizon: int = 1, trend_z: float = 0.0) -> Forecast:
    """Dispatch on ``kind`` over the last ``history_limit`` observations. ``horizon``: how many
    windows ahead the answer must hold (trend predictors answer the largest forecast up to it;
    level predictors have nothing to extrapolate); ``trend_z``: see :func:`kalman`."""
    h = list(history[-history_limit:])
    kind = PredictorKind(kind)
    if kind is PredictorKind.CONSTANT:
        return constant(h)
    if kind is PredictorKind.MOVING_AVERAGE:
        return moving_average(h, window)
    if kind is PredictorKind.KALMAN:
        return kalman(h, process_ratio, horizon, trend_z=trend_z)
    return holt_winters(h, window, seasonal_periods, horizon)


@dataclass(frozen=True, slots=True)
class Settled:
    """A rate forecast settled against the arrival-weighted mean of the latest windows."""

    value: float
    #: Arrivals the settled value effectively averages (its relative Poisson sd is
    #: ``1 / sqrt(arrivals)``).
    arrivals: float
    #: The windows' mean rate, and the forecast's distance from it in sd of Poisson counting.
    mean: float
    z: float


def settle(f: Forecast, arrivals: Sequence[int], durations: Sequence[float], windows: int,
           z: float) -> Settled | None:
    """The forecast ``f`` moved toward the arrival-weighted mean rate of the last ``windows``
    windows by ``z`` sd of the Poisson noise of their difference (a soft threshold): it keeps
    only what it differs from that mean beyond counting noise.

    Why: a trend filter on 5 s windows of a few dozen arrivals follows much of their noise
    (at 9 req/s constant the Kalman forecast swung 7.3-11.9 req/s), and the sizing turned that
    into a need swinging 2.3-4.2 replicas. A rate that moved shows as a difference well beyond
    its noise and passes nearly whole; a constant load's forecast sits within it and settles on
    the mean. The noise is computed, not guessed: both estimates are linear in the window
    rates (``f.weights``), each window's rate has Poisson variance ``mean / duration``.
    ``arrivals`` and ``durations`` run parallel to the history ``f`` was computed on (its
    newest last). None when ``f`` has no weights or there is nothing to average."""
    k = min(windows, len(arrivals))
    dur = sum(durations[-k:]) if k else 0.0
    if not f.weights or k == 0 or dur <= 0:
        return None
    n_mean = float(sum(arrivals[-k:]))
    mean = n_mean / dur
    w = f.weights[-len(arrivals):]
    w = (0.0,) * (len(arrivals) - len(w)) + tuple(w)
    lo = len(arrivals) - k
    var_d = var_f = 0.0
    for i, (wi, d) in enumerate(zip(w, durations)):
        if d <= 0:
            continue
        u = d / dur if i >= lo else 0.0
        v = mean / d
        var_d += (wi - u) ** 2 * v
        var_f += wi * wi * v
    sd = math.sqrt(var_d)
    diff = f.value - mean
    kept = math.copysign(max(abs(diff) - z * sd, 0.0), diff)
    # the settled value's noise: the mean's, the forecast's for the part of it kept
    share = abs(kept) / abs(diff) if diff else 0.0
    sd_v = (1 - share) * math.sqrt(mean / dur) + share * math.sqrt(var_f)
    n_eff = mean * mean / (sd_v * sd_v) if sd_v > 0 else n_mean
    return Settled(max(mean + kept, 0.0), n_eff, mean, diff / sd if sd > 0 else 0.0)
