"""Observation and latency corrections (steps 1-2 of ``policy.py``): closed windows become
observations, forecasts are scored, and settled windows on warmed-up workers teach the
observed/expected latency corrections. Pure."""

from __future__ import annotations

from dataclasses import replace

from control_plane.planner.config import PlannerConfig, PoolConfig
from control_plane.planner.load_view import NS, PoolLoad, WindowStats
from control_plane.planner.policy_types import ERROR_ALPHA, MAX_HIT_RATE, Observation, PoolState
from control_plane.planner.profile import PerformanceProfile, erlang_c
from control_plane.planner.sizing import _cv
from control_plane.planner.trends import _score_horizon
from schemas.types import WorkerRole


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
