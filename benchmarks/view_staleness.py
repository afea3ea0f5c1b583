"""What a staler router view costs routing (issue 38 item 3: the view's fetch wait).

The router's view learns the workers' KV blocks from the log; ``view_fetch_wait_ms`` lets the
broker hold the view's fetch that long, so the index lags the workers by up to that much more.
The router's own in-flight ledger (its speculative overlap: a routed prompt's blocks count on
its worker from the decision on, ``Router._record``) covers what this router sent meanwhile.
Two measurements:

* ``--virtual`` (no stack): the routing simulation (``control_plane.simulation.run_cluster``,
  8 aggregated mocker workers, the default kv config) on the score cases
  (``workloads.sets.SCORE_SET``; nothing is tuned here) with ``kv_event_lag_ms`` in ``--lags`` on top of the engines' own step
  lag: TTFT p50/p99 and prefix reuse per lag, every case and the worst change against lag 0.
* ``--e2e`` (the stack; take the demo lock): ``benchmarks.e2e_bench.one_run`` in kv mode (2
  prefill + 2 decode workers, real processes, the demo's trace slice) with the router's
  ``SWITCHYARD_ROUTER_VIEW_FETCH_WAIT_MS`` at each ``--waits`` value, then a repeated-prompt
  check on the same stack: ``--pairs`` fresh prompts each sent twice, the second right after
  the first completes and, for other prompts, both at once; how many seconds were served from
  cache (the prefill worker's cached tokens at least half the prompt: ``switchyard replay
  reconcile``'s per-request check over the run's log; the client's usage is the decode worker's).

    python -m benchmarks.view_staleness --virtual [--lags 0 10 25 50 100]
    flock /work/wt/demo.lock nice -n 10 python -m benchmarks.view_staleness --e2e [--waits 10 50]

Last line: ``RESULT lag<ms>_ttft_p50_ms=... lag<ms>_ttft_p99_ms=... lag<ms>_reuse=...
worst_p99_change=...`` (virtual: means over the cases) or ``RESULT wait<ms>_hit_rate=...
wait<ms>_ttft_p50_ms=... wait<ms>_ttft_p99_ms=... wait<ms>_repeat_seq=... wait<ms>_repeat_concurrent=...``
(e2e).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
from pathlib import Path

import httpx

from common.log.catalog import Catalog
from common.log.reader import KafkaLogReader, scan_events
from common.settings import BusSettings
from control_plane.replay.reconcile import KvRecord, reconcile
from schemas import EventCodec

import benchmarks.e2e_bench as eb
from benchmarks.tune_score import load_cases
from control_plane.router import RouterConfig
from control_plane.simulation import AGGREGATED_8, run_cluster
from data_plane.engines import load_profile
from ops.demo.loadgen import word_prompt
from ops.demo.up import DEMO_DEFAULTS, DEMO_TRACE
from workloads.sets import SCORE_SET


def virtual(lags: list[float]) -> dict[str, float]:

    prof = load_profile("mocker")
    cases = SCORE_SET
    with tempfile.TemporaryDirectory() as tmp:
        _, reqs = load_cases(cases, Path(tmp), prof.block_size)
    got: dict[tuple[str, float], dict] = {}
    for c in cases:
        for lag in lags:
            s = run_cluster(reqs[c], AGGREGATED_8, RouterConfig(), profile=prof, kv_event_lag_ms=lag).summary()
            got[(str(c), lag)] = s
            print(f"  {str(c):<18} lag {lag:>5g} ms: TTFT p50 {s['ttft_p50_ms']:7.1f} p99 {s['ttft_p99_ms']:8.1f} "
                  f"reuse {s['reuse']:.3f}", flush=True)
    out: dict[str, float] = {}
    base = lags[0]
    print(f"8 aggregated mocker workers, default kv config, {len(cases)} score cases; "
          f"change against lag {base:g} ms")
    for lag in lags:
        p50 = statistics.mean(got[(str(c), lag)]["ttft_p50_ms"] for c in cases)
        p99 = statistics.mean(got[(str(c), lag)]["ttft_p99_ms"] for c in cases)
        reuse = statistics.mean(got[(str(c), lag)]["reuse"] for c in cases)
        ch = {str(c): got[(str(c), lag)]["ttft_p99_ms"] / got[(str(c), base)]["ttft_p99_ms"] - 1 for c in cases}
        worst = max(ch, key=ch.get)
        print(f"lag {lag:>5g} ms: mean TTFT p50 {p50:7.1f} p99 {p99:8.1f} ms, reuse {reuse:.4f}; "
              f"worst p99 change {ch[worst]:+.1%} ({worst})")
        out.update({f"lag{lag:g}_ttft_p50_ms": p50, f"lag{lag:g}_ttft_p99_ms": p99, f"lag{lag:g}_reuse": reuse,
                    f"lag{lag:g}_worst_p99_change": ch[worst]})
    print("RESULT " + " ".join(f"{k}={v:.4g}" for k, v in out.items()))
    return out


async def _repeats(url: str, pairs: int, words: int = 2048, seed: int = 11) -> tuple[list[str], list[str]]:
    """Request ids of the second sends: (sequential, concurrent)."""
    rng = random.Random(seed)

    def body() -> dict:
        return {"model": "switchyard-sim", "prompt": word_prompt(rng.randrange(32000) for _ in range(words)),
                "max_tokens": 1}

    def rid(r: httpx.Response) -> str:
        r.raise_for_status()
        return r.json()["id"]

    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        seq = []
        for _ in range(pairs):
            b = body()
            rid(await c.post("/v1/completions", json=b))
            seq.append(rid(await c.post("/v1/completions", json=b)))
        conc = []
        for _ in range(pairs):
            b = body()
            first, second = await asyncio.gather(c.post("/v1/completions", json=b),
                                                 c.post("/v1/completions", json=b))
            rid(first)
            conc.append(rid(second))
    return seq, conc


def _served_from_cache(prefix: str, ids: list[str]) -> float:
    """The share of ``ids`` whose prefill worker found at least half the prompt in its cache
    (``switchyard replay reconcile``'s per-request check over the run's log)."""
    bus = BusSettings.from_env(topic_prefix=prefix)
    cat, codec = Catalog(bus.topic_prefix), EventCodec(verifier=bus.verifier())
    with KafkaLogReader(bus.bootstrap) as reader:
        requests = [env for _, env in scan_events(reader, cat.topic("requests"), codec=codec)]
        kv = [KvRecord(r.topic, r.partition, r.offset, env) for r, env in scan_events(reader, cat.topic("kv"), codec=codec)]
    by = {c.request_id: c for c in reconcile(requests, kv).checks}
    hits = [by[i].cached_tokens * 2 >= by[i].prompt_tokens for i in ids if i in by]
    return sum(hits) / len(ids) if ids else float("nan")


def e2e(waits: list[int], pairs: int) -> dict[str, float]:

    out: dict[str, float] = {}
    run = eb.run_trace

    for w in waits:
        os.environ["SWITCHYARD_ROUTER_VIEW_FETCH_WAIT_MS"] = str(w)
        ids: dict = {}

        async def with_repeats(url, *a, **kw):  # the trace, then the repeats on the same stack
            s = await run(url, *a, **kw)
            ids["prefix"] = os.environ["SWITCHYARD_TOPIC_PREFIX"]
            ids["seq"], ids["conc"] = await _repeats(url, pairs)
            return s

        eb.run_trace = with_repeats
        try:
            s = eb.one_run("kv", DEMO_TRACE, DEMO_DEFAULTS.limit, DEMO_DEFAULTS.rate, DEMO_DEFAULTS.max_output,
                           DEMO_DEFAULTS.speedup)
        finally:
            eb.run_trace = run
        rec = s["reconciled"]
        rep = {k: _served_from_cache(ids["prefix"], ids[k]) for k in ("seq", "conc")}
        print(f"wait {w:>3} ms: completed {s['completed']} failed {s['failed']} rejected {s['rejected']}; "
              f"TTFT p50 {s['ttft_p50_ms']:.0f} p99 {s['ttft_p99_ms']:.0f} ms; hit rate {s['hit_rate']:.3f}, "
              f"prefill hit rate {rec['prefill_hit_rate']:.3f}, predicted overlap exact "
              f"{rec['exact']}/{rec['requests']}, routed past a longer cached prefix {rec['routed_past_cache']}; repeated prompt served from cache: sequential "
              f"{rep['seq']:.0%}, concurrent {rep['conc']:.0%} (load {os.getloadavg()[0]:.1f})", flush=True)
        out.update({f"wait{w}_hit_rate": s["hit_rate"], f"wait{w}_prefill_hit_rate": rec["prefill_hit_rate"],
                    f"wait{w}_routed_past_cache": rec["routed_past_cache"],
                    f"wait{w}_ttft_p50_ms": s["ttft_p50_ms"], f"wait{w}_ttft_p99_ms": s["ttft_p99_ms"],
                    f"wait{w}_failed": s["failed"], f"wait{w}_repeat_seq": rep["seq"],
                    f"wait{w}_repeat_concurrent": rep["conc"]})
    os.environ.pop("SWITCHYARD_ROUTER_VIEW_FETCH_WAIT_MS", None)
    print("RESULT " + " ".join(f"{k}={v:.4g}" for k, v in out.items()))
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--virtual", action="store_true")
    ap.add_argument("--e2e", action="store_true")
    ap.add_argument("--lags", type=float, nargs="*", default=[0, 10, 25, 50, 100])
    ap.add_argument("--waits", type=int, nargs="*", default=[10, 50])
    ap.add_argument("--pairs", type=int, default=20)
    a = ap.parse_args()
    if not (a.virtual or a.e2e):
        ap.error("--virtual and/or --e2e")
    if a.virtual:
        virtual(a.lags)
    if a.e2e:
        e2e(a.waits, a.pairs)
