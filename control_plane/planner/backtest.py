"""Planner backtest: replay recorded load through the decision core under another config.

``read_log`` reads the ``workers`` topic from its start (registrations before the range are
needed to attribute requests to pools) and the ``requests`` topic from ``lookback_s`` before the
range, both up to its end, ordered by event time. ``run_backtest`` folds them into a
:class:`LoadView` and ticks :func:`decide` every ``tick_s`` of *event time*, just after a window
closes (:meth:`PlannerConfig.next_tick_ns`, as the live planner). The requests are
what really came; the replicas are counterfactual: a :class:`VirtualScaler` applies the
candidate's decisions (new replicas ready after ``startup_s``), and the snapshot the core sees
carries the virtual replicas instead of the recorded ones.

What the report compares, per pool:

* predicted vs actual request rate per window (the forecast the core made for each window);
* replica-seconds: candidate (virtual replicas, starting and draining included) vs recorded
  (workers registered and not yet deregistered, sampled every tick);
* SLO attainment: *recorded* is measured (good / judged completions in the log). The candidate
  never served anything, so both plans are also scored by the same capacity model: a window whose
  ready replicas ``r`` cover the replicas its actual load needed ``n`` (the core's sizing on the
  window's real rate, ISL, OSL and hit rate) counts as attained; otherwise the fraction ``r / n``
  of its requests does. ``estimated`` is that, request-weighted.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import msgspec

from control_plane.planner.config import PlannerConfig
from control_plane.planner.errors import PlannerConfigError
from control_plane.planner.load_view import NS, LoadSnapshot, LoadView, PoolLoad
from control_plane.planner.policy import PlannerState, PlannerTick, decide, needed_replicas
from control_plane.planner.predictors import PredictorKind
from control_plane.planner.scalers import VirtualScaler
from common.log.reader import read_events
from schemas.envelope import Envelope
from schemas.events import Event
from schemas.types import WorkerRole

log = logging.getLogger(__name__)

_REL = re.compile(r"^-(\d+(?:\.\d+)?)([smhd])$")


def parse_time(s: str, now_ns: int | None = None) -> int:
    """``now``, ``-30m`` (s/m/h/d), unix seconds, or an ISO 8601 time (UTC if no zone) -> ns."""
    now = time.time_ns() if now_ns is None else now_ns
    s = s.strip()
    if s == "now":
        return now
    m = _REL.match(s)
    if m:
        mult = {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
        return now - int(float(m.group(1)) * mult * NS)
    try:
        return int(float(s) * NS)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(s)
    except ValueError:
        raise PlannerConfigError(f"cannot read time {s!r}: use now, -30m, unix seconds or ISO 8601") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return int(dt.timestamp() * NS)


def read_log(bus, start_ns: int, end_ns: int, *, lookback_s: float = 600.0) -> list[Envelope[Event]]:
    """Events of the ``workers`` (from the start) and ``requests`` (from ``start - lookback``)
    topics up to ``end_ns``, ordered by event time (stable)."""
    out = [env for env in read_events(bus, "workers") if env.occurred_at_ns <= end_ns]
    since_ms = (start_ns - int(lookback_s * NS)) // 1_000_000
    out += [env for env in read_events(bus, "requests", since_ms=since_ms) if env.occurred_at_ns <= end_ns]
    out.sort(key=lambda e: e.occurred_at_ns)
    return out


@dataclass(frozen=True, slots=True)
class TickRecord:
    t_ns: int
    pool: str
    candidate_target: int
    candidate_ready: int
    recorded_active: int
    recorded_ready: int
    needed: float | None


@dataclass(frozen=True, slots=True)
class WindowRecord:
    pool: str
    end_ns: int
    actual_rate: float
    predicted_rate: float | None
    requests: int
    needed: float
    recorded_ready: float
    candidate_ready: float
    recorded_attainment: float | None


@dataclass
class BacktestReport:
    start_ns: int
    end_ns: int
    config_version: int
    predictor: str
    decisions: list[tuple[int, str, int, int, str]] = field(default_factory=list)
    ticks: list[TickRecord] = field(default_factory=list)
    windows: list[WindowRecord] = field(default_factory=list)
    candidate_replica_seconds: dict[str, float] = field(default_factory=dict)
    recorded_replica_seconds: dict[str, float] = field(default_factory=dict)

    def pools(self) -> list[str]:
        return sorted({w.pool for w in self.windows} | set(self.candidate_replica_seconds))

    def _estimated(self, which: str, pool: str | None = None) -> float | None:
        num = den = 0.0
        for w in self.windows:
            if pool is not None and w.pool != pool:
                continue
            ready = w.candidate_ready if which == "candidate" else w.recorded_ready
            cover = 1.0 if w.needed <= 0 else min(1.0, ready / w.needed)
            num += w.requests * cover
            den += w.requests
        return num / den if den else None

    def recorded_attainment(self, pool: str | None = None) -> float | None:
        num = den = 0.0
        for w in self.windows:
            if (pool is None or w.pool == pool) and w.recorded_attainment is not None:
                num += w.recorded_attainment * w.requests
                den += w.requests
        return num / den if den else None

    def forecast_error(self, pool: str | None = None) -> float | None:
        errs = [abs(w.predicted_rate - w.actual_rate) / max(w.predicted_rate, w.actual_rate)
                for w in self.windows if (pool is None or w.pool == pool) and w.predicted_rate is not None
                and max(w.predicted_rate, w.actual_rate) > 0]
        return sum(errs) / len(errs) if errs else None

    def summary(self) -> dict:
        cand = sum(self.candidate_replica_seconds.values())
        rec = sum(self.recorded_replica_seconds.values())
        return {
            "from": self.start_ns / NS, "to": self.end_ns / NS, "config_version": self.config_version,
            "predictor": self.predictor, "decisions": len(self.decisions),
            "candidate_replica_seconds": round(cand, 1), "recorded_replica_seconds": round(rec, 1),
            "replica_seconds_ratio": round(cand / rec, 4) if rec else None,
            "recorded_slo_attainment": _r(self.recorded_attainment()),
            "estimated_slo_attainment_candidate": _r(self._estimated("candidate")),
            "estimated_slo_attainment_recorded": _r(self._estimated("recorded")),
            "forecast_error": _r(self.forecast_error()),
        }

    def as_dict(self) -> dict:
        return {"summary": self.summary(),
                "decisions": [{"t": t / NS, "pool": p, "from": a, "to": b, "reason": r}
                              for t, p, a, b, r in self.decisions],
                "windows": [msgspec.to_builtins(w) for w in self.windows]}

    def text(self) -> str:
        s = self.summary()
        lines = [f"backtest {datetime.fromtimestamp(s['from'], timezone.utc):%Y-%m-%d %H:%M:%S} .. "
                 f"{datetime.fromtimestamp(s['to'], timezone.utc):%H:%M:%S} UTC, config v{s['config_version']}, "
                 f"predictor {s['predictor']}"]
        for t, p, a, b, r in self.decisions:
            lines.append(f"  {(t - self.start_ns) / NS:8.1f}s  {p}: {a} -> {b}  {r[:160]}")
        for pool in self.pools():
            lines.append(f"  pool {pool}: replica-seconds candidate {self.candidate_replica_seconds.get(pool, 0):.0f} "
                         f"vs recorded {self.recorded_replica_seconds.get(pool, 0):.0f}; SLO attainment recorded "
                         f"{_pct(self.recorded_attainment(pool))}, estimated candidate "
                         f"{_pct(self._estimated('candidate', pool))} vs recorded plan "
                         f"{_pct(self._estimated('recorded', pool))}; forecast error {_pct(self.forecast_error(pool))}")
        lines.append("RESULT " + " ".join(f"{k}={v}" for k, v in s.items() if k not in ("from", "to")))
        return "\n".join(lines)

    def plot(self, path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        pools = self.pools() or ["-"]
        fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
        for pool in pools:
            ws = [w for w in self.windows if w.pool == pool]
            x = [(w.end_ns - self.start_ns) / NS for w in ws]
            axes[0].plot(x, [w.actual_rate for w in ws], label=f"{pool} actual")
            axes[0].plot(x, [w.predicted_rate if w.predicted_rate is not None else math.nan for w in ws], "--",
                         label=f"{pool} predicted")
            ts = [t for t in self.ticks if t.pool == pool]
            tx = [(t.t_ns - self.start_ns) / NS for t in ts]
            axes[1].step(tx, [t.candidate_target for t in ts], where="post", label=f"{pool} candidate target")
            axes[1].step(tx, [t.recorded_active for t in ts], where="post", label=f"{pool} recorded", alpha=0.7)
            axes[1].plot(tx, [t.needed if t.needed is not None else math.nan for t in ts], ":", label=f"{pool} needed")
            axes[2].plot(x, [w.recorded_attainment if w.recorded_attainment is not None else math.nan for w in ws],
                         label=f"{pool} recorded")
            axes[2].plot(x, [1.0 if w.needed <= 0 else min(1.0, w.candidate_ready / w.needed) for w in ws], "--",
                         label=f"{pool} candidate (est.)")
        axes[0].set_ylabel("requests/s")
        axes[1].set_ylabel("replicas")
        axes[2].set_ylabel("SLO attainment")
        axes[2].set_xlabel("seconds since --from")
        for ax in axes:
            ax.legend(fontsize=7, loc="upper left")
            ax.grid(alpha=0.3)
        fig.suptitle(f"planner backtest (config v{self.config_version}, {self.predictor})")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def with_predictor(config: PlannerConfig, predictor: str | None) -> PlannerConfig:
    if predictor is None:
        return config
    kind = PredictorKind(predictor)
    return config.replace(pools=tuple(msgspec.structs.replace(p, predictor=kind) for p in config.pools))


def run_backtest(events: Sequence[Envelope[Event]] | Iterable[Envelope[Event]], config: PlannerConfig, *,
                 start_ns: int, end_ns: int, predictor: str | None = None, startup_s: float = 30.0,
                 drain_s: float = 5.0) -> BacktestReport:
    cfg = with_predictor(config, predictor)
    view = LoadView(cfg.load_view_config(), start_ns=start_ns)
    evs = sorted(events, key=lambda e: e.occurred_at_ns)
    i = 0
    while i < len(evs) and evs[i].occurred_at_ns <= start_ns:
        view.apply(evs[i])
        i += 1
    scaler = VirtualScaler(startup_s=startup_s, drain_s=drain_s)
    first = view.snapshot(start_ns)
    for pc in cfg.pools:
        scaler.seed(pc.name, WorkerRole(pc.role), first.pool(pc.name).replicas.active, now_ns=start_ns)
    state = PlannerState().with_targets({pc.name: first.pool(pc.name).replicas.active for pc in cfg.pools})
    report = BacktestReport(start_ns, end_ns, cfg.version,
                            ",".join(sorted({p.predictor.value for p in cfg.pools})) or "-")
    tick = int(cfg.tick_s * NS)
    rec_rs = {pc.name: 0.0 for pc in cfg.pools}
    forecasts: dict[tuple[str, int], float] = {}
    prev, t = start_ns, cfg.next_tick_ns(start_ns)  # ticks as the live planner's
    while t <= end_ns:
        while i < len(evs) and evs[i].occurred_at_ns <= t:
            view.apply(evs[i])
            i += 1
        recorded = view.snapshot(t)
        pools = tuple(PoolLoad(pool=pl.pool, role=pl.role, replicas=scaler.counts(pl.pool, t),
                               workers=scaler.workers(pl.pool, t), windows=pl.windows, hopping=pl.hopping)
                      for pl in (recorded.pool(pc.name) for pc in cfg.pools))
        decision, state = decide(t, LoadSnapshot(now_ns=t, pools=pools, watermark_ns=recorded.watermark_ns),
                                 cfg, state)
        _record(report, decision, recorded, scaler, t, forecasts)
        for eff in decision.effects:
            scaler.apply(eff.event, now_ns=t)
        for pc in cfg.pools:
            reps = recorded.pool(pc.name).replicas
            rec_rs[pc.name] += (reps.active + reps.draining) * (t - prev) / NS
        prev, t = t, cfg.next_tick_ns(t)
    # windows of the range, judged against the load that really came
    final = view.snapshot(end_ns + int(cfg.grace_s * NS), history=10_000)
    ready_at = {(r.pool, r.t_ns): r for r in report.ticks}
    for pc in cfg.pools:
        for w in final.pool(pc.name).windows:
            if w.start_ns < start_ns or w.end_ns > end_ns:
                continue
            hit = w.prefix_hit_rate or 0.0
            need = needed_replicas(pc, cfg, w.arrival_rate, w.isl_mean or 0.0, w.osl_mean or 0.0, hit)
            samples = [r for (p, tt), r in ready_at.items() if p == pc.name and w.start_ns < tt <= w.end_ns + tick]
            cand = min((r.candidate_ready for r in samples), default=0)
            rec = min((r.recorded_ready for r in samples), default=0)
            report.windows.append(WindowRecord(
                pool=pc.name, end_ns=w.end_ns, actual_rate=w.arrival_rate,
                predicted_rate=forecasts.get((pc.name, w.end_ns)), requests=max(w.arrivals, w.completions),
                needed=need, recorded_ready=rec, candidate_ready=cand, recorded_attainment=w.slo_attainment))
        report.candidate_replica_seconds[pc.name] = scaler.replica_seconds(pc.name, start_ns, end_ns)
        report.recorded_replica_seconds[pc.name] = rec_rs[pc.name]
    return report


def _record(report: BacktestReport, decision: PlannerTick, recorded: LoadSnapshot, scaler: VirtualScaler, t: int,
            forecasts: dict[tuple[str, int], float]) -> None:
    for eff in decision.effects:
        report.decisions.append((t, eff.pool, eff.from_replicas, eff.to_replicas, eff.reason))
    for r in decision.reports:
        if r.forecast_rate is not None and r.forecast_for_ns:
            forecasts[(r.pool, r.forecast_for_ns)] = r.forecast_rate
        reps = recorded.pool(r.pool).replicas
        report.ticks.append(TickRecord(t, r.pool, r.target, scaler.counts(r.pool, t).ready, reps.active, reps.ready,
                                       r.needed))
