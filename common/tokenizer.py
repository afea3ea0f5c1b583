"""Tokenizers shared by the router and the workers.

The router tokenizes once and sends workers token ids, so both sides hash the same blocks.

* :class:`HashTokenizer` (default, shipped): deterministic, no data files. Words and
  punctuation map to ids by xxh32 into a fixed vocabulary; decoding renders ids as ``" t<id>"``.
  It is what the simulated engine speaks; it is not a language model tokenizer. It runs
  natively (``native/src/tokenize.rs``; a third of the router's CPU for a 4K-word prompt in
  Python); :meth:`HashTokenizer.encode_reference` is its specification, the property tests'
  oracle and the path of the vLLM environment (``scripts/vllm-env.sh`` installs this project
  into ``.venv-vllm`` without the native crate, where importing it fails with
  ``ModuleNotFoundError: No module named 'switchyard_native'``).
* :class:`HFTokenizer`: a real Hugging Face ``tokenizer.json`` from a local file (needs the
  optional ``tokenizers`` package); nothing is downloaded.

Chat messages are flattened by one fixed template (``<|role|>\\ncontent\\n`` per message, then
``<|assistant|>\\n``), so a conversation's earlier turns form a stable token prefix: what makes
multi-turn prefix caching work.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Protocol

import xxhash

from common.hashing import HashAlgo, HashConfig
from schemas.types import BlockHash

try:  # the native crate is a project dependency; a build without it tokenizes in Python
    from switchyard_native import hash_tokenize as _native_tokenize
    from switchyard_native import hash_tokenize_json as _native_tokenize_json
except ImportError:  # pragma: no cover - exercised only without the native build
    _native_tokenize = None
    _native_tokenize_json = None

_PIECES = re.compile(r"\w+|[^\w\s]", re.UNICODE)


class Tokenizer(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class HashTokenizer:
    """Deterministic word-level tokenizer with a fixed vocabulary size."""

    #: ids below this are reserved for role markers and specials.
    RESERVED = 256

    def __init__(self, vocab_size: int = 32_000) -> None:
        if vocab_size <= self.RESERVED:
            raise ValueError("vocab_size must exceed the reserved range")
        self.vocab_size = vocab_size
        self.name = f"hash-{vocab_size}"
        self._span = vocab_size - self.RESERVED

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``: :meth:`encode_reference`'s, natively when the extension is built."""
        if _native_tokenize is not None:
            return _native_tokenize(text, self.vocab_size)
        return self.encode_reference(text)

    def encode_reference(self, text: str) -> list[int]:
        """The specification: each word (``\\w+``) and each other non-space character is one
        piece, and a piece's id is ``RESERVED + xxh32(its UTF-8) % (vocab_size - RESERVED)``.
        A lone surrogate cannot be encoded (UnicodeEncodeError), natively too."""
        span, base = self._span, self.RESERVED
        return [base + xxhash.xxh32_intdigest(p.encode()) % span for p in _PIECES.findall(text)]

    def encode_hashed(self, text: str, config: HashConfig) -> tuple[bytes, int, list[BlockHash]] | None:
        """``text`` tokenized and hashed in one native call, no Python int per id: (the ids as
        the JSON array ``msgspec.json.encode`` writes, how many, ``hash_blocks(ids, config)``).
        None when ``config`` has no native chain (sha256 only) or the extension is not built:
        the caller then runs :meth:`encode` and hashes the ids itself."""
        if _native_tokenize_json is None or config.algo is not HashAlgo.SHA256:
            return None
        return _native_tokenize_json(text, self.vocab_size, config.none_hash, config.block_size)

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(f" t{i}" for i in ids)


class HFTokenizer:
    """A Hugging Face fast tokenizer loaded from a local ``tokenizer.json``."""

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer as _T
        except ImportError as e:  # optional dependency
            raise RuntimeError("HFTokenizer needs the `tokenizers` package: uv add tokenizers") from e
        self._tok = _T.from_file(path)
        self.name = f"hf:{path}"
        #: Token ids the model knows (the router refuses prompts with others).
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))


ROLE_IDS = {"system": 1, "user": 2, "assistant": 3, "tool": 4, "developer": 5}
ASSISTANT_START = 3
NEWLINE = 10


def chat_tokens(tokenizer: Tokenizer, messages: Sequence[dict]) -> list[int]:
    """Token ids for a chat, by the fixed template in the module docstring."""
    out: list[int] = []
    for m in messages:
        out.append(ROLE_IDS.get(m.get("role", "user"), 2))
        out.append(NEWLINE)
        content = m.get("content") or ""
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        out.extend(tokenizer.encode(content))
        out.append(NEWLINE)
    out.extend((ASSISTANT_START, NEWLINE))
    return out


def build_tokenizer(spec: str | None) -> Tokenizer:
    """``None``/``"hash"`` -> HashTokenizer; ``"hf:/path/tokenizer.json"`` -> HFTokenizer."""
    if not spec or spec == "hash":
        return HashTokenizer()
    if spec.startswith("hf:"):
        return HFTokenizer(spec[3:])
    raise ValueError(f"unknown tokenizer {spec!r}: use 'hash' or 'hf:/path/to/tokenizer.json'")
