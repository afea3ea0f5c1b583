"""The TTFT prediction with and without the queue's drain, on the same logged decisions (issue 39).

For each topic prefix given (a ``bench e2e`` run's, one per mode), the router's own events are
folded, in the order it published them, through two :class:`~control_plane.router.ledger.RouterLedger`s:

* ``drain``: the ledger as built. Each prefilling decision's chosen worker is predicted under
  ``ledger.ttft_model(worker, decided_at)`` (the fit, with the part of the queue ahead the worker
  has computed since it was routed: ``ttft.queue_done``), and its ``RequestRouted`` is folded with
  that model, as the live router records it (on a log written with the drain this is the recorded
  event, and the prediction is the recorded one: the script checks it);
* ``whole``: the same events with the drain stripped from every recorded model, so the fit
  learns on the whole queue and the prediction waits behind all of it (the rule before the drain).

Both are scored against the TTFT observed after the router's queueing (as ``switchyard replay
reconcile`` reads it): |predicted - observed| / observed. Same log, same decisions, same
outcomes: only the rule differs. Also each rule's hindsight bound: one fit over every
observation of the log (its outcomes known), every request predicted under it: what the
features allow, whatever the fit. Routing is not replayed: the logged choices stand (the
bench's kv cost is blocks, so the prediction did not choose).

Run: ``uv run python -m benchmarks.ttft_queue_ab <prefix> [<prefix> ...]`` (the stack's
variables exported). Last line: ``RESULT logs=... whole_err_p50_worst=... whole_err_p90_worst=...
drain_err_p50_worst=... drain_err_p90_worst=... p90_lower_in=<logs where the drain's p90 is lower>
hindsight_drain_p50_worst=... hindsight_drain_p90_worst=...``.
"""

from __future__ import annotations

import msgspec

from benchmarks.e2e_logs import over_runs
from control_plane.replay.reconcile import _quantile
from control_plane.router.ledger import RouterLedger
from control_plane.router.ttft import predict, queue_ahead
from control_plane.router.ttft_fit import TtftFit
from schemas.envelope import Envelope
from schemas.events import RequestAdmitted, RequestCompleted, RequestRouted
from schemas.types import RequestPhase


def _without_drain(env: Envelope) -> Envelope:
    ev = env.data
    if isinstance(ev, RequestRouted) and ev.ttft_model is not None:
        model = msgspec.structs.replace(ev.ttft_model, queue_done_tokens=None)
        return msgspec.structs.replace(env, data=msgspec.structs.replace(ev, ttft_model=model))
    return env


def compare(envs: list[Envelope]) -> dict:
    """Errors of both rules over one router's log (the envelopes of its ``requests`` stream)."""
    router = next((e.producer for e in envs if isinstance(e.data, RequestRouted)), None)
    own = sorted((e for e in envs if e.producer == router), key=lambda e: e.occurred_at_ns)
    ttft = {e.data.request_id: e.data.ttft_ms for e in envs if isinstance(e.data, RequestCompleted)}
    whole, drain = RouterLedger(), RouterLedger()
    admitted: dict[str, RequestAdmitted] = {}
    preds: dict[str, tuple[float, float, float | None, float]] = {}
    #: Per prefilling decision: (worker, row, prompt tokens, block size, the drain's done tokens).
    seen: dict[str, tuple] = {}
    for env in own:
        ev = env.data
        if isinstance(ev, RequestAdmitted):
            admitted[ev.request_id] = ev
        bound = env
        if (isinstance(ev, RequestRouted) and ev.phase is not RequestPhase.DECODE and ev.request_id in admitted
                and ev.ttft_model is not None):
            now, a = ev.decided_at_s, admitted[ev.request_id]
            row = next(s for s in ev.scores if s.worker_id == ev.worker_id)
            whole.prepare(ev.request_id, ev.phase, now)
            drain.prepare(ev.request_id, ev.phase, now)
            m = drain.ttft_model(ev.worker_id, now)
            args = (queue_ahead(row), row.overlap_blocks, row.speculative_overlap, a.prompt_tokens, a.block_size)
            dec = row.active_decode_blocks  # the decode term (0 cost under a model without it)
            preds[ev.request_id] = (predict(*args, whole.ttft_fit.model(ev.worker_id), dec), predict(*args, m, dec),
                                    ev.predicted_ttft_ms, ev.queued_ms)
            bound = msgspec.structs.replace(env, data=msgspec.structs.replace(ev, ttft_model=m))
            seen[ev.request_id] = (ev.worker_id, ev.phase, row, a.prompt_tokens, a.block_size, m.queue_done_tokens or 0)
        drain.apply(bound)
        whole.apply(_without_drain(env))
    errs: dict[str, list[float]] = {"whole": [], "drain": []}
    as_recorded = 0
    for rid, (pw, pd, recorded, queued_ms) in preds.items():
        if rid not in ttft or not ttft[rid] - queued_ms > 0:
            continue
        y = ttft[rid] - queued_ms
        errs["whole"].append(abs(pw - y) / y)
        errs["drain"].append(abs(pd - y) / y)
        as_recorded += recorded == pd
    for k in ("whole", "drain"):
        fit = TtftFit()
        obs = [(rid, x, ttft[rid] - preds[rid][3]) for rid, x in seen.items()
               if rid in ttft and ttft[rid] - preds[rid][3] > 0]
        for rid, (w, phase, row, prompt, bs, done), y in obs:
            fit.routed(rid, w, phase, row, prompt, bs, 0.0, done if k == "drain" else 0)
            fit.completed(rid, y)
        errs[f"{k}_hindsight"] = [
            abs(predict(queue_ahead(row), row.overlap_blocks, row.speculative_overlap, prompt, bs,
                        msgspec.structs.replace(fit.model(w), queue_done_tokens=done if k == "drain" else None),
                        row.active_decode_blocks) - y) / y
            for rid, (w, phase, row, prompt, bs, done), y in obs]
    out = {"n": len(errs["drain"]), "drain_as_recorded": as_recorded}
    for k, v in errs.items():
        v.sort()
        out[f"{k}_p50"], out[f"{k}_p90"] = _quantile(v, 0.5), _quantile(v, 0.9)
    out["drain_p90_lower"] = out["drain_p90"] < out["whole_p90"]
    return out


def _describe(r: dict) -> str:
    return (f"{r['n']} predictions; whole queue p50 {r['whole_p50']:.3f} p90 {r['whole_p90']:.3f}; "
            f"drained p50 {r['drain_p50']:.3f} p90 {r['drain_p90']:.3f} (the drained prediction is the recorded "
            f"one in {r['drain_as_recorded']}); hindsight: whole queue p50 {r['whole_hindsight_p50']:.3f} p90 "
            f"{r['whole_hindsight_p90']:.3f}, drained p50 {r['drain_hindsight_p50']:.3f} p90 "
            f"{r['drain_hindsight_p90']:.3f}")


def main() -> None:
    over_runs(__doc__, compare, _describe, {
        "whole_err_p50_worst": "whole_p50", "whole_err_p90_worst": "whole_p90", "drain_err_p50_worst": "drain_p50",
        "drain_err_p90_worst": "drain_p90", "p90_lower_in": "#drain_p90_lower",
        "hindsight_drain_p50_worst": "drain_hindsight_p50", "hindsight_drain_p90_worst": "drain_hindsight_p90"})


if __name__ == "__main__":
    main()
