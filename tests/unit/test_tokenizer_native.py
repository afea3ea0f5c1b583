"""The native hash tokenizer (native/src/tokenize.rs) gives the ids of its Python specification
(``HashTokenizer.encode_reference``, common/tokenizer.py) byte for byte: on every code point, on
random text (unicode included), and through the one call that tokenizes and hashes a prompt."""

from __future__ import annotations


import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import switchyard_native as native
from common.hashing import HashAlgo, HashConfig, hash_blocks
from common.tokenizer import HashTokenizer

TOK = HashTokenizer()
CONFIG = HashConfig(HashAlgo.SHA256, 16)


def test_every_code_point_splits_as_python_re_does():
    """Each code point between two word characters, then a space: a word character joins the
    word, anything else (neither word nor space) is a piece of its own, a space splits. So a
    code point whose class differs from CPython's changes the ids."""
    text = "".join(f"a{chr(c)} " for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF)
    assert TOK.encode(text) == TOK.encode_reference(text)


def test_the_table_is_this_interpreters_unicode():
    import unicodedata

    assert native.TOKENIZER_UNICODE_VERSION == unicodedata.unidata_version, (
        "re-run native/tools/gen_tokenize_table.py with this interpreter")


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=300),
       st.integers(min_value=257, max_value=2**32 - 1))
def test_random_text_same_ids(text, vocab):
    tok = HashTokenizer(vocab)
    assert tok.encode(text) == tok.encode_reference(text)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["w1", "héllo", "中文", "٣٤", " ", "\t", "\n", "!", ",", "_", "x" * 40,
                                 "\u3000", "é", "🙂", "ǅ", "²", "\u00a0"]), max_size=200))
def test_mixed_pieces_same_ids_and_hashes(parts):
    text = "".join(parts)
    ids = TOK.encode_reference(text)
    assert TOK.encode(text) == ids
    raw, n, hashes = TOK.encode_hashed(text, CONFIG)
    assert raw == msgspec.json.encode(ids)
    assert n == len(ids)
    assert hashes == hash_blocks(ids, CONFIG)


def test_long_prompt_released_path_same_ids():
    """Above 64 KB the native call releases the GIL; same ids."""
    text = " ".join(f"w{i % 32000}" for i in range(40_000))
    assert len(text.encode()) > 64 * 1024
    assert TOK.encode(text) == TOK.encode_reference(text)
    raw, n, hashes = TOK.encode_hashed(text, CONFIG)
    assert n == 40_000 and hashes == hash_blocks(TOK.encode_reference(text), CONFIG)


def test_lone_surrogate_refused_like_the_reference():
    text = "a \ud800 b"
    with pytest.raises(UnicodeEncodeError):
        TOK.encode_reference(text)
    with pytest.raises(UnicodeEncodeError):
        TOK.encode(text)


def test_vocabulary_must_exceed_the_reserved_range():
    with pytest.raises(ValueError, match="reserved range"):
        native.hash_tokenize("a", 256)


def test_no_hashed_form_for_other_algorithms():
    """Only vLLM's sha256 has a native chain; the router then hashes the ids the general way."""
    cfg = HashConfig(HashAlgo.SHA256_CBOR, 16)
    assert TOK.encode_hashed("a b c", cfg) is None
