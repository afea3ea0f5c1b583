"""The planner's decision core: ``decide(now_ns, snapshot, config, state) -> (PlannerTick, state)``.

Zero I/O. The time is an input; the load comes in as an immutable :class:`LoadSnapshot`; all
memory (targets, cooldown clocks, predictor history, forecast errors, latency corrections,
operator pins, the fencing token) lives in the immutable :class:`PlannerState` passed in and
out. The live planner, ``switchyard planner backtest``, the benchmark and the tests all drive
this one function, so a recorded decision can be recomputed from its inputs.

One tick, per pool:

1. **Observe.** Every tumbling window closed since the last tick becomes an observation (request
   rate, mean ISL, mean OSL, prefix hit rate). The forecast made for that window is scored:
   relative error ``|f - a| / max(f, a)``, averaged with weight 0.2 (``forecast_error``).
2. **Correct.** If nothing is pending and the window has at least ``correction_min_samples``
   completions *on warmed-up workers*, the observed/expected latency ratio updates the pool's
   correction (EWMA, clamped), and only from windows that started a full window after the pool
   last *settled* (nothing pending, no change in the last window, queued prefill work within the
   TTFT target per worker, no decode queue): requests served through a transition or a backlog
   say nothing about the hardware. Expected TTFT is the profile's service time plus M/G/k queueing
   (Allen-Cunneen, with the window's ISL variability) at the observed utilisation;
   expected ITL is the profile's at the ready workers' mean running count. Completions on new
   (possibly slow) workers never enter this, so a slow new worker does not inflate the
   correction and cause an extra scale-up (Dynamo #12430). Corrections are frozen while the pool
   is overloaded (utilisation above ``max_utilization``, or decode requests queueing): latency
   there is the backlog's age, and learning it as slowness would over-scale one pool and starve
   the others of budget.
3. **Predict** the rate over ``forecast_horizon_s`` (default ``2 * lead_time_s + tick_s``:
   replicas ordered now are ready after the lead time, the next decision waits for them, and its
   replicas take another lead time; a trend predictor answers the largest forecast within it
   once rising windows confirm the trend (``_rising``: a CUSUM of the windows' excess over a
   lagged reference), otherwise the next window's, extrapolating only the slope beyond
   ``trend_z`` of its sd), then add the **headroom**: every horizon forecast is scored against the mean rate that
   came after the lead time, and an asymmetric EWMA tracks the ``headroom_quantile`` expectile of
   the relative under-forecast beyond Poisson noise (``headroom()``); the pool is sized for
   ``forecast * (1 + headroom)``. ISL, OSL and hit rate come from ``length_predictor``.
4. **Size** (see :mod:`control_plane.planner.profile`)::

       prefill: needed_p = rate * ISL * (1 - hit) / prefill_capacity(ISL*(1-hit), TTFT SLO / ttft_corr, cv, k)
                (k: the smallest pool size whose per-replica capacity, M/G/k, carries the demand)
       decode:  needed_d = rate * OSL / best_decode(ITL SLO / itl_corr, ISL + OSL/2)

   Corrections scale the *latency* models (the targets are divided by them), never the
   throughput: a pool whose TTFT is 1.6x the model's at 30% load is not 1.6x slower at 80%.

   (both at ``slo_quantile`` when set: the capacity that keeps that fraction of requests inside
   the target rather than the mean). A decode pool ``fed_by`` a prefill pool takes its arrivals
   and ISL from that pool's windows: demand measured upstream of a possibly saturated prefill.
       needed   = needed_p + needed_d   (aggregated pools pay both)

   **Noise.** A window's demand is a compound Poisson sum: with ``n`` arrivals whose lengths have
   a coefficient of variation ``cv``, its relative standard deviation is ``sqrt(1 + cv^2) /
   sqrt(n)`` (a forecast averaging ``k`` windows divides that by ``sqrt(k)``). The margin is
   ``m = min(noise_z * that, max_noise_margin)``. The core sizes twice: on the forecast (short
   horizon) and on the arrival-weighted average of the last ``confirm_windows`` windows (long
   horizon, much quieter), and takes ``low = max(needed * (1 - m))`` and ``high = max(needed *
   (1 + m))`` over the two. ``up = max(ceil(needed), ceil(low))``, ``down = ceil(high /
   scale_down_threshold)``.
5. **Stabilise.** A pin wins (operator override, clamped to the bounds). Otherwise: scale up to
   ``up`` when ``low > target`` (the load needs more even at the low end of its noise), unless
   the last decision is still pending (a scale-up until all its replicas are ready, a
   scale-down until nothing drains, at most ``startup_timeout_s``: never decide again while the
   last decision is being applied, AIBrix #2670, Dynamo #9774) or ``cooldown_up_s`` has not
   passed. The exception: a scale-up still starting while rising windows confirm the trend
   (``_rising``, ``stack_on_rise``): its replicas were sized before the ramp was proven, so the
   next order stacks on them. Scale down to ``down`` only when ``down < target`` held ``scale_down_ticks`` ticks in
   a row, nothing is pending and ``cooldown_down_s`` passed since the last change, never below
   ``ceil(needed * (1 + startup_reserve))`` (the growth one start-up can bring stays absorbable;
   it bounds scale-downs, never orders). Between the two nothing
   happens. A constant load sits inside that band, whose width grows with the noise, so it
   cannot oscillate (Dynamo #9294): at 15 req/s (150 arrivals a window, sd 8%) around 3.5
   replicas, one noisy window would need to be 4.3 sd high to add a replica, and the 6-window
   average 6 sd. Bounds ``[min_replicas, max_replicas]`` always hold.
6. **Budget.** While the proposals fit ``gpu_budget`` they stand. When they do not, holding
   pools offer their surplus above their point-estimate need (the hysteresis band is a luxury a
   binding budget cannot afford; their need is not), growing pools share what is left, pins
   first, then one replica at a time to the largest unmet fraction; surplus nobody took stays
   where it was. A holder may thus drain down to its need so that a starving pool grows, never
   below it and never for nothing. Only a lowered budget that even that cannot meet cuts every
   pool back from its minimum.
   **Overload loop** (issue 35): a window's SLO attainment below ``overload_attainment``, or
   queued work longer than the latency target, puts the pool in overload mode: sized for the
   measured arrivals plus the backlog drained in ``overload_drain_s`` at the measured service
   rate (``_overload``, ``_overload_need``), orders stacking on replicas still starting, no
   scale-down, first call on the budget while the breach lasts; left after
   ``overload_exit_windows`` clean windows.
7. **Effects.** Each pool whose target changes gets a :class:`ScaleEffect` carrying a
   ``ScalingDecision`` payload: from, to, a reason with the arithmetic, every input (predictions,
   profile lookups, corrections, replica counts), the predictor, the config version and the
   fencing token. A scale-down names the workers to drain (starting ones first, then the least
   loaded); replicas only leave through draining.

Latency of following a step (constant predictor, ``tick_s == tumbling_s``): a step inside window
``W`` is fully visible in window ``W+1``, which closes ``grace_s`` after its end; the first tick
after that scales. So the planner reacts within **3 ticks** of the step (2 windows + grace), and
a moving average of ``k`` windows needs ``k - 1`` more (its first partial reaction comes earlier).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from control_plane.planner.config import PlannerConfig, PoolConfig
from control_plane.planner.errors import PlannerConfigError
from control_plane.planner.load_view import (
    NS,
    LoadSnapshot,
    PoolLoad,
    PoolWorker,
    WindowStats,
    pool_entry,
)
from control_plane.planner.predictors import forecast
from control_plane.planner.profile import PerformanceProfile, erlang_c
from schemas.events import ScalingDecision
from schemas.types import PoolName, WorkerRole

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


# ----------------------------------------------------------------------------------------------
# decide
# ----------------------------------------------------------------------------------------------


def decide(now_ns: int, snapshot: LoadSnapshot, config: PlannerConfig,
           state: PlannerState) -> tuple[PlannerTick, PlannerState]:
    """One planner tick. Pure: same inputs, same outputs (see the module docstring)."""
    pins = dict(state.pins)
    # the fleet's need besides each pool's own (GPUs, from the last tick): near the budget, a
    # standing headroom
    fleet = {pc.name: sum(state.pool(q.name).last_needed * q.gpus_per_replica for q in config.pools if q.name != pc.name)
             for pc in config.pools}
    plans = [_plan_pool(now_ns, _with_upstream(snapshot, pc), pc, config, state.pool(pc.name), pins.get(pc.name),
                        fleet[pc.name])
             for pc in config.pools]
    final = _apply_budget(plans, config.gpu_budget)

    effects: list[ScaleEffect] = []
    reports: list[PoolReport] = []
    pool_states: dict[str, PoolState] = {p.pool: p for p in state.pools}
    seq = state.decisions
    for plan in plans:
        pc, ps = plan.config, plan.state
        to, budget_note = final[pc.name]
        reason = plan.reason + (f"; {budget_note}" if budget_note else "")
        inputs = dict(plan.inputs)
        inputs["proposed_replicas"] = plan.proposed
        action = "up" if to > plan.current else "down" if to < plan.current else "hold"
        binding = ("pin" if plan.pinned else "overload" if plan.overload and to > plan.current
                   else "gpu_budget" if budget_note
                   else "max_replicas" if to == pc.max_replicas and plan.needed is not None and plan.needed > to
                   else "min_replicas" if to == pc.min_replicas and (plan.needed or 0.0) < to else plan.binding)
        if binding:
            inputs["binding"] = binding
        if action != "hold":
            drain = _victims(plan.load, plan.current - to) if to < plan.current else ()
            if drain:
                inputs["drain_workers"] = ",".join(drain)
            event = ScalingDecision(
                pool=PoolName(pc.name), decision_id=f"{pc.name}-{now_ns // 1_000_000}-{seq}",
                role=WorkerRole(pc.role), from_replicas=plan.current, to_replicas=to,
                reason=f"scale {action} {plan.current} -> {to}: {reason}", inputs=inputs,
                predictor=pc.predictor.value, config_version=config.version,
                fencing_token=state.fencing_token,
                forecast_rate=_num(inputs.get("forecast_rate")), forecast_horizon_s=_num(inputs.get("forecast_horizon_s")),
                headroom=_num(inputs.get("headroom")), startup_allowance_s=config.lead_time_s, binding=binding)
            seq += 1
            effects.append(ScaleEffect(pc.name, WorkerRole(pc.role), plan.current, to, event.reason, drain, event))
            ps = replace(ps, target=to, last_change_ns=now_ns, below_ticks=0,
                         last_up_ns=now_ns if action == "up" else ps.last_up_ns, pending_since_ns=now_ns)
        else:
            ps = replace(ps, target=plan.current)
        pool_states[pc.name] = ps
        last = ps.history[-1] if ps.history else None
        reports.append(PoolReport(
            pool=pc.name, action=action, target=to, reason=reason, inputs=tuple(sorted(inputs.items())),
            needed=plan.needed, forecast_rate=ps.forecast_rate, forecast_for_ns=ps.forecast_for_ns,
            observed_rate=last.rate if last else None, observed_end_ns=last.window_end_ns if last else 0))
    new_state = replace(state, pools=tuple(pool_states[k] for k in sorted(pool_states)), decisions=seq)
    return PlannerTick(now_ns, tuple(effects), tuple(reports)), new_state


# ----------------------------------------------------------------------------------------------
# One pool
# ----------------------------------------------------------------------------------------------


def _with_upstream(snapshot: LoadSnapshot, pc: PoolConfig) -> PoolLoad:
    """The pool's load; for a decode pool ``fed_by`` a prefill pool, its windows' demand
    (arrivals, ISL) is the upstream pool's for the same window."""
    load = snapshot.pool(pc.name)
    if pc.fed_by is None:
        return load
    up = {w.end_ns: w for w in snapshot.pool(pc.fed_by).windows}
    windows = []
    for w in load.windows:
        u = up.get(w.end_ns)
        if u is not None:
            w = replace(w, arrivals=u.arrivals, isl_mean=u.isl_mean if u.isl_mean is not None else w.isl_mean,
                        isl_sd=u.isl_sd if u.isl_mean is not None else w.isl_sd)
        windows.append(w)
    return replace(load, windows=tuple(windows))


def _plan_pool(now: int, load: PoolLoad, pc: PoolConfig, cfg: PlannerConfig, ps: PoolState,
               pin: Pin | None, others_gpus: float = 0.0) -> _Plan:
    prof = pc.performance
    if prof is None:
        raise PlannerConfigError(f"pool {pc.name}: performance profile not resolved "
                                 "(build the config with resolve_profiles / load_config)")
    role = WorkerRole(pc.role)
    reps = load.replicas
    current = ps.target if ps.target is not None else reps.active
    inputs: dict[str, InputValue] = {
        "ready": reps.ready, "starting": reps.starting, "draining": reps.draining, "stale": reps.stale,
        "target": current, "min_replicas": pc.min_replicas, "max_replicas": pc.max_replicas,
        "gpus_per_replica": pc.gpus_per_replica, "profile": prof.name,
    }

    # 1-2. observe and correct. A decision is pending until applied: every replica of the target
    # ready (a scale-up) and nothing draining (a scale-down).
    pending = ps.pending_since_ns is not None and (reps.ready != current or reps.draining > 0)
    settled = not pending and _settled(load, pc, prof, cfg) and (
        ps.last_change_ns is None or now - ps.last_change_ns >= cfg.tumbling_s * NS)
    if not settled:
        ps = replace(ps, settled_since_ns=None)
    elif ps.settled_since_ns is None:
        ps = replace(ps, settled_since_ns=now)
    new_windows = [w for w in load.windows if w.end_ns > ps.last_window_end_ns]
    ps = _observe(ps, load, pc, cfg, prof, pending)
    ps, breach = _overload(ps, load, pc, cfg, prof, now, new_windows)
    overload = ps.overload_since_ns is not None
    if overload:
        inputs["overload"] = breach or f"no breach for {ps.clean_windows} windows, queue not yet drained"
    if ps.service_tok_s is not None:
        inputs["measured_tok_s_per_replica"] = round(ps.service_tok_s, 1)
    if ps.latency_ratio is not None:
        inputs["latency_over_slo"] = round(ps.latency_ratio, 4)
    timed_out = pending and now - (ps.pending_since_ns or now) > cfg.startup_timeout_s * NS
    if timed_out:
        pending = False
    if ps.pending_since_ns is not None and (not pending):
        ps = replace(ps, pending_since_ns=None)

    # 3-4. predict and size
    needed: float | None = None
    binding = ""
    sizing = "no closed window observed yet"
    up = down = None
    low = high = None
    if ps.history:
        sz, ps = _size(ps, pc, cfg, prof, role, inputs, load, overload, others_gpus)
        ps = replace(ps, last_needed=sz.needed)
        needed, sizing, low, high = sz.needed, sz.text, sz.low, sz.high
        up = max(math.ceil(needed - _EPS), math.ceil(low - _EPS), 0)
        down = max(math.ceil(high / cfg.scale_down_threshold - _EPS), 0)
        if cfg.startup_reserve > 0:
            # a start-up's growth stays absorbable: never down below the need plus that reserve
            keep = math.ceil(needed * (1 + cfg.startup_reserve) - _EPS)
            if keep > down:
                inputs["startup_reserve_keeps"] = keep
                down = keep
        inputs.update(needed_replicas=round(needed, 4), needed_low=round(low, 4), needed_high=round(high, 4),
                      desired_up=up, desired_down=down)
        binding = str(inputs.get("binding_slo", ""))
    inputs.update(ttft_correction=round(ps.ttft_correction, 4), itl_correction=round(ps.itl_correction, 4))
    if ps.forecast_error is not None:
        inputs["forecast_error"] = round(ps.forecast_error, 4)

    # 5. stabilise
    lo, hi = pc.min_replicas, pc.max_replicas
    proposed, action = current, "hold"
    below = ps.below_ticks
    if pin is not None:
        proposed = min(max(pin.replicas, lo), hi)
        inputs["pinned"] = pin.replicas
        if pin.by:
            inputs["pinned_by"] = pin.by
        reason = (f"pinned by operator{' ' + pin.by if pin.by else ''} to {pin.replicas}"
                  + (f" ({pin.reason})" if pin.reason else "")
                  + (f" (clamped to [{lo}, {hi}])" if proposed != pin.replicas else ""))
        below = 0
    elif overload and up is not None and up > current:
        # the closed loop: orders stack on replicas still starting (the pending gate is for the
        # model's forecasts; a breach users feel now is evidence enough)
        below = 0
        proposed, action, reason = _gated(current, sizing, (
            (_cooling(now, ps.last_up_ns, cfg.cooldown_up_s),
             f"overload loop wants {up} but in scale-up cooldown ({cfg.cooldown_up_s:g}s)"),
        ), (min(up, hi), "up", f"overload loop ({inputs['overload']}): {sizing}"
            + (f"; stacked on {reps.starting} starting" if reps.starting else "")
            + (f"; capped at max_replicas {hi}" if up > hi else "")))
    elif overload:
        below = 0
        reason = f"overload loop ({inputs['overload']}): {sizing}; holding {current} (no scale-down in overload)"
    elif low is not None and up is not None and low > current + _EPS:
        below = 0
        since = (now - (ps.pending_since_ns or now)) / NS
        # a scale-up still starting does not hold the next order when rising windows confirm the
        # trend: the replicas starting were sized before the windows proved the ramp
        stack = (pending and cfg.stack_on_rise and reps.draining == 0 and reps.ready < current
                 and inputs.get("trend_confirmed") == 1)
        go = (sizing + (f"; capped at max_replicas {hi}" if up > hi else "")
              + (f"; stacked on {reps.starting} starting (a rise confirmed by rising windows)" if stack else "")
              + (f"; the previous decision was not applied within {cfg.startup_timeout_s:g}s"
                 if timed_out else ""))
        proposed, action, reason = _gated(current, sizing, (
            (pending and not stack, f"wants {up} but the decision {since:.0f}s ago is still pending "
                      f"({reps.ready} of {current} ready, {reps.draining} draining): never decide again "
                      "while the last decision is being applied"),
            (_cooling(now, ps.last_up_ns, cfg.cooldown_up_s),
             f"wants {up} but in scale-up cooldown ({cfg.cooldown_up_s:g}s)"),
        ), (min(up, hi), "up", go))
    elif down is not None and down < current:
        below += 1
        go = (f"{sizing}; below {cfg.scale_down_threshold:.0%} of capacity for {below} ticks"
              + (f"; kept at min_replicas {lo}" if down < lo else ""))
        proposed, action, reason = _gated(current, sizing, (
            (pending, "below the scale-down threshold but the last decision is still pending"),
            (below < cfg.scale_down_ticks, f"below {cfg.scale_down_threshold:.0%} of capacity for {below} of "
                                           f"{cfg.scale_down_ticks} ticks"),
            (_cooling(now, ps.last_change_ns, cfg.cooldown_down_s),
             f"wants {down} but in scale-down cooldown ({cfg.cooldown_down_s:g}s since last change)"),
        ), (max(down, lo), "down", go))
    else:
        below = 0
        if low is None:
            reason = sizing
        elif needed is not None and math.ceil(needed - _EPS) > current:
            reason = (f"{sizing}; {needed:.2f} > {current} but within the noise (low end {low:.2f}): "
                      f"holding {current}")
        else:
            reason = f"{sizing}; holding {current} (scale-down needs the high end {high:.2f} to fit "\
                     f"{cfg.scale_down_threshold:.0%} of fewer replicas)"
    if not lo <= proposed <= hi:
        proposed = min(max(proposed, lo), hi)
        reason += f"; brought into bounds [{lo}, {hi}]"
    ps = replace(ps, below_ticks=below if action != "down" else 0)
    frozen = pending and pin is None
    if frozen or high is None or _cooling(now, ps.last_change_ns, cfg.cooldown_down_s):
        yield_to = proposed
    else:
        yield_to = min(proposed, max(math.ceil(high - _EPS), lo))
    margin_yield_to = None
    r = ps.latency_ratio
    failing = overload and bool(breach)
    if not failing and pin is None and not frozen and needed is not None and r is not None and r <= cfg.yield_margin:
        margin_yield_to = min(proposed, max(lo, math.ceil(needed * max(r / cfg.yield_margin, 0.75) - _EPS)))
    return _Plan(pc, ps, current, proposed, action, reason, inputs, needed, pin is not None, load,
                 frozen=frozen, binding=binding, yield_to=yield_to, overload=failing and pin is None,
                 margin_yield_to=margin_yield_to)


def _num(x: InputValue | None) -> float | None:
    """A number for the event, or None: a NaN or infinite forecast is no number (the codec
    refuses one in any float field)."""
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def _gated(current: int, sizing: str, gates: tuple[tuple[bool, str], ...],
           step: tuple[int, str, str]) -> tuple[int, str, str]:
    """(proposed, action, reason) of a scale step: ``step`` when no gate holds, else a hold at
    ``current`` with the reason of the first gate that holds. Both directions are gated this way,
    their gates in the order their reasons should be read."""
    held = next((why for holds, why in gates if holds), None)
    return step if held is None else (current, "hold", f"{sizing}; {held}")


def _cooling(now: int, since_ns: int | None, cooldown_s: float) -> bool:
    """Still within ``cooldown_s`` of the change at ``since_ns`` (None: no change yet)."""
    return since_ns is not None and now - since_ns < cooldown_s * NS


def _observe(ps: PoolState, load: PoolLoad, pc: PoolConfig, cfg: PlannerConfig, prof: PerformanceProfile,
             pending: bool) -> PoolState:
    history = list(ps.history)
    err, scored = ps.forecast_error, ps.forecast_scored
    ttft_c, itl_c = ps.ttft_correction, ps.itl_correction
    last_end = ps.last_window_end_ns
    for w in load.windows:
        if w.end_ns <= last_end:
            continue
        rate = w.arrival_rate
        if ps.forecast_rate is not None and ps.forecast_for_ns == w.end_ns:
            denom = max(rate, ps.forecast_rate)
            e = abs(ps.forecast_rate - rate) / denom if denom > 0 else 0.0
            err = e if err is None else (1 - ERROR_ALPHA) * err + ERROR_ALPHA * e
            scored += 1
        history.append(Observation(w.end_ns, rate, w.isl_mean, w.osl_mean, w.prefix_hit_rate, w.arrivals,
                                   w.duration_s, w.isl_sd, w.osl_sd))
        last_end = w.end_ns
        settled = ps.settled_since_ns is not None and w.start_ns >= ps.settled_since_ns + int(cfg.tumbling_s * NS)
        if not pending and settled:
            ttft_c, itl_c = _corrections(w, load, pc, cfg, prof, ttft_c, itl_c)
    ps = replace(ps, history=tuple(history[-cfg.history_limit:]), last_window_end_ns=last_end,
                 forecast_error=err, forecast_scored=scored, ttft_correction=ttft_c, itl_correction=itl_c)
    return _score_horizon(ps, history, cfg)


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


def _overload(ps: PoolState, load: PoolLoad, pc: PoolConfig, cfg: PlannerConfig, prof: PerformanceProfile,
              now: int, new: list[WindowStats]) -> tuple[PoolState, str]:
    """The closed loop's observations: (state, the breach that holds now or "").

    A **breach** is what users feel: a window just closed whose SLO attainment is below
    ``overload_attainment`` (at least ``correction_min_samples`` judged), or a queue on the ready
    workers that would wait longer than the latency target (prefill: queued tokens / (ready x
    measured throughput) > TTFT SLO; decode: more requests waiting than ready workers). A breach
    enters overload mode; it is left after ``overload_exit_windows`` windows in a row without
    one, with the prefill queue under a quarter of the TTFT target.

    While every ready worker has work queued (*saturated*), a window that lay wholly inside that
    time, with no worker joining or leaving, measures what a replica serves per second (prefill:
    new prompt tokens; decode: output tokens): the service rate, an EWMA. It is learned in
    overload too, where latency ratios say nothing about the hardware (item 4 of issue 35).
    """
    role = WorkerRole(pc.role)
    ready = [w for w in load.workers if w.state == "ready"]
    breaches: list[str] = []
    saturated = bool(ready)
    wait_s = 0.0
    if role is not WorkerRole.DECODE:
        mu = ps.service_tok_s or prof.prefill_tokens_per_s
        queued = sum(w.queued_prefill_tokens for w in ready)
        if ready and mu > 0:
            wait_s = queued / (len(ready) * mu)
            if wait_s * 1000.0 > (pc.ttft_slo_ms or 0.0):
                breaches.append(f"{queued:,} prefill tokens queued, {wait_s:.1f} s of work > TTFT "
                                f"{(pc.ttft_slo_ms or 0.0) / 1000:g} s")
        # busy for the whole window only with at least a second of the profile's work queued each
        # (a queue that is merely non-empty at the tick leaves idle gaps: measured low)
        saturated = saturated and all(w.queued_prefill_tokens >= prof.prefill_tokens_per_s for w in ready)
    if role is not WorkerRole.PREFILL:
        waiting = sum(w.waiting for w in ready)
        if ready and waiting > len(ready):
            breaches.append(f"{waiting} decode requests waiting on {len(ready)} ready workers")
        saturated = saturated and bool(ready) and all(w.waiting > 0 for w in ready)

    mu_m, ratio = ps.service_tok_s, ps.latency_ratio
    clean = ps.clean_windows
    for w in new:
        att = w.slo_attainment
        judged = w.completions + w.failures
        window_breach = att is not None and judged >= cfg.correction_min_samples and att < cfg.overload_attainment
        if window_breach:
            breaches.append(f"SLO attainment {att:.2f} < {cfg.overload_attainment:g} in the window ending "
                            f"{w.end_ns / NS:.0f} s")
        clean = 0 if window_breach or breaches else clean + 1
        if judged >= cfg.correction_min_samples:
            terms = []
            if role is not WorkerRole.DECODE and w.ttft_mean is not None and pc.ttft_slo_ms:
                terms.append(w.ttft_mean / pc.ttft_slo_ms)
            if role is not WorkerRole.PREFILL and w.itl_mean is not None and pc.itl_slo_ms:
                terms.append(w.itl_mean / pc.itl_slo_ms)
            if terms:
                ratio = max(terms) if att is None or att >= cfg.overload_attainment else max(max(terms), 1.0)
        steady = (saturated and ps.saturated_since_ns is not None and w.start_ns >= ps.saturated_since_ns
                  and load.replicas.draining == 0
                  and all(x.ready_at_ns is not None and x.ready_at_ns <= w.start_ns for x in ready))
        if steady and w.duration_s > 0:
            done = (w.prompt_tokens - w.cached_tokens if role is WorkerRole.PREFILL
                    else w.completions * (w.osl_mean or 0.0) if role is WorkerRole.DECODE else 0.0)
            if done > 0:
                x = done / (len(ready) * w.duration_s)
                mu_m = x if mu_m is None else (1 - cfg.correction_alpha) * mu_m + cfg.correction_alpha * x
    if breaches:
        clean = 0
    since = ps.overload_since_ns
    if breaches and since is None:
        since = now
    elif (since is not None and not breaches and clean >= cfg.overload_exit_windows
          and wait_s * 1000.0 <= 0.25 * (pc.ttft_slo_ms or 0.0)):
        since = None
    ps = replace(ps, overload_since_ns=since, clean_windows=clean, service_tok_s=mu_m, latency_ratio=ratio,
                 saturated_since_ns=(ps.saturated_since_ns or now) if saturated else None)
    return ps, "; ".join(breaches)


def _overload_need(rate: float, isl: float, osl: float, hit: float, load: PoolLoad, pc: PoolConfig,
                   cfg: PlannerConfig, prof: PerformanceProfile, ps: PoolState, role: WorkerRole,
                   inputs: dict[str, InputValue]) -> tuple[float, str]:
    """Replicas the overload loop sizes for: the arrivals plus the backlog, projected to when
    replicas ordered now are ready (it grows by what arrives beyond what the ready workers
    serve), drained within ``overload_drain_s``, at the *measured* throughput per replica (the
    profile's until one is measured); arrivals at ``max_utilization`` of it, so the queue does
    not build again. Prefill and decode needs add up (aggregated pools pay both)."""
    ready = [w for w in load.workers if w.state == "ready"]
    lead, drain = cfg.lead_time_s, cfg.overload_drain_s
    need, parts = 0.0, []
    if role is not WorkerRole.DECODE:
        mu = ps.service_tok_s or prof.prefill_tokens_per_s
        arr = rate * isl * (1 - hit)
        backlog = float(sum(w.queued_prefill_tokens for w in ready))
        projected = backlog + max(arr - len(ready) * mu, 0.0) * lead
        n = (arr / cfg.max_utilization + projected / drain) / mu if mu > 0 else 0.0
        need += n
        inputs.update(overload_prefill_backlog=round(backlog), overload_prefill_projected=round(projected),
                      overload_prefill_needed=round(n, 4))
        parts.append(f"prefill {arr:,.0f} tok/s arriving / {cfg.max_utilization:.0%} + backlog {backlog:,.0f} tokens "
                     f"({projected:,.0f} in {lead:g} s) / {drain:g} s, at {mu:,.0f} tok/s per replica "
                     f"({'measured' if ps.service_tok_s else 'profile'}) = {n:.2f}")
    if role is not WorkerRole.PREFILL:
        context = isl + osl / 2
        mu = ps.service_tok_s or prof.best_decode((pc.itl_slo_ms or 0.0) / ps.itl_correction, context).tokens_per_s
        arr = rate * osl
        waiting = sum(w.waiting for w in ready)
        backlog = waiting * osl
        projected = backlog + max(arr - len(ready) * mu, 0.0) * lead
        n = (arr + projected / drain) / mu if mu > 0 else 0.0
        need += n
        inputs.update(overload_decode_waiting=waiting, overload_decode_needed=round(n, 4))
        parts.append(f"decode {arr:,.0f} tok/s arriving + {waiting} waiting x OSL {osl:,.0f} ({projected:,.0f} tokens "
                     f"in {lead:g} s) / {drain:g} s, at {mu:,.0f} tok/s per replica "
                     f"({'measured' if ps.service_tok_s else 'profile'}) = {n:.2f}")
    return need, " + ".join(parts)


def _rising(hist: tuple[Observation, ...], cfg: PlannerConfig) -> bool:
    """A rise the windows themselves confirm: a one-sided CUSUM of the window rates against a
    lagged reference. Each window's excess over the mean of the ``2 * confirm_windows`` windows
    that ended ``trend_confirm_windows`` windows before it, in sd of Poisson noise (``sqrt(reference
    arrivals)``), less ``trend_confirm_k``, accumulates (floored at 0); the trend is confirmed
    while the sum exceeds ``trend_confirm_z``. Recomputed from the history each tick (no state).
    With k = 1 and h = 4, a constant load confirms by chance about 0.12 times in 10 minutes of
    5 s windows; a ramp of one sd per window is confirmed in about 4 windows, a ramp of 3 sd per
    window in 2 (seeded Monte Carlo; docs/planner.md)."""
    lag, ref_n = cfg.trend_confirm_windows, 2 * cfg.confirm_windows
    s = 0.0
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
        s = max(0.0, s + (o.arrivals - expected) / math.sqrt(max(expected, 1.0)) - cfg.trend_confirm_k)
    return s > cfg.trend_confirm_z


def headroom(ps: PoolState, cfg: PlannerConfig) -> float:
    """The fraction added to the rate forecast: the tracked expectile of the horizon forecast's
    measured relative under-forecast, in [0, max_headroom] (0 until a horizon has been scored:
    until then the noise band alone guards the forecast)."""
    return min(max(ps.horizon_error, 0.0), cfg.max_headroom)


def _settled(load: PoolLoad, pc: PoolConfig, prof: PerformanceProfile, cfg: PlannerConfig) -> bool:
    """No backlog the targets could not absorb: prefill work queued per ready worker fits the
    TTFT slack, and no more decode requests wait than there are ready workers."""
    ready = [w for w in load.workers if w.state == "ready"]
    if not ready:
        return False
    role = WorkerRole(pc.role)
    if role is not WorkerRole.DECODE:
        queued = sum(w.queued_prefill_tokens for w in ready) / len(ready)
        if queued / prof.prefill_tokens_per_s * 1000.0 > (pc.ttft_slo_ms or 0.0):
            return False
    if role is not WorkerRole.PREFILL and sum(w.waiting for w in ready) > len(ready):
        return False
    return True


def _corrections(w: WindowStats, load: PoolLoad, pc: PoolConfig, cfg: PlannerConfig,
                 prof: PerformanceProfile, ttft_c: float, itl_c: float) -> tuple[float, float]:
    """Observed/expected latency on warmed-up workers only (see the module docstring).

    Frozen while the pool is overloaded: the profile predicts latency at a utilisation below
    saturation; past it, latency is the backlog's age, not the hardware's speed, and learning it
    as "slower hardware" would over-scale this pool and starve the others of budget.
    """
    role = WorkerRole(pc.role)
    ready = load.replicas.ready
    if ready <= 0 or w.steady_samples < cfg.correction_min_samples:
        return ttft_c, itl_c
    a, lo, hi = cfg.correction_alpha, cfg.correction_min, cfg.correction_max
    if role is not WorkerRole.DECODE and w.steady_ttft_mean is not None and w.isl_mean:
        hit = min(w.prefix_hit_rate or 0.0, MAX_HIT_RATE)
        isl_eff = w.isl_mean * (1 - hit)
        s = prof.prefill_time_ms(isl_eff)
        rho = w.arrival_rate * isl_eff / (ready * prof.prefill_tokens_per_s)
        cv = _cv(w.isl_mean, w.isl_sd)
        if rho <= cfg.max_utilization:
            # M/G/k (Allen-Cunneen), the model the sizing uses
            expected = s + erlang_c(ready, ready * rho) * s / (ready * (1 - rho)) * (1 + cv * cv) / 2
            if expected > 0:
                ttft_c = min(max((1 - a) * ttft_c + a * (w.steady_ttft_mean / expected), lo), hi)
    if role is not WorkerRole.PREFILL and w.steady_itl_mean is not None and w.isl_mean is not None:
        ready_workers = [x for x in load.workers if x.state == "ready"]
        running = [x.running for x in ready_workers]
        queued = sum(x.waiting for x in ready_workers)
        if running and queued <= len(ready_workers):
            seqs = max(sum(running) / len(running), 1.0)
            context = w.isl_mean + (w.osl_mean or 0.0) / 2
            expected = prof.decode_itl(seqs, context)
            if expected > 0:
                itl_c = min(max((1 - a) * itl_c + a * (w.steady_itl_mean / expected), lo), hi)
    return ttft_c, itl_c


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


def _size(ps: PoolState, pc: PoolConfig, cfg: PlannerConfig, prof: PerformanceProfile, role: WorkerRole,
          inputs: dict[str, InputValue], load: PoolLoad, overload: bool = False,
          others_gpus: float = 0.0) -> tuple[_Sizing, PoolState]:
    """Forecast, then size twice: on the forecast (short horizon: reacts fast, noisy) and on the
    average of the last ``confirm_windows`` windows (long horizon: slow, quiet). The low end
    (``needed * (1 - margin)``, margin = ``noise_z`` x relative noise, capped) of either proves a
    scale-up; a scale-down needs the high end of both to fit."""
    hist = ps.history
    horizon = max(1, math.ceil(cfg.horizon_s / cfg.tumbling_s - _EPS))
    # a trend is extrapolated over the horizon only once rising windows confirm it (then in
    # full); unconfirmed, only the next window's (its slope beyond trend_z sd)
    rising = _rising(hist, cfg)
    rate_f = forecast(pc.predictor, [o.rate for o in hist], window=pc.predictor_window,
                      history_limit=cfg.history_limit, seasonal_periods=pc.seasonal_periods,
                      horizon=horizon if rising else 1, trend_z=0.0 if rising else cfg.trend_z)
    inputs["trend_confirmed"] = int(rising)

    def length(values: list[float]) -> float | None:
        if not values:
            return None
        return forecast(cfg.length_predictor, values, window=pc.predictor_window,
                        history_limit=cfg.history_limit).value

    isl = length([o.isl for o in hist if o.isl is not None]) or 0.0
    osl = length([o.osl for o in hist if o.osl is not None]) or 0.0
    hit = min(length([o.hit_rate for o in hist if o.hit_rate is not None]) or 0.0, MAX_HIT_RATE)
    last = hist[-1]
    k = max(1, min(len(hist), math.ceil(rate_f.samples)))
    n_short = rate_f.samples * sum(o.arrivals for o in hist[-k:]) / k
    made = tuple(f for f in ps.horizon_forecasts if f[0] != last.window_end_ns)
    ps = replace(ps, horizon_forecasts=made + (
        (last.window_end_ns, last.window_end_ns + horizon * int(round(cfg.tumbling_s * NS)), rate_f.value, n_short),))
    room = headroom(ps, cfg)
    rate = rate_f.value * (1 + room)
    isl_cv, osl_cv = _cv(last.isl, last.isl_sd), _cv(last.osl, last.osl_sd)
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
    need_f, rel_f, parts = _need(rate, isl, osl, hit, n_short, isl_cv, osl_cv, pc, cfg, prof, ps, role, inputs,
                                 backlog)
    standing = cfg.standing_headroom
    if standing > room and need_f * pc.gpus_per_replica + others_gpus >= cfg.standing_headroom_from * cfg.gpu_budget:
        # near the budget: a standing headroom (a ramp caught late cannot be caught up with)
        room = standing
        rate = rate_f.value * (1 + room)
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
    n_long = sum(o.arrivals for o in tail)
    dur = sum(o.duration_s for o in tail)
    need_l, m_l = need_f, m_f
    if n_long > 0 and dur > 0:
        def wmean(get) -> tuple[float, float]:
            pts = [(o.arrivals, get(o)) for o in tail if get(o)[0] is not None and o.arrivals > 0]
            w = sum(a for a, _ in pts)
            if not w:
                return 0.0, 0.0
            m = sum(a * v[0] for a, v in pts) / w
            ex2 = sum(a * ((v[1] or 0.0) ** 2 + v[0] ** 2) for a, v in pts) / w
            return m, _cv(m, math.sqrt(max(ex2 - m * m, 0.0)))

        isl_l, isl_cv_l = wmean(lambda o: (o.isl, o.isl_sd))
        osl_l, osl_cv_l = wmean(lambda o: (o.osl, o.osl_sd))
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


# ----------------------------------------------------------------------------------------------
# Budget and victims
# ----------------------------------------------------------------------------------------------


def _apply_budget(plans: list[_Plan], budget: int) -> dict[str, tuple[int, str]]:
    """Final replicas per pool and a note when the budget changed the proposal.

    Draining replicas still hold their GPUs until they are gone: the budget the targets share is
    ``budget`` less those. While the proposals fit, nothing changes. When they do not: pools that
    hold or shrink offer their surplus above the high end of their noise band (``yield_to``, at
    least their minimum; nothing while pending or within ``cooldown_down_s`` of their last
    change: trading a replica costs a start-up, and doing it on a noisy need is churn); growing pools start from
    what they hold; what is left of the budget goes one replica at a time to the growing pool
    with the largest unmet fraction (pins first); a holder gets back the surplus nobody took.
    Only if even that base does not fit (the budget was lowered) does every pool start again
    from its minimum. So a holder never drops below its need, and never drains for nothing. A
    pool whose last decision is still pending (``frozen``) offers nothing: no new decision for it
    until that one is applied.
    """
    if any(p.overload and p.proposed > p.current for p in plans):
        # a pool in overload is failing its SLO: one with a wide margin yields to it, even below
        # its model need (to margin_yield_to), cooldown or not
        # (and does not grow meanwhile)
        plans = [replace(p, proposed=min(p.proposed, p.current),
                         yield_to=min(p.yield_to if p.yield_to is not None else p.proposed, p.margin_yield_to))
                 if p.margin_yield_to is not None and not p.overload else p for p in plans]
    names = sorted(p.config.name for p in plans)
    by = {p.config.name: p for p in plans}
    g = {n: by[n].config.gpus_per_replica for n in names}
    floor = {n: by[n].config.min_replicas for n in names}
    proposed = {n: by[n].proposed for n in names}
    total = budget
    budget -= sum(by[n].load.replicas.draining * g[n] for n in names)
    if sum(proposed[n] * g[n] for n in names) <= budget:
        return _wait_for_drains(by, names, dict(proposed), proposed, budget)
    growing = {n for n in names if by[n].pinned or proposed[n] > by[n].current}
    need = {n: proposed[n] if n in growing or by[n].yield_to is None
            else max(min(proposed[n], by[n].yield_to), floor[n]) for n in names}
    base = {n: max(floor[n], by[n].current if n in growing else need[n]) for n in names}
    if sum(base[n] * g[n] for n in names) > budget:
        base, growing = dict(floor), set(names)  # the budget was lowered: everyone from its minimum
    alloc = dict(base)
    left = budget - sum(alloc[n] * g[n] for n in names)

    def fill(pool_names: list[str], target: dict[str, int]) -> None:
        nonlocal left
        while True:
            cands = [n for n in pool_names if alloc[n] < target[n] and g[n] <= left]
            if not cands:
                return
            # largest unmet fraction first; then the larger pool; then name order (max keeps the first)
            n = max(cands, key=lambda n: ((target[n] - alloc[n]) / target[n], target[n]))
            alloc[n] += 1
            left -= g[n]

    want = {n: proposed[n] if n in growing else need[n] for n in names}
    fill([n for n in names if n in growing and by[n].pinned], want)
    fill([n for n in names if n in growing and by[n].overload], want)  # the SLO is failing there
    fill([n for n in names if n in growing], want)
    fill([n for n in names if n not in growing], proposed)  # give back the surplus nobody took
    used = budget - left
    notes: dict[str, str] = {}
    for n in names:
        if alloc[n] != proposed[n]:
            notes[n] = (f"GPU budget: {proposed[n]} -> {alloc[n]} replicas (needs {need[n]}; {used} of {budget} "
                        f"GPUs allocated, {g[n]} per replica"
                        + (f", {total - budget} held by draining replicas)" if total != budget else ")"))
    out = _wait_for_drains(by, names, alloc, proposed, budget)
    return {n: (to, "; ".join(x for x in (notes.get(n, ""), note) if x)) for n, (to, note) in out.items()}


def _wait_for_drains(by: Mapping[str, _Plan], names: list[str], alloc: dict[str, int], proposed: Mapping[str, int],
                     budget: int) -> dict[str, tuple[int, str]]:
    """Growth never takes a GPU that a replica drained in the same tick still holds: a shrinking
    pool keeps holding its victims' GPUs until they are gone (counted as held even when a victim
    is still starting: a scaler may take a moment to stop it too). While the targets plus those
    do not fit ``budget`` (already less the replicas draining from earlier ticks), the growing
    pool whose unmet fraction is smallest gives back one replica; it asks again on a later tick,
    once the drain is through (the shrinking pool's decision is pending until then). Returns
    (replicas, note) per pool."""
    g = {n: by[n].config.gpus_per_replica for n in names}
    cur = {n: by[n].current for n in names}

    def held(n: str) -> int:
        return max(alloc[n], cur[n])

    freeing = sum((held(n) - alloc[n]) * g[n] for n in names)
    waited: dict[str, int] = {}
    while sum(held(n) * g[n] for n in names) > budget:
        growers = [n for n in names if alloc[n] > cur[n]]
        if not growers:
            break
        n = min(growers, key=lambda n: ((proposed[n] - alloc[n]) / proposed[n], n))
        alloc[n] -= 1
        waited[n] = waited.get(n, 0) + 1
    return {n: (alloc[n], f"waits for {freeing} GPUs that replicas drained now still hold ({waited[n]} replica"
                          f"{'s' if waited[n] > 1 else ''} later)" if n in waited else "") for n in names}


def _victims(load: PoolLoad, k: int) -> tuple[str, ...]:
    """Workers to drain for a scale-down by ``k``: starting ones first (newest first), then
    lost ones, then the least loaded ready ones (newest first on ties)."""
    if k <= 0:
        return ()
    rank = {"starting": 0, "stale": 1, "ready": 2}

    def key(w: PoolWorker):
        return (rank[w.state], w.running + w.waiting if w.state == "ready" else 0, -w.registered_at_ns, w.worker_id)

    cands = sorted((w for w in load.workers if w.state in rank), key=key)
    return tuple(w.worker_id for w in cands[:k])


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
