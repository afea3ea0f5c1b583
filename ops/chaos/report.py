"""The verdict of a chaos run: pure folds of what the client recorded, what the log holds and
what the ack ledgers say, into figures that must be zero and figures that describe.

Must be zero (or one), else the command exits non-zero:

* ``acked_lost``: events a producer was told were acknowledged that the log does not hold (or
  holds only where the consumers' dedupe drops them, or at another offset);
* ``duplicates``: events the consumers' sequence dedupe would deliver twice;
* ``gaps``: holes in a producer's per-partition sequence no failed delivery explains;
* ``views_equal_oracle`` = 1: every live router's view digest equals the oracle fold of the log
  at the positions that router reports;
* ``unended``: admitted requests whose end (``RequestCompleted``, ``RequestRejected``, or
  ``RequestFailed`` with ``retried=False``) is not on the log;
* ``silent_failures``: requests the client saw fail whose failure the log does not explain (no
  ``RequestRejected`` / final ``RequestFailed`` for the router's id of the request);
* ``unrecovered``: faults after which the component or the traffic did not come back;
* ``crashed``: Switchyard processes that exited on their own (a crash, not a fault: say a
  segfault in a client library), whenever it happened and whatever came back after it.

Described: recovery and failover times, failures and rejections by reason (client and log),
what the overload phase shed (rejected, with reasons) and failed, the client-measured TTFT of
the requests served (p50/p99 before and during the overload phase: whether admission kept
its promise to those it let in; during it also as the routers measured it from admission, the
difference being the time before the router took the request), and client errors of requests the log never admitted (a
connection cut before admission: the fault itself, e.g. a killed router).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ops.chaos.load import Sent
from ops.chaos.plan import BROKER_FAULTS, Plan
from common.log.acks import LedgerCheck
from schemas import Envelope
from schemas.events import RequestAdmitted, RequestCompleted, RequestFailed, RequestRejected


@dataclass
class FaultRecord:
    """One injected fault as it happened. Times are seconds of load."""

    kind: str
    planned_s: float
    at_s: float
    target: str = ""
    #: The component healthy again (see ops/chaos/run.py for each kind's condition).
    healthy_s: float | None = None
    #: The end of the first request sent after the fault that was served in full.
    traffic_s: float | None = None
    #: Broker faults: injection -> first acknowledged produce of an event published after it.
    failover_s: float | None = None
    #: Planner: kill of the leader -> another replica holds the lease.
    takeover_s: float | None = None
    #: Disk full: block writes the worker's disk tier refused while it was full (ENOSPC).
    refused_writes: int | None = None
    recovered: bool = False
    error: str = ""

    @property
    def recovery_s(self) -> float | None:
        if not self.recovered or self.healthy_s is None or self.traffic_s is None:
            return None
        return max(self.healthy_s, self.traffic_s) - self.at_s


@dataclass(frozen=True)
class ViewCheck:
    router: str
    equal: bool
    digest: str
    oracle_digest: str
    applied: int
    error: str = ""


@dataclass(frozen=True)
class End:
    """How the log ended a request."""

    kind: str  # completed | rejected | failed
    code: str = ""
    #: A completion's TTFT as its router measured it (from its admission), ms.
    ttft_ms: float | None = None


def request_ends(events: list[Envelope]) -> tuple[dict[str, str | None], dict[str, End]]:
    """(admitted router id -> client id, router id -> its end) from the requests stream. Pure."""
    admitted: dict[str, str | None] = {}
    ended: dict[str, End] = {}
    for env in events:
        d = env.data
        if isinstance(d, RequestAdmitted):
            admitted[d.request_id] = d.client_request_id
        elif isinstance(d, RequestCompleted):
            ended.setdefault(d.request_id, End("completed", ttft_ms=d.ttft_ms))
        elif isinstance(d, RequestRejected):
            ended.setdefault(d.request_id, End("rejected", d.code))
        elif isinstance(d, RequestFailed) and not d.retried:
            ended.setdefault(d.request_id, End("failed", d.code))
    return admitted, ended


@dataclass(frozen=True)
class ChaosReport:
    plan: dict
    faults: list[dict]
    requests: dict
    checks: dict
    ledger: str
    views: list[dict]
    overload: dict
    failures_by_reason: dict
    log_ends_by_reason: dict
    unadmitted_client_errors: dict
    examples: dict = field(default_factory=dict)
    lag: list = field(default_factory=list)
    #: Where it ran: topic prefix (in every process's id), state and report dirs.
    system: dict = field(default_factory=dict)

    #: Figures that must be 0, and the one that must be 1.
    ZERO = ("acked_lost", "duplicates", "gaps", "unended", "silent_failures", "unrecovered", "crashed")

    @property
    def ok(self) -> bool:
        return all(self.checks[k] == 0 for k in self.ZERO) and self.checks["views_equal_oracle"] == 1

    def result_line(self) -> str:
        c = self.checks
        return (f"RESULT faults={c['faults']} acked_lost={c['acked_lost']} duplicates={c['duplicates']} "
                f"gaps={c['gaps']} views_equal_oracle={c['views_equal_oracle']} unended={c['unended']} "
                f"silent_failures={c['silent_failures']} unrecovered={c['unrecovered']} crashed={c['crashed']} "
                f"max_recovery_s={_fmt(c['max_recovery_s'])} broker_failover_s={_fmt(c['broker_failover_s'])} "
                f"overload_rejected={self.overload['rejected']} overload_failed={self.overload['failed']}")

    def summary(self) -> list[str]:
        r = self.requests
        lines = [f"requests   {r['sent']} sent: {r['ok']} ok, {r['rejected']} rejected, {r['failed']} failed, "
                 f"{r['unfinished']} unfinished; {r['admitted']} admitted on the log"]
        for f in self.faults:
            extra = "".join(f", {k.removesuffix('_s')} {f[k]:.2f} s" for k in ("failover_s", "takeover_s")
                            if f.get(k) is not None)
            if f.get("refused_writes") is not None:
                extra += f", {f['refused_writes']} writes refused"
            state = f"recovery {f['recovery_s']:.1f} s" if f["recovered"] else f"NOT RECOVERED: {f['error'][:120]}"
            lines.append(f"fault      {f['kind']:13s} {f['target']:12s} at {f['at_s']:6.1f} s  {state}{extra}")
        for c in self.checks.get("crashes", []):
            lines.append(f"CRASHED    {c}")
        lines.append(f"ledger     {self.ledger}")
        for v in self.views:
            lines.append(f"view       {v['router']}: {'equal to' if v['equal'] else 'DIFFERS from'} the oracle "
                         f"({v['applied']} applied){' ' + v['error'] if v['error'] else ''}")
        if self.failures_by_reason:
            lines.append("not ok     " + ", ".join(f"{k} {v}" for k, v in self.failures_by_reason.items()))
        if self.unadmitted_client_errors:
            lines.append("unadmitted " + ", ".join(f"{k} {v}" for k, v in self.unadmitted_client_errors.items())
                         + " (no answer and never admitted: cut by a fault before the router logged it)")
        o = self.overload
        why = ", ".join(f"{k} {v}" for k, v in o["rejected_by_reason"].items()) or "none"
        lines.append(f"overload   {o['sent']} sent: {o['ok']} ok, {o['rejected']} rejected ({why}), "
                     f"{o['failed']} failed; served TTFT p50 {_fmt(o['ttft_ms_p50'])} / p99 "
                     f"{_fmt(o['ttft_ms_p99'])} ms (before it: p50 {_fmt(r['ttft_ms_p50'])} / p99 "
                     f"{_fmt(r['ttft_ms_p99'])} ms); by its router from admission: p50 "
                     f"{_fmt(o['router_ttft_ms_p50'])} / p99 {_fmt(o['router_ttft_ms_p99'])} ms; the client's "
                     f"own loop lag p50 {_fmt(o['client_loop_lag_ms_p50'])} / p99 "
                     f"{_fmt(o['client_loop_lag_ms_p99'])} ms")
        for k, ex in self.examples.items():
            if ex:
                lines.append(f"{k:10s} e.g. {', '.join(map(str, ex[:5]))}")
        return lines

    def as_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        d["result"] = self.result_line()
        return d

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.as_dict(), indent=2, default=str))
        return path


def _fmt(x: float | None) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


def _pcts(xs: list[float], name: str = "ttft_ms") -> dict[str, float | None]:
    """p50 and p99 (nearest rank) of ``xs`` as ``<name>_p50`` / ``<name>_p99``; None: no value."""
    xs = sorted(xs)
    return {f"{name}_p{q}": xs[max(0, math.ceil(q / 100 * len(xs)) - 1)] if xs else None for q in (50, 99)}


def build_report(plan: Plan, faults: list[FaultRecord], sent: list[Sent], events: list[Envelope],
                 ledger: LedgerCheck, views: list[ViewCheck], lag: list | None = None,
                 crashes: list[str] | tuple[str, ...] = (),
                 client_loop_lag: list[tuple[float, float]] | None = None) -> ChaosReport:
    """Fold the run into the report. Pure. ``client_loop_lag``: (seconds of load, lag s) samples
    of the load generator's own event loop (its percentiles in the overload phase are reported:
    a client that runs late measures its own lateness as TTFT)."""
    admitted, ended = request_ends(events)
    by_client = {cid: rid for rid, cid in admitted.items() if cid}
    unended = sorted(set(admitted) - set(ended))

    silent: list[str] = []
    unadmitted: Counter[str] = Counter()
    failures: Counter[str] = Counter()
    done = [s for s in sent if s.done]
    for s in done:
        r = s.result
        if r.ok:
            continue
        failures[s.outcome] += 1
        rid = r.router_request_id or by_client.get(s.client_id)
        if not rid or rid not in admitted:
            # No answer and no admission on the log: the connection was cut before the router
            # logged the request (a killed replica), which the client knows as an exception.
            if r.status == 0:
                unadmitted[r.code] += 1
                continue
            silent.append(s.client_id)  # an HTTP answer with an error, and nothing on the log
            continue
        end = ended.get(rid)
        if end is None or end.kind == "completed":
            silent.append(s.client_id)

    ov = [s for s in done if s.overload]
    ov_rejected = [s for s in ov if s.result.rejected]
    ov_failed = [s for s in ov if not s.result.ok and not s.result.rejected]
    recoveries = [f.recovery_s for f in faults if f.recovery_s is not None]
    failovers = [f.failover_s for f in faults if f.kind in BROKER_FAULTS and f.failover_s is not None]
    acked_lost = len(ledger.missing) + len(ledger.undelivered) + len(ledger.moved)
    checks = {
        "faults": len(faults),
        "acked_lost": acked_lost,
        "duplicates": len(ledger.survive_dedupe),
        "gaps": len(ledger.gaps),
        "views_equal_oracle": int(bool(views) and all(v.equal for v in views)),
        "unended": len(unended),
        "silent_failures": len(silent),
        "unrecovered": sum(1 for f in faults if not f.recovered) + (len(plan.faults) - len(faults)),
        "crashed": len(crashes),
        "crashes": list(crashes),
        "max_recovery_s": max(recoveries) if recoveries else None,
        "broker_failover_s": max(failovers) if failovers else None,
        "raw_duplicates": len(ledger.duplicates),
        "acked": ledger.acked,
    }
    return ChaosReport(
        plan=plan.as_dict(),
        faults=[{**asdict(f), "recovery_s": f.recovery_s} for f in faults],
        requests={"sent": len(sent), "ok": sum(1 for s in done if s.result.ok),
                  "rejected": sum(1 for s in done if s.result.rejected),
                  "failed": sum(1 for s in done if not s.result.ok and not s.result.rejected),
                  "unfinished": len(sent) - len(done), "admitted": len(admitted),
                  "failovers_to_another_replica": sum(1 for s in done if s.attempts > 1),
                  **_pcts([s.result.ttft_ms for s in done if s.result.ok and not s.overload])},
        checks=checks,
        ledger=ledger.summary(),
        views=[asdict(v) for v in views],
        overload={"sent": len(ov), "ok": sum(1 for s in ov if s.result.ok), "rejected": len(ov_rejected),
                  "failed": len(ov_failed),
                  "rejected_by_reason": dict(Counter(s.result.code for s in ov_rejected).most_common()),
                  "failed_by_reason": dict(Counter(s.result.code for s in ov_failed).most_common()),
                  **_pcts([s.result.ttft_ms for s in ov if s.result.ok]),
                  **_pcts([lag * 1000 for t, lag in client_loop_lag or () if plan.overload is not None
                           and plan.overload.covers(t)], "client_loop_lag_ms"),
                  **_pcts([e.ttft_ms for s in ov if s.result.ok and (e := ended.get(
                      s.result.router_request_id or by_client.get(s.client_id, ""))) is not None
                      and e.ttft_ms is not None], "router_ttft_ms")},
        failures_by_reason=dict(failures.most_common()),
        log_ends_by_reason=dict(Counter(f"{e.kind}:{e.code}" if e.code else e.kind
                                        for e in ended.values()).most_common()),
        unadmitted_client_errors=dict(unadmitted.most_common()),
        examples={"unended": unended[:10], "silent": silent[:10],
                  "lost": [e.event_id for e in ledger.missing[:10]],
                  "gaps": [f"{g.topic}:{g.partition} {g.producer} {g.first}..{g.last}" for g in ledger.gaps[:10]]},
        lag=list(lag or []),
    )


def plot_timeline(report: ChaosReport, sent: list[Sent], path: Path) -> Path:
    """Faults, TTFT, errors and the routers' view lag on one time axis (seconds of load)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ttft, ax_err, ax_lag) = plt.subplots(3, 1, figsize=(13, 8), sharex=True,
                                                  gridspec_kw={"height_ratios": [3, 1.5, 1.5]})
    ok = [s for s in sent if s.ok]
    ax_ttft.scatter([s.sent_s for s in ok], [s.result.ttft_ms for s in ok], s=4, label="TTFT (ok)")
    ax_ttft.set(ylabel="TTFT ms", yscale="log")
    bad = [s for s in sent if s.done and not s.ok]
    kinds = sorted({s.outcome for s in bad})
    for k in kinds:
        xs = [s.sent_s for s in bad if s.outcome == k]
        ax_err.scatter(xs, [kinds.index(k)] * len(xs), s=8, label=k)
    ax_err.set_yticks(range(len(kinds)), kinds, fontsize=7)
    ax_err.set(ylabel="errors")
    for router in sorted({x[1] for x in report.lag}):
        pts = [(t, lag) for t, r, lag, _ in report.lag if r == router]
        ax_lag.plot([t for t, _ in pts], [v for _, v in pts], label=router)
    ax_lag.set(ylabel="view lag (events)", xlabel="seconds of load")
    if report.lag:
        ax_lag.legend(fontsize=7)
    ov = report.plan.get("overload")
    for ax in (ax_ttft, ax_err, ax_lag):
        if ov:
            ax.axvspan(ov["start_s"], ov["end_s"], color="orange", alpha=0.15)
        for f in report.faults:
            ax.axvline(f["at_s"], color="red" if not f["recovered"] else "grey", lw=0.8, ls="--")
            if f.get("recovery_s") is not None:
                ax.axvspan(f["at_s"], f["at_s"] + f["recovery_s"], color="red", alpha=0.07)
    for f in report.faults:
        ax_ttft.annotate(f["kind"], (f["at_s"], 1), xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                         va="top", ha="right")
    fig.suptitle(report.result_line().removeprefix("RESULT "), fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
