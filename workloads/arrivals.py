"""Arrival processes: when requests (or sessions) start.

A rate curve is a :class:`Shape` (requests/s over ``[0, duration_s)``). The planner
benchmark's shapes live here (``step``, ``ramp``, ``flash_crowd``, ``diurnal``,
``constant``, with their published defaults, which ``benchmarks/load_shapes.py`` re-exports),
so the same curves apply to every workload family. :func:`arrival_times` draws arrivals for the
generator from a named process at a given mean rate:

* ``poisson``: a constant rate, exponential gaps (cv 1).
* ``bursty``: a renewal process with Gamma gaps of coefficient of variation ``cv`` (BurstGPT
  models its traces' inter-arrival times with a Gamma distribution; cv > 1 is burstier than
  Poisson).
* ``diurnal``, ``step``, ``ramp``, ``flash``: the planner shapes, stretched to the run's
  duration and scaled so that their mean rate is the requested one; a non-homogeneous Poisson
  process drawn by thinning.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from workloads.rng import Draws


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


#: The planner benchmark's shapes, by name, with its defaults.
SHAPES: dict[str, Callable[[], Shape]] = {
    "step": step, "ramp": ramp, "flash_crowd": flash_crowd, "diurnal": diurnal, "constant": constant,
}

#: The generator's arrival processes (``--arrival``).
ARRIVALS = ("poisson", "bursty", "diurnal", "step", "ramp", "flash")
_CURVES = {"diurnal": "diurnal", "step": "step", "ramp": "ramp", "flash": "flash_crowd"}


def fitted(name: str, rate: float, duration_s: float) -> Shape:
    """The planner shape ``name`` stretched over ``duration_s`` and scaled to mean ``rate``."""
    if name == "poisson":
        return constant(rate, duration_s)
    base = SHAPES[_CURVES.get(name, name)]()
    k = base.duration_s / duration_s
    f = rate / base.mean()
    return Shape(name, duration_s, lambda t: f * base.rate(t * k),
                 f"{base.name} curve over {duration_s:g} s, mean {rate:g}/s",
                 None if base.surprise_s is None else base.surprise_s / k)


def arrival_times(process: str, rate: float, duration_s: float, draws: Draws, *, cv: float = 2.0,
                  start_s: float = 0.0) -> list[float]:
    """Arrival times (s, ascending) in ``[start_s, duration_s)`` of ``process`` at mean ``rate``
    per second. Before 0 (a warm-up, ``start_s < 0``) the curve's rate at 0 applies."""
    if process not in ARRIVALS:
        raise ValueError(f"unknown arrival process {process!r}; one of {', '.join(ARRIVALS)}")
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    out: list[float] = []
    t = start_s
    if process == "bursty":
        if cv <= 0:
            raise ValueError(f"cv must be > 0, got {cv}")
        shape = 1.0 / (cv * cv)  # Gamma gaps: cv = 1 / sqrt(shape); mean gap = shape * scale
        scale = 1.0 / (rate * shape)
        while True:
            t += draws.gamma(shape, scale)
            if t >= duration_s:
                return out
            out.append(t)
    curve = fitted(process, rate, duration_s)
    peak = max(curve.peak(), curve.rate(0.0))
    while True:
        t += draws.exponential(1.0 / peak)
        if t >= duration_s:
            return out
        if draws.uniform() * peak <= curve.rate(max(t, 0.0)):
            out.append(t)
