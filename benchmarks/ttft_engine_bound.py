"""How well any TTFT model could predict a ``bench e2e`` run, given what the router knows (issue 39).

For each topic prefix given (a ``bench e2e`` run's: 2 prefill + 2 decode simulated workers on the
mocker profile), the simulated engine itself (``EngineCore("mocker")``, the workers' own) replays
each prefill worker's requests twice, with their prompt lengths and each prefill's cached tokens
(the prompts are fresh tokens, and each request's hit is left to the engine: a few blocks here):

* ``as_taken``: each request reaching the engine when the worker took it (``PrefillCompleted``:
  its publish time less ``duration_ms``), in that order: what happened, with the box's noise
  left out;
* ``as_routed``: each request reaching it the median hop after the router's decision
  (``RequestRouted.decided_at_s``), so in the router's order: what the router knows.

The error of ``as_routed`` (plus the median hop) against ``as_taken`` (plus each request's own
hop): |predicted - observed| / observed of the time from the decision to the prefill's end, is what an exact engine model
would get in the router's order. Against the engine admitting a step's arrivals in the router's
order (``EngineRequest.router_order``: ``as_taken_in_order``) it is what remains when the
workers keep that order. ``whole``: the whole TTFT observed (as ``switchyard replay reconcile``
reads it) against ``as_routed`` plus the median hop and the median rest after the prefill worker
(the way back, the decode decision, the transfer, the decode worker's first step): what no model
of the router's information can beat, the hops' jitter included. Routing is not replayed; the
runs' choices stand.

Run: ``uv run python -m benchmarks.ttft_engine_bound <prefix> [<prefix> ...]`` (the stack's
variables exported). Last line: ``RESULT logs=... fcfs_err_p50_worst=... fcfs_err_p90_worst=...
in_order_err_p50_worst=... in_order_err_p90_worst=... whole_err_p50_worst=... whole_err_p90_worst=...``.
"""

from __future__ import annotations

import random

from benchmarks.e2e_logs import over_runs
from control_plane.replay.reconcile import _quantile
from data_plane.engines.core import EngineCore
from data_plane.engines.request import EngineRequest
from schemas.envelope import Envelope
from schemas.events import PrefillCompleted, RequestAdmitted, RequestCompleted, RequestRouted
from schemas.types import RequestPhase, WorkerRole


def prefills(envs: list[Envelope]) -> list[dict]:
    """Per disaggregated request: its prefill worker, when the router decided (s), when the
    worker took it (s), its prompt tokens, the hop to the worker and the time after it (ms), and
    the TTFT observed after the router's queue (ms; None: not completed)."""
    out: dict[str, dict] = {}
    for env in envs:
        ev = env.data
        if isinstance(ev, RequestAdmitted):
            out.setdefault(ev.request_id, {})["prompt"] = ev.prompt_tokens
        elif isinstance(ev, RequestRouted) and ev.phase is RequestPhase.PREFILL:
            out.setdefault(ev.request_id, {}).update(worker=ev.worker_id, queued_ms=ev.queued_ms,
                                                     decided=ev.decided_at_s or env.occurred_at_ns / 1e9)
        elif isinstance(ev, PrefillCompleted):
            out.setdefault(ev.request_id, {}).update(taken=env.occurred_at_ns / 1e9 - ev.duration_ms / 1e3,
                                                     worker_ms=ev.duration_ms)
        elif isinstance(ev, RequestCompleted):
            out.setdefault(ev.request_id, {})["ttft_ms"] = ev.ttft_ms
    rows = [dict(r, id=rid) for rid, r in out.items() if {"prompt", "worker", "decided", "taken"} <= r.keys()]
    for r in rows:
        r["hop_ms"] = (r["taken"] - r["decided"]) * 1e3
        r["observed_ms"] = r["ttft_ms"] - r["queued_ms"] if "ttft_ms" in r else None
        r["after_ms"] = None if r["observed_ms"] is None else r["observed_ms"] - r["hop_ms"] - r["worker_ms"]
    return rows


def engine_ms(reqs: list[tuple[float, float, dict]], in_order: bool) -> dict[str, float]:
    """Replay ``reqs`` ((reaches the engine, ms; the router's order; row)) through the mocker
    engine of a prefill worker, a step's arrivals in the router's order or in arrival order
    (as ``AsyncEngine`` does); each request's time from reaching it to its first token (ms)."""
    core = EngineCore("mocker", worker_id="bound", role=WorkerRole.PREFILL)
    rng = random.Random(0)
    pending = sorted(reqs, key=lambda x: x[0])
    t, out, at = 0.0, {}, {}
    while pending or core.has_work():
        due = [x for x in pending if x[0] <= t]
        pending = pending[len(due):]
        if in_order:
            due.sort(key=lambda x: x[1])
        for a, _, r in due:
            at[r["id"]] = a
            core.add_request(EngineRequest(request_id=r["id"], prompt=[rng.randrange(1, 1 << 20) for _ in
                                                                       range(r["prompt"])],
                                           max_tokens=1, phase=RequestPhase.PREFILL))
        res = core.step() if core.has_work() else None
        if res is None or not res.num_scheduled:
            t = pending[0][0] if pending else t
            continue
        t += res.duration_ms
        for tok in res.tokens:
            if tok.finished:
                out[tok.request_id] = t - at[tok.request_id]
                core.release(tok.request_id)
    return out


def bound(rows: list[dict]) -> dict:
    t0 = min(r["decided"] for r in rows)
    hop = _quantile(sorted(r["hop_ms"] for r in rows), 0.5)
    after = _quantile(sorted(r["after_ms"] for r in rows if r["after_ms"] is not None), 0.5)
    errs: dict[str, list[float]] = {"fcfs": [], "in_order": [], "whole": []}
    for w in {r["worker"] for r in rows}:
        mine = [r for r in rows if r["worker"] == w]
        routed = engine_ms([((r["decided"] - t0) * 1e3 + hop, r["decided"], r) for r in mine], False)
        taken = [((r["taken"] - t0) * 1e3, r["decided"], r) for r in mine]
        for name, got in (("fcfs", engine_ms(taken, False)), ("in_order", engine_ms(taken, True))):
            for r in mine:
                observed = r["hop_ms"] + got[r["id"]]
                errs[name].append(abs(hop + routed[r["id"]] - observed) / observed)
        for r in mine:
            if r["observed_ms"]:
                errs["whole"].append(abs(hop + routed[r["id"]] + after - r["observed_ms"]) / r["observed_ms"])
    out = {"n": len(rows), "hop_ms_p50": hop}
    for k, v in errs.items():
        v.sort()
        out[f"{k}_p50"], out[f"{k}_p90"] = _quantile(v, 0.5), _quantile(v, 0.9)
    return out


def _describe(r: dict) -> str:
    return (f"{r['n']} prefills, hop to the worker p50 {r['hop_ms_p50']:.1f} ms; the exact engine in the router's "
            f"order against it as taken: p50 {r['fcfs_p50']:.3f} p90 {r['fcfs_p90']:.3f}; against it taking a step's "
            f"arrivals in the router's order: p50 {r['in_order_p50']:.3f} p90 {r['in_order_p90']:.3f}; the whole "
            f"TTFT with the median hops: p50 {r['whole_p50']:.3f} p90 {r['whole_p90']:.3f}")


def main() -> None:
    over_runs(__doc__, lambda envs: bound(prefills(envs)), _describe,
              {f"{k}_err_{p}_worst": f"{k}_{p}" for k in ("fcfs", "in_order", "whole") for p in ("p50", "p90")})


if __name__ == "__main__":
    main()
