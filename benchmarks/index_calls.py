"""Per-call cost of the native index as Python calls it, for instruction counts.

Folds the first half of a workload dumped by ``python -m benchmarks.index_bench --dump PATH``,
then makes ``N`` calls of one kind: ``find`` (``find_matches``), ``items`` (``find_matches``
then ``.items()``), ``router`` (``RouterView.matches``' loop over the answer) or ``apply``
(``apply_bytes`` of the next records). Wall-clock time on a shared box is noisy; instruction
counts are not. Run it under callgrind with ``N`` and with ``0`` calls and divide the difference
by ``N``::

    for n in 0 2000; do OPENBLAS_NUM_THREADS=1 PYTHONHASHSEED=0 valgrind --tool=callgrind \\
        --callgrind-out-file=/tmp/calls.$n .venv/bin/python -m benchmarks.index_calls \\
        /tmp/wl.bin find $n; done   # then: callgrind_annotate /tmp/calls.N | head

Ends with ``RESULT kind=... calls=... ns_per_call=...`` (wall clock, for a sanity check only).
"""

from __future__ import annotations

import argparse
import struct
import time

from control_plane.index.native import NativePrefixIndex


def read_dump(path: str) -> tuple[list[bytes], list[tuple[int, list[int]]], str, int]:
    with open(path, "rb") as f:
        data = f.read()
    pos = 0

    def take(fmt: str):
        nonlocal pos
        vals = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return vals

    (n,) = take("<Q")
    records = []
    for _ in range(n):
        (length,) = take("<I")
        records.append(data[pos:pos + length])
        pos += length
    (nq,) = take("<Q")
    queries = []
    for _ in range(nq):
        first, length = take("<QI")
        queries.append((first, list(take(f"<{length}Q"))))
    (length,) = take("<I")
    algo = data[pos:pos + length].decode()
    pos += length
    (block_size,) = take("<q")
    return records, queries, algo, block_size


def _find(f, queries):
    for q in queries:
        f(q)


def _items(f, queries):
    for q in queries:
        f(q).items()


def _router(f, queries):
    for q in queries:  # RouterView.matches: per worker id, the deepest match
        out = {}
        for rank, m in f(q).items():
            prev = out.get(rank.worker_id)
            if prev is None or m.depth > prev.depth:
                out[rank.worker_id] = m


def _apply(f, records):
    for r in records:
        f(r)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dump")
    p.add_argument("kind", choices=("find", "items", "router", "apply"))
    p.add_argument("calls", type=int)
    a = p.parse_args(argv)
    records, queries, algo, block_size = read_dump(a.dump)
    idx = NativePrefixIndex(algo, block_size)
    half = len(records) // 2
    for r in records[:half]:
        idx.apply_bytes(r)
    idx.find_matches(queries[0][1])  # the first call's one-time set-up, outside the count
    later = [q for first, q in queries if first >= half][:a.calls]
    t0 = time.perf_counter_ns()
    if a.kind == "apply":
        _apply(idx.apply_bytes, records[half:half + a.calls])
        n = min(a.calls, len(records) - half)
    else:
        {"find": _find, "items": _items, "router": _router}[a.kind](idx.find_matches, later)
        n = len(later)
    dt = time.perf_counter_ns() - t0
    print(f"RESULT kind={a.kind} calls={n} ns_per_call={dt / max(n, 1):.0f}")


if __name__ == "__main__":
    main()
