"""A router restart with 1M indexed blocks, until its view is EXACT again (snapshot + tail).

On a fresh topic prefix: 8 workers register and store 1,000,000 distinct blocks (events of 64
blocks, as engines report them); a router replica (``switchyard router --snapshot-every 1``)
folds them and checkpoints; it is killed with -9; 1,000 more store events land in the log; a new
replica starts. ``restart_exact_s`` is the wall time from spawning the new process until its
``/health`` says EXACT with all 1M+ blocks indexed: Python start-up, loading the newest snapshot
from the compacted topic, restoring the index and folding the tail.

Run: ``uv run python -m benchmarks.router_restart`` (needs ``switchyard stack up``).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
import uuid

import httpx

from common.log.admin import apply_topics
from common.log.kafka import EventProducer
from common.net import free_port
from common.settings import BusSettings
from schemas.events import BlockStored, WorkerRegistered
from schemas.types import Tier, WorkerRole

WORKERS = 8
BLOCKS = 1_000_000
PER_EVENT = 64
TAIL_EVENTS = 1000
HASH_ALGO = "sha256"
BLOCK_SIZE = 64


def _health(port: int) -> dict | None:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return None


def _wait_exact(port: int, min_hashes: int, timeout: float) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        h = _health(port)
        if h is not None and h.get("state") == "EXACT":
            try:
                v = httpx.get(f"http://127.0.0.1:{port}/router/view", timeout=5).json()
            except (httpx.HTTPError, ValueError):
                v = {}
            if v.get("hashes", 0) >= min_hashes:
                return time.perf_counter() - t0
        time.sleep(0.02)
    raise RuntimeError(f"router on :{port} not EXACT with {min_hashes} hashes after {timeout}s")


def _produce(producers: list[EventProducer], rng: random.Random, events: int) -> int:
    blocks = 0
    for i in range(events):
        p = producers[i % len(producers)]
        hashes = [rng.getrandbits(64) for _ in range(PER_EVENT)]
        p.publish(BlockStored(worker_id=p.producer_id, tier=Tier.DEVICE, block_hashes=hashes,
                              block_size=BLOCK_SIZE, hash_algo=HASH_ALGO))
        blocks += PER_EVENT
        if i % 500 == 0:
            p.poll(0)
    for p in producers:
        p.flush(60)
    return blocks


def _router(env: dict, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "switchyard.cli", "router", "--port", str(port), "--router-id",
         "restart-bench", "--snapshot-every", "1", "--hash-algo", HASH_ALGO, "--block-size",
         str(BLOCK_SIZE), "--no-auth"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run() -> dict:
    bus = BusSettings.from_env(topic_prefix=f"benchrs{uuid.uuid4().hex[:6]}")
    apply_topics(bus)
    env = {**os.environ, "SWITCHYARD_KAFKA_BOOTSTRAP": bus.bootstrap,
           "SWITCHYARD_TOPIC_PREFIX": bus.topic_prefix}
    rng = random.Random(12)
    producers = [EventProducer(bus, f"w{i}", epoch=1) for i in range(WORKERS)]
    for p in producers:
        p.publish(WorkerRegistered(worker_id=p.producer_id, role=WorkerRole.AGGREGATED, pool="p",
                                   endpoint="http://127.0.0.1:9", block_size=BLOCK_SIZE,
                                   hash_algo=HASH_ALGO))
    t0 = time.perf_counter()
    blocks = _produce(producers, rng, BLOCKS // PER_EVENT)
    produce_s = time.perf_counter() - t0
    port = free_port()
    first = _router(env, port)
    procs = [first]
    try:
        cold_s = _wait_exact(port, blocks, 600)
        time.sleep(4)  # two checkpoints at --snapshot-every 1 after the view is complete
        first.kill()
        first.wait(10)
        tail = _produce(producers, rng, TAIL_EVENTS)
        port = free_port()
        t1 = time.perf_counter()
        second = _router(env, port)
        procs.append(second)
        restart_s = _wait_exact(port, blocks + tail, 600)
        assert abs(restart_s - (time.perf_counter() - t1)) < 1.0
        return {"blocks": blocks, "tail_blocks": tail, "produce_s": produce_s,
                "cold_exact_s": cold_s, "restart_exact_s": restart_s}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for p in producers:
            p.close(10)


def main() -> dict:
    r = run()
    print(f"router restart: {r['blocks']:,} blocks indexed (+{r['tail_blocks']:,} in the tail); "
          f"cold fold from the log start {r['cold_exact_s']:.2f} s; restart from snapshot + tail "
          f"to EXACT {r['restart_exact_s']:.2f} s (spawn to /health EXACT with every block)")
    print(f"RESULT restart_exact_s={r['restart_exact_s']:.2f} cold_exact_s={r['cold_exact_s']:.2f}")
    return r


if __name__ == "__main__":
    main()
