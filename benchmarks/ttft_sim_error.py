"""The TTFT prediction against outcomes in virtual time (issue 39, items 1-2): the tune set.

Each tune case (``workloads.sets.TUNE_SET``, at each ``--rate-scale``) replays on 8 aggregated
simulated workers (mocker profile, which the router is never given) exactly as ``bench
routing`` runs ours, with ``RouterConfig.cost`` ``--cost``; the virtual router records its
events (``run_cluster(record=True)``). For every routed request: the prediction it recorded
(``RequestRouted.predicted_ttft_ms``, under the model its ledger fitted so far) against the TTFT
it recorded (``RequestCompleted.ttft_ms``), |predicted - observed| / observed, as ``switchyard
replay reconcile`` reads a live log. Also each case's TTFT mean, the figure ``bench routing``
tunes on (with ``--cost ttft`` the same as its tune table's).

Run: ``uv run --group bench python -m benchmarks.ttft_sim_error [--cost ttft|blocks]
[--rate-scale 2,1.5]``. Deterministic (virtual time). Last line: ``RESULT cases=...
err_p50_worst=... err_p90_worst=... worst_case=<family:seed@scale> ttft_mean_ms_sum=...``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks import tune_score
from control_plane import simulation
from control_plane.router import RouterConfig
from data_plane.engines import load_profile
from schemas.events import RequestCompleted, RequestRouted
from workloads.sets import TUNE_SET


def case_errors(requests, cost: str) -> tuple[float, list[float]]:
    """(TTFT mean ms, sorted relative errors) of one case's requests routed with ``cost``."""
    # prefill_load_scale 10: bench routing's pick for blocks on the tune set (ttft ignores it)
    res = simulation.run_cluster(requests, simulation.AGGREGATED_8, RouterConfig(cost=cost, prefill_load_scale=10.0),
                                 record=True)
    pred: dict[str, float] = {}
    obs: dict[str, float] = {}
    for env in res.recorded:
        ev = env.data
        if isinstance(ev, RequestRouted) and ev.predicted_ttft_ms is not None:
            pred[ev.request_id] = ev.predicted_ttft_ms
        elif isinstance(ev, RequestCompleted) and ev.ttft_ms > 0:
            obs[ev.request_id] = ev.ttft_ms
    errs = sorted(abs(pred[r] - y) / y for r, y in obs.items() if r in pred)
    ttfts = [r.token_times[0] - r.arrival_ms for r in res.records if r.token_times]
    return sum(ttfts) / len(ttfts), errs


def main(cost: str, scales: list[float]) -> None:
    prof = load_profile("mocker")
    rows = []
    for scale in scales:
        with tempfile.TemporaryDirectory() as d:
            _, reqs = tune_score.load_cases(list(TUNE_SET), Path(d), prof.block_size, rate_scale=scale)
        for case in TUNE_SET:
            mean, errs = case_errors(reqs[case], cost)
            p50, p90 = errs[len(errs) // 2], errs[int(len(errs) * 0.9)]
            rows.append((f"{case}@{scale:g}", mean, p50, p90))
            print(f"{case}@{scale:g}: ttft_mean_ms={mean:.1f} err_p50={p50:.3f} err_p90={p90:.3f} n={len(errs)}",
                  flush=True)
    worst = max(rows, key=lambda r: r[3])
    print(f"RESULT cost={cost} cases={len(rows)} err_p50_worst={max(r[2] for r in rows):.3f} "
          f"err_p90_worst={worst[3]:.3f} worst_case={worst[0]} ttft_mean_ms_sum={sum(r[1] for r in rows):.1f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cost", choices=["blocks", "ttft"], default="ttft")
    p.add_argument("--rate-scale", default="2,1.5")
    a = p.parse_args()
    main(a.cost, [float(x) for x in a.rate_scale.split(",")])
