"""The hash tokenizer's specification (``common.tokenizer.HashTokenizer``, native in
``native/src/tokenize.rs``): the differential oracle of ``tests/unit/test_tokenizer_native.py``
and ``tests/unit/test_router_prompt.py``."""

from __future__ import annotations

import re

import xxhash

from common.tokenizer import HashTokenizer

_PIECES = re.compile(r"\w+|[^\w\s]", re.UNICODE)


def hash_tokenize(text: str, vocab_size: int = 32_000) -> list[int]:
    """Each word (``\\w+``) and each other non-space character is one piece, and a piece's id is
    ``RESERVED + xxh32(its UTF-8) % (vocab_size - RESERVED)``. A lone surrogate cannot be
    encoded (UnicodeEncodeError)."""
    base = HashTokenizer.RESERVED
    span = vocab_size - base
    return [base + xxhash.xxh32_intdigest(p.encode()) % span for p in _PIECES.findall(text)]
