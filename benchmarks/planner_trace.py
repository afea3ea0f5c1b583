"""One planner case traced window by window: where its requests miss the SLO (TTFT or ITL, by
arrival window), what each pool held (ordered, ready), and every decision with its reason.

    python -m benchmarks.planner_trace agentic:1:burst_ramp40 [--tuned k=v,...] [--static P] [--window-s 10]
        [--from-s 100 --to-s 200] [--reasons decode]

The same path as ``planner_bench``'s rows (``planner_config``, ``workload_load``,
``initial_split``, :class:`planner_bench.Sim`), so its figures equal the bench's. Virtual time:
deterministic. Tracing a score case is looking, never tuning: a knob is chosen on tune cases.
"""

from __future__ import annotations

import sys
from collections import defaultdict

from benchmarks.planner_bench import Sim, _fresh, initial_split, miss, planner_config, workload_load


class TracedSim(Sim):
    """:class:`Sim` that keeps every tick's pool reports (the decision's inputs and reason)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.reports: list[tuple[float, object]] = []

    def on_tick(self, t: float, decision) -> None:
        self.reports.extend((t / 1000.0, rep) for rep in decision.reports)


def misses(res, ttft_slo_ms: float, itl_slo_ms: float, window_s: float):
    """Per arrival window: (requests, TTFT misses, ITL misses, unfinished)."""
    out: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    col = {"ttft": 1, "itl": 2, "unfinished": 3}
    for r in res.requests:
        row = out[int(r.arrival_ms / 1000 // window_s)]
        row[0] += 1
        why = miss(r, ttft_slo_ms, itl_slo_ms)
        if why is not None:
            row[col[why]] += 1
    return out


def held(res, pool: str, t_s: float) -> tuple[int, int]:
    """(alive: starting or ready, ready) workers of ``pool`` at ``t_s``."""
    t = t_s * 1000.0
    alive = ready = 0
    for w in res.workers:
        if w.pool != pool or w.started_ms > t or (w.gone_ms is not None and w.gone_ms <= t):
            continue
        alive += 1
        if w.started_ms == 0.0 or w.started_ms + 30_000.0 <= t:
            ready += 1
    return alive, ready


def main(argv: list[str]) -> None:
    case = argv.pop(0)
    tuned: dict[str, float] = {"standing_headroom": 0.2, "standing_headroom_from": 0.0}
    window_s, t_from, t_to, reasons, static = 10.0, 0.0, 1e9, "", None
    while argv:
        k = argv.pop(0)
        if k == "--tuned":
            tuned.update({n: float(v) for n, v in (x.split("=") for x in argv.pop(0).split(",") if x)})
        elif k == "--window-s":
            window_s = float(argv.pop(0))
        elif k == "--from-s":
            t_from = float(argv.pop(0))
        elif k == "--to-s":
            t_to = float(argv.pop(0))
        elif k == "--reasons":
            reasons = argv.pop(0)
        elif k == "--static":
            static = int(argv.pop(0))
        else:
            sys.exit(f"unknown argument {k}")
    fam, seed, shape = case.split(":")
    ttft, itl, budget = 2000.0, 25.0, 12
    cfg = planner_config(budget, ttft, itl, "kalman", lead_time_s=30.0, **tuned)
    name, desc, reqs = workload_load(fam, int(seed), shape, cfg)
    if static is not None:
        res = Sim(_fresh(reqs), prefill=static, decode=budget - static).run()
        label = f"static {static}P+{budget - static}D"
    else:
        p0, d0 = initial_split(cfg, reqs)
        sim = TracedSim(_fresh(reqs), prefill=p0, decode=d0, planner=cfg, startup_s=30.0)
        res = sim.run()
        label = f"ours from {p0}P+{d0}D, {tuned}"
    print(f"{name}: {desc}; {len(reqs)} requests; {label}")
    print(f"attainment {res.attainment(ttft, itl):.4f}, replica-seconds {res.replica_seconds():.0f}, "
          f"wall {res.wall_s:.0f} s")
    print(f"{'window':>9} {'reqs':>5} {'ttft':>5} {'itl':>5} {'unfin':>5}  prefill alive/ready  decode alive/ready")
    for i, (n, bt, bi, un) in sorted(misses(res, ttft, itl, window_s).items()):
        t0 = i * window_s
        if not t_from <= t0 < t_to:
            continue
        p, d = held(res, "prefill", t0 + window_s / 2), held(res, "decode", t0 + window_s / 2)
        print(f"{t0:>4.0f}-{t0 + window_s:<4.0f} {n:>5} {bt:>5} {bi:>5} {un:>5}  {p[0]:>7}/{p[1]:<7}      "
              f"{d[0]:>6}/{d[1]:<6}")
    for t, pool, a, b in res.decisions:
        print(f"decision {t:7.1f} s {pool:<8} {a} -> {b}")
    if static is None and reasons:
        for t, rep in sim.reports:
            if rep.pool == reasons and t_from <= t < t_to:
                inp = dict(rep.inputs)
                keys = ("observed_rate", "forecast_rate", "trend_confirmed", "headroom", "safety_stock",
                        "needed_replicas", "needed_low", "needed_high", "decode_seqs_per_replica",
                        "decode_itl_ms", "itl_correction", "latency_over_slo", "overload")
                print(f"{t:7.1f} {rep.action:<5} {rep.target:>2} " + " ".join(f"{k}={inp[k]}" for k in keys if k in inp))


if __name__ == "__main__":
    main(sys.argv[1:])
