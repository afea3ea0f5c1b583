"""The planner core's state and results: :class:`PlannerState` (with each pool's
:class:`PoolState` and its :class:`Observation` history), operator :class:`Pin` s, the tick's
:class:`PlannerTick` (its :class:`ScaleEffect` s and :class:`PoolReport` s), the per-pool proposal
before the budget (``_Plan``) and the constants the rules share. See ``policy.py``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from control_plane.planner.config import PoolConfig
from control_plane.planner.load_view import PoolLoad, pool_entry
from schemas.events import ScalingDecision
from schemas.types import WorkerRole

#: Weight of the newest error in the forecast error average.
ERROR_ALPHA = 0.2
#: Prefix hit rates above this are not trusted for sizing (a cold cache must not starve a pool).
MAX_HIT_RATE = 0.9
_EPS = 1e-9
#: Forecasts below this rate (req/s) are scored as if they were this (a relative error of a
#: forecast of zero is unbounded).
_RATE_FLOOR = 0.1
#: Standard deviations of Poisson noise an error must exceed before it counts as the forecast's.
_SCORE_Z = 2.0

InputValue = float | int | str


# ----------------------------------------------------------------------------------------------
# State
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Observation:
    """One closed tumbling window of one pool, as the predictors see it."""

    window_end_ns: int
    rate: float
    isl: float | None = None
    osl: float | None = None
    hit_rate: float | None = None
    arrivals: int = 0
    duration_s: float = 0.0
    isl_sd: float | None = None
    osl_sd: float | None = None


@dataclass(frozen=True, slots=True)
class Pin:
    """An operator's manual override of one pool's size (from ``PoolPinned``)."""

    replicas: int
    by: str = ""
    reason: str = ""


@dataclass(frozen=True, slots=True)
class PoolState:
    pool: str
    #: Replicas the planner last asked for (None: not adopted yet; the first tick adopts the
    #: observed count).
    target: int | None = None
    last_up_ns: int | None = None
    last_change_ns: int | None = None
    #: Set by every decision, cleared once it is applied (the target is ready and nothing is
    #: draining) or after startup_timeout_s. While set, no new decision is issued for the pool.
    pending_since_ns: int | None = None
    #: Consecutive ticks with ``down < target``.
    below_ticks: int = 0
    last_window_end_ns: int = 0
    history: tuple[Observation, ...] = ()
    #: The last rate forecast and the window it was made for.
    forecast_rate: float | None = None
    forecast_for_ns: int = 0
    forecast_scored: int = 0
    forecast_error: float | None = None
    ttft_correction: float = 1.0
    itl_correction: float = 1.0
    #: Since when the pool has been settled (nothing pending, no backlog, no recent change);
    #: only windows starting a full window after this teach the corrections.
    settled_since_ns: int | None = None
    #: Horizon forecasts not yet scored: (window end they were made after, window end they are
    #: scored at, forecast rate, arrivals the forecast effectively averaged).
    horizon_forecasts: tuple[tuple[int, int, float, float], ...] = ()
    #: The ``headroom_quantile`` expectile of the horizon forecast's relative under-forecast ``u =
    #: actual / forecast - 1``, tracked online; the headroom is this, clamped.
    horizon_error: float = 0.0
    horizon_scored: int = 0
    #: Overload mode (the closed loop on what users feel): since when (None: not in it), and
    #: closed windows in a row without a breach since the last one.
    overload_since_ns: int | None = None
    clean_windows: int = 0
    #: Measured throughput of one ready replica while saturated (prefill: new prompt tokens/s;
    #: decode: output tokens/s), an EWMA over saturated windows; None until one was seen.
    service_tok_s: float | None = None
    #: Since when the pool has been saturated (work queued on every ready worker).
    saturated_since_ns: int | None = None
    #: Observed mean latency / SLO in the last window with enough completions (its margin).
    latency_ratio: float | None = None
    #: The replicas its last sizing needed (the fleet's total decides the standing headroom).
    last_needed: float = 0.0


@dataclass(frozen=True, slots=True)
class PlannerState:
    pools: tuple[PoolState, ...] = ()
    #: Leader-lease fencing token stamped on every decision (set by the runner).
    fencing_token: int = 0
    #: Operator pins by pool, sorted by pool (folded from ``PoolPinned`` admin events).
    pins: tuple[tuple[str, Pin], ...] = ()
    #: Decisions emitted so far (part of each decision id, so ids are deterministic).
    decisions: int = 0

    def pool(self, name: str) -> PoolState:
        return pool_entry(self.pools, name, PoolState)

    def with_token(self, token: int) -> PlannerState:
        return replace(self, fencing_token=token)

    def with_pins(self, pins: Mapping[str, int | Pin]) -> PlannerState:
        return replace(self, pins=tuple(sorted(
            (k, v if isinstance(v, Pin) else Pin(int(v))) for k, v in pins.items())))

    def with_targets(self, targets: Mapping[str, int]) -> PlannerState:
        """Adopt replica counts observed by a scaler (a new leader starts from reality)."""
        pools = {p.pool: p for p in self.pools}
        for name, n in targets.items():
            pools[name] = replace(pools.get(name, PoolState(pool=name)), target=n)
        return replace(self, pools=tuple(pools[k] for k in sorted(pools)))


# ----------------------------------------------------------------------------------------------
# PlannerTick
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ScaleEffect:
    """Change ``pool`` from ``from_replicas`` to ``to_replicas`` (draining ``drain`` first)."""

    pool: str
    role: WorkerRole
    from_replicas: int
    to_replicas: int
    reason: str
    drain: tuple[str, ...]
    event: ScalingDecision


@dataclass(frozen=True, slots=True)
class PoolReport:
    """What the core concluded for one pool this tick, changed or not (backtests plot these)."""

    pool: str
    action: str  # "up" | "down" | "hold"
    target: int
    reason: str
    inputs: tuple[tuple[str, InputValue], ...]
    needed: float | None = None
    forecast_rate: float | None = None
    forecast_for_ns: int = 0
    observed_rate: float | None = None
    observed_end_ns: int = 0

    def input(self, key: str, default: InputValue | None = None) -> InputValue | None:
        for k, v in self.inputs:
            if k == key:
                return v
        return default


@dataclass(frozen=True, slots=True)
class PlannerTick:
    """What one planner tick decided: the scaling effects (each with its ScalingDecision) and a
    report per pool of what it was decided on."""

    now_ns: int
    effects: tuple[ScaleEffect, ...] = ()
    reports: tuple[PoolReport, ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.effects)

    @property
    def events(self) -> tuple[ScalingDecision, ...]:
        return tuple(e.event for e in self.effects)

    def report(self, pool: str) -> PoolReport | None:
        for r in self.reports:
            if r.pool == pool:
                return r
        return None


@dataclass(frozen=True, slots=True)
class _Plan:
    """A pool's proposal before the budget is applied."""

    config: PoolConfig
    state: PoolState
    current: int
    proposed: int
    action: str
    reason: str
    inputs: dict[str, InputValue]
    needed: float | None
    pinned: bool
    load: PoolLoad
    #: Its last decision is still being applied: the budget must not move it either.
    frozen: bool = False
    #: The SLO term its sizing was bound by ("ttft", "itl"; "" before any window).
    binding: str = ""
    #: How far a budget squeeze may take it down when it is not growing: the high end of its
    #: noise band, or nothing at all while its last decision is pending or it changed within
    #: ``cooldown_down_s`` (a scale-down forced by the budget is still a scale-down: slow).
    yield_to: int | None = None
    #: In overload mode: it has the budget before every other growing pool but pins.
    overload: bool = False
    #: How far it may yield to a pool in overload when its own SLO has a wide margin (below its
    #: need; None: no such margin).
    margin_yield_to: int | None = None
