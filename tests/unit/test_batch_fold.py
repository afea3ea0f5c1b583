"""The batch fold against the one-record fold (its specification), and the native signature
check against ``schemas.signing.Verifier``.

Replay and a restarting router fold the log a batch at a time (``RecordFold.fold_batch`` with the
native index's run over envelope bytes, signatures checked in Rust). Random logs of kv and worker
events, signed, unsigned, forged, refused by the index, duplicated and out of sequence, cut into
random batches and started from a random position, fold to the same view (digest, positions,
record times, counts) with the same records poisoned for the same reasons as record by record.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from control_plane.replay.state import ViewFolder
from control_plane.router.view import RouterView
from common.log.reader import FileLogReader, LogRecord, MemoryLogReader, RecordBatch, export_log
from schemas import EnvelopeFactory, EventCodec
from schemas.signing import Signer, Verifier, owner_key, worker_owner
from tests.unit import test_native_index as native_props

MASTER = b"k" * 32
CODEC = EventCodec()
SIGNER = Signer.master(MASTER)
TOPICS = {"kv": "sy.kv", "workers": "sy.workers"}

#: How a record's signature is treated: the owner's (most), none, another worker's, a flipped bit.
SIGNATURES = ("owner",) * 6 + ("none", "other", "flipped")


def _wire(producer: str, epoch: int, seq: int, payload, how: str) -> bytes:
    env = EnvelopeFactory(producer, epoch, lambda: 7).wrap(payload, key=payload.key())
    env = msgspec.structs.replace(env, seq=seq)
    raw = CODEC.encode(env)
    if how == "none":
        return raw
    if how == "other":
        other = "w-other"
        return Signer.identity(worker_owner(other), owner_key(MASTER, worker_owner(other))).seal(raw)
    signed = SIGNER.sign(env.type, env.key, raw)
    return signed[:-1] + bytes((signed[-1] ^ 1,)) if how == "flipped" else signed


@st.composite
def _log(draw):
    """Records of 2 kv partitions and 1 workers partition, offsets dense from 0 (a few values
    missing or not envelopes at all)."""
    records: list[LogRecord] = []
    offsets: dict[tuple[str, int], int] = {}
    for producer, epoch, seq, payload in draw(native_props._sequence()):
        topic = TOPICS[payload.STREAM]
        partition = draw(st.integers(0, 1)) if payload.STREAM == "kv" else 0
        value = _wire(producer, epoch, seq, payload, draw(st.sampled_from(SIGNATURES)))
        value = draw(st.sampled_from([value] * 12 + [None, b"\x00not an envelope"]))
        off = offsets.get((topic, partition), 0)
        offsets[(topic, partition)] = off + 1
        records.append(LogRecord(topic, partition, off, draw(st.sampled_from((0, 1000 + off))), None, value))
    return records


def _fold(records: list[LogRecord], verify: bool, start: dict, cuts: list[int] | None):
    view = RouterView(native_props.ALGO, native_props.BS)
    view.positions.update(start)
    poisoned: list[tuple[str, int, int, str]] = []
    folder = ViewFolder(view, EventCodec(verifier=Verifier(MASTER) if verify else None),
                        on_poison=lambda r, e: poisoned.append((r.topic, r.partition, r.offset, e.reason)))
    log = MemoryLogReader(records)
    for tp in sorted({(r.topic, r.partition) for r in records}):
        part = list(log.read(*tp, 0, 1 << 40))
        if cuts is None:
            for r in part:
                folder.apply(r)
            continue
        at = 0
        for cut in [*sorted({c % (len(part) + 1) for c in cuts}), len(part)]:
            if cut > at:
                folder.apply_batch(RecordBatch.of(tp[0], tp[1], part[at:cut]))
                at = cut
    return view, folder.stats, poisoned


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records=_log(), verify=st.booleans(), cuts=st.lists(st.integers(0, 80), max_size=4),
       skip=st.integers(0, 6))
def test_batches_fold_as_records_do(records, verify, cuts, skip):
    start = {("sy.kv", 0): skip} if skip else {}
    one, one_stats, one_poison = _fold(records, verify, start, None)
    many, many_stats, many_poison = _fold(records, verify, start, cuts)
    assert many.digest() == one.digest()
    assert (many.positions, many.last_ts_ms, many.applied) == (one.positions, one.last_ts_ms, one.applied)
    assert many_stats == one_stats
    assert many_poison == one_poison


def test_forged_and_refused_records_in_a_batch_are_poisoned_in_place():
    """kv:0 holds a good store, an unsigned one, one of another hash algorithm, a good one: the
    batch takes the good ones natively and poisons the other two where they stand."""
    from tests.unit.test_prefix_index import _stored

    values = [_wire("w1", 1, 0, _stored("w1", (1, 2)), "owner"), _wire("w1", 1, 1, _stored("w1", (3,)), "none"),
              _wire("w1", 1, 1, _stored("w1", (4,), hash_algo="xxhash"), "owner"),
              _wire("w1", 1, 2, _stored("w1", (5,)), "owner")]
    records = [LogRecord("sy.kv", 0, i, 10 + i, None, v) for i, v in enumerate(values)]
    view, stats, poisoned = _fold(records, True, {}, [0])
    assert [(o, why) for _, _, o, why in poisoned] == [(1, "forged:unsigned"), (2, "index_rejected:hash_algo")]
    assert (stats.applied, stats.poisoned, view.positions, view.last_ts_ms) == (
        2, 2, {("sy.kv", 0): 4}, {("sy.kv", 0): 13})
    assert len(view.index) == 3  # blocks 1, 2 and 5


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records=_log())
def test_the_native_check_accepts_only_what_the_reference_accepts(records):
    """Whatever the native verifier says yes to, the reference verifies; and it says yes to every
    kv record signed by its owner (so the batch path is the one taken)."""
    reference, native = Verifier(MASTER), Verifier(MASTER).native()
    for r in records:
        if r.value is None:
            continue
        if native.verified(r.value):
            reference.check(r.value)
        elif r.topic == "sy.kv" and r.value[-38:-32] == b"\xa3sig\xc4\x20":
            try:
                reference.check(r.value)
            except Exception:
                continue
            assert CODEC.peek(r.value).type not in ("BlockStored", "BlockRemoved", "BlockMoved", "AllBlocksCleared"), \
                "a kv record the reference verifies was left to it"


@pytest.mark.parametrize("where", ["memory", "file"])
def test_read_batches_hold_the_records_read_returns(where, tmp_path):
    records = [LogRecord("t", p, o, o * 10, b"k", b"v%d" % o) for p in (0, 1) for o in range(0, 25000, 1 + p)]
    log = MemoryLogReader(records)
    if where == "file":
        export_log(log, ["t"], tmp_path / "x.sylog", frame_records=7000)
        log = FileLogReader(tmp_path / "x.sylog")
    for p, lo, hi in [(0, 0, 25000), (1, 3, 20001), (0, 24999, 30000), (1, 10, 10)]:
        flat = [r for b in log.read_batches("t", p, lo, hi) for r in b.records()]
        assert flat == list(log.read("t", p, lo, hi)) == [r for r in records if r.partition == p and lo <= r.offset < hi]
