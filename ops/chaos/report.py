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
from bisect import bisect_left, bisect_right
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import msgspec

from ops.chaos.load import Sent
from ops.chaos.plan import BROKER_FAULTS, Plan
from common.log.acks import LedgerCheck
from schemas import Envelope
from schemas.events import AdmissionTerms, RequestAdmitted, RequestCompleted, RequestFailed, RequestRejected, RequestRouted
from schemas.types import RequestPhase


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
    #: A rejection's or failure's reason as recorded.
    reason: str = ""


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
            ended.setdefault(d.request_id, End("rejected", d.code, reason=d.reason))
        elif isinstance(d, RequestFailed) and not d.retried:
            ended.setdefault(d.request_id, End("failed", d.code, reason=d.reason))
    return admitted, ended


@dataclass(frozen=True)
class FirstRoute:
    """A request's first prefilling decision as recorded: what the router promised."""

    predicted_ttft_ms: float | None
    queued_ms: float
    #: The worker chosen, the workers excluded (failed attempts, or a detour around a worker
    #: that broke the TTFT budget), and the budget test's terms (None: the budget was off).
    worker_id: str = ""
    admission: AdmissionTerms | None = None
    excluded_workers: tuple[str, ...] = ()


def first_routes(events: list[Envelope]) -> dict[str, FirstRoute]:
    """Router id -> its first prefilling decision (aggregated or prefill phase). Pure."""
    out: dict[str, FirstRoute] = {}
    for env in events:
        d = env.data
        if isinstance(d, RequestRouted) and d.phase is not RequestPhase.DECODE and d.request_id not in out:
            out[d.request_id] = FirstRoute(d.predicted_ttft_ms, d.queued_ms, d.worker_id, d.admission,
                                          tuple(d.excluded_workers))
    return out


def client_lag_ms(lag: list[tuple[float, float]], s: Sent) -> float | None:
    """The longest the client's own loop was seen late (ms; one sample every 50 ms) while ``s``
    waited for its first token: a first token that arrived then was read that much late, which
    is the client's, not the system's. None when ``s`` was not served or nothing was sampled."""
    if not (s.ok and lag):
        return None
    end = s.sent_s + s.result.ttft_ms / 1000
    # A sample at t late by L says the loop was blocked over [t - L, t].
    lags = [x for t, x in lag[bisect_left(lag, (s.sent_s,)):bisect_right(lag, (end + 1.0,))] if t - x <= end]
    return max(lags) * 1000 if lags else 0.0


def request_rows(sent: list[Sent], events: list[Envelope],
                 client_loop_lag: list[tuple[float, float]] | None = None,
                 wall_t0: float | None = None) -> list[dict]:
    """One row per request sent, the client's record beside the log's (the router's TTFT from
    admission, its first prediction, the worker it chose, the budget test's terms, its
    queueing, its end): what ``requests.jsonl`` holds, to blame a missed TTFT on the client,
    the router, the prediction or the admission test. The client's own share:
    ``send_late_ms`` (the generator sent it that late against its arrival schedule; not in its
    TTFT) and ``client_lag_ms`` (:func:`client_lag_ms`: in its TTFT). Pure.

    With ``wall_t0`` (the wall clock at the load's start, :attr:`OpenLoopLoad.wall_t0`), the
    part of the client's TTFT the router never saw is split in two: ``inbound_ms``, from the
    client's send to the router's ``RequestAdmitted`` (the connection, the router's accept and
    its loop, the body and its tokens), and ``outbound_ms``, the rest (the first token's way
    back: the router's write, the client's read). One machine, one wall clock."""
    lag = sorted(client_loop_lag or ())
    admitted, ended = request_ends(events)
    admitted_at = {env.data.request_id: env.occurred_at_ns / 1e9 for env in events
                   if isinstance(env.data, RequestAdmitted)}
    by_client = {cid: rid for rid, cid in admitted.items() if cid}
    routes = first_routes(events)
    rows = []
    for s in sent:
        r = s.result
        rid = (r.router_request_id if r else "") or by_client.get(s.client_id, "")
        e, fr = ended.get(rid), routes.get(rid)
        inbound = (None if wall_t0 is None or rid not in admitted_at
                   else round((admitted_at[rid] - wall_t0 - s.sent_s) * 1000, 1))
        outbound = (round(r.ttft_ms - inbound - e.ttft_ms, 1)
                    if inbound is not None and r and r.ok and e and e.ttft_ms is not None else None)
        rows.append({"client_id": s.client_id, "sent_s": round(s.sent_s, 4), "overload": s.overload,
                     "replica": s.replica, "outcome": s.outcome, "request_id": rid,
                     "ttft_ms": r.ttft_ms if r and r.ok else None,
                     "router_ttft_ms": e.ttft_ms if e else None,
                     "predicted_ttft_ms": fr.predicted_ttft_ms if fr else None,
                     "queued_ms": fr.queued_ms if fr else None,
                     "worker_id": fr.worker_id if fr else None,
                     "excluded_workers": list(fr.excluded_workers) if fr else [],
                     "admission": msgspec.to_builtins(fr.admission) if fr and fr.admission else None,
                     "end": f"{e.kind}:{e.code}" if e and e.code else (e.kind if e else None),
                     "reason": e.reason if e else "",
                     "send_late_ms": None if s.send_late_ms is None else round(s.send_late_ms, 1),
                     "client_lag_ms": client_lag_ms(lag, s),
                     "inbound_ms": inbound, "outbound_ms": outbound})
    return rows


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
    #: The same figures as ``overload`` (but the client's loop lag) outside the overload phase,
    #: and ``quiet``: outside it and outside every fault's injection-to-recovery window (where
    #: nothing healthy should be shed).
    outside: dict = field(default_factory=dict)
    quiet: dict = field(default_factory=dict)
    #: The routers' TTFT budget (ms; 0: off).
    slo_ms: float = 0.0

    #: Figures that must be 0, and the one that must be 1.
    ZERO = ("acked_lost", "duplicates", "gaps", "unended", "silent_failures", "unrecovered", "crashed",
            "rejections_without_reason")

    @property
    def ok(self) -> bool:
        return all(self.checks[k] == 0 for k in self.ZERO) and self.checks["views_equal_oracle"] == 1

    def result_line(self) -> str:
        c = self.checks
        return (f"RESULT faults={c['faults']} acked_lost={c['acked_lost']} duplicates={c['duplicates']} "
                f"gaps={c['gaps']} views_equal_oracle={c['views_equal_oracle']} unended={c['unended']} "
                f"silent_failures={c['silent_failures']} unrecovered={c['unrecovered']} crashed={c['crashed']} "
                f"max_recovery_s={_fmt(c['max_recovery_s'])} broker_failover_s={_fmt(c['broker_failover_s'])} "
                f"overload_rejected={self.overload['rejected']} overload_failed={self.overload['failed']} "
                f"rejections_without_reason={c['rejections_without_reason']} slo_ms={self.slo_ms:g} "
                f"overload_ttft_p99_ms={_fmt(self.overload.get('ttft_ms_p99'))} "
                f"overload_over_slo={self.overload.get('over_slo', 0)} "
                f"overload_over_slo_client={self.overload.get('over_slo_client', 0)} "
                f"overload_send_late_p99_ms={_fmt(self.overload.get('send_late_ms_p99'))} "
                f"overload_shed={self.overload.get('shed', 0.0):.3f} "
                f"outside_shed={self.outside.get('shed', 0.0):.3f} quiet_shed={self.quiet.get('shed', 0.0):.3f}")

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
        for name, o in (("overload", self.overload), ("outside", self.outside), ("quiet", self.quiet)):
            if not o:
                continue
            why = ", ".join(f"{k} {v}" for k, v in o["rejected_by_reason"].items()) or "none"
            line = (f"{name:10s} {o['sent']} sent: {o['ok']} ok, {o['rejected']} rejected ({why}), "
                    f"{o['failed']} failed; served TTFT p50 {_fmt(o['ttft_ms_p50'])} / p99 "
                    f"{_fmt(o['ttft_ms_p99'])} ms")
            if "over_slo" in o:
                line += (f" ({o['over_slo']} over the {self.slo_ms:g} ms SLO, {o.get('over_slo_client', 0)} of them "
                         f"within it but for the client's own loop lag); sent late by the generator p50 "
                         f"{_fmt(o.get('send_late_ms_p50'))} / p99 {_fmt(o.get('send_late_ms_p99'))} ms; by its router from admission: p50 "
                         f"{_fmt(o['router_ttft_ms_p50'])} / p99 {_fmt(o['router_ttft_ms_p99'])} ms; predicted p50 "
                         f"{_fmt(o['predicted_ttft_ms_p50'])} / p99 {_fmt(o['predicted_ttft_ms_p99'])} ms; unseen "
                         f"by the router p50 {_fmt(o['unseen_ms_p50'])} / p99 {_fmt(o['unseen_ms_p99'])} ms")
            if "client_loop_lag_ms_p50" in o:
                line += (f"; the client's own loop lag p50 {_fmt(o['client_loop_lag_ms_p50'])} / p99 "
                         f"{_fmt(o['client_loop_lag_ms_p99'])} ms (late {_fmt(o['client_loop_late_share'])} "
                         f"of the time), the routers' (smoothed, 1 s samples) p50 "
                         f"{_fmt(o['router_loop_lag_ms_p50'])} / p99 {_fmt(o['router_loop_lag_ms_p99'])} ms")
            lines.append(line)
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


def _phase(sent: list[Sent], ended: dict[str, End], routes: dict[str, FirstRoute], rid_of, slo_ms: float,
           lag: list[tuple[float, float]] = ()) -> dict:
    """One phase's figures (requests that ended at the client): what was served and how fast
    (at the client from its send, by the router from admission, as predicted at the first
    decision, and the part the router never saw: client TTFT less the router's), what was shed
    and why. ``over_slo``: served requests whose client TTFT exceeds ``slo_ms`` (when > 0);
    ``over_slo_client``: those of them within it once the client's own loop lag while they
    waited (:func:`client_lag_ms`, from the sorted samples ``lag``) is taken off: the client's.
    ``send_late_ms``: how late the generator sent them against its arrival schedule."""
    ok = [s for s in sent if s.result.ok]
    rejected = [s for s in sent if s.result.rejected]
    failed = [s for s in sent if not s.result.ok and not s.result.rejected]
    router, predicted, unseen = [], [], []
    for s in ok:
        rid = rid_of(s)
        if (e := ended.get(rid)) is not None and e.ttft_ms is not None:
            router.append(e.ttft_ms)
            unseen.append(s.result.ttft_ms - e.ttft_ms)
        if (fr := routes.get(rid)) is not None and fr.predicted_ttft_ms is not None:
            predicted.append(fr.predicted_ttft_ms)
    return {"sent": len(sent), "ok": len(ok), "rejected": len(rejected), "failed": len(failed),
            "shed": round(len(rejected) / len(sent), 4) if sent else 0.0,
            "rejected_by_reason": dict(Counter(s.result.code for s in rejected).most_common()),
            "failed_by_reason": dict(Counter(s.result.code for s in failed).most_common()),
            "over_slo": sum(1 for s in ok if s.result.ttft_ms > slo_ms) if slo_ms > 0 else 0,
            "over_slo_client": sum(1 for s in ok if s.result.ttft_ms > slo_ms >= s.result.ttft_ms
                                   - (client_lag_ms(lag, s) or 0.0)) if slo_ms > 0 else 0,
            **_pcts([s.result.ttft_ms for s in ok]), **_pcts(router, "router_ttft_ms"),
            **_pcts(predicted, "predicted_ttft_ms"), **_pcts(unseen, "unseen_ms"),
            **_pcts([s.send_late_ms for s in sent if s.send_late_ms is not None], "send_late_ms")}


def build_report(plan: Plan, faults: list[FaultRecord], sent: list[Sent], events: list[Envelope],
                 ledger: LedgerCheck, views: list[ViewCheck], lag: list | None = None,
                 crashes: list[str] | tuple[str, ...] = (),
                 client_loop_lag: list[tuple[float, float]] | None = None, slo_ms: float = 0.0) -> ChaosReport:
    """Fold the run into the report. Pure. ``client_loop_lag``: (seconds of load, lag s) samples
    of the load generator's own event loop (its percentiles in the overload phase are reported:
    a client that runs late measures its own lateness as TTFT). ``slo_ms``: the routers' TTFT
    budget (0: off), which the served requests' client TTFT is held to."""
    admitted, ended = request_ends(events)
    by_client = {cid: rid for rid, cid in admitted.items() if cid}
    unended = sorted(set(admitted) - set(ended))
    lag_sorted = sorted(client_loop_lag or ())

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
    routes = first_routes(events)

    def rid_of(s: Sent) -> str:
        return s.result.router_request_id or by_client.get(s.client_id, "")

    # A rejection without a reason: the client got no error code, or the log holds no
    # RequestRejected with a code and a reason for it; or any RequestRejected on the log
    # without one.
    unreasoned = {rid_of(s) or s.client_id for s in done if s.result.rejected and (
        not s.result.code or s.result.code.startswith("http_")
        or (e := ended.get(rid_of(s))) is None or e.kind != "rejected" or not e.code or not e.reason)}
    unreasoned |= {rid for rid, e in ended.items() if e.kind == "rejected" and not (e.code and e.reason)}

    def during_fault(t: float) -> bool:
        return any(f.at_s <= t <= f.at_s + (f.recovery_s if f.recovery_s is not None else math.inf)
                   for f in faults)

    outside = [s for s in done if not s.overload]
    quiet = [s for s in outside if not during_fault(s.sent_s)]
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
        "rejections_without_reason": len(unreasoned),
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
        overload={**_phase(ov, ended, routes, rid_of, slo_ms, lag_sorted),
                  **_pcts([lag * 1000 for t, lag in client_loop_lag or () if plan.overload is not None
                           and plan.overload.covers(t)], "client_loop_lag_ms"),
                  # Per sample, a loop blocked 0.5 s counts once among many on-time samples: the
                  # share of the phase's time the client's loop spent late says it as it was.
                  "client_loop_late_share": round(sum(
                      lag for t, lag in client_loop_lag or () if plan.overload is not None
                      and plan.overload.covers(t)) / (plan.overload.end_s - plan.overload.start_s), 3)
                  if plan.overload is not None and plan.overload.end_s > plan.overload.start_s else None,
                  **_pcts([x[4] for x in lag or () if len(x) > 4 and plan.overload is not None
                           and plan.overload.covers(x[0])], "router_loop_lag_ms")},
        outside=_phase(outside, ended, routes, rid_of, slo_ms, lag_sorted),
        quiet=_phase(quiet, ended, routes, rid_of, slo_ms, lag_sorted),
        slo_ms=slo_ms,
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
        pts = [(x[0], x[2]) for x in report.lag if x[1] == router]
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
