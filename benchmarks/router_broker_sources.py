"""Where the broker's CPU goes per routed request, one source of the router's at a time (issue 38
item 3).

Two workers publish the KV events a routed 4K-token request leaves (two ``BlockStored`` of 64
hashes on the prefill worker, two ``BlockRemoved``: what ``bench peers`` reads back per request),
request after request ``GAP_S`` apart, on a topic prefix of its own. Each phase adds one of the
router's sources on top of that baseline (what the ``direct`` side costs the broker too):

* ``workers``: the workers' KV events alone;
* ``request_events``: + the router's four events per request (router_events_cost.py's shapes);
* ``view``: + the router's view (:class:`RouterViewProcessor`, its librdkafka tail following
  ``kv`` and ``workers``; a Faust consumer before) with the fetch settings it had before issue 38 (1 byte, 1,500 ms),
  snapshots off;
* ``view_tuned``: the same with ``--fetch-min-bytes``/``--fetch-wait-ms`` (the ones to try);
* ``snapshots``: ``view_tuned`` + checkpoints every ``--snapshot-every`` s of a view holding
  ``--view-blocks`` blocks (a long-running router's size); the cost of one checkpoint is printed,
  as the number of checkpoints in a phase is small.

Broker CPU per request: the brokers' ``/proc`` CPU over the phase minus their rate over a quiet
window right after (other clients share the broker), over the requests. The phases alternate
round by round. Freshness of the view: per request, how long after its last ``BlockStored`` was
produced the view held its whole chain (p50/p99), in the two view phases.

    uv run --group bench python -m benchmarks.router_broker_sources [--rounds 3] [--n 600]

Last line: ``RESULT <phase>_broker_ms=... view_fresh_p50_ms=... view_tuned_fresh_p99_ms=...
checkpoint_broker_ms=...`` (medians over rounds; a source's cost is its phase minus the one it
adds to).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

from benchmarks.peers_bench import broker_cpu_s, broker_idle_rate, broker_pids
from benchmarks.router_events_cost import _request
from common.log.admin import apply_topics
from common.log.kafka import EventProducer
from common.settings import BusSettings
from control_plane.router.stream import RouterViewProcessor
from control_plane.router.view import RouterView
from schemas.events import BlockRemoved, BlockStored, WorkerRegistered

GAP_S = 0.005
ALGO, BS = "sha256", 64
PHASES = ("workers", "request_events", "view", "view_tuned", "snapshots")


def _register(p: EventProducer, wid: str) -> None:
    p.publish(WorkerRegistered(worker_id=wid, role="aggregated", pool="default", endpoint="http://127.0.0.1:9",
                               capacity={"device": 1_000_000}, block_size=BS, hash_algo=ALGO))


def _kv(p: EventProducer, wid: str, i: int) -> tuple[int, ...]:
    """One request's KV events on ``wid``; the chain the view must come to hold whole."""
    base = (i + 1) << 20
    chain = [base + k for k in range(64)]
    p.publish(BlockStored(worker_id=wid, tier="device", block_hashes=chain[:32], block_size=BS, hash_algo=ALGO))
    p.publish(BlockStored(worker_id=wid, tier="device", block_hashes=chain[32:], parent_hash=chain[31],
                          block_size=BS, hash_algo=ALGO))
    old = ((i - 200) + 1) << 20
    if i >= 200:  # the oldest requests' blocks go: the index holds about 200 requests' worth
        p.publish(BlockRemoved(worker_id=wid, tier="device", block_hashes=[old + k for k in range(32)]))
        p.publish(BlockRemoved(worker_id=wid, tier="device", block_hashes=[old + k for k in range(32, 64)]))
    return tuple(chain)


def _drive(workers: dict[str, EventProducer], router: EventProducer | None, n: int, prefix: str,
           produced: dict[tuple[int, ...], float], start: int) -> None:
    wids = list(workers)
    for j in range(n):
        i = start + j
        wid = wids[i % 2]
        if router is not None:
            _request(router, i, prefix)
        last = _kv(workers[wid], wid, i)
        produced[last] = time.monotonic()
        time.sleep(GAP_S)
    for p in [*workers.values(), *([router] if router else [])]:
        assert p.flush(30) == 0


async def _phase(phase: str, bus: BusSettings, rbus: BusSettings, workers: dict[str, EventProducer],
                 router: EventProducer, n: int, start: int, brokers: list[int], args,
                 snaps: list[int]) -> tuple[float, list[float]]:
    proc = None
    fresh: list[float] = []
    seen: dict[int, float] = {}
    produced: dict[tuple[int, ...], float] = {}
    if phase in ("view", "view_tuned", "snapshots"):
        view = RouterView(ALGO, BS)
        every = args.snapshot_every if phase == "snapshots" else 3600
        fetch = (1, 1500) if phase == "view" else (args.fetch_min_bytes, args.fetch_wait_ms)
        proc = RouterViewProcessor(rbus, f"bsrc-{phase}", view, snapshot_every_s=every, fetch_min_bytes=fetch[0],
                                   fetch_wait_ms=fetch[1])
        if phase == "snapshots":  # a long-running router's view: its checkpoint is that big
            filler = EventProducer(bus, "w-fill")
            _register(filler, "w-fill")
            for k in range(0, args.view_blocks, 512):
                filler.publish(BlockStored(worker_id="w-fill", tier="device",
                                           block_hashes=[(1 << 40) + k + m for m in range(512)],
                                           block_size=BS, hash_algo=ALGO))
            assert filler.flush(30) == 0
        await proc.start()
        await proc.sync(120)
        snaps0 = proc.snapshots_written
    async def watch() -> None:  # when the view came to hold each request's whole chain (on the loop)
        while True:
            for chain, t in list(produced.items()):
                if any(m.depth == len(chain) for m in proc.view.matches(chain).values()):
                    seen[chain] = time.monotonic() - t
                    del produced[chain]
            await asyncio.sleep(0.001)

    watcher = asyncio.create_task(watch()) if phase in ("view", "view_tuned") else None
    b0, t0 = broker_cpu_s(brokers), time.monotonic()
    await asyncio.to_thread(_drive, workers, None if phase == "workers" else router, n, bus.topic_prefix,
                            produced, start)
    if proc is not None:
        await proc.sync(60)
    wall, broker = time.monotonic() - t0, broker_cpu_s(brokers) - b0
    if watcher:
        await asyncio.sleep(0.01)
        watcher.cancel()
        fresh = [v * 1000 for v in seen.values()]
    if proc is not None:
        if phase == "snapshots":
            snaps.append(proc.snapshots_written - snaps0)
        await proc.stop()
    idle = await asyncio.to_thread(broker_idle_rate, brokers)
    return max(broker - idle * wall, 0.0) * 1000 / n, fresh


async def amain(args) -> dict[str, float]:
    prefix = f"bsrc{uuid.uuid4().hex[:6]}"
    apply_topics(BusSettings.from_env(topic_prefix=prefix))
    bus = BusSettings.from_env(topic_prefix=prefix, role="worker")
    rbus = BusSettings.from_env(topic_prefix=prefix, role="router")
    workers = {w: EventProducer(bus, w) for w in ("w1", "w2")}
    for w, p in workers.items():
        _register(p, w)
    router = EventProducer(rbus, "bench-router")
    brokers = broker_pids()
    got: dict[str, list[float]] = {k: [] for k in PHASES}
    fresh: dict[str, list[float]] = {"view": [], "view_tuned": []}
    snaps: list[int] = []
    start = 0
    for r in range(args.rounds):
        for phase in PHASES[r % len(PHASES):] + PHASES[:r % len(PHASES)]:
            ms, f = await _phase(phase, bus, rbus, workers, router, args.n, start, brokers, args, snaps)
            start += args.n
            got[phase].append(ms)
            fresh.get(phase, []).extend(f)
            print(f"  round {r + 1} {phase:<15} broker {ms:.3f} ms/req", flush=True)
    out = {k: statistics.median(v) for k, v in got.items()}
    pct = {}
    for k, v in fresh.items():
        v.sort()
        pct[k] = (v[len(v) // 2], v[int(len(v) * 0.99)]) if v else (float("nan"), float("nan"))
    per_snap = (out["snapshots"] - out["view_tuned"]) * args.n / max(statistics.median(snaps), 1)
    print(f"{args.n} requests per phase, {args.rounds} rounds, fetch.min.bytes {args.fetch_min_bytes}, "
          f"fetch wait {args.fetch_wait_ms} ms; broker ms per request, median [min-max]; a source = its phase "
          f"minus the one before")
    before = {"request_events": "workers", "view": "request_events", "view_tuned": "request_events",
              "snapshots": "view_tuned"}
    for k in PHASES:
        extra = f"  source {out[k] - out[before[k]]:+.3f}" if k in before else ""
        print(f"{k:<15} {out[k]:.3f} [{min(got[k]):.3f}-{max(got[k]):.3f}]{extra}")
    for k, (p50, p99) in pct.items():
        print(f"{k} freshness (produce -> the view holds the chain): p50 {p50:.1f} ms, p99 {p99:.1f} ms")
    print(f"checkpoints per snapshots phase {snaps}: broker {per_snap:.1f} ms per checkpoint")
    print("RESULT " + " ".join(f"{k}_broker_ms={v:.3f}" for k, v in out.items())
          + "".join(f" {k}_fresh_p50_ms={p[0]:.1f} {k}_fresh_p99_ms={p[1]:.1f}" for k, p in pct.items())
          + f" checkpoint_broker_ms={per_snap:.1f}")
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n", type=int, default=600)
    ap.add_argument("--fetch-min-bytes", type=int, default=None, help="The view consumer's (default: its own).")
    ap.add_argument("--fetch-wait-ms", type=int, default=None, help="The view consumer's (default: its own).")
    ap.add_argument("--snapshot-every", type=float, default=1.0)
    ap.add_argument("--view-blocks", type=int, default=200_000)
    asyncio.run(amain(ap.parse_args()))
