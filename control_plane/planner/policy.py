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
   ``trend_z`` of its sd; confirmed, the larger of that and the rising windows' own least-squares
   line beyond ``trend_fit_z`` sd, ``rise_fit``), then add the **headroom**: every horizon forecast is scored against the mean rate that
   came after the lead time, and an asymmetric EWMA tracks the ``headroom_quantile`` expectile of
   the relative under-forecast beyond Poisson noise (``headroom()``); the pool is sized for
   ``forecast * (1 + headroom)``. Unconfirmed, the forecast keeps only what it differs from the
   mean of the last ``settle_windows`` windows beyond ``settle_z`` sd of Poisson noise
   (``predictors.settle``: a constant load's need holds still). ISL, OSL and hit rate are pooled
   over the last ``length_windows`` windows (None: ``length_predictor``).
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
   a row, nothing is pending and ``cooldown_down_s`` passed since the last change (after a
   scale-down, not a scale-up, a pool within ``yield_margin`` of its SLO is released from that
   cooldown: ``release_on_margin``), never below
   ``ceil(needed * (1 + startup_reserve))`` (the growth one start-up can bring stays absorbable;
   it bounds scale-downs, never orders). A fall confirmed by falling windows (``_fall``, the
   rise's CUSUM mirrored; ``release_on_fall``) sizes on the falling windows' line and steps down
   to ``ceil(high)`` after ``fall_down_ticks``, without the cooldown after a scale-down, while
   the pool's observed latency meets its SLO. Between the two nothing
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
   ``overload_exit_windows`` clean windows. Once its queue has drained (only lagging windows
   breach), it may yield down to its need in a squeeze, cooldown or not.
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
from dataclasses import replace

from control_plane.planner.budget import _apply_budget
from control_plane.planner.config import PlannerConfig, PoolConfig
from control_plane.planner.corrections import _observe, _settled
from control_plane.planner.errors import PlannerConfigError
from control_plane.planner.load_view import NS, LoadSnapshot, PoolLoad, PoolWorker
from control_plane.planner.overload import _overload
from control_plane.planner.policy_types import (
    _EPS,
    ERROR_ALPHA,
    MAX_HIT_RATE,
    InputValue,
    Observation,
    Pin,
    PlannerState,
    PlannerTick,
    PoolReport,
    PoolState,
    ScaleEffect,
    _Plan,
)
from control_plane.planner.sizing import _size, needed_replicas
from control_plane.planner.trends import headroom
from schemas.events import ScalingDecision
from schemas.types import PoolName, WorkerRole

#: The rules live in sibling modules (policy_types, trends, corrections, overload, sizing,
#: budget); these names stay importable from here.
__all__ = ["ERROR_ALPHA", "MAX_HIT_RATE", "InputValue", "Observation", "Pin", "PlannerState", "PlannerTick",
           "PoolReport", "PoolState", "ScaleEffect", "decide", "headroom", "needed_replicas"]


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
    ps, breach, queued = _overload(ps, load, pc, cfg, prof, now, new_windows)
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
    fell_now = False
    if ps.history:
        sz, ps = _size(ps, pc, cfg, prof, role, inputs, load, overload, others_gpus)
        ps = replace(ps, last_needed=sz.needed)
        needed, sizing, low, high = sz.needed, sz.text, sz.low, sz.high
        up = max(math.ceil(needed - _EPS), math.ceil(low - _EPS), 0)
        # a confirmed fall releases to the band's high end (no threshold: a falling load is no
        # constant load that could oscillate around it)
        fell_now = cfg.release_on_fall and inputs.get("fall_confirmed") == 1
        down = max(math.ceil(high / (1.0 if fell_now else cfg.scale_down_threshold) - _EPS), 0)
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
        # released on evidence: after a scale-down (not an up: that keeps its cooldown), a pool
        # whose observed latency is within yield_margin of its SLO steps down again on its own
        # scale_down_ticks of evidence (a burst's surplus is not held a cooldown per step)
        released = (cfg.release_on_margin and ps.last_change_ns is not None
                    and (ps.last_up_ns is None or ps.last_up_ns < ps.last_change_ns)
                    and not _cooling(now, ps.last_up_ns, cfg.cooldown_down_s)
                    and ps.latency_ratio is not None and ps.latency_ratio <= cfg.yield_margin)
        # a fall confirmed by falling windows is evidence too (the mirror of a confirmed rise's
        # stacked orders): fall_down_ticks, and after a scale-down no cooldown (after a scale-up
        # the cooldown stands: no up-down flapping), while the pool's observed latency meets its
        # SLO (overload, a breach users feel, never scales down at all)
        fell = (cfg.release_on_fall and inputs.get("fall_confirmed") == 1
                and (ps.latency_ratio is None or ps.latency_ratio <= 1.0))
        ticks = min(cfg.fall_down_ticks, cfg.scale_down_ticks) if fell else cfg.scale_down_ticks
        go = (f"{sizing}; below {1.0 if fell_now else cfg.scale_down_threshold:.0%} of capacity for {below} ticks"
              + ("; a fall confirmed by falling windows" if fell else "")
              + (f"; kept at min_replicas {lo}" if down < lo else ""))
        proposed, action, reason = _gated(current, sizing, (
            (pending, "below the scale-down threshold but the last decision is still pending"),
            (below < ticks, f"below {1.0 if fell_now else cfg.scale_down_threshold:.0%} of capacity for {below} of "
                            f"{ticks} ticks"),
            (_cooling(now, ps.last_change_ns, cfg.cooldown_down_s) and not released
             and not (fell and not _cooling(now, ps.last_up_ns, cfg.cooldown_down_s)),
             f"wants {down} but in scale-down cooldown ({cfg.cooldown_down_s:g}s since last change)"),
        ), (max(down, lo), "down", go + ("; a step down after a step down, observed latency "
                                          f"{ps.latency_ratio:.2f} of the SLO (<= {cfg.yield_margin:g}): "
                                          "no cooldown" if released and _cooling(now, ps.last_change_ns,
                                                                                  cfg.cooldown_down_s) else "")))
    else:
        below = 0
        if low is None:
            reason = sizing
        elif needed is not None and math.ceil(needed - _EPS) > current:
            reason = (f"{sizing}; {needed:.2f} > {current} but within the noise (low end {low:.2f}): "
                      f"holding {current}")
        else:
            reason = f"{sizing}; holding {current} (scale-down needs the high end {high:.2f} to fit "\
                     f"{1.0 if fell_now else cfg.scale_down_threshold:.0%} of fewer replicas)"
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
    if overload and not queued and pin is None and needed is not None:
        # in overload with its queue drained (only lagging windows breach, or none): the
        # replicas ordered for the backlog are surplus above the need; a squeeze may take them
        # back, cooldown, pending start-ups or not (a replica still starting is cancelled at once)
        yield_to = min(yield_to, max(math.ceil(needed - _EPS), lo))
        inputs["drained_yield_to"] = yield_to
    elif not failing and pin is None and not frozen and needed is not None and r is not None and r <= cfg.yield_margin:
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
