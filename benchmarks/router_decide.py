"""Latency of one kv-mode routing decision (``control_plane.router.decide``), in process.

For 8, 64 and 256 workers and 4K- and 32K-token prompts (block size 16: 256 and 2,048 blocks):
random per-worker overlaps spread over the four tiers (some stale), random reported loads, and a
ledger holding ~2 in-flight requests per worker whose prompts share a random prefix with the
measured one (so the speculative-overlap binary search runs). Each sample is one ``decide``
call including building the score table and the reason; inputs are built outside the timer.
Also reported: the same decision with nothing in flight (what the ledger lookups cost), and one
``InflightLedger.add`` + ``complete`` pair (also on the per-request path).

Run: ``uv run python -m benchmarks.router_decide``.
"""

from __future__ import annotations

import random
import time

from control_plane.router import (
    InflightLedger,
    RouterConfig,
    RoutingRequest,
    WorkerLoad,
    WorkerOverlap,
    decide,
)
from schemas.types import BlockHash, RequestId, WorkerId

WORKER_COUNTS = (8, 64, 256)
PROMPT_TOKENS = (4096, 32768)
BLOCK_SIZE = 16
SAMPLES = 1500
WARMUP = 100
INFLIGHT_PER_WORKER = 2


def _chain(rng: random.Random, n: int, shared: tuple[BlockHash, ...] = ()) -> tuple[BlockHash, ...]:
    """A prompt's hash chain: ``shared`` as its prefix, then fresh random 64-bit hashes."""
    return shared + tuple(BlockHash(rng.getrandbits(64)) for _ in range(n - len(shared)))


def _scenario(rng: random.Random, n_workers: int, prompt_tokens: int):
    """A decision's inputs, with a ledger holding ~``INFLIGHT_PER_WORKER`` requests per worker."""
    n_blocks = prompt_tokens // BLOCK_SIZE
    hashes = _chain(rng, n_blocks)
    request = RoutingRequest(
        request_id=RequestId("bench"), prompt_tokens=prompt_tokens, block_size=BLOCK_SIZE,
        block_hashes=hashes, expected_output_tokens=512,
    )
    workers = [
        WorkerLoad(
            worker_id=WorkerId(f"worker-{i:03d}"),
            queued_prefill_tokens=rng.randrange(0, 4 * prompt_tokens),
            active_decode_blocks=rng.randrange(0, 20_000),
            inflight_requests=rng.randrange(0, 40),
            kv_capacity_blocks=40_000,
        )
        for i in range(n_workers)
    ]
    overlaps = {}
    for w in workers:
        depth = rng.randrange(0, n_blocks + 1)
        cuts = sorted(rng.randrange(0, depth + 1) for _ in range(3))
        overlaps[w.worker_id] = WorkerOverlap.of(
            device=cuts[0], host=cuts[1] - cuts[0], disk=cuts[2] - cuts[1], object=depth - cuts[2],
            stale=rng.random() < 0.05,
        )
    ledger = InflightLedger()
    for w in workers:
        for k in range(INFLIGHT_PER_WORKER):
            shared = hashes[: rng.randrange(0, n_blocks + 1)]
            ledger.add(RequestId(f"{w.worker_id}-{k}"), w.worker_id, _chain(rng, n_blocks, shared),
                       rng.randrange(0, prompt_tokens), n_blocks + 32, now=0.0, ttl=600.0)
    return request, workers, overlaps, ledger


def _percentile(sorted_values: list[float], q: float) -> float:
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


def run(samples: int = SAMPLES) -> dict:
    """Measure; return {"decide": {"<workers>w/<tokens>tok": {...us...}}, "ledger": {...},
    "inputs": {"<workers>w/<tokens>tok": (request, overlaps)}} (what each point decided on, so an
    anchor can be measured on the same prompt)."""
    rng = random.Random(20260501)
    config = RouterConfig()
    results: dict = {"decide": {}, "ledger": {}, "inputs": {}}
    for prompt_tokens in PROMPT_TOKENS:
        for n_workers in WORKER_COUNTS:
            request, workers, overlaps, ledger = _scenario(rng, n_workers, prompt_tokens)
            for seed in range(WARMUP):
                decide(request, workers, config, rng_seed=seed, overlaps=overlaps, inflight=ledger)
            timings = []
            for seed in range(samples):
                t0 = time.perf_counter_ns()
                decide(request, workers, config, rng_seed=seed, overlaps=overlaps, inflight=ledger)
                timings.append((time.perf_counter_ns() - t0) / 1000.0)
            timings.sort()
            # The same decision with nothing in flight: what the ledger lookups cost.
            idle = []
            for seed in range(samples // 3):
                t0 = time.perf_counter_ns()
                decide(request, workers, config, rng_seed=seed, overlaps=overlaps)
                idle.append((time.perf_counter_ns() - t0) / 1000.0)
            idle.sort()
            results["inputs"][f"{n_workers}w/{prompt_tokens}tok"] = (request, overlaps)
            results["decide"][f"{n_workers}w/{prompt_tokens}tok"] = {
                "workers": n_workers,
                "prompt_tokens": prompt_tokens,
                "blocks": prompt_tokens // BLOCK_SIZE,
                "p50_us": _percentile(timings, 0.50),
                "p99_us": _percentile(timings, 0.99),
                "max_us": timings[-1],
                "no_inflight_p50_us": _percentile(idle, 0.50),
                "no_inflight_p99_us": _percentile(idle, 0.99),
            }
        # Ledger bookkeeping per request: add on routing, complete at the end.
        ledger = InflightLedger()
        hashes = request.block_hashes
        timings = []
        for k in range(samples // 3):
            t0 = time.perf_counter_ns()
            ledger.add(RequestId(f"r{k}"), WorkerId("w"), hashes, prompt_tokens,
                       len(hashes) + 32, now=float(k), ttl=600.0)
            ledger.complete(RequestId(f"r{k}"))
            timings.append((time.perf_counter_ns() - t0) / 1000.0)
        timings.sort()
        results["ledger"][f"{prompt_tokens}tok"] = {
            "blocks": len(hashes),
            "p50_us": _percentile(timings, 0.50),
            "p99_us": _percentile(timings, 0.99),
        }
    return results


def _print(results: dict) -> None:
    print(f"{'kv decide':<16}{'workers':>8}{'blocks':>8}{'p50 us':>10}{'p99 us':>10}"
          f"{'max us':>10}   {'no in-flight p50/p99 us':>24}")
    for name, row in results["decide"].items():
        idle = f"{row['no_inflight_p50_us']:.1f} / {row['no_inflight_p99_us']:.1f}"
        print(f"{name:<16}{row['workers']:>8}{row['blocks']:>8}{row['p50_us']:>10.1f}"
              f"{row['p99_us']:>10.1f}{row['max_us']:>10.1f}   {idle:>24}")
    print(f"{'ledger add+complete':<24}{'blocks':>8}{'p50 us':>10}{'p99 us':>10}")
    for name, row in results["ledger"].items():
        print(f"{name:<24}{row['blocks']:>8}{row['p50_us']:>10.1f}{row['p99_us']:>10.1f}")


if __name__ == "__main__":
    started = time.perf_counter()
    _print(run())
    print(f"({time.perf_counter() - started:.1f} s)")
