"""The overload loop (issue 35; step 6 of ``policy.py``): breaches of what users feel, the
measured service rate, and the sizing for arrivals plus backlog at that rate. Pure."""

from __future__ import annotations

from dataclasses import replace

from control_plane.planner.config import PlannerConfig, PoolConfig
from control_plane.planner.load_view import NS, PoolLoad, WindowStats
from control_plane.planner.policy_types import InputValue, PoolState
from control_plane.planner.profile import PerformanceProfile
from schemas.types import WorkerRole


def _overload(ps: PoolState, load: PoolLoad, pc: PoolConfig, cfg: PlannerConfig, prof: PerformanceProfile,
              now: int, new: list[WindowStats]) -> tuple[PoolState, str, bool]:
    """The closed loop's observations: (state, the breach that holds now or "", whether a queue
    breaches now). A window's attainment lags (its completions waited earlier); a queue is what
    users will feel next: a pool in overload without one has drained its backlog.

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

    queued = bool(breaches)
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
    return ps, "; ".join(breaches), queued


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
