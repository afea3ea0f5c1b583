"""The prefix index's contract, on its executable specification (``tests/oracles/prefix_index.py``):
worked examples, sequencing, rejection, checkpoints, and a property test against a brute-force
oracle. ``test_native_index.py`` runs every test here again on the product's native index."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from control_plane.index.errors import IndexPackageError, IndexRejected
from tests.oracles.prefix_index import PrefixIndex
from control_plane.index.shapes import ApplyOutcome, Match, WorkerRank
from common.hashing import HashConfig, hash_blocks
from schemas import EnvelopeFactory, EventCodec
from schemas.events import (
    AllBlocksCleared,
    BlockMoved,
    BlockRemoved,
    BlockStored,
    WorkerDeregistered,
    WorkerLoadReported,
    WorkerRegistered,
)
from schemas.types import TIER_ORDER, CacheGroup, Tier, WorkerRole

ALGO = "sha256_cbor"
BS = 16
DEVICE, HOST, DISK, OBJECT = TIER_ORDER


# -- builders -----------------------------------------------------------------------------------


def _index() -> PrefixIndex:
    return PrefixIndex(ALGO, BS)


def _stored(worker="w1", hashes=(1, 2, 3), **overrides) -> BlockStored:
    fields = dict(worker_id=worker, tier=DEVICE, block_hashes=list(hashes), block_size=BS,
                  hash_algo=ALGO)
    fields.update(overrides)
    return BlockStored(**fields)


def _removed(worker="w1", hashes=(3,), **overrides) -> BlockRemoved:
    fields = dict(worker_id=worker, tier=DEVICE, block_hashes=list(hashes))
    fields.update(overrides)
    return BlockRemoved(**fields)


def _moved(worker="w1", hashes=(1,), frm=DEVICE, to=HOST, **overrides) -> BlockMoved:
    fields = dict(worker_id=worker, block_hashes=list(hashes), from_tier=frm, to_tier=to)
    fields.update(overrides)
    return BlockMoved(**fields)


def _cleared(worker="w1", tier=None, **overrides) -> AllBlocksCleared:
    return AllBlocksCleared(worker_id=worker, tier=tier, **overrides)


def _registered(worker="w1", **overrides) -> WorkerRegistered:
    fields = dict(worker_id=worker, role=WorkerRole.AGGREGATED, pool="p", endpoint="http://127.0.0.1:1",
                  block_size=BS, hash_algo=ALGO)
    fields.update(overrides)
    return WorkerRegistered(**fields)


class _Feed:
    """Applies payloads with dense per-(producer, stream) sequence numbers, like a producer."""

    def __init__(self, index: PrefixIndex, epoch: int = 1) -> None:
        self.index = index
        self.epoch = epoch
        #: (producer, stream) -> (epoch, next seq)
        self.seq: dict[tuple[str, str], tuple[int, int]] = {}

    def __call__(self, payload, *, producer: str | None = None, epoch: int | None = None):
        """Send ``payload``; a higher ``epoch`` than before restarts that stream at seq 0."""
        producer = producer or payload.worker_id
        epoch = self.epoch if epoch is None else epoch
        key = (producer, payload.STREAM)
        last_epoch, seq = self.seq.get(key, (epoch, 0))
        if epoch > last_epoch:
            seq = 0
        self.seq[key] = (epoch, seq + 1)
        return self.index.apply(producer, epoch, seq, payload)

    def skip(self, producer: str, stream: str = "kv", n: int = 1) -> None:
        """Lose ``n`` events: the next one arrives with a gap."""
        epoch, seq = self.seq.get((producer, stream), (self.epoch, 0))
        self.seq[(producer, stream)] = (epoch, seq + n)


def _w(worker: str, dp_rank: int = 0) -> WorkerRank:
    return WorkerRank(worker, dp_rank)


# -- worked examples ----------------------------------------------------------------------------


def test_find_matches_walks_prefix_per_worker():
    """w1 holds [1,2,3], w2 holds [1,2,9]. Query [1,2,3,4]: w1 matches 3 blocks (misses at 4),
    w2 matches 2 (misses at 3); a worker holding only [5] matches nothing and is absent."""
    idx = _index()
    feed = _Feed(idx)
    feed(_stored("w1", [1, 2, 3]))
    feed(_stored("w2", [1, 2, 9]))
    feed(_stored("w3", [5]))
    assert idx.find_matches([1, 2, 3, 4]) == {
        _w("w1"): Match(3, (3, 0, 0, 0), False),
        _w("w2"): Match(2, (2, 0, 0, 0), False),
    }
    assert idx.find_matches([7]) == {}
    assert idx.find_matches([]) == {}


def test_match_is_contiguous_from_block_zero():
    """w1 holds blocks 0, 1 and 3 of the query but not 2: its match is 2 blocks, not 3."""
    idx = _index()
    feed = _Feed(idx)
    feed(_stored("w1", [10, 11, 13]))
    assert idx.find_matches([10, 11, 12, 13]) == {_w("w1"): Match(2, (2, 0, 0, 0))}
    assert idx.find_matches([12, 13]) == {}


def test_tiers_count_each_block_in_its_fastest_tier():
    """Blocks [1,2,3,4]: 1 on device and host, 2 moved device->host, 3 on disk only, 4 object.
    by_tier = device 1 (block 1), host 1 (block 2), disk 1, object 1; depth 4."""
    idx = _index()
    feed = _Feed(idx)
    feed(_stored("w1", [1, 2]))
    feed(_stored("w1", [1], tier=HOST))
    feed(_moved("w1", [2], DEVICE, HOST))
    feed(_stored("w1", [3], tier=DISK))
    feed(_stored("w1", [4], tier=OBJECT))
    m = idx.find_matches([1, 2, 3, 4])[_w("w1")]
    assert m == Match(4, (1, 1, 1, 1), False)
    assert m.tier_counts() == {DEVICE: 1, HOST: 1, DISK: 1, OBJECT: 1}
    # Removing block 1 from the device leaves its host copy: still matched, now as host.
    feed(_removed("w1", [1], tier=DEVICE))
    assert idx.find_matches([1, 2])[_w("w1")] == Match(2, (0, 2, 0, 0))
    # Removing it from host too breaks the prefix at block 0.
    feed(_removed("w1", [1], tier=HOST))
    assert idx.find_matches([1, 2]) == {}
    idx.verify_invariants()


def test_move_adds_to_target_even_if_source_unknown():
    """BlockMoved is emitted once the bytes are in to_tier, so the block is there regardless."""
    idx = _index()
    feed = _Feed(idx)
    feed(_moved("w1", [7], DISK, HOST))
    assert idx.find_matches([7]) == {_w("w1"): Match(1, (0, 1, 0, 0))}


def test_all_blocks_cleared_for_one_tier_keeps_the_others():
    idx = _index()
    feed = _Feed(idx)
    feed(_stored("w1", [1, 2]))
    feed(_stored("w1", [1, 2, 3], tier=HOST))
    feed(_stored("w2", [1, 2]))
    feed(_cleared("w1", tier=DEVICE))
    assert idx.as_dict()["residency"] == {
        ("w1", 0, "host"): frozenset({1, 2, 3}),
        ("w2", 0, "device"): frozenset({1, 2}),
    }
    assert idx.find_matches([1, 2, 3])[_w("w1")] == Match(3, (0, 3, 0, 0))


def test_all_blocks_cleared_for_all_tiers_really_clears():
    idx = _index()
    feed = _Feed(idx)
    for tier in TIER_ORDER:
        feed(_stored("w1", [1, 2], tier=tier))
    feed(_stored("w2", [1]))
    feed(_cleared("w1"))
    assert idx.find_matches([1, 2]) == {_w("w2"): Match(1, (1, 0, 0, 0))}
    assert ("w1", 0, "device") not in idx.as_dict()["residency"]
    assert idx.stats().blocks == {_w("w2"): {DEVICE: 1}}
    assert len(idx) == 1
    # Clearing a worker the index has never heard of is harmless.
    feed(_cleared("w9"))
    idx.verify_invariants()


def test_redelivery_is_a_noop():
    """seq 0 stores [1,2,3], seq 1 removes 3, seq 2 stores 3 again. Redelivering seq 1 must not
    remove block 3 a second time."""
    idx = _index()
    assert idx.apply("w1", 1, 0, _stored(hashes=[1, 2, 3])) is ApplyOutcome.APPLIED
    assert idx.apply("w1", 1, 1, _removed(hashes=[3])) is ApplyOutcome.APPLIED
    assert idx.apply("w1", 1, 2, _stored(hashes=[3])) is ApplyOutcome.APPLIED
    assert idx.apply("w1", 1, 1, _removed(hashes=[3])) is ApplyOutcome.DUPLICATE
    assert idx.find_matches([1, 2, 3]) == {_w("w1"): Match(3, (3, 0, 0, 0))}
    assert idx.stats().counters["duplicate"] == 1


def test_gap_marks_stale_until_full_clear():
    idx = _index()
    feed = _Feed(idx)
    feed(_stored("w1", [1, 2]))
    feed(_stored("w2", [1]))
    feed.skip("w1")
    feed(_stored("w1", [3]))
    assert idx.find_matches([1, 2]) == {
        _w("w1"): Match(2, (2, 0, 0, 0), stale=True),
        _w("w2"): Match(1, (1, 0, 0, 0), stale=False),
    }
    assert idx.is_stale(_w("w1")) and idx.stale_workers() == [_w("w1")]
    # A tier-specific clear is not a resync; a full one is.
    feed(_cleared("w1", tier=HOST))
    assert idx.is_stale(_w("w1"))
    feed(_cleared("w1"))
    assert not idx.is_stale(_w("w1"))
    feed(_stored("w1", [1]))
    assert idx.find_matches([1]) [_w("w1")] == Match(1, (1, 0, 0, 0), stale=False)
    assert idx.stats().counters["gaps"] == 1


def test_first_event_mid_stream_is_a_gap():
    """Joining a producer at seq 5 means seqs 0..4 were never seen: the entries are partial."""
    idx = _index()
    idx.apply("w1", 1, 5, _stored())
    assert idx.is_stale(_w("w1"))


def test_new_epoch_marks_stale_old_epoch_is_fenced_registration_resyncs():
    """Epoch 1 stores [1,2] on device and [1] on disk. Epoch 2 appears: device entries gone at
    once (a new process has empty memory), disk kept but stale. A late epoch-1 event is fenced.
    WorkerRegistered in epoch 2 resyncs: disk kept (persistent), no longer stale."""
    idx = _index()
    feed = _Feed(idx, epoch=1)
    feed(_registered("w1"))
    feed(_stored("w1", [1, 2]))
    feed(_stored("w1", [1], tier=DISK))
    assert idx.apply("w1", 2, 0, _stored("w1", [5])) is ApplyOutcome.APPLIED
    assert idx.epoch_of("w1") == 2
    assert idx.find_matches([1, 2])[_w("w1")] == Match(1, (0, 0, 1, 0), stale=True)
    assert idx.apply("w1", 1, 99, _stored("w1", [9])) is ApplyOutcome.FENCED
    assert idx.find_matches([9]) == {}
    assert idx.apply("w1", 2, 0, _registered("w1")) is ApplyOutcome.APPLIED
    assert idx.find_matches([1, 2]) == {_w("w1"): Match(1, (0, 0, 1, 0), stale=False)}
    assert idx.as_dict()["residency"] == {("w1", 0, "disk"): frozenset({1}), ("w1", 0, "device"): frozenset({5})}


def test_registration_folded_after_the_same_incarnations_stores_keeps_them():
    """``workers`` and ``kv`` are separate topics: a registration may be folded after the first
    stores of the same epoch. It must not wipe them."""
    idx = _index()
    idx.apply("w1@kv", 1, 0, _stored("w1", [1, 2]))
    idx.apply("w1@workers", 1, 0, _registered("w1"))
    assert idx.find_matches([1, 2]) == {_w("w1"): Match(2, (2, 0, 0, 0), stale=False)}


def test_after_lost_events_the_next_epoch_drops_persistent_tiers_too():
    """Events were lost (gap), so even disk entries may be wrong: the worker's next KV epoch
    drops them. A registration alone changes no residency (it commutes with KV events)."""
    idx = _index()
    feed = _Feed(idx)
    feed(_stored("w1", [1], tier=DISK))
    feed.skip("w1")
    feed(_stored("w1", [2], tier=DISK))
    feed(_registered("w1"), epoch=2)
    assert idx.is_stale(_w("w1")) and len(idx.as_dict()["residency"]) == 1
    feed(_cleared("w1", tier=Tier.DEVICE), epoch=2)  # the new incarnation's first KV event
    assert idx.as_dict()["residency"] == {}
    assert not idx.is_stale(_w("w1"))


def test_deregistered_worker_is_excluded_until_it_registers_again():
    idx = _index()
    feed = _Feed(idx)
    feed(_registered("w1"))
    feed(_stored("w1", [1, 2]))
    feed(_stored("w1", [1, 2], tier=DISK))
    feed(_stored("w2", [1]))
    feed(WorkerDeregistered(worker_id="w1", reason="scale down"))
    assert idx.find_matches([1, 2]) == {_w("w2"): Match(1, (1, 0, 0, 0))}
    assert idx.stats().deregistered == ("w1",)
    # The next incarnation: its first KV event drops the memory tiers; disk residency survives.
    feed(_registered("w1"), epoch=2)
    feed(_cleared("w1", tier=Tier.DEVICE), epoch=2)
    assert idx.find_matches([1, 2])[_w("w1")] == Match(2, (0, 0, 2, 0))


def test_a_deregistered_workers_emptied_slots_are_freed_for_reuse():
    """Deregistration itself touches no residency; once the worker's own KV events have emptied
    its slot (a draining worker clears its memory tiers), the slot is freed and reused."""
    idx = _index()
    feed = _Feed(idx)
    for i in range(8):
        feed(_stored(f"w{i}", [i]))
    feed(WorkerDeregistered(worker_id="w3"))
    assert _w("w3") in idx.workers()
    feed(_cleared("w3", tier=Tier.DEVICE))
    feed(_stored("w8", [100, 101]))
    assert _w("w3") not in idx.workers() and _w("w8") in idx.workers()
    assert idx.find_matches([100, 101]) == {_w("w8"): Match(2, (2, 0, 0, 0))}
    idx.verify_invariants()


def test_many_workers_grow_the_layout():
    """More slots than the initial plane width (8) forces a re-layout; answers stay right."""
    idx = _index()
    feed = _Feed(idx)
    for i in range(40):
        feed(_stored(f"w{i}", [1, 2, 3][: 1 + i % 3], tier=TIER_ORDER[i % 4]))
    got = idx.find_matches([1, 2, 3])
    assert len(got) == 40
    for i in range(40):
        depth = 1 + i % 3
        by = [0, 0, 0, 0]
        by[i % 4] = depth
        assert got[_w(f"w{i}")] == Match(depth, tuple(by))
    idx.verify_invariants()


def test_dp_ranks_are_separate_caches():
    idx = _index()
    feed = _Feed(idx)
    feed(_stored("w1", [1, 2], dp_rank=0))
    feed(_stored("w1", [1], dp_rank=1))
    feed(_cleared("w1", dp_rank=0))
    assert idx.find_matches([1, 2]) == {_w("w1", 1): Match(1, (1, 0, 0, 0))}


def test_events_not_folded_still_advance_the_sequence():
    """A WorkerLoadReported between two registrations is sequenced (IGNORED), so the next
    workers-stream event is not taken for a gap."""
    idx = _index()
    feed = _Feed(idx)
    feed(_registered("w1"))
    assert feed(WorkerLoadReported(worker_id="w1", running=1, waiting=0)) is ApplyOutcome.IGNORED
    feed(WorkerDeregistered(worker_id="w1"))
    assert idx.stats().counters["gaps"] == 0
    assert idx.position("w1", "workers") == (1, 2)


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (_stored(hash_algo="sha256"), "hash_algo"),
        (_stored(block_size=32), "block_size"),
        (_stored(cache_group=CacheGroup.SLIDING_WINDOW), "cache_group"),
        (_registered(hash_algo="xxhash_cbor:1234abcd"), "hash_algo"),
        (_registered(block_size=64), "block_size"),
    ],
)
def test_rejects_incompatible_events_but_consumes_their_seq(payload, reason):
    idx = _index()
    feed = _Feed(idx)
    feed(_stored("w1", [1]))
    with pytest.raises(IndexRejected) as exc:
        feed(payload)
    assert exc.value.reason == reason and isinstance(exc.value, IndexPackageError)
    assert idx.find_matches([1, 2, 3]) == {_w("w1"): Match(1, (1, 0, 0, 0))}
    feed(_stored("w1", [1, 2]))
    assert not idx.is_stale(_w("w1"))
    assert idx.stats().counters["rejected"] == 1


def test_other_cache_group_removals_do_not_touch_full_attention_residency():
    """vLLM hybrid models reuse one block hash across cache groups: a sliding-window eviction
    of hash 2 must not remove the full-attention block 2."""
    idx = _index()
    feed = _Feed(idx)
    feed(_stored("w1", [1, 2]))
    out = feed(_removed("w1", [2], cache_group=CacheGroup.SLIDING_WINDOW))
    assert out is ApplyOutcome.IGNORED
    out = feed(_moved("w1", [2], cache_group=CacheGroup.MAMBA))
    assert out is ApplyOutcome.IGNORED
    assert idx.find_matches([1, 2]) == {_w("w1"): Match(2, (2, 0, 0, 0))}


def test_snapshot_restore_roundtrip_keeps_residency_and_sequencing():
    idx = _index()
    feed = _Feed(idx)
    feed(_registered("w1"))
    feed(_stored("w1", [1, 2, 3]))
    feed(_stored("w1", [1], tier=DISK))
    feed(_stored("w2", [1, 2]))
    feed.skip("w2")
    feed(_stored("w2", [4]))
    feed(WorkerDeregistered(worker_id="w3"))
    feed(_stored("w4", [5]))
    feed(WorkerDeregistered(worker_id="w4"))  # frees its slot
    data = idx.snapshot()
    back = PrefixIndex.restore(data)
    assert back.as_dict() == idx.as_dict()
    assert back.snapshot() == data
    assert back.find_matches([1, 2, 3]) == idx.find_matches([1, 2, 3])
    back.verify_invariants()
    # Sequencing survived: a redelivery is still a duplicate, the next seq is in order.
    assert back.apply("w1", 1, 1, _stored("w1", [7])) is ApplyOutcome.DUPLICATE
    assert back.apply("w1", 1, 2, _stored("w1", [7])) is ApplyOutcome.APPLIED
    assert not back.is_stale(_w("w1")) and back.is_stale(_w("w2"))
    # Folding on from the snapshot is indistinguishable from never having stopped.
    idx.apply("w1", 1, 1, _stored("w1", [7]))
    idx.apply("w1", 1, 2, _stored("w1", [7]))
    for i in range(3):
        for index in (idx, back):
            index.apply("w5", 1, i, _stored("w5", [8 + i]))
    assert back.snapshot() == idx.snapshot()


def test_applies_decoded_envelopes_from_the_wire():
    codec = EventCodec()
    factory = EnvelopeFactory("engine-w1", epoch=3, clock_ns=lambda: 0)
    hashes = hash_blocks(list(range(64)), HashConfig("sha256_cbor", BS))
    wire = [codec.encode(factory.wrap(_stored("w1", hashes))) for _ in range(2)]
    idx = _index()
    assert idx.apply_envelope(codec.decode(wire[0])) is ApplyOutcome.APPLIED
    assert idx.apply_envelope(codec.decode(wire[1])) is ApplyOutcome.APPLIED
    assert idx.apply_envelope(codec.decode(wire[1])) is ApplyOutcome.DUPLICATE
    assert idx.find_matches(hashes) == {_w("w1"): Match(4, (4, 0, 0, 0))}
    assert PrefixIndex.for_config(HashConfig("sha256_cbor", BS)).hash_algo == ALGO


# -- property test against a brute-force oracle ------------------------------------------------

WORKERS = ("a", "b", "c")
# Three chains of 6 hashes; b-chain shares its first two blocks with a-chain.
CHAINS = ((11, 12, 13, 14, 15, 16), (11, 12, 23, 24, 25, 26), (31, 32, 33, 34, 35, 36))
ALL_HASHES = sorted(set(itertools.chain(*CHAINS)))


@st.composite
def _kv_op(draw):
    kind = draw(st.sampled_from(["store", "store", "store", "remove", "move", "clear", "clear_all",
                                 "restart"]))
    tier = draw(st.sampled_from(TIER_ORDER))
    if kind == "store":
        chain = draw(st.sampled_from(CHAINS))
        a = draw(st.integers(0, 5))
        b = draw(st.integers(a + 1, 6))
        return ("store", tier, chain[a:b])
    if kind in ("remove", "move"):
        hs = draw(st.lists(st.sampled_from(ALL_HASHES), min_size=1, max_size=4))
        if kind == "remove":
            return ("remove", tier, tuple(hs))
        return ("move", (tier, draw(st.sampled_from(TIER_ORDER))), tuple(hs))
    if kind == "clear":
        return ("clear", tier, ())
    return (kind, None, ())


def _payload(worker, op):
    kind, tier, hs = op
    if kind == "store":
        return _stored(worker, hs, tier=tier)
    if kind == "remove":
        return _removed(worker, hs, tier=tier)
    if kind == "move":
        return _moved(worker, hs, tier[0], tier[1])
    if kind == "clear":
        return _cleared(worker, tier=tier)
    return _cleared(worker)  # clear_all (the first event of a restart is one too)


def _oracle_fold(res: dict, worker: str, op) -> None:
    kind, tier, hs = op
    key = lambda t: (worker, 0, t.value)  # noqa: E731
    if kind == "store":
        res.setdefault(key(tier), set()).update(hs)
    elif kind == "remove":
        res.get(key(tier), set()).difference_update(hs)
    elif kind == "move":
        res.get(key(tier[0]), set()).difference_update(hs)
        res.setdefault(key(tier[1]), set()).update(hs)
    elif kind == "clear":
        res.pop(key(tier), None)
    else:
        for t in TIER_ORDER:
            res.pop(key(t), None)


def _naive_find(residency: dict, query) -> dict:
    out = {}
    for w in WORKERS:
        by = [0, 0, 0, 0]
        depth = 0
        for h in query:
            tiers = [i for i, t in enumerate(TIER_ORDER) if h in residency.get((w, 0, t.value), ())]
            if not tiers:
                break
            by[tiers[0]] += 1
            depth += 1
        if depth:
            out[_w(w)] = (depth, tuple(by))
    return out


def _clean(res: dict) -> dict:
    return {k: frozenset(v) for k, v in res.items() if v}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    streams=st.fixed_dictionaries({w: st.lists(_kv_op(), max_size=25) for w in WORKERS}),
    schedule=st.lists(st.tuples(st.sampled_from(WORKERS), st.sampled_from(
        ["deliver"] * 6 + ["redeliver", "drop"])), max_size=120),
    queries=st.lists(st.sampled_from(CHAINS).flatmap(
        lambda c: st.integers(1, 6).map(lambda n: c[:n])), min_size=1, max_size=5),
)
def test_index_agrees_with_brute_force_oracle(streams, schedule, queries):
    """Each worker produces its stream in order (epochs, dense seqs; a "restart" op starts a
    new epoch at seq 0 with a full clear). Delivery interleaves workers, redelivers old events
    and drops some. Then for every worker:

    * stale == (a drop was detected, or a new epoch began) since the last delivered full clear;
    * residency == the oracle's fold of its true stream up to the last delivered event, whenever
      no drop happened since the last full clear;
    * find_matches == a naive walk over the index's own residency (for every worker), with
      the expected stale flags.
    """
    # Producer side: number every worker's events (epoch, seq).
    produced: dict[str, list[tuple[int, int, tuple]]] = {}
    for w, ops in streams.items():
        epoch, seq, out = 1, 0, []
        for op in ops:
            if op[0] == "restart":
                epoch, seq = epoch + 1, 0
            out.append((epoch, seq, op))
            seq += 1
        produced[w] = out

    idx = _index()
    cursor = dict.fromkeys(WORKERS, 0)
    delivered: dict[str, list[int]] = {w: [] for w in WORKERS}
    stale = dict.fromkeys(WORKERS, False)
    dirty = dict.fromkeys(WORKERS, False)  # a drop since the last delivered full clear
    expect_seq: dict[str, tuple[int, int] | None] = dict.fromkeys(WORKERS, None)
    for w, action in schedule:
        if action == "redeliver" and delivered[w]:
            i = delivered[w][len(delivered[w]) // 2]
            epoch, seq, op = produced[w][i]
            got = idx.apply(w, epoch, seq, _payload(w, op))
            assert got in (ApplyOutcome.DUPLICATE, ApplyOutcome.FENCED)
            continue
        if cursor[w] >= len(produced[w]):
            continue
        i = cursor[w]
        cursor[w] += 1
        if action == "drop":
            dirty[w] = True
            continue
        epoch, seq, op = produced[w][i]
        prev = expect_seq[w]
        if prev is None:
            stale[w] = stale[w] or seq != 0
        elif epoch > prev[0]:
            stale[w] = True
            stale[w] = stale[w] or seq != 0
        elif seq != prev[1] + 1:
            stale[w] = True
        expect_seq[w] = (epoch, seq)
        assert idx.apply(w, epoch, seq, _payload(w, op)) is ApplyOutcome.APPLIED
        delivered[w].append(i)
        if op[0] in ("clear_all", "restart"):
            stale[w] = False
            dirty[w] = False

    idx.verify_invariants()
    view = idx.as_dict()
    for w in WORKERS:
        assert idx.is_stale(_w(w)) == stale[w], w
        if delivered[w] and not dirty[w]:
            oracle: dict = {}
            for i in range(delivered[w][-1] + 1):
                _oracle_fold(oracle, w, produced[w][i][2])
            mine = {k: v for k, v in view["residency"].items() if k[0] == w}
            assert mine == _clean(oracle), w

    for q in queries:
        got = idx.find_matches(q)
        want = _naive_find(view["residency"], q)
        assert {k: (m.depth, m.by_tier) for k, m in got.items()} == want
        for k, m in got.items():
            assert m.stale == stale[k.worker_id]

    back = PrefixIndex.restore(idx.snapshot())
    assert back.as_dict() == view
