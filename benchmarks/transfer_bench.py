"""KV block transfer benchmark: NIXL READ DRAM -> DRAM between two processes, against a plain
single-process numpy memcpy of the same bytes.

For each block size (64 KiB, 256 KiB, 1 MiB, 4 MiB) a holder process registers a region of
``--total-mib`` (default 256 MiB) filled with a known pattern and drives its endpoint the way a
prefill worker would (``notifications()`` every ``--holder-poll-us``); this process reads the
region block by block with :class:`data_plane.transfer.NixlEndpoint`, ``--batch-mib`` per READ
(one request's worth of blocks, one done notification each), ``--passes`` times over the whole
region after one warm-up pass (the first READ also sets up the UCX connection). Every pass is
zeroed before and checked byte for byte after (outside the timing), so every pass moves every byte;
destination pages are touched before timing, for both sides. Then ``--latency-reads`` single-block
READs give a median latency, which the holder's poll period bounds from below: with NIXL's
progress thread off, a READ completes only once the source has been driven. Measured here (2
vCPUs): a holder sleeping 100 us between polls gives ~190 us per 64 KiB READ; 20 us gives ~110 us;
busy polling ~30 us but halves large-batch throughput (the two processes share 2 cores).

The memcpy baseline copies the same batches with ``np.copyto`` inside one process (what a
transfer could at best be on this host: no second process, no transport).

Throughput is bytes / wall time of a whole pass, GB/s = 10^9 bytes per second; the table shows
the median and the best pass. The last line is
``RESULT nixl_gbps=<median> memcpy_gbps=<median> ratio=<nixl/memcpy>`` for the 256 KiB block size
(a per-layer KV block of a 7B-class model: 16 tokens x K,V x 32 heads x 128 dims x fp16), stated
on the line before it.

Run: ``uv run python benchmarks/transfer_bench.py [--total-mib 256] [--passes 5]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
import uuid

import numpy as np

from data_plane.transfer import NixlEndpoint, encode_done

KIB = 1024
MIB = 1024 * KIB
BLOCK_SIZES = (64 * KIB, 256 * KIB, MIB, 4 * MIB)
RESULT_BLOCK = 256 * KIB


def _pattern(total: int) -> np.ndarray:
    return np.arange(total // 8, dtype=np.uint64).view(np.uint8)


def _holder_main(conn, agent_name: str, total: int, block_len: int, poll_s: float) -> None:
    memory = _pattern(total)
    with NixlEndpoint.from_array(agent_name, memory, block_len) as endpoint:
        conn.send(endpoint.metadata().encode())
        notified = 0
        while True:
            notified += sum(len(m) for m in endpoint.notifications().values())
            # Not conn.poll(poll_s): its timeout is rounded up to whole milliseconds.
            if conn.poll(0):
                if conn.recv() == "stop":
                    conn.send(notified + sum(len(m) for m in endpoint.notifications().values()))
                    return
            elif poll_s:
                time.sleep(poll_s)


def _bench_nixl(block_len: int, args) -> tuple[list[float], int, float]:
    total = args.total_mib * MIB
    n_blocks = total // block_len
    per_read = max(1, args.batch_mib * MIB // block_len)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    holder = ctx.Process(
        target=_holder_main,
        args=(
            child,
            f"bench-src-{uuid.uuid4().hex[:6]}",
            total,
            block_len,
            args.holder_poll_us / 1e6,
        ),
        daemon=True,
    )
    holder.start()
    try:
        metadata = conn.recv()
        dst = np.ones(total, dtype=np.uint8)  # touched: no page faults inside the timing
        with NixlEndpoint.from_array(
            f"bench-dst-{uuid.uuid4().hex[:6]}", dst, block_len, spin_s=args.spin_ms / 1e3
        ) as endpoint:
            peer = endpoint.add_peer(metadata)
            ids = np.arange(n_blocks)
            batches = [ids[i : i + per_read] for i in range(0, n_blocks, per_read)]
            expected = _pattern(total)
            rates: list[float] = []
            reads = 0
            for p in range(args.passes + 1):  # pass 0 is the warm-up
                dst.fill(0)  # so every pass must move every byte again
                start = time.perf_counter()
                for b, batch in enumerate(batches):
                    endpoint.read_blocks(
                        peer, batch, batch, notif=encode_done(f"p{p}b{b}"), timeout=30
                    )
                    reads += 1
                elapsed = time.perf_counter() - start
                if p:
                    rates.append(total / elapsed / 1e9)
                if not np.array_equal(dst, expected):
                    raise SystemExit(
                        f"block size {block_len}, pass {p}: destination differs from the source"
                    )
            latencies = []
            for i in range(args.latency_reads):
                start = time.perf_counter()
                endpoint.read_blocks(peer, [i % n_blocks], [i % n_blocks], notif=b"lat", timeout=30)
                latencies.append(time.perf_counter() - start)
                reads += 1
        conn.send("stop")
        notified = conn.recv()
        if notified != reads:
            raise SystemExit(f"block size {block_len}: {reads} reads but {notified} notifications")
        return rates, per_read, statistics.median(latencies) * 1e6
    finally:
        holder.join(5)
        if holder.is_alive():
            holder.kill()


def _bench_memcpy(block_len: int, args) -> list[float]:
    total = args.total_mib * MIB
    per_read = max(1, args.batch_mib * MIB // block_len) * block_len
    src = _pattern(total)
    dst = np.ones(total, dtype=np.uint8)
    rates = []
    for p in range(args.passes + 1):
        dst.fill(0)
        start = time.perf_counter()
        for off in range(0, total, per_read):
            np.copyto(dst[off : off + per_read], src[off : off + per_read])
        elapsed = time.perf_counter() - start
        if p:
            rates.append(total / elapsed / 1e9)
    assert np.array_equal(dst, src)
    return rates


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--total-mib", type=int, default=256, help="bytes moved per pass and block size"
    )
    parser.add_argument(
        "--batch-mib", type=int, default=32, help="bytes per READ (one request's blocks)"
    )
    parser.add_argument("--passes", type=int, default=5, help="timed passes after one warm-up")
    parser.add_argument(
        "--latency-reads", type=int, default=200, help="single-block READs timed for latency"
    )
    parser.add_argument(
        "--holder-poll-us",
        type=float,
        default=100,
        help="holder's sleep between notification polls",
    )
    parser.add_argument(
        "--spin-ms", type=float, default=2.0, help="reader's tight polling before backing off"
    )
    args = parser.parse_args(argv)

    print(
        f"NIXL READ DRAM->DRAM, 2 processes (UCX), {args.total_mib} MiB per pass, "
        f"{args.batch_mib} MiB per READ, {args.passes} passes; memcpy = np.copyto, 1 process"
    )
    print(
        f"{'block':>8} {'blocks/READ':>11} {'nixl med':>9} {'nixl best':>9} {'memcpy med':>10} "
        f"{'ratio':>6} {'1-block READ p50':>17}"
    )
    print(f"{'':>8} {'':>11} {'GB/s':>9} {'GB/s':>9} {'GB/s':>10} {'':>6} {'us':>17}")
    rows = {}
    for block_len in BLOCK_SIZES:
        nixl, per_read, latency_us = _bench_nixl(block_len, args)
        memcpy = _bench_memcpy(block_len, args)
        med_n, med_m = statistics.median(nixl), statistics.median(memcpy)
        rows[block_len] = (med_n, med_m)
        label = f"{block_len // KIB} KiB" if block_len < MIB else f"{block_len // MIB} MiB"
        print(
            f"{label:>8} {per_read:>11} {med_n:>9.2f} {max(nixl):>9.2f} {med_m:>10.2f} "
            f"{med_n / med_m:>6.2f} {latency_us:>17.0f}"
        )
        sys.stdout.flush()
    nixl_gbps, memcpy_gbps = rows[RESULT_BLOCK]
    print(f"RESULT below: block size {RESULT_BLOCK // KIB} KiB, medians of {args.passes} passes")
    ratio = nixl_gbps / memcpy_gbps
    print(f"RESULT nixl_gbps={nixl_gbps:.2f} memcpy_gbps={memcpy_gbps:.2f} ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
