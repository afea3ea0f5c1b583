"""vLLM-compatible chained block hashing: published vectors and a literal reference."""

from __future__ import annotations

import hashlib
import pickle
import re

import cbor2
import msgspec
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from common.errors import HashConfigError, KernelError
from common.hashing import (
    DEFAULT_NONE_HASH_SEED,
    HashAlgo,
    HashConfig,
    hash_block_digests,
    hash_blocks,
    hash_json_ids,
    hash_object,
    to_wire,
)
from tests.fixtures.vllm.generate import SAMPLE_V0_33_HEX

# The byte-exact KV event batch published by vLLM 0.33.0 (topic "kv-events", seq 0, ts
# 1700000000.5, rank 0; tests/fixtures/vllm/sample_v0_33.msgpack): one BlockStored with two
# blocks of tokens 1..32, block_size 16, default sha256 hashing with PYTHONHASHSEED unset, int
# hashes on the wire; then a BlockRemoved and an AllBlocksCleared.
VLLM_0_33_SAMPLE_BATCH = bytes.fromhex(SAMPLE_V0_33_HEX)


def _vllm_reference(algo: str, seed: str, tokens: list[int], block_size: int, extra=None):
    """A literal transcription of vLLM's init_none_hash + hash_block_tokens + int conversion."""
    ser = {
        "sha256": lambda x: pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL),
        "sha256_cbor": lambda x: cbor2.dumps(x, canonical=True),
        "xxhash": lambda x: pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL),
        "xxhash_cbor": lambda x: cbor2.dumps(x, canonical=True),
    }[algo]
    dig = hashlib.sha256 if algo.startswith("sha256") else xxhash.xxh3_128

    def hash_fn(x):
        return dig(ser(x)).digest()

    none_hash = hash_fn(seed)
    out, parent = [], None
    for b in range(len(tokens) // block_size):
        block = tokens[b * block_size : (b + 1) * block_size]
        parent = hash_fn((parent or none_hash, tuple(block), extra[b] if extra else None))
        out.append(int.from_bytes(parent, byteorder="big") & ((1 << 64) - 1))
    return out


def test_none_hash_vectors_with_pythonhashseed_unset():
    """NONE_HASH = H("vllm-none-hash"): sha256 066b1e89...d71198, sha256_cbor 9bd96a48...9581eef0
    (vLLM's ``NONE_HASH``)."""
    sha = HashConfig(HashAlgo.SHA256).none_hash.hex()
    cbor = HashConfig(HashAlgo.SHA256_CBOR).none_hash.hex()
    assert sha.startswith("066b1e89") and sha.endswith("d71198")
    assert cbor.startswith("9bd96a48") and cbor.endswith("9581eef0")


def test_vllm_published_sample_hashes_tokens_1_to_32():
    """vLLM's own sample event carries the u64 hashes of blocks [1..16] and [17..32]:
    0x137bb037547f4caf and 0x16d077ad0843c577. Our default config reproduces both exactly."""
    batch = msgspec.msgpack.decode(VLLM_0_33_SAMPLE_BATCH)
    stored = batch[1][0]
    assert stored["type"] == "BlockStored" and stored["block_size"] == 16
    assert stored["token_ids"] == list(range(1, 33))
    assert stored["block_hashes"] == [0x137BB037547F4CAF, 0x16D077AD0843C577]
    assert hash_blocks(stored["token_ids"], HashConfig()) == stored["block_hashes"]


@pytest.mark.parametrize("algo", [a.value for a in HashAlgo])
def test_matches_literal_vllm_reference(algo):
    tokens = [(i * 7919) % 151_000 for i in range(16 * 5 + 3)]
    extra = [None, ("adapter-a",), (("mm-hash-1", 3),), None, ("salt", b"\x00\x01")]
    config = HashConfig(HashAlgo(algo), 16, seed="1234")
    assert hash_blocks(tokens, config) == _vllm_reference(algo, "1234", tokens, 16)
    assert hash_blocks(tokens, config, extra) == _vllm_reference(algo, "1234", tokens, 16, extra)
    if HashAlgo(algo).cryptographic:
        default = HashConfig(HashAlgo(algo), 16)
        assert hash_blocks(tokens, default) == _vllm_reference(
            algo, DEFAULT_NONE_HASH_SEED, tokens, 16
        )


def test_only_full_blocks_and_chain_continuation():
    """A trailing partial block has no hash; hashing the tail from the parent's full digest
    continues the same chain."""
    cfg = HashConfig(HashAlgo.SHA256_CBOR, block_size=4)
    toks = list(range(100, 111))  # 11 tokens: 2 full blocks of 4 and 3 left over
    full = hash_blocks(toks, cfg)
    assert len(full) == 2
    digests = hash_block_digests(toks, cfg)
    assert [to_wire(d) for d in digests] == full
    assert hash_blocks(toks[4:8], cfg, parent=digests[0]) == full[1:]
    assert hash_blocks(toks[:3], cfg) == []


def test_input_container_does_not_change_hashes():
    cfg = HashConfig()
    toks = list(range(64))
    expect = hash_blocks(toks, cfg)
    assert hash_blocks(tuple(toks), cfg) == expect
    assert hash_blocks(np.arange(64, dtype=np.int64), cfg) == expect
    assert hash_blocks(range(64), cfg) == expect


def test_hash_object_is_vllms_h():
    cfg = HashConfig(HashAlgo.SHA256)
    assert hash_object(DEFAULT_NONE_HASH_SEED, cfg) == cfg.none_hash


def test_config_validation_and_wire_name():
    assert HashConfig(HashAlgo.SHA256_CBOR).hash_algo == "sha256_cbor"
    # The default seed spelled out is the same config.
    assert HashConfig("sha256", 16, DEFAULT_NONE_HASH_SEED) == HashConfig("sha256", 16)
    seeded = HashConfig("sha256", 16, "0")
    assert seeded.hash_algo.startswith("sha256:") and len(seeded.hash_algo) == len("sha256:") + 8
    assert seeded.hash_algo != HashConfig("sha256", 16, "1").hash_algo
    assert seeded.hash_algo == HashConfig.from_engine_env("sha256", 16, {"PYTHONHASHSEED": "0"}).hash_algo
    with pytest.raises(HashConfigError, match="explicit seed"):
        HashConfig(HashAlgo.XXHASH_CBOR)
    with pytest.raises(KernelError, match="unknown prefix-caching hash algorithm"):
        HashConfig("md5")
    with pytest.raises(HashConfigError, match="block_size"):
        HashConfig(block_size=0)
    with pytest.raises(ValueError, match="extra_keys"):
        hash_blocks(list(range(32)), HashConfig(), [None])


# -- the native paths: the same hashes as the specification, bit for bit ------------------------

_EDGES = [0, 1, 255, 256, 65535, 65536, 2**31 - 1, 2**31, -1, -(2**31), -(2**31) - 1, 2**63 - 1, -(2**63),
          2**63, 2**64, -(2**63) - 1]


@given(st.lists(st.one_of(st.integers(0, 200_000), st.sampled_from(_EDGES)), max_size=300),
       st.sampled_from([1, 2, 3, 16, 64]), st.booleans())
@settings(max_examples=300, deadline=None)
def test_hash_blocks_natively_is_the_specification(tokens: list[int], block_size: int, chained: bool) -> None:
    """Property: ``hash_blocks`` (native for sha256 on lists and tuples of plain ints) gives
    the wire forms of ``hash_block_digests`` (pickle + hashlib), whatever the ints' sizes (an
    int beyond 64 bits takes the Python path), from NONE_HASH or from a parent."""
    cfg = HashConfig(HashAlgo.SHA256, block_size)
    parent = hash_block_digests([7] * block_size, cfg)[0] if chained else None
    want = [to_wire(d) for d in hash_block_digests(tokens, cfg, parent=parent)]
    assert hash_blocks(tokens, cfg, parent=parent) == want
    assert hash_blocks(tuple(tokens), cfg, parent=parent) == want


def test_hash_blocks_falls_back_for_what_pickles_differently() -> None:
    """A bool or a numpy int pickles otherwise than the int it equals: the native path refuses
    them and the answer is the specification's."""
    cfg = HashConfig(HashAlgo.SHA256, 2)
    for odd in ([True, 3], [3, False], [np.int64(3), 4], [2**64, 1], [2**70, -(2**65)]):
        assert hash_blocks(odd, cfg) == [to_wire(d) for d in hash_block_digests(odd, cfg)]
    assert hash_blocks([True, 3], cfg) != hash_blocks([1, 3], cfg)


_WS = st.sampled_from(["", " ", "\n", "\t", "\r\n", "  "])


@st.composite
def _json_ids(draw) -> str:
    """JSON texts near the form ``hash_json_ids`` reads: arrays of ids with any whitespace,
    and now and then one number written another way (sign, fraction, exponent, leading zero,
    string, nesting) or a broken array."""
    ids = draw(st.lists(st.integers(0, 300), max_size=80))
    parts = [str(i) for i in ids]
    if parts and draw(st.booleans()):
        k = draw(st.integers(0, len(parts) - 1))
        parts[k] = draw(st.sampled_from(["-1", "-0", "1.0", "1e2", "01", "00", '"5"', "[5]", "true", "null",
                                         "12345678901234567890", "", "5,"]))
    text = draw(_WS) + "[" + draw(_WS) + ",".join(p + draw(_WS) for p in parts) + "]" + draw(_WS)
    return text if draw(st.integers(0, 9)) else text[: draw(st.integers(0, len(text)))]


@given(_json_ids(), st.sampled_from([1, 4, 16, 64]), st.sampled_from([1, 200, 301, 128_256]))
@settings(max_examples=500, deadline=None)
def test_hash_json_ids_reads_what_a_json_parser_reads(text: str, block_size: int, vocab: int) -> None:
    """Property: whenever ``hash_json_ids`` reads a JSON text, a JSON parser reads the same ids
    from it (strictly, as a list of ints), all below the vocabulary, and the hashes are
    ``hash_blocks`` of them; it declines every array of plain ids below the vocabulary only
    when one is not written as digits alone."""
    cfg = HashConfig(HashAlgo.SHA256, block_size)
    got = hash_json_ids(text.encode(), vocab, cfg)
    try:
        ids = msgspec.json.decode(text, type=list[int], strict=True)
    except (msgspec.DecodeError, msgspec.ValidationError):
        ids = None
    if got is not None:
        assert ids is not None and all(0 <= i < vocab for i in ids)
        assert got == (len(ids), hash_blocks(ids, cfg))
    elif ids is not None and all(0 <= i < vocab for i in ids):
        assert re.search(r"-0|01|00|e2|\.0", text), text  # msgspec reads -0, 01... as ints too


def test_hash_json_ids_declines_other_configurations() -> None:
    assert hash_json_ids(b"[1, 2]", 10, HashConfig(HashAlgo.SHA256_CBOR, 1)) is None
    assert hash_json_ids(b"[1, 2]", 10, HashConfig(HashAlgo.SHA256, 1)) == (2, hash_blocks([1, 2], HashConfig(
        HashAlgo.SHA256, 1)))
