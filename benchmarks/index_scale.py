"""Growth of the native prefix index: ``switchyard bench index --scale``.

A generated event stream per point (workers W, target (block, worker) entries E): BlockStored
events of 32 blocks, worker ``i % W`` for event ``i``; each chain starts with a prefix (0-16
blocks) of one of 256 shared "system prompt" chains, so popular prefixes are held by many
workers, and continues with fresh random hashes. Events are real envelope bytes (msgspec).

Per point, in a fresh process (so RSS is the point's own): the apply rate through the production
path (``NativePrefixIndex.apply_bytes``, one Python call per event) and inside Rust (the same
bytes replayed with no Python crossing), then 2,000 queries (the chains of random stored events,
so the deep ones match their worker fully and their shared prefix matches many workers):
``find_matches`` p50/p99 as the router calls it (a mapping of Match per worker) and in Rust; the
index's structure bytes per entry, and the process RSS.

Compare: Dynamo's published sharded indexer, find p99 446-713 us at 28k-224k simulated workers
(``INDEXER_BENCH.md`` in ai-dynamo/dynamo).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time

import numpy as np

from control_plane.index.native import NativePrefixIndex
from schemas import EnvelopeFactory, EventCodec
from schemas.events import BlockStored
from schemas.types import Tier

BLOCKS_PER_EVENT = 32
SHARED_CHAINS = 256
QUERIES = 2000
HASH_ALGO = "bench_scale"
BLOCK_SIZE = 16
DEFAULT_POINTS = [(w, e) for e in (1_000_000, 10_000_000) for w in (64, 1024, 8192)]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def generate(workers: int, entries: int, seed: int = 7) -> tuple[list[bytes], list[list[int]]]:
    """Envelope bytes of the stream, and the hash chains of QUERIES random events."""
    rng = np.random.default_rng(seed)
    n_events = max(1, entries // BLOCKS_PER_EVENT)
    shared = rng.integers(1, 2**63, size=(SHARED_CHAINS, 16), dtype=np.uint64)
    fresh = rng.integers(2**63, 2**64 - 1, size=(n_events, BLOCKS_PER_EVENT), dtype=np.uint64)
    which = rng.integers(0, SHARED_CHAINS, size=n_events)
    depth = rng.integers(0, 17, size=n_events)
    fresh[:, :16] = np.where(np.arange(16) < depth[:, None], shared[which], fresh[:, :16])
    sample = set(rng.choice(n_events, size=min(QUERIES, n_events), replace=False).tolist())
    codec = EventCodec()
    factories = [EnvelopeFactory(f"w{i}", epoch=1, clock_ns=lambda: 0) for i in range(workers)]
    events, queries = [], []
    rows = fresh.tolist()
    for i, chain in enumerate(rows):
        w = i % workers
        ev = BlockStored(worker_id=f"w{w}", tier=Tier.DEVICE, block_hashes=chain,
                         block_size=BLOCK_SIZE, hash_algo=HASH_ALGO)
        events.append(codec.encode(factories[w].wrap(ev)))
        if i in sample:
            queries.append(chain)
    return events, queries


def run_point(workers: int, entries: int) -> dict:
    t0 = time.perf_counter()
    events, queries = generate(workers, entries)
    gen_s = time.perf_counter() - t0
    gc.collect()
    rss0 = _rss_mb()
    # Production path: one Python call per event.
    idx = NativePrefixIndex(HASH_ALGO, BLOCK_SIZE)
    apply = idx.apply_bytes
    t0 = time.perf_counter()
    for buf in events:
        apply(buf)
    py_apply_s = time.perf_counter() - t0
    rss_index = _rss_mb() - rss0
    lat = []
    find = idx.find_matches
    for q in queries:
        s = time.perf_counter_ns()
        got = find(q)
        lat.append((time.perf_counter_ns() - s) / 1e3)
    lat.sort()
    matched_workers = len(got)
    rust_lat = sorted(x / 1e3 for x in idx.match_timed(queries))
    out = {
        "workers": workers, "target_entries": entries, "events": len(events),
        "entries": idx.entries(), "distinct": len(idx),
        "bytes_per_entry": idx.structure_bytes() / max(idx.entries(), 1),
        "apply_per_s": len(events) / py_apply_s,
        "match_p50_us": _pct(lat, 0.5), "match_p99_us": _pct(lat, 0.99),
        "rust_match_p50_us": _pct(rust_lat, 0.5), "rust_match_p99_us": _pct(rust_lat, 0.99),
        "rss_index_mb": rss_index, "rss_mb": _rss_mb(), "gen_s": gen_s,
        "last_query_workers": matched_workers,
    }
    del idx
    gc.collect()
    # In Rust: the same bytes, no Python crossing per event.
    idx = NativePrefixIndex(HASH_ALGO, BLOCK_SIZE)
    apply_ns, _, skipped, _ = idx.replay_timed(events, [], "")
    assert skipped == 0
    out["rust_apply_per_s"] = len(events) / (apply_ns / 1e9)
    out["rust_entries_per_s"] = out["rust_apply_per_s"] * BLOCKS_PER_EVENT
    return out


def _mem_available_mb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1e3
    return 0.0


def main(points: list[tuple[int, int]] | None = None) -> list[dict]:
    points = points or DEFAULT_POINTS
    print(f"{'workers':>8}{'entries':>12}{'distinct':>11}{'B/entry':>9}{'events/s':>11}"
          f"{'Rust ev/s':>11}{'match p50':>11}{'p99 us':>9}{'Rust p50':>10}{'p99 us':>9}"
          f"{'RSS MB':>9}{'idx MB':>9}", flush=True)
    rows = []
    for w, e in points:
        # Generated bytes + index: about 0.5 KB per 32-block event plus the index itself.
        need = e / BLOCKS_PER_EVENT * 0.5e-3 * 3 + e * 60 / 1e6
        if need > 0.6 * _mem_available_mb():
            print(f"{w:>8}{e:>12,}  skipped: needs ~{need:,.0f} MB, "
                  f"{_mem_available_mb():,.0f} MB available", flush=True)
            continue
        cp = subprocess.run([sys.executable, "-m", "benchmarks.index_scale", str(w), str(e)],
                            capture_output=True, text=True)
        if cp.returncode != 0:
            print(f"{w:>8}{e:>12,}  failed: {cp.stderr.strip().splitlines()[-1:]}", flush=True)
            continue
        r = json.loads(cp.stdout.strip().splitlines()[-1])
        rows.append(r)
        print(f"{w:>8}{r['entries']:>12,}{r['distinct']:>11,}{r['bytes_per_entry']:>9.1f}"
              f"{r['apply_per_s']:>11,.0f}{r['rust_apply_per_s']:>11,.0f}"
              f"{r['match_p50_us']:>11.1f}{r['match_p99_us']:>9.1f}"
              f"{r['rust_match_p50_us']:>10.1f}{r['rust_match_p99_us']:>9.1f}"
              f"{r['rss_mb']:>9,.0f}{r['rss_index_mb']:>9,.0f}", flush=True)
    print("events of 32 blocks; match = find_matches as the router calls it (a mapping of Match "
          "per worker), Rust = the same lookup inside the core; RSS = the process (generated "
          "events included), idx = its growth while the index was built. Dynamo's sharded indexer "
          "(INDEXER_BENCH.md): find p99 446-713 us at 28k-224k simulated workers.")
    if rows:
        worst = max(rows, key=lambda r: (r["workers"], r["entries"]))
        print(f"RESULT_SCALE points={len(rows)} max_entries={max(r['entries'] for r in rows)} "
              f"bytes_per_entry_max={max(r['bytes_per_entry'] for r in rows):.1f} "
              f"match_p99_us_at_largest={worst['match_p99_us']:.1f} "
              f"apply_per_s_min={min(r['apply_per_s'] for r in rows):.0f}")
    return rows


if __name__ == "__main__":
    if len(sys.argv) == 3:
        print(json.dumps(run_point(int(sys.argv[1]), int(sys.argv[2]))))
    else:
        main()
