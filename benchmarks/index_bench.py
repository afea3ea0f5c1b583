"""Prefix index benchmark: Switchyard's native prefix index (``NativePrefixIndex``, the Rust core
the router uses) against Dynamo's RadixTree (Rust, via PyPI ``ai-dynamo-runtime``; install with
``uv sync --group bench``). (The pure-Python ``PrefixIndex`` no longer runs here: it is the
differential oracle in ``tests/oracles/prefix_index.py``, and benchmarks do not import the tests.)

Workload, derived from a Mooncake-format trace (one JSON object per line with ``hash_ids``: ids of
512-token blocks, equal ids = equal prefix block):

* requests are assigned round-robin to 8 workers;
* each request stores all of its blocks as one event (an idempotent upsert, as vLLM does with
  ``kv_cache_report_mode == "full"``); the chained hash of block i is
  ``xxh3_64(seq[i-1] || local[i])`` with ``local[i] = xxh3_64(hash_id)``;
* each worker has a bounded capacity (LRU, tail blocks first, like vLLM's free queue): the blocks a
  store pushes out become one remove event;
* each request is also a query (the prompt's blocks) made just before its store.

Both sides start from wire bytes. Ours: the msgpack envelope bytes into
``NativePrefixIndex.apply_bytes`` (decoded in Rust). Dynamo's: the UTF-8 JSON ``apply_event`` takes. Queries: ours get
the chained hashes, Dynamo's the local hashes (its tree matches on ``tokens_hash``). The "raw"
row is our core replaying the same bytes and queries inside Rust (no Python crossing per call),
to set beside Dynamo's native claim (> 10M events+requests/s, p99 < 10 us).

Passes: (1) apply every event back to back (events/s, per-call p50/p99, memory); (2) replay
again, querying before each request's events are applied (lookups/s, per-call p50/p99) and
checking both indexes agree on every match depth. Ends with
``RESULT apply_ratio=<ours/dynamo events/s> match_ratio=<ours/dynamo lookups/s>``.

Run: ``uv run python benchmarks/index_bench.py [--limit N] [--capacity BLOCKS]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from benchmarks.lru_blocks import LruBlocks
from ops.demo.up import WHOLE_TRACE
from control_plane.index.native import NativePrefixIndex
from schemas import EnvelopeFactory, EventCodec
from schemas.events import BlockRemoved, BlockStored
from schemas.types import Tier

DEFAULT_TRACE = WHOLE_TRACE
HASH_ALGO = "bench_xxh3_64"
TRACE_BLOCK_SIZE = 512


@dataclass
class Workload:
    n_workers: int
    #: Per event, in log order: (worker index, our envelope bytes, Dynamo's JSON bytes).
    events: list[tuple[int, bytes, bytes]] = field(default_factory=list)
    #: Per request: (worker index, chained hashes, local hashes, index of its first event).
    requests: list[tuple[int, list[int], list[int], int]] = field(default_factory=list)
    stores: int = 0
    removes: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0


def _u64(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


def load_trace(path: Path, limit: int | None) -> list[list[int]]:
    out = []
    with open(path) as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            line = line.strip()
            if line:
                out.append(json.loads(line)["hash_ids"])
    return out


def dynamo_stored(event_id: int, chained: list[int], local: list[int]) -> bytes:
    """A store of ``chained`` blocks (from the root) as the JSON Dynamo's ``RadixTree.apply_event``
    takes; its tree matches on ``local`` (``tokens_hash``)."""
    return json.dumps({"event_id": event_id, "dp_rank": 0, "data": {"stored": {
        "parent_hash": None,
        "blocks": [{"block_hash": c, "tokens_hash": lh} for c, lh in zip(chained, local)]}}}).encode()


def build_workload(trace: list[list[int]], n_workers: int, capacity: int) -> Workload:
    codec = EventCodec()
    factories = [EnvelopeFactory(f"w{i}", epoch=1, clock_ns=lambda: 0) for i in range(n_workers)]
    lru = [LruBlocks(capacity) for _ in range(n_workers)]
    event_ids = [0] * n_workers
    wl = Workload(n_workers)
    pack2 = struct.Struct("<QQ").pack
    pack1 = struct.Struct("<Q").pack
    for r, hash_ids in enumerate(trace):
        w = r % n_workers
        local = [_u64(pack1(h)) for h in hash_ids]
        chained, prev = [], 0
        for lh in local:
            prev = _u64(pack2(prev, lh))
            chained.append(prev)
        wl.requests.append((w, chained, local, len(wl.events)))
        wid = f"w{w}"
        # Store: all blocks of the request, one event.
        stored = BlockStored(worker_id=wid, tier=Tier.DEVICE, block_hashes=chained,
                             parent_hash=None, block_size=TRACE_BLOCK_SIZE, hash_algo=HASH_ALGO)
        dyn = dynamo_stored(event_ids[w], chained, local)
        event_ids[w] += 1
        wl.events.append((w, codec.encode(factories[w].wrap(stored)), dyn))
        wl.stores += 1
        wl.stored_blocks += len(chained)
        # LRU: touch tail first so the root ends most recent (vLLM frees a request's blocks in
        # reverse so that tails are evicted before the prefixes they extend).
        _, evicted = lru[w].touch(reversed(chained))
        if evicted:
            removed = BlockRemoved(worker_id=wid, tier=Tier.DEVICE, block_hashes=evicted)
            dyn = {"event_id": event_ids[w], "dp_rank": 0,
                   "data": {"removed": {"block_hashes": evicted}}}
            event_ids[w] += 1
            wl.events.append((w, codec.encode(factories[w].wrap(removed)),
                              json.dumps(dyn).encode()))
            wl.removes += 1
            wl.removed_blocks += len(evicted)
    return wl


def _pct(sorted_ns: list[int], p: float) -> float:
    if not sorted_ns:
        return float("nan")
    i = min(len(sorted_ns) - 1, int(p / 100 * len(sorted_ns)))
    return sorted_ns[i] / 1e3


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass
class SideResult:
    name: str
    apply_per_s: float = 0.0
    apply_p50_us: float = 0.0
    apply_p99_us: float = 0.0
    match_per_s: float = 0.0
    match_p50_us: float = 0.0
    match_p99_us: float = 0.0
    rss_delta_mb: float = 0.0


def _time_applies(res: SideResult, apply, calls: list[tuple], barrier=None) -> None:
    """Every side's apply pass: ``apply(*args)`` for each of ``calls`` (arguments built before
    the clock starts, called the same way on every side), each call timed into ``res``'s
    p50/p99 and the whole pass, up to ``barrier()`` when given, into its rate."""
    lat = []
    clock = time.perf_counter_ns
    t0 = time.perf_counter()
    for args in calls:
        s = clock()
        apply(*args)
        lat.append(clock() - s)
    if barrier is not None:
        barrier()
    dt = time.perf_counter() - t0
    lat.sort()
    res.apply_per_s = len(calls) / dt
    res.apply_p50_us, res.apply_p99_us = _pct(lat, 50), _pct(lat, 99)


def _ours_apply_pass(wl: Workload) -> tuple[SideResult, NativePrefixIndex]:
    res = SideResult("switchyard")
    calls = [(buf,) for _, buf, _ in wl.events]  # before the RSS baseline: not the index's memory
    gc.collect()
    rss0 = _rss_bytes()
    idx = NativePrefixIndex(HASH_ALGO, TRACE_BLOCK_SIZE)
    _time_applies(res, idx.apply_bytes, calls)
    res.rss_delta_mb = (_rss_bytes() - rss0) / 1e6
    return res, idx


def _raw_pass(wl: Workload) -> SideResult:
    """Our core replaying the same bytes and queries inside Rust: no Python crossing per call."""
    res = SideResult("raw (Rust)")
    idx = NativePrefixIndex(HASH_ALGO, TRACE_BLOCK_SIZE)
    records = [buf for _, buf, _ in wl.events]
    queries = [(first, chained) for _, chained, _, first in wl.requests]
    apply_ns, match_ns, skipped, _ = idx.replay_timed(records, queries, "")
    assert skipped == 0, f"{skipped} records not taken by the native decoder"
    res.apply_per_s = len(records) / (apply_ns / 1e9)
    res.match_per_s = len(queries) / (match_ns / 1e9)
    lat = sorted(idx.match_timed([q for _, q in queries]))
    res.match_p50_us, res.match_p99_us = _pct(lat, 50), _pct(lat, 99)
    return res


def _dynamo_apply_pass(wl: Workload, radix_tree_cls) -> tuple[SideResult, object]:
    res = SideResult("dynamo")
    calls = [(w, jbuf) for w, _, jbuf in wl.events]
    gc.collect()
    rss0 = _rss_bytes()
    tree = radix_tree_cls()
    # barrier: calls are served in order by the tree's thread
    _time_applies(res, tree.apply_event, calls, barrier=lambda: tree.find_matches([]))
    res.rss_delta_mb = (_rss_bytes() - rss0) / 1e6
    return res, tree


def _match_pass(wl: Workload, ours: SideResult, dyn: SideResult | None, radix_tree_cls) -> dict:
    """Replay; before each request's events, both sides answer its query."""
    idx = NativePrefixIndex(HASH_ALGO, TRACE_BLOCK_SIZE)
    tree = radix_tree_cls() if radix_tree_cls is not None else None
    lat_ours, lat_dyn = [], []
    t_ours = t_dyn = 0.0
    agree = disagree = matched = 0
    clock = time.perf_counter_ns
    find = idx.find_matches
    next_event = 0
    for w, chained, local, first_event in wl.requests:
        while next_event < first_event:  # untimed: this pass measures lookups
            ww, buf, jbuf = wl.events[next_event]
            idx.apply_bytes(buf)
            if tree is not None:
                tree.apply_event(ww, jbuf)
            next_event += 1
        if tree is not None:
            tree.find_matches([])  # barrier, untimed
        s = clock()
        got = find(chained)
        e = clock()
        lat_ours.append(e - s)
        t_ours += (e - s) / 1e9
        if tree is not None:
            s = clock()
            scores = tree.find_matches(local).scores
            e = clock()
            lat_dyn.append(e - s)
            t_dyn += (e - s) / 1e9
            mine = {int(k.worker_id[1:]): m.depth for k, m in got.items()}
            theirs = {wk: d for (wk, _dp), d in scores.items() if d}
            if mine == theirs:
                agree += 1
            else:
                disagree += 1
        matched += bool(got)
    lat_ours.sort()
    ours.match_per_s = len(lat_ours) / t_ours
    ours.match_p50_us, ours.match_p99_us = _pct(lat_ours, 50), _pct(lat_ours, 99)
    if dyn is not None:
        lat_dyn.sort()
        dyn.match_per_s = len(lat_dyn) / t_dyn
        dyn.match_p50_us, dyn.match_p99_us = _pct(lat_dyn, 50), _pct(lat_dyn, 99)
    return {"agree": agree, "disagree": disagree, "queries_with_a_match": matched}


def dump(wl: Workload, path: Path | str) -> None:
    """The workload's envelope bytes and queries in the format of the crate's replay example
    (``native/examples/replay.rs``): the same fold and lookups inside Rust, for profilers."""
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(wl.events)))
        for _, buf, _ in wl.events:
            f.write(struct.pack("<I", len(buf)) + buf)
        f.write(struct.pack("<Q", len(wl.requests)))
        for _, chained, _, first in wl.requests:
            f.write(struct.pack(f"<QI{len(chained)}Q", first, len(chained), *chained))
        algo = HASH_ALGO.encode()
        f.write(struct.pack("<I", len(algo)) + algo + struct.pack("<q", TRACE_BLOCK_SIZE))


def load_dynamo():
    try:
        from dynamo._core import RadixTree  # type: ignore[import-not-found]
    except Exception as e:  # noqa: BLE001 - any import failure means "no comparison"
        return None, f"{type(e).__name__}: {e}"
    return RadixTree, None


def _median(results: list[SideResult], key: str) -> SideResult:
    return sorted(results, key=lambda r: getattr(r, key))[len(results) // 2]


def run(
    trace_path: Path | str = DEFAULT_TRACE,
    *,
    limit: int | None = None,
    n_workers: int = 8,
    capacity: int = 4096,
    repeat: int = 5,
    label: str = "RESULT",
    out=sys.stdout,
) -> dict:
    """Run both passes ``repeat`` times (medians reported) and print a report ending with
    ``<label> apply_ratio=... match_ratio=...``; returns the numbers."""

    def say(msg: str = "") -> None:
        print(msg, file=out, flush=True)

    t0 = time.perf_counter()
    trace = load_trace(Path(trace_path), limit)
    wl = build_workload(trace, n_workers, capacity)
    cpus = sorted(os.sched_getaffinity(0))
    say(f"trace {trace_path}: {len(trace)} requests, {n_workers} workers round robin, "
        f"capacity {capacity} blocks/worker; CPUs {cpus}; median of {repeat} runs")
    say(f"events: {len(wl.events)} ({wl.stores} stores of {wl.stored_blocks / max(wl.stores, 1):.1f}"
        f" blocks avg, {wl.removes} removes of {wl.removed_blocks} blocks); "
        f"built in {time.perf_counter() - t0:.1f}s")

    radix_tree_cls, why = load_dynamo()
    if radix_tree_cls is None:
        say(f"DYNAMO UNAVAILABLE ({why}): run `uv sync --group bench`. Reporting ours only.")

    ours_runs, dyn_runs = [], []
    for i in range(repeat):
        # Dynamo first on the first round, so its RSS delta is measured on a fresh heap.
        if radix_tree_cls is not None and i == 0:
            d, tree = _dynamo_apply_pass(wl, radix_tree_cls)
            dyn_runs.append(d)
            del tree
        r, idx = _ours_apply_pass(wl)
        ours_runs.append(r)
        residencies = sum(sum(t.values()) for t in idx.stats().blocks.values())
        distinct = len(idx)
        entries = idx.entries()
        structure_bytes = idx.structure_bytes()
        del idx
        if radix_tree_cls is not None and i > 0:
            d, tree = _dynamo_apply_pass(wl, radix_tree_cls)
            dyn_runs.append(d)
            del tree
        gc.collect()
    ours = _median(ours_runs, "apply_per_s")
    dyn = _median(dyn_runs, "apply_per_s") if dyn_runs else None
    # RSS deltas are only meaningful on a fresh heap: keep each side's first.
    ours.rss_delta_mb = ours_runs[0].rss_delta_mb
    if dyn is not None:
        dyn.rss_delta_mb = dyn_runs[0].rss_delta_mb
    match_ours, match_dyn = [], []
    check: dict = {}
    for i in range(repeat):
        mo = SideResult("switchyard")
        md = SideResult("dynamo") if radix_tree_cls is not None else None
        check = _match_pass(wl, mo, md, radix_tree_cls)
        match_ours.append(mo)
        if md is not None:
            match_dyn.append(md)
    for side, runs in ((ours, match_ours), (dyn, match_dyn)):
        if side is not None:
            m = _median(runs, "match_per_s")
            side.match_per_s, side.match_p50_us, side.match_p99_us = (
                m.match_per_s, m.match_p50_us, m.match_p99_us)
    raw = _median([_raw_pass(wl) for _ in range(repeat)], "apply_per_s")

    say(f"final index: {distinct} distinct hashes, {residencies} (worker, block) residencies")
    say(f"{'':12}{'events/s':>12}{'p50 us':>9}{'p99 us':>9}{'lookups/s':>12}{'p50 us':>9}"
        f"{'p99 us':>9}{'RSS dMB':>9}  (RSS: first run, approximate)")
    for r in (ours, dyn, raw):
        if r is None:
            continue
        say(f"{r.name:12}{r.apply_per_s:12,.0f}{r.apply_p50_us:9.1f}{r.apply_p99_us:9.1f}"
            f"{r.match_per_s:12,.0f}{r.match_p50_us:9.1f}{r.match_p99_us:9.1f}"
            f"{r.rss_delta_mb:9.1f}")
    if dyn_runs:
        say("dynamo runs (events/s | lookups/s): "
            + ", ".join(f"{d.apply_per_s:,.0f}" for d in dyn_runs) + " | "
            + ", ".join(f"{d.match_per_s:,.0f}" for d in match_dyn))
    bytes_per_entry = structure_bytes / max(entries, 1)
    say(f"switchyard memory (native structures): {structure_bytes / 1e6:.1f} MB = "
        f"{bytes_per_entry:.1f} bytes per (block, worker) entry ({bytes_per_entry:.1f} MB per "
        f"million), {structure_bytes / max(distinct, 1):.1f} bytes per distinct hash; "
        f"first-run RSS delta {ours.rss_delta_mb:.1f} MB")
    say("ours apply = envelope bytes into the native index (msgpack decoded in Rust); "
        "dynamo apply = apply_event(JSON) + final barrier")
    say(f"raw (Rust): {raw.apply_per_s:,.0f} events/s and {raw.match_per_s:,.0f} lookups/s "
        f"in-process, lookup p50 {raw.match_p50_us:.2f} us / p99 {raw.match_p99_us:.2f} us "
        "(Dynamo's native claim: > 10M events+requests/s, p99 < 10 us, on bigger machines)")
    if radix_tree_cls is not None:
        say(f"match agreement (same depth for every worker): {check['agree']} agree, "
            f"{check['disagree']} disagree; {check['queries_with_a_match']} queries matched")
        apply_ratio = ours.apply_per_s / dyn.apply_per_s
        match_ratio = ours.match_per_s / dyn.match_per_s
        say(f"{label} apply_ratio={apply_ratio:.2f} match_ratio={match_ratio:.2f} "
            f"raw_apply_per_s={raw.apply_per_s:.0f} raw_match_per_s={raw.match_per_s:.0f} "
            f"bytes_per_entry={bytes_per_entry:.1f}")
    else:
        apply_ratio = match_ratio = None
        say(f"{label} apply_ratio=n/a match_ratio=n/a (dynamo unavailable)")
    say(f"total {time.perf_counter() - t0:.1f}s")
    return {"ours": ours, "dynamo": dyn, "raw": raw, "check": check,
            "bytes_per_entry": bytes_per_entry, "apply_ratio": apply_ratio,
            "match_ratio": match_ratio, "distinct": distinct, "residencies": residencies}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", nargs="?", default=str(DEFAULT_TRACE))
    p.add_argument("--limit", type=int, default=None, help="use only the first N requests")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--capacity", type=int, default=4096, help="blocks per worker (LRU)")
    p.add_argument("--repeat", type=int, default=5, help="runs per pass (medians reported)")
    p.add_argument("--pin-cpu", type=int, default=None,
                   help="pin this process (and so Dynamo's tree thread) to one CPU and run once")
    p.add_argument("--no-pinned", action="store_true",
                   help="skip the extra run pinned to one CPU")
    p.add_argument("--dump", default=None, metavar="PATH",
                   help="write the workload for native/examples/replay.rs to PATH and exit")
    p.add_argument("--scale", action="store_true",
                   help="growth on a generated stream instead (benchmarks/index_scale.py)")
    p.add_argument("--points", default=None,
                   help="with --scale: WORKERSxENTRIES,... (default 64/1024/8192 x 1M/10M)")
    a = p.parse_args(argv)
    if a.scale:
        # lazy: start-up time: loads numpy only when called
        from benchmarks import index_scale

        points = None
        if a.points:
            points = [tuple(int(float(x)) for x in pt.split("x")) for pt in a.points.split(",")]
        index_scale.main(points)  # type: ignore[arg-type]
        return
    if a.dump:
        wl = build_workload(load_trace(Path(a.trace), a.limit), a.workers, a.capacity)
        dump(wl, a.dump)
        print(f"wrote {len(wl.events)} events and {len(wl.requests)} queries to {a.dump}")
        return
    common = dict(limit=a.limit, n_workers=a.workers, capacity=a.capacity, repeat=a.repeat)
    if a.pin_cpu is not None:
        # Before the first RadixTree exists, so its thread inherits the affinity.
        os.sched_setaffinity(0, {a.pin_cpu})
        run(a.trace, label="RESULT_PINNED", **common)
        return
    if not a.no_pinned and len(os.sched_getaffinity(0)) > 1:
        # Dynamo's tree serves calls on its own thread: when that thread and the caller sit on
        # different CPUs each call pays a cross-CPU wake-up (about 35 us on this VM), on one CPU
        # it does not (about 5 us). Show both; the headline RESULT is the default scheduling.
        say_cmd = [sys.executable, __file__, a.trace, "--pin-cpu", str(min(os.sched_getaffinity(0))),
                   "--workers", str(a.workers), "--capacity", str(a.capacity),
                   "--repeat", str(a.repeat)] + (["--limit", str(a.limit)] if a.limit else [])
        print("== pinned to one CPU (Dynamo's best case) ==", flush=True)
        subprocess.run(say_cmd, check=False)
        print("== default scheduling ==", flush=True)
    run(a.trace, **common)


if __name__ == "__main__":
    main()
