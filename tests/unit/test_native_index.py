"""The native prefix index against its differential oracle (``tests/oracles/prefix_index.py``,
the executable specification).

1. The oracle's whole contract suite (``test_prefix_index.py``: worked examples, sequencing,
   rejections, checkpoints, the brute-force oracle property) runs again with the native class.
2. Equivalence properties: random event sequences (duplicates, gaps, epochs, removals, moves,
   clears, registrations, DP ranks, rejected events) fold through both, as decoded payloads and
   as envelope bytes; after every event the outcomes agree, and at the end the state
   (``as_dict``, hence the router view digest), every match and the snapshot bytes are identical,
   and each implementation restores the other's snapshot.
"""

from __future__ import annotations

import inspect

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from control_plane.index.errors import IndexRejected
from control_plane.index.native import NativePrefixIndex
from tests.oracles.prefix_index import PrefixIndex
from schemas import EnvelopeFactory, EventCodec
from schemas.events import WorkerDeregistered, WorkerLoadReported
from schemas.types import TIER_ORDER, CacheGroup
from tests.unit import test_prefix_index as contract

ALGO, BS = contract.ALGO, contract.BS
CODEC = EventCodec()


# -- 1. the oracle's contract suite, on the native class -------------------------------------

_CONTRACT = sorted(name for name, f in vars(contract).items()
                   if name.startswith("test_") and inspect.isfunction(f))


@pytest.mark.parametrize("name", _CONTRACT)
def test_native_passes_the_oracle_contract(name, monkeypatch):
    """Every oracle test, with the module's ``PrefixIndex`` bound to the native class."""
    monkeypatch.setattr(contract, "PrefixIndex", NativePrefixIndex)
    assert type(contract._index()) is NativePrefixIndex
    fn = getattr(contract, name)
    marks = getattr(fn, "pytestmark", [])
    params = [m for m in marks if m.name == "parametrize"]
    if not params:
        fn()
        return
    (argnames, values), = [(m.args[0], m.args[1]) for m in params]
    names = [a.strip() for a in argnames.split(",")] if isinstance(argnames, str) else argnames
    for v in values:
        v = v.values if hasattr(v, "values") else v
        fn(**dict(zip(names, v if len(names) > 1 else (v,))))


# -- 2. equivalence on random sequences ---------------------------------------------------------

WORKERS = ("a", "b", "c", "d")
# Chains over a small hash space so holders overlap; one huge hash exercises the u64 range.
CHAINS = ((11, 12, 13, 14, 15, 16), (11, 12, 23, 24, 25, 26), (31, 32, 33, 34, 35, 2**64 - 1),
          (41, 42, 43, 44, 45, 46))
ALL_HASHES = sorted({h for c in CHAINS for h in c})


@st.composite
def _payload(draw):
    w = draw(st.sampled_from(WORKERS))
    dp = draw(st.sampled_from((0, 0, 0, 1)))
    tier = draw(st.sampled_from(TIER_ORDER))
    kind = draw(st.sampled_from(["store"] * 5 + ["remove"] * 2 + ["move"] * 2 + [
        "clear", "clear_all", "register", "deregister", "load", "bad_store", "hybrid_remove"]))
    if kind in ("store", "bad_store"):
        chain = draw(st.sampled_from(CHAINS))
        a = draw(st.integers(0, 5))
        hs = list(chain[a:draw(st.integers(a + 1, 6))])
        extra = {}
        if kind == "bad_store":
            extra = draw(st.sampled_from([{"block_size": 32}, {"hash_algo": "xxh3_64:1337"},
                                          {"cache_group": CacheGroup.SLIDING_WINDOW}]))
        return contract._stored(w, hs, **{"tier": tier, "dp_rank": dp, **extra})
    if kind in ("remove", "hybrid_remove"):
        hs = draw(st.lists(st.sampled_from(ALL_HASHES), min_size=1, max_size=4))
        group = CacheGroup.MAMBA if kind == "hybrid_remove" else CacheGroup.FULL_ATTENTION
        return contract._removed(w, hs, tier=tier, dp_rank=dp, cache_group=group)
    if kind == "move":
        hs = draw(st.lists(st.sampled_from(ALL_HASHES), min_size=1, max_size=4))
        return contract._moved(w, hs, frm=tier, to=draw(st.sampled_from(TIER_ORDER)), dp_rank=dp)
    if kind == "clear":
        return contract._cleared(w, tier, dp_rank=dp)
    if kind == "clear_all":
        return contract._cleared(w, dp_rank=dp)
    if kind == "register":
        bs = draw(st.sampled_from((BS, BS, BS, 8)))
        return contract._registered(w, block_size=bs)
    if kind == "deregister":
        return WorkerDeregistered(worker_id=w)
    return WorkerLoadReported(worker_id=w, running=1, waiting=0)


@st.composite
def _sequence(draw):
    """Events with their (producer, epoch, seq) as producers would number them, then perturbed:
    duplicates (an old seq again), gaps (seq jumps), new epochs (seq back to 0), stale epochs."""
    out = []
    pos: dict[tuple[str, str], tuple[int, int]] = {}
    for _ in range(draw(st.integers(0, 60))):
        p = draw(_payload())
        producer = p.worker_id + draw(st.sampled_from(("", "", "", "@other")))
        key = (producer, p.STREAM)
        epoch, seq = pos.get(key, (1, -1))
        move = draw(st.sampled_from(["next"] * 8 + ["dup", "gap", "epoch", "old_epoch"]))
        if move == "next":
            seq += 1
        elif move == "dup":
            seq = max(seq, 0)
        elif move == "gap":
            seq += draw(st.integers(2, 4))
        elif move == "epoch":
            epoch, seq = epoch + 1, draw(st.sampled_from((0, 0, 3)))
        else:
            out.append((producer, max(epoch - 1, 0), seq + 1, p))
            continue
        pos[key] = (epoch, seq)
        out.append((producer, epoch, seq, p))
    return out


def _apply(idx, producer, epoch, seq, payload):
    try:
        return idx.apply(producer, epoch, seq, payload).value
    except IndexRejected as e:
        return ("rejected", e.reason, str(e))


def _apply_bytes(idx, wire: bytes, suffix: str):
    try:
        got = idx.apply_bytes(wire, suffix)
        if got is None:
            env = CODEC.decode(wire)
            got = idx.apply(env.producer + suffix, env.epoch, env.seq, env.data)
        return got.value
    except IndexRejected as e:
        return ("rejected", e.reason, str(e))


def _queries():
    qs = [list(c[:n]) for c in CHAINS for n in (1, 3, 6)]
    return qs + [[11, 12, 13, 99], [2**64 - 1], []]


def _assert_same(ref: PrefixIndex, nat: NativePrefixIndex) -> None:
    nat.verify_invariants()
    ref.verify_invariants()
    assert nat.as_dict() == ref.as_dict()
    for q in _queries():
        assert list(nat.find_matches(q).items()) == list(ref.find_matches(q).items()), q
    assert nat.stats() == ref.stats()
    assert nat.stale_workers() == ref.stale_workers()
    assert nat.workers() == ref.workers()
    assert len(nat) == len(ref)
    for w in WORKERS:
        assert nat.epoch_of(w) == ref.epoch_of(w)
    snap = ref.snapshot()
    assert nat.snapshot() == snap
    assert NativePrefixIndex.restore(snap).as_dict() == ref.as_dict()
    assert PrefixIndex.restore(nat.snapshot()).snapshot() == snap


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=_sequence())
def test_native_and_oracle_fold_identically(events):
    ref, nat = PrefixIndex(ALGO, BS), NativePrefixIndex(ALGO, BS)
    for producer, epoch, seq, payload in events:
        assert _apply(nat, producer, epoch, seq, payload) == _apply(ref, producer, epoch, seq, payload)
    _assert_same(ref, nat)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=_sequence(), cut=st.integers(0, 60))
def test_envelope_bytes_path_equals_the_decoded_path(events, cut):
    """The same sequence as envelope bytes through ``apply_bytes`` (Rust msgpack decode; worker
    events fall back to the codec), checkpointed and restored half way."""
    ref, nat = PrefixIndex(ALGO, BS), NativePrefixIndex(ALGO, BS)
    suffix = "@sy.kv:3"
    for i, (producer, epoch, seq, payload) in enumerate(events):
        if i == cut:
            nat = NativePrefixIndex.restore(nat.snapshot())
        wire = CODEC.encode(EnvelopeFactory(producer, epoch, lambda: 0).wrap(payload))
        # EnvelopeFactory numbers from 0; put the sequence we want on the wire.
        env = CODEC.decode(wire)
        wire = CODEC.encode(type(env)(**{**{f: getattr(env, f) for f in env.__struct_fields__},
                                         "seq": seq}))
        assert _apply_bytes(nat, wire, suffix) == _apply(ref, producer + suffix, epoch, seq, payload)
    _assert_same(ref, nat)


def test_bytes_path_leaves_records_it_does_not_take_to_the_codec():
    nat = NativePrefixIndex(ALGO, BS)
    reg = contract._registered("a")
    wire = CODEC.encode(EnvelopeFactory("a", 1, lambda: 0).wrap(reg))
    assert nat.apply_bytes(wire) is None
    assert nat.apply_bytes(b"\x81\xa1x\x01") is None
    assert nat.apply_bytes(b"") is None
    assert nat.position("a", "workers") is None  # nothing was folded


def test_the_views_fold_into_the_native_index_unless_given_one():
    """One production index; the router view takes another only when a test hands it one."""
    from control_plane.metrics.projection import MetricsProjection, ProjectionConfig
    from control_plane.router.view import RouterView

    assert type(RouterView(ALGO, BS).index) is NativePrefixIndex
    assert type(RouterView.restore(RouterView(ALGO, BS).snapshot()).index) is NativePrefixIndex
    proj = MetricsProjection(ProjectionConfig(hash_algo=ALGO, block_size=BS))
    assert type(proj.index) is NativePrefixIndex
    assert type(MetricsProjection.restore(proj.snapshot(), proj.config).index) is NativePrefixIndex
    assert type(RouterView(ALGO, BS, index=PrefixIndex(ALGO, BS)).index) is PrefixIndex


def test_an_index_built_on_one_thread_folds_on_another():
    """Processes restore their index in a worker thread and fold on the event loop."""
    import threading

    box = []
    t = threading.Thread(target=lambda: box.append(NativePrefixIndex(ALGO, BS)))
    t.start()
    t.join()
    idx = box[0]
    idx.apply("a", 1, 0, contract._stored("a", [1, 2]))
    assert len(idx) == 2


def test_find_matches_reads_any_sequence_of_u64_hashes():
    """Lists and tuples are read in place (with a faster int conversion above 2^63), other
    sequences through PyO3; every one gives the same answer, and an int outside the u64 range is
    an OverflowError, as before."""
    import numpy as np

    nat = NativePrefixIndex(ALGO, BS)
    chain = [5, 2**62, 2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1]
    nat.apply("a", 1, 0, contract._stored("a", chain))
    want = nat.find_matches(chain)
    assert next(iter(want.values())).depth == len(chain)
    for q in (tuple(chain), np.array(chain, dtype=np.uint64), [np.uint64(h) for h in chain],
              range(5, 6)):
        got = nat.find_matches(q)
        assert list(got.items()) == (list(want.items()) if len(q) == len(chain)
                                     else list(nat.find_matches([5]).items()))
    for bad in (-1, 2**64, 2**70, -(2**64)):
        with pytest.raises(OverflowError):
            nat.find_matches([5, bad])
    with pytest.raises(TypeError):
        nat.find_matches([5, "6"])


def test_find_matches_answers_a_read_only_mapping_equal_to_the_oracles_dict():
    from collections.abc import Mapping

    from control_plane.index.shapes import Match, WorkerRank

    ref, nat = PrefixIndex(ALGO, BS), NativePrefixIndex(ALGO, BS)
    for i, (w, hs) in enumerate((("a", [1, 2, 3]), ("b", [1, 2]))):
        for idx in (ref, nat):
            idx.apply(w, 1, 0, contract._stored(w, hs, dp_rank=i))
    want, got = ref.find_matches([1, 2, 3]), nat.find_matches([1, 2, 3])
    assert isinstance(got, Mapping) and got == want and want == got and not got != want
    assert list(got) == list(want) and list(got.keys()) == list(want.keys())
    assert list(got.values()) == list(want.values()) and len(got) == 2 and got
    a, missing = WorkerRank("a", 0), WorkerRank("a", 1)
    assert got[a] == want[a] == Match(3, (3, 0, 0, 0)) and got.get(a) == want[a]
    assert a in got and ("a", 0) in got and missing not in got
    assert got.get(missing) is None and got.get(missing, 7) == 7
    with pytest.raises(KeyError):
        got[missing]
    assert repr(got) == repr(want) and dict(got) == want
    assert not nat.find_matches([9]) and nat.find_matches([9]) == {} and got != {}
    with pytest.raises(TypeError):
        hash(got)
    with pytest.raises(TypeError):
        got[a] = Match(1, (1, 0, 0, 0))  # type: ignore[index]
