"""One prompt sent ``n`` times in a row through our router in front of two real worker processes
(issue 39, "the 207/193 split").

A cache-aware router should send every repetition after the first to the worker that holds the
prompt. The bench starts two simulated workers (the peers bench's, engine speed 1) and our router
(kv mode) on a topic prefix of their own, sends one ``words``-word completion ``n`` times, one
after the other, and reads back:

* the split: requests per worker from the workers' own ``vllm:e2e_request_latency_seconds``;
* the hit rate: ``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries`` of the workers;
* from the log, for every ``RequestRouted``: the chosen worker's index overlap and speculative
  overlap, and whether the decision was a tie broken by the seed; and how many requests the
  router saw no overlap for on the worker that had served the prompt before (``blind``).

Last line: ``RESULT n=... max_share=... hit_rate=... ties=... blind=... switches=...``.
"""

from __future__ import annotations

import asyncio
import json
import re
import tempfile
from pathlib import Path

import aiohttp
import httpx

from benchmarks.peers_bench import MODEL, _launch_ours, start_workers
from ops.demo.loadgen import word_prompt
from data_plane.engines.trace import DEFAULT_VOCAB_SIZE
from common.log.reader import read_events
from common.settings import BusSettings
from schemas.events import RequestRouted


def _metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            m = re.match(rf"{re.escape(name)}(\{{[^}}]*\}})? ([0-9.eE+-]+)$", line)
            if m:
                total += float(m.group(2))
    return total


async def _send(url: str, body: bytes, n: int, clients: int) -> int:
    errors = 0
    left = iter(range(n))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        async def client() -> None:
            nonlocal errors
            for _ in left:
                async with s.post(f"{url}/v1/completions", data=body,
                                  headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    errors += r.status != 200

        await asyncio.gather(*(client() for _ in range(clients)))
    return errors


def run(n: int = 400, words: int = 4096, max_tokens: int = 8, speedup: float = 1.0, clients: int = 1,
        seed: int = 39) -> dict:
    import random

    rng = random.Random(seed)
    body = json.dumps({"model": MODEL, "prompt": word_prompt(rng.randrange(DEFAULT_VOCAB_SIZE) for _ in range(words)),
                       "max_tokens": max_tokens, "stream": False}).encode()
    with tempfile.TemporaryDirectory(prefix="repeat-") as tmp:
        w = start_workers(Path(tmp), speedup=speedup)
        side = None
        try:
            side = _launch_ours(w, Path(tmp) / "router.log")
            errors = asyncio.run(_send(side.url, body, n, clients))
            per_worker = [_metric(u, "vllm:e2e_request_latency_seconds_count") for u in w.urls]
            hits = sum(_metric(u, "vllm:prefix_cache_hits_total") for u in w.urls)
            queries = sum(_metric(u, "vllm:prefix_cache_queries_total") for u in w.urls)
            routed = [e.data for e in read_events(BusSettings.from_env(topic_prefix=w.prefix), "requests")
                      if isinstance(e.data, RequestRouted)]
        finally:
            if side is not None:
                side.stop()
            w.stop()
    ties = sum(" tied, broken by rng_seed" in r.reason for r in routed)
    blind = 0
    served: set[str] = set()
    switches = 0
    last = None
    for r in routed:
        row = {s.worker_id: s for s in r.scores}
        if served and not any(row[wid].overlap_blocks or row[wid].speculative_overlap for wid in served if wid in row):
            blind += 1
        served.add(r.worker_id)
        switches += last is not None and r.worker_id != last
        last = r.worker_id
    total = sum(per_worker) or 1.0
    out = {"n": n, "errors": errors, "prefix": w.prefix, "split": "/".join(str(int(x)) for x in per_worker),
           "max_share": max(per_worker) / total, "hit_rate": hits / queries if queries else float("nan"),
           "routed": len(routed), "ties": ties, "blind": blind, "switches": switches}
    return out


def main(n: int = 400, words: int = 4096, max_tokens: int = 8, speedup: float = 1.0, clients: int = 1) -> None:
    r = run(n, words, max_tokens, speedup, clients)
    print(f"one {words}-word prompt x {r['n']} in a row ({clients} client(s)), engine speed x{speedup:g}, two workers: split {r['split']}, errors {r['errors']}; "
          f"{r['routed']} decisions, {r['ties']} ties broken by the seed, {r['blind']} with no overlap seen on a "
          f"worker that had served the prompt, {r['switches']} worker switches; topic prefix {r['prefix']} (`switchyard replay reconcile --prefix` it)")
    print(f"RESULT n={r['n']} max_share={r['max_share']:.3f} hit_rate={r['hit_rate']:.3f} ties={r['ties']} "
          f"blind={r['blind']} switches={r['switches']}")


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--words", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--speedup", type=float, default=1.0, help="engine time runs this much faster (the peers "
                    "bench's HTTP phase: 1000)")
    ap.add_argument("--clients", type=int, default=1, help="concurrent clients (1: one request at a time)")
    a = ap.parse_args()
    main(a.n, a.words, a.max_tokens, a.speedup, a.clients)
