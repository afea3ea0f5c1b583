"""CPU of one routed request's decision path with TTFT predictions, in process (issues 38, 39).

What the live router does per prefilling request, through its own functions: fold the
``RequestAdmitted``, build the decision's inputs (``decision_inputs``: the ledger's preparation,
the candidates, the overlaps, every candidate's TTFT model), decide (``execute``), record
(``routed_event``), fold the ``RequestRouted`` and later the ``RequestCompleted`` (whose TTFT
is an observation of the fit). ``WORKERS`` aggregated workers, 4K-token prompts sharing random
prefixes, ``INFLIGHT`` requests open per worker (each completion ends the oldest one), and a
TTFT per completion from a fixed linear rule with noise, so the fit has something to learn.
Timed: the whole path per request, and its parts (inputs, decide, record, folds); also the
encoded ``RequestRouted`` size (msgpack, as the codec writes it).

Run: ``uv run python -m benchmarks.router_ttft_path [--n 3000] [--workers 8 64]``.
Last line: ``RESULT w<N>_path_us_p50=... w<N>_decide_us_p50=... w<N>_routed_bytes=...``.
"""

from __future__ import annotations

import argparse
import random
import time
from collections import deque
from collections.abc import Mapping, Sequence

import msgspec

from control_plane.router import RouterConfig, WorkerLoad, WorkerOverlap
from control_plane.router.inputs import decision_inputs, execute, routed_event
from control_plane.router.ledger import RouterLedger
from schemas.envelope import EnvelopeFactory
from schemas.events import RequestAdmitted, RequestCompleted
from schemas.types import BlockHash, RequestId, RequestPhase, WorkerId

PROMPT_TOKENS = 4096
BLOCK_SIZE = 16
INFLIGHT = 2
WARMUP = 300


class _Source:
    """A fixed candidate list and prefix matches (the router's view, in memory)."""

    def __init__(self, workers: list[WorkerLoad], overlaps: dict[WorkerId, WorkerOverlap]) -> None:
        self.workers = workers
        self.matches = overlaps

    def candidates(self, role: str) -> list[WorkerLoad]:
        return self.workers

    def overlaps(self, hashes: Sequence[BlockHash]) -> Mapping[WorkerId, WorkerOverlap]:
        return self.matches


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def run(n_workers: int, n: int, seed: int = 20261207) -> dict:
    rng = random.Random(seed)
    config = RouterConfig()
    workers = [WorkerLoad(worker_id=WorkerId(f"worker-{i:03d}"), queued_prefill_tokens=rng.randrange(0, 8192),
                          active_decode_blocks=rng.randrange(0, 5000), inflight_requests=rng.randrange(0, 8),
                          kv_capacity_blocks=40_000) for i in range(n_workers)]
    n_blocks = PROMPT_TOKENS // BLOCK_SIZE
    overlaps = {w.worker_id: WorkerOverlap.of(device=rng.randrange(0, n_blocks // 2)) for w in workers}
    source = _Source(workers, overlaps)
    ledger = RouterLedger()
    clock = [1_000_000_000_000]

    def tick() -> int:
        clock[0] += 1_000_000  # 1 ms of decision time per event
        return clock[0]

    factory = EnvelopeFactory("router-bench", 1, tick)
    encoder = msgspec.msgpack.Encoder()
    shared = tuple(BlockHash(rng.getrandbits(64)) for _ in range(n_blocks))
    open_: deque[tuple[RequestId, float]] = deque()
    parts: dict[str, list[float]] = {k: [] for k in ("path", "inputs", "decide", "record", "fold")}
    sizes: list[int] = []
    for k in range(WARMUP + n):
        rid = RequestId(f"r{k}")
        cut = rng.randrange(0, n_blocks)
        hashes = shared[:cut] + tuple(BlockHash(rng.getrandbits(64)) for _ in range(n_blocks - cut))
        admitted = factory.wrap(RequestAdmitted(request_id=rid, prompt_tokens=PROMPT_TOKENS, block_size=BLOCK_SIZE,
                                                block_hashes=list(hashes), max_tokens=64, model="m",
                                                hash_algo="xxh64"))
        t0 = time.perf_counter_ns()
        ledger.apply(admitted)
        t1 = time.perf_counter_ns()
        inputs = decision_inputs(source, ledger, request_id=rid, prompt_tokens=PROMPT_TOKENS, block_hashes=hashes,
                                 block_size=BLOCK_SIZE, expected_output_tokens=64, phase=RequestPhase.AGGREGATED,
                                 attempt=0, now=clock[0] / 1e9)
        t2 = time.perf_counter_ns()
        decision = execute(inputs, config)
        t3 = time.perf_counter_ns()
        ev = routed_event(decision, inputs, config, decided_at_s=clock[0] / 1e9)
        t4 = time.perf_counter_ns()
        env = factory.wrap(ev)
        t5 = time.perf_counter_ns()
        ledger.apply(env)
        t6 = time.perf_counter_ns()
        sizes.append(len(encoder.encode(ev)))
        open_.append((rid, (ev.predicted_ttft_ms or 0.0) * 1.5 * rng.uniform(0.8, 1.2) + 20.0))
        done = None
        if len(open_) > INFLIGHT * n_workers:
            crid, ttft = open_.popleft()
            done = factory.wrap(RequestCompleted(request_id=crid, worker_id=decision.worker_id, ttft_ms=ttft,
                                                 e2e_ms=ttft + 100.0, prompt_tokens=PROMPT_TOKENS,
                                                 output_tokens=64))
        t7 = time.perf_counter_ns()
        if done is not None:
            ledger.apply(done)
        t8 = time.perf_counter_ns()
        if k >= WARMUP:
            parts["inputs"].append((t2 - t1) / 1000)
            parts["decide"].append((t3 - t2) / 1000)
            parts["record"].append((t4 - t3) / 1000)
            parts["fold"].append((t1 - t0 + t6 - t5 + t8 - t7) / 1000)
            parts["path"].append((t1 - t0 + t4 - t1 + t6 - t5 + t8 - t7) / 1000)
    out = {f"{name}_us_p50": round(_pct(v, 0.5), 1) for name, v in parts.items()}
    out.update({f"{name}_us_mean": round(sum(v) / len(v), 1) for name, v in parts.items()})
    out["path_us_p99"] = round(_pct(parts["path"], 0.99), 1)
    out["routed_bytes"] = round(sum(sizes[WARMUP:]) / n)
    out["fit_samples"] = ledger.ttft_fit.observations()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=3000, help="requests timed per worker count (after 300 warm-up)")
    p.add_argument("--workers", type=int, nargs="+", default=[8, 64])
    a = p.parse_args(argv)
    result = []
    for w in a.workers:
        r = run(w, a.n)
        print(f"{w} workers: " + " ".join(f"{k}={v}" for k, v in r.items()))
        result += [f"w{w}_path_us_p50={r['path_us_p50']}", f"w{w}_path_us_mean={r['path_us_mean']}",
                   f"w{w}_inputs_us_p50={r['inputs_us_p50']}", f"w{w}_decide_us_p50={r['decide_us_p50']}",
                   f"w{w}_routed_bytes={r['routed_bytes']}"]
    print("RESULT " + " ".join(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
