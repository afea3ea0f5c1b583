"""The newest snapshot of a key, found by reading a partition backwards (common.log.snapshots)."""

from __future__ import annotations

import pytest

from common.log.reader import LogRecord, MemoryLogReader
from common.log.snapshots import newest_of_key

T = "p.snapshots"


def _log(keys: list[bytes | None], values: list[bytes | None] | None = None, *, first: int = 0) -> MemoryLogReader:
    values = values or [b"v%d" % i for i in range(len(keys))]
    return MemoryLogReader([LogRecord(T, 0, first + i, 1000 + i, k, v) for i, (k, v) in enumerate(zip(keys, values))])


def _scan(reader: MemoryLogReader, key: bytes) -> tuple[int, bytes] | None:
    """The specification: the last record of the key in offset order, read from the start."""
    hits = [(r.ts_ms, r.value) for r in reader.read(T, 0, 0, 1 << 62) if r.key == key and r.value is not None]
    return hits[-1] if hits else None


@pytest.mark.parametrize("keys", [
    [b"a"],
    [b"a", b"a", b"a"],
    [b"a", b"b", b"b", b"b", b"b", b"b", b"b", b"b"],          # found only after the window grew
    [b"b"] * 30 + [b"a"] + [b"b"] * 70,
    [b"b", b"c", b"b"],                                          # absent
    [],
])
def test_backwards_lookup_equals_a_forward_scan(keys):
    reader = _log(keys)
    assert newest_of_key(reader, T, 0, b"a") == _scan(reader, b"a")


def test_tombstones_are_skipped_and_compacted_offsets_are_gaps():
    reader = MemoryLogReader([LogRecord(T, 0, 3, 1, b"a", b"old"), LogRecord(T, 0, 9, 2, b"b", b"x"),
                              LogRecord(T, 0, 40, 3, b"a", None), LogRecord(T, 0, 41, 4, b"c", b"y")])
    assert newest_of_key(reader, T, 0, b"a") == (1, b"old")


def test_a_refused_record_is_passed_over_for_the_one_before_it():
    """What the snapshot store does with a forged newest snapshot: ``opened`` refuses it (and
    dead-letters it), the search goes on to the key's older records."""
    reader = _log([b"a", b"b", b"a", b"a", b"b"], [b"ok-old", b"x", b"ok", b"forged", b"y"])
    refused = []

    def opened(rec):
        if rec.value.startswith(b"forged"):
            refused.append(rec.offset)
            return None
        return rec.value

    assert newest_of_key(reader, T, 0, b"a", opened) == (1002, b"ok")
    assert refused == [3]
    assert newest_of_key(reader, T, 0, b"a", lambda rec: None) is None
