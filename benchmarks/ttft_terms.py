"""Which term of the TTFT prediction a ``bench e2e`` run's error sits in (issue 39, item 3).

For each topic prefix given (a ``bench e2e`` run's: 2 prefill + 2 decode simulated workers),
``switchyard replay reconcile``'s checks of the disaggregated requests split each observed TTFT
into the hop to the prefill worker, the worker's own time (its ``PrefillCompleted.duration_ms``)
and the rest (the way back, the decode decision, the transfer, the decode worker's first step).
The prediction splits the same way under the decision's recorded model: ``base_ms`` (the fixed
cost per request, which takes the hops' and the handoff's mean) and the rest (the wait behind
the queue at the rate seen and the request's own last step). Per request, signed, relative to the
observed TTFT: ``base_ms - (hop + after)`` and ``(predicted - base_ms) - worker``; their medians
over the requests whose model had observations (not the prior's), and the error by what the
worker looked like at the decision (``idle``: no prefill of the router's in flight there;
``drained``: some, all computed by the drain; ``queued``: some left).

Run: ``uv run python -m benchmarks.ttft_terms <prefix> [<prefix> ...]`` (the stack's variables
exported). Last line: ``RESULT logs=... err_p50_worst=... base_vs_hops_p50_worst=...
worker_part_p50_worst=...`` (the two signed medians, largest in magnitude over the logs).
"""

from __future__ import annotations

from benchmarks.e2e_logs import over_runs, quantile as _q
from control_plane.replay.reconcile import reconcile
from control_plane.router.ttft import queue_ahead, rate_split, split
from schemas.events import RequestAdmitted, RequestRouted
from schemas.types import RequestPhase


def terms(envs: list) -> dict:
    """Per log: the error p50/p90, the two signed medians and the error by the worker's state."""
    rec = reconcile(envs, [])
    routed: dict[str, RequestRouted] = {}
    admitted: dict[str, RequestAdmitted] = {}
    for env in envs:
        ev = env.data
        if isinstance(ev, RequestAdmitted):
            admitted[ev.request_id] = ev
        elif isinstance(ev, RequestRouted) and ev.phase is RequestPhase.PREFILL:
            routed[ev.request_id] = ev
    rows = []
    for c in rec.checks:
        ev = routed.get(c.request_id)
        if ev is None or ev.ttft_model is None or c.ttft_error is None or c.worker_ms is None:
            continue
        m, a = ev.ttft_model, admitted[c.request_id]
        row = next(s for s in ev.scores if s.worker_id == ev.worker_id)
        q, _, n = split(row, a.prompt_tokens, a.block_size, m.queue_done_tokens or 0)
        obs, pred = c.observed_ttft_ms, c.predicted_ttft_ms
        rows.append({"err": c.ttft_error, "fitted": m.samples + m.pool_samples > 0,
                     "state": "queued" if q > 0 else "drained" if queue_ahead(row) > 0 else "idle",
                     "base": (m.base_ms - c.to_worker_ms - c.after_worker_ms) / obs,
                     "worker": (pred - m.base_ms - c.worker_ms) / obs, "signed": (pred - obs) / obs,
                     "wait_ms": rate_split(q + n, m.chunk_tokens)[0] / m.queue_tokens_per_ms
                     if m.queue_tokens_per_ms else 0.0})
    fitted = [r for r in rows if r["fitted"]]
    out = {"n": len(rows), "err_p50": _q([r["err"] for r in rows], 0.5), "err_p90": _q([r["err"] for r in rows], 0.9),
           "base_vs_hops": _q([r["base"] for r in fitted], 0.5), "worker_part": _q([r["worker"] for r in fitted], 0.5),
           "by_state": {}}
    for state in ("idle", "drained", "queued"):
        g = [r for r in fitted if r["state"] == state]
        if g:
            out["by_state"][state] = (len(g), _q([r["err"] for r in g], 0.5), _q([r["signed"] for r in g], 0.5))
    return out


def _describe(r: dict) -> str:
    states = "; ".join(f"{k} {n}: err p50 {e:.3f}, signed {s:+.3f}" for k, (n, e, s) in r["by_state"].items())
    return (f"{r['n']} prefills, error p50 {r['err_p50']:.3f} p90 {r['err_p90']:.3f}; signed medians: "
            f"base - (hop + after) {r['base_vs_hops']:+.3f}, (predicted - base) - worker {r['worker_part']:+.3f}; "
            f"{states}")


def main() -> None:
    over_runs(__doc__, terms, _describe, {"err_p50_worst": "err_p50", "base_vs_hops_p50_worst": "+base_vs_hops",
                                          "worker_part_p50_worst": "+worker_part"})


if __name__ == "__main__":
    main()
