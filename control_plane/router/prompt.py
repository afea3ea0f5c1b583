"""A prompt of token ids kept as the bytes the client sent, read once, natively. Pure.

A completions request usually sends its prompt as token ids: 4K of them are ~20 KB of JSON.
Decoding them into 4K Python ints, checking each against the vocabulary, hashing them block by
block in Python and encoding them again into the worker's body took more of the router's CPU
than anything else it does in process for such a request (profiled). A :class:`PromptIds`
keeps the JSON array's bytes as they came and reads them in one native call
(:func:`common.hashing.hash_json_ids`): how many ids, that each is below the vocabulary, and
the wire hashes of the full blocks. The worker's body carries the same bytes
(:data:`encode_json`). It reads as the list of ints it stands for (made on first read), so code
that iterates a prompt's tokens works unchanged.

Only the narrow form is read this way (:func:`read_prompt_ids`): a JSON array of integers
written as digits alone, each below the vocabulary. Anything else (text, strings, another
spelling of a number, an id out of range) is decoded the general way, which words every error,
so a client sees the same answer whichever path read its prompt.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

import msgspec

from common.hashing import HashConfig, hash_blocks, hash_json_ids
from common.tokenizer import Tokenizer
from schemas.types import BlockHash


class PromptIds(Sequence[int]):
    """Token ids as the JSON array a client sent (``raw``), with what reading it found: how
    many, the bound every id is below (``below``), and the wire hashes of the full blocks
    under ``hash_config``. Immutable."""

    __slots__ = ("raw", "below", "hash_config", "hashes", "_n", "_ids")

    def __init__(self, raw: bytes, n: int, below: int, hash_config: HashConfig, hashes: list[BlockHash]) -> None:
        self.raw = raw
        self.below = below
        self.hash_config = hash_config
        self.hashes = hashes
        self._n = n
        self._ids: list[int] | None = None

    def ids(self) -> list[int]:
        """The ids as a list (decoded on first use, then kept)."""
        if self._ids is None:
            self._ids = msgspec.json.decode(self.raw, type=list[int])
        return self._ids

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        return self.ids()[i]

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PromptIds):
            return self.ids() == other.ids()
        if isinstance(other, list):
            return self.ids() == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment] - equal to a list, which is unhashable

    def __repr__(self) -> str:
        return f"PromptIds({self._n} ids)"


def read_prompt_ids(raw: bytes | msgspec.Raw, vocab_size: int, config: HashConfig) -> PromptIds | None:
    """``raw`` (a JSON value) as :class:`PromptIds` when it is an array of plain ids below
    ``vocab_size`` and ``config`` has a native path; else None (decode it the general way)."""
    data = bytes(raw)
    got = hash_json_ids(data, vocab_size, config)
    if got is None:
        return None
    n, hashes = got
    return PromptIds(data, n, vocab_size, config, hashes)


def tokenize_prompt(tokenizer: Tokenizer, text: str, config: HashConfig) -> Sequence[int]:
    """A string prompt's ids. With the hash tokenizer and a native chain for ``config``, one
    native call tokenizes and hashes it into a :class:`PromptIds` (the ids as the JSON array
    the worker's body carries, and the block hashes: no Python int per id); otherwise
    ``tokenizer.encode(text)``, hashed later by :func:`block_hashes`. The same ids either way."""
    encode_hashed = getattr(tokenizer, "encode_hashed", None)
    got = encode_hashed(text, config) if encode_hashed is not None else None
    if got is None:
        return tokenizer.encode(text)
    raw, n, hashes = got
    return PromptIds(raw, n, tokenizer.vocab_size, config, hashes)  # type: ignore[attr-defined]


def block_hashes(tokens: Sequence[int], config: HashConfig) -> list[BlockHash]:
    """:func:`common.hashing.hash_blocks` of ``tokens``: the ones reading found, for a
    :class:`PromptIds` read under ``config``."""
    if isinstance(tokens, PromptIds) and tokens.hash_config == config:
        return tokens.hashes
    return hash_blocks(tokens, config)


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, PromptIds):
        return msgspec.Raw(obj.raw)  # the client's bytes: a JSON array of ints, as it came
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


#: JSON bytes of a value whose prompt may be a :class:`PromptIds` (written as its own bytes).
encode_json = msgspec.json.Encoder(enc_hook=_enc_hook).encode
