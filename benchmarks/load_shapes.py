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

from collections.abc import Sequence

import numpy as np

from data_plane.engines.trace import TraceRecord
# The shapes themselves are arrival processes of the workload generator (one definition).
from workloads.arrivals import SHAPES, Shape, constant, diurnal, flash_crowd, ramp, step

__all__ = ["SHAPES", "Shape", "arrivals", "assign", "constant", "diurnal", "flash_crowd", "ramp", "scaled", "step"]


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
