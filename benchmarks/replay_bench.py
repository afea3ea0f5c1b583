"""``switchyard bench replay``: how fast replay rebuilds state from the log.

1. Generates (once; reused while its topics exist) a bench log under the topic prefix
   ``benchreplay1m``: 16 workers serving shared-prefix traffic with bounded caches (LRU of 4,096
   blocks each, so every store of new blocks soon brings a removal), a load report per worker
   every 20 of its stores, and one request chain (admitted, routed, completed) every 5 stores:
   exactly 1,000,000 ``kv`` + ``workers`` events and about 300,000 ``requests`` events.
2. Replays it from the local broker into the router view (prefix index + worker registry) and
   the load view (requests), timing records per second; the same from a file export
   (``switchyard replay export``).
3. Reconstructs the state at the position 1,000,000 view events deep: from the start of the
   log, and from a router snapshot taken 900,000 events deep plus the tail.

Before the folds, the same records are read with no fold at all (``raw_read_events_per_s``): the
broker's and the client's share, so the folds' share is the difference.

Last line: ``RESULT replay_events_per_s=<broker, view + load> reconstruct_1m_s=<from start>
raw_read_events_per_s=<no fold> view_fold_events_per_s=<broker, view alone> ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

from control_plane.replay.engine import VIEW_STREAMS, ReplayEngine
from control_plane.replay.state import RequestTraffic
from control_plane.router.stream import snapshot_key
from benchmarks.lru_blocks import LruBlocks
from common.log.admin import apply_topics
from common.log.catalog import Catalog
from common.log.kafka import EventProducer
from common.log.reader import FileLogReader, KafkaLogReader, export_log
from common.log.snapshots import SnapshotStore
from common.settings import BusSettings
from schemas.events import (
    BlockRemoved,
    BlockStored,
    CandidateScore,
    RequestAdmitted,
    RequestCompleted,
    RequestRouted,
    WorkerLoadReported,
    WorkerRegistered,
)
from schemas.types import RoutingMode

PREFIX = "benchreplay1m"
VIEW_EVENTS = 1_000_000
SNAPSHOT_AT = 900_000
WORKERS = 16
CAPACITY = 4096
ALGO, BS = "sha256", 64


def _count(reader, topics) -> int:
    return sum(hi - lo for t in topics for p in reader.partitions(t) for lo, hi in [reader.bounds(t, p)])


def generate(bus: BusSettings, n_view: int = VIEW_EVENTS, snapshot_at: int = SNAPSHOT_AT, seed: int = 7) -> dict:
    """Publish the bench log; write a router-view snapshot ``snapshot_at`` view events deep."""
    rng = random.Random(seed)
    producers = {f"bw{i:02d}": EventProducer(bus, f"bw{i:02d}", epoch=1) for i in range(WORKERS)}
    router = EventProducer(bus, "bench-router", epoch=1)
    docs = [[rng.getrandbits(63) for _ in range(8)] for _ in range(64)]
    held = {w: LruBlocks(CAPACITY) for w in producers}
    stores = dict.fromkeys(producers, 0)
    n = 0
    snap_written = False
    t0 = time.perf_counter()

    def publish(p: EventProducer, ev) -> None:
        nonlocal n
        p.publish(ev)
        n += 1

    for wid, p in producers.items():
        publish(p, WorkerRegistered(worker_id=wid, role="aggregated", pool="bench", endpoint=f"http://{wid}",
                                    capacity={"device": CAPACITY}, block_size=BS, hash_algo=ALGO))
    req = 0
    while n < n_view:
        wid = rng.choice(list(producers))
        p = producers[wid]
        chain = docs[rng.randrange(len(docs))] + [rng.getrandbits(63) for _ in range(4)]
        h = held[wid]
        new, evicted = h.touch(chain)
        publish(p, BlockStored(worker_id=wid, tier="device", block_hashes=new, block_size=BS, hash_algo=ALGO))
        if evicted and n < n_view:
            publish(p, BlockRemoved(worker_id=wid, tier="device", block_hashes=evicted))
        stores[wid] += 1
        if stores[wid] % 20 == 0 and n < n_view:
            publish(p, WorkerLoadReported(worker_id=wid, running=rng.randrange(8), waiting=rng.randrange(4),
                                          queued_prefill_tokens=rng.randrange(4096), active_decode_blocks=len(h),
                                          tier_usage={"device": len(h) / CAPACITY}))
        if stores[wid] % 5 == 0:
            rid = f"breq-{req}"
            req += 1
            router.publish(RequestAdmitted(request_id=rid, model="m", prompt_tokens=len(chain) * BS, max_tokens=16,
                                           block_hashes=chain, block_size=BS, hash_algo=ALGO), correlation_id=rid)
            router.publish(RequestRouted(request_id=rid, worker_id=wid, mode=RoutingMode.KV, config_version=1,
                                         rng_seed=req, scores=[CandidateScore(worker_id=wid, overlap_blocks=8)],
                                         reason="bench"), correlation_id=rid)
            router.publish(RequestCompleted(request_id=rid, worker_id=wid, prompt_tokens=len(chain) * BS,
                                            output_tokens=16, ttft_ms=20.0, e2e_ms=120.0), correlation_id=rid)
        if not snap_written and n >= snapshot_at:
            for q in producers.values():
                assert q.flush(60) == 0
            # The snapshot a router would write at this position (a fold of what is in the log).
            reader = KafkaLogReader(bus.bootstrap)
            engine = ReplayEngine(reader, Catalog(bus.topic_prefix))
            view, _, _ = engine.view_at(engine.resolve("end", engine.topics(VIEW_STREAMS)), ALGO, BS,
                                        use_snapshots=False)
            reader.close()
            SnapshotStore(bus).save(snapshot_key(view), view.snapshot())
            snap_written = True
    for q in [*producers.values(), router]:
        assert q.flush(120) == 0
    return {"generated_view_events": n, "requests": req, "generate_s": round(time.perf_counter() - t0, 1)}


def raw_read(reader, topics) -> dict:
    """Every record of ``topics`` read and counted, folded into nothing: the reading's own rate,
    beside which the folds' rates show their share."""
    n = 0
    t0 = time.perf_counter()
    for t in topics:
        for p in reader.partitions(t):
            lo, hi = reader.bounds(t, p)
            for batch in reader.read_batches(t, p, lo, hi):
                n += len(batch)
    dt = time.perf_counter() - t0
    return {"raw_read_records": n, "raw_read_s": round(dt, 2), "raw_read_records_per_s": round(n / dt)}


def replay(engine: ReplayEngine, label: str) -> dict:
    """Fold the whole view log and the whole requests stream; records per second."""
    view_topics = engine.topics(VIEW_STREAMS)
    t0 = time.perf_counter()
    view, stats, _ = engine.view_at(engine.resolve("end", view_topics), ALGO, BS, use_snapshots=False)
    t_view = time.perf_counter() - t0
    load = RequestTraffic()
    req_topic = engine.catalog.topic("requests")
    t1 = time.perf_counter()
    # As `replay state` reads and folds them.
    bounds = {(req_topic, p): engine.reader.bounds(req_topic, p) for p in engine.reader.partitions(req_topic)}
    n_req = 0
    for loc in engine.iter_requests({tp: lo for tp, (lo, _) in bounds.items()},
                                    {tp: hi for tp, (_, hi) in bounds.items()}):
        n_req += 1
        if loc is not None:
            load.apply(loc.env, loc.topic, loc.partition, loc.offset)
    t_req = time.perf_counter() - t1
    total = stats.records + n_req
    return {"source": label, "view_records": stats.records, "view_s": round(t_view, 2),
            "view_records_per_s": round(stats.records / t_view), "request_records": n_req, "requests_s": round(t_req, 2),
            "request_records_per_s": round(n_req / t_req) if t_req else None,
            "records_per_s": round(total / (t_view + t_req)), "distinct_hashes": len(view.index),
            "digest": view.digest(), "completed": load.completed}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", default=PREFIX)
    ap.add_argument("--regenerate", action="store_true", help="Generate again under a fresh prefix.")
    a = ap.parse_args(argv)
    bus = BusSettings.from_env(topic_prefix=a.prefix if not a.regenerate else f"{a.prefix}{int(time.time())}")
    apply_topics(bus)
    cat = Catalog(bus.topic_prefix)
    reader = KafkaLogReader(bus.bootstrap)
    out: dict = {"prefix": bus.topic_prefix}
    have = _count(reader, [cat.topic(s) for s in VIEW_STREAMS])
    if have < VIEW_EVENTS:
        if have:
            raise SystemExit(f"prefix {bus.topic_prefix} holds {have} view events, not {VIEW_EVENTS}: use --regenerate")
        print(f"generating {VIEW_EVENTS} view events under {bus.topic_prefix} ...", flush=True)
        out.update(generate(bus))
        print(json.dumps(out), flush=True)
    else:
        out["generated"] = "reused"
    engine = ReplayEngine(reader, cat)
    raw = raw_read(reader, [cat.topic(s) for s in (*VIEW_STREAMS, "requests")])
    print(json.dumps({"source": "broker", **raw}), flush=True)
    broker = replay(engine, "broker")
    print(json.dumps(broker), flush=True)

    # The same from a file export.
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "bench.sylog")
        t0 = time.perf_counter()
        n = export_log(reader, [cat.topic(s) for s in ("workers", "kv", "requests", "snapshots")], path)
        exported = {"exported_records": n, "export_s": round(time.perf_counter() - t0, 2),
                    "file_mb": round(os.path.getsize(path) / 1e6, 1)}
        print(json.dumps(exported), flush=True)
        fr = FileLogReader(path)
        filed = replay(ReplayEngine(fr, cat), "file")
        fr.close()
        print(json.dumps(filed), flush=True)
    assert filed["digest"] == broker["digest"], "file and broker replays disagree"

    # State 1M view events deep: from the start, then from the snapshot 900k deep + the tail.
    at = json.dumps({f"{t}:{p}": o for (t, p), o in engine.resolve("end", engine.topics(VIEW_STREAMS)).items()})
    t0 = time.perf_counter()
    _, v1 = engine.state(at, hash_algo=ALGO, block_size=BS, use_snapshots=False, with_requests=False)
    scratch_s = time.perf_counter() - t0
    engine2 = ReplayEngine(KafkaLogReader(bus.bootstrap), cat)
    t0 = time.perf_counter()
    st, v2 = engine2.state(at, hash_algo=ALGO, block_size=BS, use_snapshots=True, with_requests=False)
    snap_s = time.perf_counter() - t0
    assert v1.digest() == v2.digest() == broker["digest"], "snapshot + tail differs from the full fold"
    recon = {"reconstruct_1m_s": round(scratch_s, 2), "reconstruct_1m_from_snapshot_s": round(snap_s, 2),
             "snapshot_applied": (st["snapshot"] or {}).get("applied"), "tail_records": st["fold"]["records"]}
    print(json.dumps(recon), flush=True)
    print(f"RESULT replay_events_per_s={broker['records_per_s']} reconstruct_1m_s={recon['reconstruct_1m_s']} "
          f"raw_read_events_per_s={raw['raw_read_records_per_s']} view_fold_events_per_s={broker['view_records_per_s']} "
          f"replay_file_events_per_s={filed['records_per_s']} "
          f"reconstruct_1m_from_snapshot_s={recon['reconstruct_1m_from_snapshot_s']}")


if __name__ == "__main__":
    main()
