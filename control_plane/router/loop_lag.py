"""The router's own saturation: its event loop's lag, smoothed, and the admission rule on it. Pure.

Why: every request, every token streamed, the view's fold and the event producer's callbacks
run on the router's one event loop. When the box runs out of CPU (or the router's own share
of it fills), that loop falls behind: a callback due now runs later, a first token already
received reaches its client later, and the admission queue, which only sees the workers'
load, keeps admitting. Under ``switchyard chaos``'s overload phase the served TTFT climbed
from ~100 ms to ~10 s with nothing shed (issue 39 step 4, issue 38 item 4).

Measure: a periodic callback (:class:`~control_plane.router.loop_lag_probe.LoopLagProbe`)
records, at each run, how late it ran against when it was due (one *sample*). The samples are
smoothed by an exponentially weighted mean whose weight follows the time between samples
(time constant ``tau_s``), so a loop blocked for a long stretch (one late sample after a long
gap) weighs as much as the many samples it would have given had it kept running.

Rule (:func:`overloaded`): while the smoothed lag exceeds ``RouterConfig.max_loop_lag_ms``
(0: off), a new request is refused at once with 503 ``router_overloaded``, Retry-After and the
lag in ``RequestRejected.reason``: the router counts its own lag as load. The clock is an
input: the same samples always give the same state and the same decisions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Default time constant of the smoothing: long enough that one scheduling hiccup (a full GC,
#: a large body parsed inline) does not shed, short enough that a saturated loop is seen within
#: a few hundred ms (at 50 ms between samples, 2 samples of a sustained lag reach ~40% of it,
#: 10 samples ~92%).
DEFAULT_TAU_S = 0.5


@dataclass(frozen=True, slots=True)
class LoopLag:
    """The smoothed lag after some samples (seconds; ``at``: the last sample's run time)."""

    smoothed_s: float = 0.0
    #: The last sample's own lag.
    last_s: float = 0.0
    #: Monotonic time the last sample ran at; None: no sample yet.
    at: float | None = None
    samples: int = 0


def observe(state: LoopLag, due: float, ran: float, tau_s: float = DEFAULT_TAU_S) -> LoopLag:
    """``state`` after one sample: a callback due at ``due`` ran at ``ran`` (monotonic seconds).

    Its lag is ``max(0, ran - due)``; the mean moves toward it by ``1 - exp(-dt / tau_s)``, with
    ``dt`` the time since the previous sample (the first sample is taken as it is)."""
    if tau_s <= 0:
        raise ValueError(f"tau_s={tau_s}: the smoothing's time constant must be > 0")
    lag = max(0.0, ran - due)
    if state.at is None:
        return LoopLag(lag, lag, ran, 1)
    weight = 1.0 - math.exp(-max(0.0, ran - state.at) / tau_s)
    return LoopLag(state.smoothed_s + weight * (lag - state.smoothed_s), lag, ran, state.samples + 1)


def overloaded(lag: LoopLag, limit_ms: float) -> tuple[str, int] | None:
    """(reason, Retry-After seconds) when the smoothed lag exceeds ``limit_ms``; None when it
    does not or the limit is off (0). Retry-After: the smoothed lag in whole seconds, at least 1
    (the backlog behind a lagging loop drains at about that pace)."""
    if limit_ms <= 0 or lag.smoothed_s * 1000 <= limit_ms:
        return None
    ms = lag.smoothed_s * 1000
    return (f"router overloaded: its event loop runs {ms:.0f} ms late (smoothed; last sample "
            f"{lag.last_s * 1000:.0f} ms), over the limit of {limit_ms:g} ms", max(1, math.ceil(lag.smoothed_s)))
