"""Is the router's view exact? A pure assessment from positions, high watermarks and staleness.

* ``LOADING``: the view has not yet caught up with the log end it saw at start-up.
* ``EXACT``: caught up (lag within the thresholds) and no worker's entries are stale.
* ``DEGRADED``: lag above a threshold, or some workers' entries are stale (a sequence gap or a
  new incarnation not yet resynced). The router still routes, but says so in ``/health`` and in
  every decision it records.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class HealthThresholds:
    #: Records behind the log end before the view counts as degraded.
    max_lag_events: int = 1000
    #: Age of the newest applied record on a lagging partition before it counts as degraded.
    max_lag_ms: float = 2000.0


@dataclass(frozen=True)
class RouterHealth:
    state: str
    lag_events: int
    lag_ms: float
    stale_workers: tuple[str, ...] = ()
    reasons: tuple[str, ...] = field(default_factory=tuple)

    def as_dict(self) -> dict:
        return {"state": self.state, "lag_events": self.lag_events, "lag_ms": round(self.lag_ms, 1),
                "stale_workers": list(self.stale_workers), "reasons": list(self.reasons)}


def assess(
    positions: dict[tuple[str, int], int],
    highwaters: dict[tuple[str, int], int],
    last_ts_ms: dict[tuple[str, int], int],
    stale_workers: list[str],
    now_ms: float,
    caught_up_once: bool,
    thresholds: HealthThresholds = HealthThresholds(),
    stopped: str | None = None,
) -> RouterHealth:
    """``stopped``: why the fold is not following the log (its processor's watch: the fold
    stopped while the log moved, or another member took its partitions); it degrades the view
    whatever the lag says, since the lag is then measured against what it no longer reads."""
    lag = 0
    oldest_ts: float | None = None
    for tp, hw in highwaters.items():
        behind = max(hw - positions.get(tp, 0), 0)
        if behind:
            lag += behind
            ts = last_ts_ms.get(tp)
            oldest_ts = ts if oldest_ts is None or (ts is not None and ts < oldest_ts) else oldest_ts
    lag_ms = 0.0 if lag == 0 else (now_ms - oldest_ts if oldest_ts else float("inf"))
    reasons = []
    if not caught_up_once:
        return RouterHealth("LOADING", lag, lag_ms, tuple(stale_workers), ("replaying the log tail",))
    if lag > thresholds.max_lag_events:
        reasons.append(f"lag {lag} events > {thresholds.max_lag_events}")
    if lag and lag_ms > thresholds.max_lag_ms:
        reasons.append(f"lag {lag_ms:.0f} ms > {thresholds.max_lag_ms:.0f} ms")
    if stale_workers:
        reasons.append(f"stale workers: {', '.join(stale_workers)}")
    if stopped:
        reasons.append(stopped)
    return RouterHealth("DEGRADED" if reasons else "EXACT", lag, lag_ms, tuple(stale_workers), tuple(reasons))
