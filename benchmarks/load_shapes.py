"""Seeded load shapes for the planner benchmark: arrival times from a rate curve, request
contents from the trace.

A shape is a rate curve ``rate(t)`` (requests/s over virtual seconds ``[0, duration_s)``).
:func:`arrivals` draws a non-homogeneous Poisson process from it by thinning (candidates at the
curve's peak rate, each kept with probability ``rate(t) / peak``) with a ``numpy`` generator
seeded by ``seed``: the same shape and seed give the same arrivals, on any machine.
:func:`requests` gives the arrivals the prompts and output lengths of consecutive trace
records, starting at an offset drawn from the same seed (consecutive, so the trace's
conversation structure, and with it its prefix reuse, is kept).

The shapes (``SHAPES``), all sized for the benchmark's 12-GPU budget (about 20 req/s of the
conversation trace saturate a 6P+6D split):

* ``constant``: 9 req/s for 10 minutes: counts direction reversals (oscillation, Dynamo #9294).
* ``step``: 5 req/s, then 15 from t=120 s.
* ``ramp``: 5 req/s, a linear ramp to 17 over 20 s from t=120 s (faster than the 30 s worker
  start-up), held, then back down over 20 s.
* ``flash_crowd``: 6 req/s; at t=150 s 18 req/s at once, decaying back with a 60 s time constant.
* ``diurnal``: a sine between 4 and 16 req/s with a 300 s period (two "days").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from data_plane.engines.trace import TraceRecord


@dataclass(frozen=True)
class Shape:
    name: str
    duration_s: float
    rate: Callable[[float], float]
    #: One line saying what it is (printed above its table).
    description: str
    #: When the load jumps in a way its history before cannot announce (a step, a fast ramp, a
    #: flash crowd), for the oracle's causal bound; None: nothing unannounced.
    surprise_s: float | None = None

    def peak(self, step_s: float = 0.5) -> float:
        return max(self.rate(i * step_s) for i in range(int(self.duration_s / step_s) + 1))

    def mean(self, step_s: float = 0.5) -> float:
        n = int(self.duration_s / step_s)
        return sum(self.rate((i + 0.5) * step_s) for i in range(n)) / n


def _ramp(t: float, t0: float, t1: float, a: float, b: float) -> float:
    if t <= t0:
        return a
    if t >= t1:
        return b
    return a + (b - a) * (t - t0) / (t1 - t0)


def constant(rate: float = 9.0, duration_s: float = 600.0) -> Shape:
    return Shape("constant", duration_s, lambda t: rate, f"{rate:g} req/s for {duration_s:g} s")


def step(lo: float = 5.0, hi: float = 15.0, at_s: float = 120.0, duration_s: float = 420.0) -> Shape:
    return Shape("step", duration_s, lambda t: lo if t < at_s else hi,
                 f"{lo:g} req/s, {hi:g} from t={at_s:g} s, {duration_s:g} s", at_s)


def ramp(lo: float = 5.0, hi: float = 17.0, at_s: float = 120.0, ramp_s: float = 20.0, hold_s: float = 180.0,
         duration_s: float = 480.0) -> Shape:
    down = at_s + ramp_s + hold_s

    def rate(t: float) -> float:
        return _ramp(t, at_s, at_s + ramp_s, lo, hi) if t < down else _ramp(t, down, down + ramp_s, hi, lo)

    return Shape("ramp", duration_s, rate, f"{lo:g} -> {hi:g} req/s in {ramp_s:g} s at t={at_s:g} s, held "
                 f"{hold_s:g} s, back in {ramp_s:g} s; {duration_s:g} s", at_s)


def flash_crowd(base: float = 6.0, peak: float = 18.0, at_s: float = 150.0, tau_s: float = 60.0,
                duration_s: float = 480.0) -> Shape:
    def rate(t: float) -> float:
        return base if t < at_s else base + (peak - base) * math.exp(-(t - at_s) / tau_s)

    return Shape("flash_crowd", duration_s, rate, f"{base:g} req/s, {peak:g} at once at t={at_s:g} s decaying "
                 f"back (tau {tau_s:g} s); {duration_s:g} s", at_s)


def diurnal(lo: float = 4.0, hi: float = 16.0, period_s: float = 300.0, duration_s: float = 600.0) -> Shape:
    def rate(t: float) -> float:
        return lo + (hi - lo) * (1 - math.cos(2 * math.pi * t / period_s)) / 2

    return Shape("diurnal", duration_s, rate, f"sine {lo:g}..{hi:g} req/s, period {period_s:g} s; {duration_s:g} s")


SHAPES: dict[str, Callable[[], Shape]] = {
    "step": step, "ramp": ramp, "flash_crowd": flash_crowd, "diurnal": diurnal, "constant": constant,
}


def scaled(shape: Shape, factor: float) -> Shape:
    """The same curve over ``factor`` of its time (for a short run while developing): the
    events happen at the same fraction of the run; ramps get steeper."""
    if factor == 1.0:
        return shape
    return Shape(shape.name, shape.duration_s * factor, lambda t: shape.rate(t / factor),
                 shape.description + f" (time x{factor:g})",
                 None if shape.surprise_s is None else shape.surprise_s * factor)


def arrivals(shape: Shape, seed: int) -> list[float]:
    """Arrival times (ms, ascending) of a Poisson process of rate ``shape.rate``, by thinning."""
    rng = np.random.default_rng(seed)
    peak = shape.peak()
    out: list[float] = []
    t = 0.0
    while True:
        t += float(rng.exponential(1.0 / peak))
        if t >= shape.duration_s:
            return out
        if float(rng.random()) * peak <= shape.rate(t):
            out.append(t * 1000.0)


def assign(records: Sequence[TraceRecord], times_ms: Sequence[float], seed: int) -> list[tuple[TraceRecord, float]]:
    """Consecutive trace records (from an offset drawn from ``seed``, wrapping) for the arrival
    times: each record is used at most once when there are enough."""
    if not records:
        raise ValueError("no trace records")
    start = int(np.random.default_rng(seed + 1).integers(0, len(records)))
    return [(records[(start + i) % len(records)], t) for i, t in enumerate(times_ms)]
