"""Decoding vLLM's KV event batches (every stored fixture) and translating them into ours."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from data_plane.vllm.kv_events import (
    EventForm,
    KvEventTranslator,
    VllmAllBlocksCleared,
    VllmBlockRemoved,
    VllmBlockStored,
    VllmDecodeError,
    VllmSource,
    decode_batch,
    wire_hash,
)
from schemas.events import AllBlocksCleared, BlockRemoved, BlockStored
from schemas.types import CacheGroup, Tier, WorkerId
from tests.fixtures.vllm import generate

FIXTURES = Path(generate.__file__).resolve().parent
W = WorkerId("w1")
#: sha256 (vLLM's default) wire hashes of tokens 1..16 and 17..32 from the start of a sequence.
H1, H2 = 1403909460543360175, 1643945449041937783


def _source(**overrides) -> VllmSource:
    kw = dict(worker_id=W, hash_algo="sha256", block_size=16)
    kw.update(overrides)
    return VllmSource(**kw)


def _fixture(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def _translate(name: str, **overrides):
    return KvEventTranslator(_source(**overrides)).translate(decode_batch(_fixture(name)))


def _stored(hashes, *, tier=Tier.DEVICE, parent=None, tokens=(), lora_id=None, lora_name=None,
            group=CacheGroup.FULL_ATTENTION, dp_rank=0) -> BlockStored:
    return BlockStored(worker_id=W, tier=tier, block_hashes=list(hashes), parent_hash=parent,
                       block_size=16, hash_algo="sha256", cache_group=group, lora_id=lora_id,
                       lora_name=lora_name, token_ids=list(tokens), dp_rank=dp_rank)


def _removed(hashes, *, tier=Tier.DEVICE, group=CacheGroup.FULL_ATTENTION, dp_rank=0):
    return BlockRemoved(worker_id=W, tier=tier, block_hashes=list(hashes), cache_group=group,
                        dp_rank=dp_rank)


# -- fixtures themselves ---------------------------------------------------------------------


def test_fixtures_are_what_the_generator_builds():
    """The stored bytes are frozen: regenerating them must not change a byte (the generator
    also checks that its vLLM 0.33 mirror re-encodes the published sample exactly)."""
    built = generate.build()
    stored = {p.name: p.read_bytes() for p in FIXTURES.glob("*.msgpack")}
    assert stored == built


def test_sample_is_the_published_269_bytes():
    data = _fixture("sample_v0_33.msgpack")
    assert len(data) == 269
    assert data.hex() == generate.SAMPLE_V0_33_HEX


def test_sample_hashes_are_real_sha256_block_hashes():
    digests = generate.sha256_chain(list(range(1, 33)))
    assert [wire_hash(d) for d in digests] == [H1, H2]


# -- decoding --------------------------------------------------------------------------------


def test_v0_33_sample_decodes():
    b = decode_batch(_fixture("sample_v0_33.msgpack"))
    assert b.ts == 1700000000.5
    assert b.data_parallel_rank == 0
    assert b.form is EventForm.ARRAY_BATCH_MAP_EVENTS
    assert b.events == (
        VllmBlockStored(block_hashes=(H1, H2), parent_block_hash=None,
                        token_ids=tuple(range(1, 33)), block_size=16, medium="GPU", group_idx=0),
        VllmBlockRemoved(block_hashes=(H1,), medium="GPU", group_idx=0),
        VllmAllBlocksCleared(),
    )


def test_v0_33_sample_translates():
    assert _translate("sample_v0_33.msgpack") == [
        _stored([H1, H2], tokens=range(1, 33)),
        _removed([H1]),
        AllBlocksCleared(worker_id=W, tier=None, dp_rank=0),
    ]


def test_legacy_array_events():
    """Early releases: [ts, events] without a DP rank; events are tagged arrays; a negative
    builtin-hash() value is taken modulo 2**64."""
    b = decode_batch(_fixture("legacy_array_events.msgpack"))
    assert b.form is EventForm.ARRAY_BATCH_ARRAY_EVENTS
    assert b.data_parallel_rank is None
    neg = (-4611686018427387904) % 2**64
    assert _translate("legacy_array_events.msgpack", dp_rank=3) == [
        _stored([neg, 7], parent=42, tokens=range(100, 132), lora_id=3, dp_rank=3),
        _removed([7], dp_rank=3),
        AllBlocksCleared(worker_id=W, tier=None, dp_rank=3),
    ]


def test_bytes_hashes_become_the_same_u64_as_int_hashes():
    """VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 sends full digests; they must index exactly like
    the int form (last 8 bytes, big-endian) of the same blocks in the 0.33 sample."""
    h3 = wire_hash(generate.sha256_chain(list(range(1, 49)))[2])
    assert _translate("bytes_hashes_v0_33.msgpack") == [
        _stored([H1, H2], tokens=range(1, 33)),
        _stored([h3], parent=H2, tokens=range(33, 49)),
        _removed([h3]),
    ]


def test_cpu_storage_and_nil_media_map_to_tiers():
    assert _translate("cpu_storage_media_v0_33.msgpack") == [
        _stored([11, 12], tier=Tier.HOST, tokens=range(32)),
        _stored([11], tier=Tier.DISK, tokens=range(16)),
        _removed([12], tier=Tier.HOST),
        _stored([13], parent=12, tokens=range(32, 48), lora_id=5, lora_name="adapter-a"),
    ]


def test_hybrid_groups_keep_only_full_attention_by_default():
    """Group 1 (sliding window) and 2 (Mamba) share the hashes of group 0: publishing them
    would claim prefix residency that is not there. The remove of group 1 carries only
    group_idx: its kind is known from the store before it."""
    t = KvEventTranslator(_source())
    events = t.translate(decode_batch(_fixture("hybrid_groups_v0_33.msgpack")))
    assert events == [_stored([21, 22], tokens=range(32), dp_rank=1), _removed([22], dp_rank=1)]
    assert t.dropped == {"non_prefix_group": 3}
    assert t.learned_groups == {0: CacheGroup.FULL_ATTENTION, 1: CacheGroup.SLIDING_WINDOW,
                                2: CacheGroup.MAMBA}


def test_hybrid_groups_all_published_when_asked():
    assert _translate("hybrid_groups_v0_33.msgpack", prefix_groups_only=False) == [
        _stored([21, 22], tokens=range(32), dp_rank=1),
        _stored([21, 22], tokens=range(32), group=CacheGroup.SLIDING_WINDOW, dp_rank=1),
        _removed([21], group=CacheGroup.SLIDING_WINDOW, dp_rank=1),
        _removed([22], dp_rank=1),
        _stored([23], parent=22, tokens=range(32, 48), group=CacheGroup.MAMBA, dp_rank=1),
    ]


def test_map_batch_from_vllm_main():
    b = decode_batch(_fixture("map_batch_main_0181ea.msgpack"))
    assert b.form is EventForm.MAP_BATCH_MAP_EVENTS
    assert _translate("map_batch_main_0181ea.msgpack") == [
        _stored([31, 32], tokens=range(32)),
        _removed([31, 32]),
    ]


def test_unknown_fields_are_ignored_and_unknown_event_types_skipped():
    b = decode_batch(_fixture("future_fields_v0_33.msgpack"))
    assert b.unknown_types == ("BlockPinned",)
    t = KvEventTranslator(_source())
    assert t.translate(b) == [_stored([41], tokens=range(16)), _removed([41])]
    assert t.dropped == {"unknown_type": 1}


@pytest.mark.parametrize("payload", [
    b"",
    b"\xc1",                                      # never-used msgpack byte
    msgspec.msgpack.encode("not a batch"),
    msgspec.msgpack.encode([1.0]),                # no events
    msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}], 0]),          # no block_hashes
    msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": "x"}], 0]),
    msgspec.msgpack.encode([1.0, [5], 0]),        # an event that is neither map nor array
])
def test_malformed_batches_raise(payload):
    with pytest.raises(VllmDecodeError):
        decode_batch(payload)


# -- translation rules -----------------------------------------------------------------------


def _batch(*events, rank=0) -> bytes:
    return msgspec.msgpack.encode([1.0, list(events), rank])


def _store_map(**kw) -> dict:
    ev = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
          "token_ids": list(range(16)), "block_size": 16, "lora_id": None, "medium": "GPU",
          "lora_name": None}
    ev.update(kw)
    return ev


def test_cache_group_rules_in_order():
    t = KvEventTranslator(_source(group_kinds={3: CacheGroup.SLIDING_WINDOW}))
    assert t.cache_group(None) is CacheGroup.FULL_ATTENTION          # no group: single-group
    assert t.cache_group(0) is CacheGroup.FULL_ATTENTION             # group 0, nothing known
    assert t.cache_group(5) is CacheGroup.OTHER                      # unidentified group
    assert t.cache_group(3) is CacheGroup.SLIDING_WINDOW             # operator config
    assert t.cache_group(4, sliding_window=256) is CacheGroup.SLIDING_WINDOW
    assert t.cache_group(3, "mla_attention") is CacheGroup.FULL_ATTENTION  # the event wins...
    assert t.cache_group(3) is CacheGroup.FULL_ATTENTION             # ...and is remembered
    assert t.cache_group(0, "sliding_window") is CacheGroup.SLIDING_WINDOW
    assert t.cache_group(0) is CacheGroup.SLIDING_WINDOW
    assert t.cache_group(6, "a_future_kind") is CacheGroup.OTHER


def test_unknown_medium_and_remote_locality_are_dropped_both_ways():
    payload = _batch(
        _store_map(medium="NVME_OVER_FABRIC"),
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "NVME_OVER_FABRIC"},
        _store_map(locality="REMOTE"),
        _store_map(locality="LOCAL", block_hashes=[2]),
        _store_map(medium="cpu", block_hashes=[3]),   # case-insensitive
    )
    t = KvEventTranslator(_source())
    assert t.translate(decode_batch(payload)) == [
        _stored([2], tokens=range(16)), _stored([3], tier=Tier.HOST, tokens=range(16))]
    assert t.dropped == {"unknown_medium": 2, "not_local": 1}


def test_store_keeps_its_own_block_size_and_empty_events_vanish():
    payload = _batch(_store_map(block_size=32, token_ids=list(range(32))),
                     {"type": "BlockRemoved", "block_hashes": [], "medium": "GPU"})
    (ev,) = KvEventTranslator(_source()).translate(decode_batch(payload))
    assert ev.block_size == 32  # the index refuses it; the fact is still recorded truthfully


def test_resync_uses_the_last_dp_rank_seen():
    t = KvEventTranslator(_source(dp_rank=2))
    assert t.resync() == AllBlocksCleared(worker_id=W, dp_rank=2)
    t.translate(decode_batch(_batch(rank=5)))
    assert t.resync() == AllBlocksCleared(worker_id=W, dp_rank=5)


@pytest.mark.parametrize("kw", [dict(worker_id=""), dict(hash_algo=""), dict(block_size=0)])
def test_source_validation(kw):
    with pytest.raises(ValueError):
        _source(**kw)


def test_wire_hash():
    assert wire_hash(5) == 5
    assert wire_hash(-1) == 2**64 - 1
    assert wire_hash(bytes(24) + (7).to_bytes(8, "big")) == 7
    assert wire_hash(b"\x01\x02") == 0x0102
