"""What the router view's fold costs its process per routed request (issue 38: the view fold).

A child process runs only a router's view (:class:`RouterViewProcessor` on a topic prefix of its
own, fetch settings as the router's defaults: 64 KB / 10 ms: its tail of librdkafka batches
folded on the loop); this process publishes, as two
workers, the KV events a routed 4K-token request leaves (``router_broker_sources._kv``: two
``BlockStored`` of 32 hashes, two ``BlockRemoved``), ``--gap-ms`` apart, plus a load report per
worker every 100 requests. Per request: the child's CPU (``/proc``, every thread: the tail's
thread, librdkafka's, the loop) from the first event published to the view holding the
last one (its ``sync``), minus its rate over a quiet second before (the idle loop's timers).

    uv run --group bench python -m benchmarks.router_view_cost [--rounds 3] [--n 1000]
    ... --profile out.txt   # py-spy (SWITCHYARD_PYSPY or the uv cache's) on the child, round 1

Last line: ``RESULT view_ms=<median> view_ms_max=<worst round> ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid

from benchmarks.router_broker_sources import ALGO, BS, _kv, _register
from common.log.admin import apply_topics
from common.log.kafka import EventProducer
from common.processes import cpu_s
from common.settings import BusSettings
from control_plane.router.stream import RouterViewProcessor
from control_plane.router.view import RouterView
from schemas.events import WorkerLoadReported


async def child(prefix: str) -> None:
    """Run a view; answer ``sync`` on stdin with a line once the view holds the log's end."""
    bus = BusSettings.from_env(topic_prefix=prefix, role="router")
    proc = RouterViewProcessor(bus, f"vcost-{os.getpid()}", RouterView(ALGO, BS), snapshot_every_s=3600,
                               fetch_min_bytes=65536, fetch_wait_ms=10)
    await proc.start()
    await proc.sync(120)
    loop = asyncio.get_running_loop()
    print("ready", flush=True)
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line or line.strip() == "stop":
            break
        await proc.sync(120)
        print(json.dumps({"applied": proc.view.applied, "dead_lettered": proc.dead_lettered}), flush=True)
    await proc.stop()


def _pyspy() -> str | None:
    found = os.environ.get("SWITCHYARD_PYSPY") or shutil.which("py-spy")
    if not found:
        hits = glob.glob(os.path.expanduser("~/.cache/uv/archive-v0/*/py_spy-*.data/scripts/py-spy"))
        found = hits[0] if hits else None
    return found


def _drive(workers: dict[str, EventProducer], n: int, start: int, gap_s: float) -> None:
    wids = list(workers)
    for j in range(n):
        i = start + j
        wid = wids[i % 2]
        _kv(workers[wid], wid, i)
        if i % 100 == 0:
            for w, p in workers.items():
                p.publish(WorkerLoadReported(worker_id=w, running=1, waiting=0, tier_usage={"device": 0.1}))
        time.sleep(gap_s)
    for p in workers.values():
        assert p.flush(30) == 0


def main(args) -> None:
    prefix = f"vcost{uuid.uuid4().hex[:6]}"
    apply_topics(BusSettings.from_env(topic_prefix=prefix))
    bus = BusSettings.from_env(topic_prefix=prefix, role="worker")
    workers = {w: EventProducer(bus, w) for w in ("w1", "w2")}
    for w, p in workers.items():
        _register(p, w)
    _drive(workers, 200, 0, 0.0)  # the index holds ~200 requests' blocks from here on
    start = 200
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    got: list[float] = []
    for r in range(args.rounds):
        c = subprocess.Popen([sys.executable, "-m", "benchmarks.router_view_cost",
                              "--child", prefix],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        try:
            if c.stdout.readline().strip() != "ready":
                raise RuntimeError("the view process did not start")
            time.sleep(1.0)
            i0, t0 = cpu_s(c.pid), time.monotonic()
            time.sleep(1.0)
            idle = (cpu_s(c.pid) - i0) / (time.monotonic() - t0)
            spy = None
            if args.profile and r == 0:
                spy = subprocess.Popen([_pyspy(), "record", "--pid", str(c.pid), "--rate", "500", "--format", "raw",
                                        "--threads", "-o", args.profile + ".raw"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1.0)
            c0, t0 = cpu_s(c.pid), time.monotonic()
            _drive(workers, args.n, start, args.gap_ms / 1000)
            start += args.n
            c.stdin.write("sync\n")
            c.stdin.flush()
            state = json.loads(c.stdout.readline())
            cpu, wall = cpu_s(c.pid) - c0, time.monotonic() - t0
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(30)
            ms = max(cpu - idle * wall, 0.0) * 1000 / args.n
            got.append(ms)
            print(f"  round {r + 1}: view {ms:.3f} ms/req, {cpu * 1000 / args.n:.3f} before the idle rate is "
                  f"subtracted (idle {idle * 1000:.1f} ms/s, {wall:.1f} s, "
                  f"applied {state['applied']}, dead-lettered {state['dead_lettered']}, load "
                  f"{os.getloadavg()[0]:.1f})", flush=True)
        finally:
            if c.poll() is None:
                c.stdin.write("stop\n")
                c.stdin.flush()
                try:
                    c.wait(30)
                except subprocess.TimeoutExpired:
                    c.kill()
    print(f"{args.n} requests per round ({args.gap_ms} ms apart), {args.rounds} rounds: view CPU ms per "
          f"request median {statistics.median(got):.3f} [{min(got):.3f}-{max(got):.3f}]")
    print(f"RESULT view_ms={statistics.median(got):.3f} view_ms_min={min(got):.3f} view_ms_max={max(got):.3f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--gap-ms", type=float, default=5.0)
    ap.add_argument("--profile", help="py-spy raw output path (round 1).")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        asyncio.run(child(a.child))
    else:
        main(a)
