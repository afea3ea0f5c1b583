"""Our kv router's configs against each other on generated cases, and their tails request by
request (issue 39: why a side loses a case, and whether a change fixes it).

Each case (``family:seed``, ``--rate-scale`` x its default rate, 120 s, as ``bench routing``
writes it) replays on 8 aggregated simulated workers (mocker profile) under each config of
``--configs``: ``;``-separated, each a ``,``-separated list of ``RouterConfig`` fields
(``cost=ttft,prefill_load_scale=10``), the first being the baseline. Prints per case and config
TTFT p50 / p99 / mean and their ratios to the baseline, and the mean over the cases of each
ratio (the tune objective's shape). With ``--top N`` the virtual router records its events
(``run_cluster(record=True)``) and the N slowest requests of each run are listed: the TTFT, the
wait before its engine admitted it (a step in progress, or a queue), its prefill steps, the
chosen worker's row (f in flight, q queued prefill tokens, a decode blocks, c cached blocks, p
predicted TTFT) and the candidates that had nothing in flight: whether an idle worker was passed
over. With ``--idle-err`` (``cost=ttft`` configs: rows carry predictions) every candidate row
with nothing in flight, queued or decoding there is set against what the engine would take
alone (the profile's chunked prefill of the row's uncached tokens, ``data_plane.engines.tiers.
prefill_ms``): predicted / alone by uncached size (a 8,192-token chunk a bucket) and by half of
the run (first 30 s, the rest), the prediction the argmin compares a busy worker against.

Run: ``PYTHONPATH=$PWD python -m benchmarks.routing_tail --cases chat:2 --rate-scale 1.5
--configs 'prefill_load_scale=10;cost=ttft' [--top 12] [--idle-err] [--jobs 1]``. Deterministic (virtual
time). Last line: ``RESULT cases=N rate_scale=X <config #i>_p99_ratio=... _p50_ratio=...
_mean_ratio=... _worst_p99_ratio=... ...`` (means over the cases of config / baseline).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import msgspec

from benchmarks import tune_score
from benchmarks.routing_bench import pool_map
from control_plane import simulation
from control_plane.router import RouterConfig
from data_plane.engines import load_profile
from data_plane.engines.tiers import prefill_ms
from schemas.events import RequestRouted
from workloads.sets import TUNE_SET, parse_cases


def parse_config(text: str) -> RouterConfig:
    """``k=v,k=v`` over ``RouterConfig()`` (values typed by msgspec: numbers, true/false, names)."""
    fields: dict[str, object] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        k, _, v = part.partition("=")
        try:
            fields[k] = msgspec.json.decode(v)
        except msgspec.DecodeError:
            fields[k] = v
    return msgspec.convert(fields, RouterConfig)


def run_recorded(requests, config: RouterConfig, record: bool):
    """(the cluster's result, the router's recorded ``RequestRouted`` by request id, if asked)."""
    res = simulation.run_cluster(requests, simulation.AGGREGATED_8, config, record=record)
    return res, {e.data.request_id: e.data for e in res.recorded if isinstance(e.data, RequestRouted)}


def _row(r) -> str:
    p = "-" if r.predicted_ttft_ms is None else f"{r.predicted_ttft_ms:.1f}"
    return (f"{r.worker_id[-2:]}(f{r.inflight_requests} q{r.queued_prefill_tokens} a{r.active_decode_blocks} "
            f"c{max(r.overlap_blocks, r.speculative_overlap)} p{p})")


def tail_lines(res, routed, top: int) -> list[str]:
    done = sorted((r for r in res.records if r.token_times), key=lambda r: r.token_times[0] - r.arrival_ms,
                  reverse=True)
    out = [f"{'ttft':>7} {'wait':>6} {'st':>3} {'prompt':>6} {'blk':>4} chosen -> idle candidates"]
    for r in done[:top]:
        ev = routed[r.request.request_id]
        wait = (r.admitted_ms - r.arrival_ms) if r.admitted_ms is not None else float("nan")
        chosen = next(x for x in ev.scores if x.worker_id == ev.worker_id)
        idle = [x for x in ev.scores if x.inflight_requests == 0 and x.worker_id != ev.worker_id]
        out.append(f"{r.token_times[0] - r.arrival_ms:7.1f} {wait:6.1f} {r.prefill_steps:3d} "
                   f"{len(r.request.prompt):6d} {len(r.hashes):4d} {_row(chosen)} -> "
                   f"{' '.join(_row(x) for x in idle) or '-'}")
    return out


def idle_error_lines(res, routed, profile, block_size: int) -> list[str]:
    """Predicted / the engine's alone time of every idle candidate row, by (first 30 s or later,
    uncached tokens in chunks): p10 / p50 / p90 and how many rows."""
    chunk = profile.max_num_batched_tokens
    t0 = res.records[0].arrival_ms if res.records else 0.0
    by: dict[tuple[str, int], list[float]] = {}
    for r in res.records:
        ev = routed.get(r.request.request_id)
        if ev is None:
            continue
        half = "early" if r.arrival_ms - t0 < 30_000 else "late"
        for row in ev.scores:
            if (row.predicted_ttft_ms is None or row.inflight_requests or row.active_decode_blocks
                    or row.queued_prefill_tokens):
                continue
            prompt = len(r.request.prompt)
            cached = min(max(row.overlap_blocks, row.speculative_overlap) * block_size, prompt - 1)
            n = prompt - cached
            alone = prefill_ms(profile.timing, cached, prompt, chunk)
            by.setdefault((half, n // chunk), []).append(row.predicted_ttft_ms / alone)
    out = [f"idle candidates, predicted / alone on the engine ({chunk}-token chunks):"]
    for (half, k), v in sorted(by.items(), key=lambda kv: (kv[0][0] != "early", kv[0][1])):
        v.sort()
        out.append(f"  {half:<5} uncached {k * chunk:>6}-{(k + 1) * chunk - 1:<6} rows {len(v):5d} "
                   f"p10 {v[len(v) // 10]:.3f} p50 {v[len(v) // 2]:.3f} p90 {v[9 * len(v) // 10]:.3f}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(map(str, TUNE_SET)))
    p.add_argument("--rate-scale", type=float, default=tune_score.CASE_RATE_SCALE)
    p.add_argument("--configs", default="prefill_load_scale=10;cost=ttft")
    p.add_argument("--top", type=int, default=0)
    p.add_argument("--idle-err", action="store_true", help="idle candidates' predictions against the engine")
    p.add_argument("--jobs", type=int, default=1)
    a = p.parse_args()
    prof = load_profile("mocker")
    cases = parse_cases(a.cases)
    names = [c.strip() for c in a.configs.split(";")]
    configs = [parse_config(c) for c in names]
    with tempfile.TemporaryDirectory() as d:
        _, reqs = tune_score.load_cases(cases, Path(d), prof.block_size, rate_scale=a.rate_scale)

    def run(job):
        c, i = job
        res, routed = run_recorded(reqs[c], configs[i], a.top > 0 or a.idle_err)
        lines = tail_lines(res, routed, a.top) if a.top else []
        if a.idle_err and configs[i].cost == "ttft":
            lines += idle_error_lines(res, routed, prof, prof.block_size)
        return res.summary(), lines

    jobs = [(c, i) for c in cases for i in range(len(configs))]
    out = dict(zip(jobs, pool_map(run, jobs, a.jobs)))
    ratios: dict[int, list[tuple[float, float, float]]] = {i: [] for i in range(len(configs))}
    for c in cases:
        base = out[(c, 0)][0]
        for i, name in enumerate(names):
            s, lines = out[(c, i)]
            r = (s["ttft_p99_ms"] / base["ttft_p99_ms"], s["ttft_p50_ms"] / base["ttft_p50_ms"],
                 s["ttft_mean_ms"] / base["ttft_mean_ms"])
            ratios[i].append(r)
            print(f"{str(c):<16} x{a.rate_scale:g} [{i}] {name:<40} p50 {s['ttft_p50_ms']:8.1f} p99 "
                  f"{s['ttft_p99_ms']:8.1f} mean {s['ttft_mean_ms']:8.1f}  ratio p99 {r[0]:.4f} p50 {r[1]:.4f} "
                  f"mean {r[2]:.4f}", flush=True)
            for line in lines:
                print("    " + line)
    fields = [f"cases={len(cases)} rate_scale={a.rate_scale:g}"]
    for i in range(1, len(configs)):
        rs = ratios[i]
        fields.append(f"c{i}_p99_ratio={statistics.fmean(r[0] for r in rs):.4f} "
                      f"c{i}_p50_ratio={statistics.fmean(r[1] for r in rs):.4f} "
                      f"c{i}_mean_ratio={statistics.fmean(r[2] for r in rs):.4f} "
                      f"c{i}_worst_p99_ratio={max(r[0] for r in rs):.4f}")
    print("RESULT " + " ".join(fields))


if __name__ == "__main__":
    main()
