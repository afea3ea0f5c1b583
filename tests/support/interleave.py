"""A cluster's log as its producers write it, and the interleavings a consumer may read it in.

``cluster_log(seed)`` plays a small cluster forward in real time: workers register, store, move
and evict KV blocks, report load, drain or crash and come back under a new epoch (re-announcing
their persistent blocks, as ``data_plane.workers.wiring`` does); a router admits, routes and
completes requests on them (aggregated, or disaggregated over a prefill and a decode worker;
some attempts fail and are retried, some requests fail); an operator asks for some drains
(``admin``). Every event is wrapped by its producer's ``EnvelopeFactory`` with the partition
scope ``EventProducer`` uses, and placed in the partition its key hashes to (xxh64 mod the
catalog's partition count). A few KV events are produced but never written (``lost``): their
sequence numbers are consumed, so the log has real gaps.

``interleavings(log, rng)`` yields the same records merged in a random order that keeps each
partition's order: exactly the freedom a consumer of several partitions has.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import xxhash

from common.log.catalog import SPECS
from schemas.envelope import Envelope, EnvelopeFactory
from schemas.events import (
    AllBlocksCleared,
    BlockMoved,
    BlockRemoved,
    BlockStored,
    Event,
    PrefillCompleted,
    RequestAdmitted,
    RequestCompleted,
    RequestFailed,
    RequestRouted,
    WorkerDeregistered,
    WorkerDraining,
    WorkerDrainRequested,
    WorkerLoadReported,
    WorkerRegistered,
)
from schemas.types import RequestPhase, RoutingMode, Tier

BLOCK_SIZE = 16
HASH_ALGO = "sha256"
PARTITIONS = {s.stream: s.partitions for s in SPECS}
TOPIC_PREFIX = "t"


@dataclass(frozen=True)
class Rec:
    """One record of the log: an envelope at ``topic:partition@offset``."""

    env: Envelope[Event]
    stream: str
    topic: str
    partition: int
    offset: int

    @property
    def tp(self) -> tuple[str, int]:
        return (self.topic, self.partition)


class _Log:
    def __init__(self) -> None:
        self.ns = 1_700_000_000 * 10**9
        self.ends: dict[tuple[str, int], int] = {}
        self.records: list[Rec] = []
        self.lost = 0

    def clock(self) -> int:
        self.ns += 1_000_000  # 1 ms per event
        return self.ns

    def write(self, f: EnvelopeFactory, ev: Event, *, drop: bool = False) -> None:
        stream = ev.STREAM
        topic = f"{TOPIC_PREFIX}.{stream}"
        key = ev.key()
        p = xxhash.xxh64_intdigest(key.encode()) % PARTITIONS[stream]
        env = f.wrap(ev, key=key, scope=f"{topic}:{p}")
        if drop:  # produced (its seq is taken) but never written: a gap
            self.lost += 1
            return
        off = self.ends.get((topic, p), 0)
        self.ends[(topic, p)] = off + 1
        self.records.append(Rec(env, stream, topic, p, off))


def cluster_log(seed: int, *, workers: int = 3, steps: int = 120, gaps: bool = True) -> list[Rec]:
    """The log of a small cluster's life (see the module docstring), in produce order."""
    rng = random.Random(seed)
    log = _Log()
    ids = [f"w{i}" for i in range(workers)]
    roles = {w: ("prefill", "decode", "aggregated")[i % 3] for i, w in enumerate(ids)}
    epoch = dict.fromkeys(ids, 0)
    factory: dict[str, EnvelopeFactory] = {}
    up: dict[str, bool] = dict.fromkeys(ids, False)
    held: dict[str, dict[Tier, set[int]]] = {w: {t: set() for t in Tier} for w in ids}
    router = EnvelopeFactory("router-0", 1, log.clock)
    admin = EnvelopeFactory("admin-api", 1, log.clock)
    #: (request id, worker completing it, its prefill worker when disaggregated)
    open_requests: list[tuple[str, str, str | None]] = []
    nreq = 0

    def kv(w: str, ev: Event) -> None:
        log.write(factory[w], ev, drop=gaps and rng.random() < 0.02)

    def start(w: str) -> None:
        epoch[w] += 1
        factory[w] = EnvelopeFactory(w, epoch[w], log.clock)
        # A new incarnation's memory is empty; its persistent blocks are re-announced.
        held[w][Tier.DEVICE].clear()
        held[w][Tier.HOST].clear()
        kv(w, AllBlocksCleared(worker_id=w, tier=Tier.DEVICE))
        kv(w, AllBlocksCleared(worker_id=w, tier=Tier.HOST))
        for h in sorted(held[w][Tier.DISK]):
            kv(w, BlockStored(worker_id=w, tier=Tier.DISK, block_hashes=[h], block_size=BLOCK_SIZE,
                              hash_algo=HASH_ALGO))
        log.write(factory[w], WorkerRegistered(
            worker_id=w, role=roles[w], pool=f"pool-{roles[w]}", endpoint=f"http://127.0.0.1:{9000 + int(w[1:])}",
            capacity={"device": 64}, block_size=BLOCK_SIZE, hash_algo=HASH_ALGO))
        up[w] = True

    for w in ids:
        start(w)
    for _ in range(steps):
        w = rng.choice(ids)
        if not up[w]:
            start(w)
            continue
        roll = rng.random()
        if roll < 0.30:
            n = rng.randrange(1, 5)
            base = rng.randrange(0, 40)
            hashes = [1000 + base + i for i in range(n)]
            tier = rng.choice((Tier.DEVICE, Tier.DEVICE, Tier.HOST, Tier.DISK))
            held[w][tier].update(hashes)
            kv(w, BlockStored(worker_id=w, tier=tier, block_hashes=hashes, block_size=BLOCK_SIZE,
                              hash_algo=HASH_ALGO))
        elif roll < 0.42:
            tier = rng.choice((Tier.DEVICE, Tier.HOST, Tier.DISK))
            if held[w][tier]:
                gone = rng.sample(sorted(held[w][tier]), min(2, len(held[w][tier])))
                held[w][tier].difference_update(gone)
                kv(w, BlockRemoved(worker_id=w, tier=tier, block_hashes=gone))
        elif roll < 0.52:
            src, dst = rng.choice(((Tier.DEVICE, Tier.HOST), (Tier.HOST, Tier.DISK), (Tier.DEVICE, Tier.DISK)))
            if held[w][src]:
                moved = rng.sample(sorted(held[w][src]), min(3, len(held[w][src])))
                held[w][src].difference_update(moved)
                held[w][dst].update(moved)
                kv(w, BlockMoved(worker_id=w, block_hashes=moved, from_tier=src, to_tier=dst))
        elif roll < 0.62:
            log.write(factory[w], WorkerLoadReported(worker_id=w, running=rng.randrange(4), waiting=rng.randrange(3),
                                                     queued_prefill_tokens=rng.randrange(500),
                                                     tier_usage={"device": rng.random()}))
        elif roll < 0.84:
            nreq += 1
            rid = f"req-{nreq}"
            prompt = rng.choice((16, 64, 200))
            log.write(router, RequestAdmitted(request_id=rid, model="m", prompt_tokens=prompt, max_tokens=8,
                                              block_size=BLOCK_SIZE, hash_algo=HASH_ALGO, block_hashes=[1, 2, 3, 4]))

            def route(worker: str, phase: RequestPhase) -> None:
                log.write(router, RequestRouted(request_id=rid, worker_id=worker, phase=phase, mode=RoutingMode.KV,
                                                reason="kv_overlap", config_version=1, rng_seed=nreq))

            decoders = [d for d in ids if up[d] and roles[d] == "decode"]
            if roles[w] == "prefill" and decoders and rng.random() < 0.7:
                # Disaggregated: prefill here, decode on a decode worker (two pools).
                route(w, RequestPhase.PREFILL)
                d = rng.choice(decoders)
                route(d, RequestPhase.DECODE)
                open_requests.append((rid, d, w))
            else:
                if rng.random() < 0.2:
                    # An attempt that failed before any token: the router retries (same worker here).
                    route(w, RequestPhase.AGGREGATED)
                    log.write(router, RequestFailed(request_id=rid, worker_id=w, reason="worker_error: reset",
                                                    code="worker_error", retried=True))
                route(w, RequestPhase.AGGREGATED)
                open_requests.append((rid, w, None))
        elif roll < 0.94 and open_requests:
            rid, rw, pw = open_requests.pop(rng.randrange(len(open_requests)))
            if rng.random() < 0.1:
                log.write(router, RequestFailed(request_id=rid, worker_id=rw, reason="timeout", code="timeout"))
                continue
            if pw is not None or rng.random() < 0.5:
                log.write(router, PrefillCompleted(request_id=rid, worker_id=pw or rw, prompt_tokens=64,
                                                   cached_tokens=16, duration_ms=12.0))
            out = rng.choice((1, 8, 30))
            log.write(router, RequestCompleted(request_id=rid, worker_id=rw, prompt_tokens=64, output_tokens=out,
                                               cached_tokens=rng.choice((0, 16)), ttft_ms=40.0 + rng.random() * 200,
                                               itl_mean_ms=5.0 + rng.random() * 60, e2e_ms=300.0))
        elif roll < 0.97:
            # A graceful stop, sometimes asked by an operator: drain, forget the memory tiers,
            # deregister.
            if rng.random() < 0.5:
                log.write(admin, WorkerDrainRequested(worker_id=w, reason="maintenance", actor="ops"))
            log.write(factory[w], WorkerDraining(worker_id=w, reason="scale down"))
            kv(w, AllBlocksCleared(worker_id=w, tier=Tier.DEVICE))
            kv(w, AllBlocksCleared(worker_id=w, tier=Tier.HOST))
            log.write(factory[w], WorkerDeregistered(worker_id=w, reason="scale down"))
            up[w] = False
        else:
            up[w] = False  # kill -9: nothing published; it comes back under a new epoch
    return log.records


def partitions_of(log: list[Rec]) -> dict[tuple[str, int], list[Rec]]:
    out: dict[tuple[str, int], list[Rec]] = {}
    for r in log:
        out.setdefault(r.tp, []).append(r)
    return out


def interleave(log: list[Rec], rng: random.Random, streams: tuple[str, ...] | None = None) -> list[Rec]:
    """The records of ``streams`` (all by default) in a random order that keeps each partition's
    order. Runs of one partition are drawn with random lengths, so long lags of one partition
    behind another happen as well as fine-grained mixing."""
    queues = [list(reversed(q)) for tp, q in sorted(partitions_of(log).items())
              if streams is None or q[0].stream in streams]
    out: list[Rec] = []
    while queues:
        i = rng.randrange(len(queues))
        q = queues[i]
        for _ in range(min(len(q), rng.choice((1, 1, 2, 5, 50)))):
            out.append(q.pop())
        if not q:
            queues.pop(i)
    return out


def interleavings(log: list[Rec], rng: random.Random, n: int, streams: tuple[str, ...] | None = None
                  ) -> Iterator[list[Rec]]:
    """Produce order first (filtered to ``streams``), then ``n`` random interleavings."""
    yield [r for r in log if streams is None or r.stream in streams]
    for _ in range(n):
        yield interleave(log, rng, streams)
