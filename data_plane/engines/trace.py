"""Mooncake traces -> engine requests, with token ids synthesized from the trace's hash ids.

The Mooncake trace format (one JSON object per line)::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, ...]}

``timestamp`` is the arrival in ms; each hash id stands for one block of ``trace_block_size``
(512) prompt tokens, the last one possibly partial; equal hash ids mean equal content. We turn
hash id ``h`` into 512 deterministic token ids (token ``j`` of the block is a function of
``(h, j)``), so prompts whose hash-id lists share a prefix share exactly that token prefix, and
their chained engine block hashes match block for block. With engine block size 64 each trace
hash id is 8 engine blocks; a trace block that is a prefix of another (a shorter last block)
shares its first full engine blocks, like real text would.

Like Dynamo's loader, ``input_length`` is clamped to ``len(hash_ids) * trace_block_size``.
Dynamo fills a trace block with one repeated token (the hash id); the token values differ from
ours but the sharing structure, which is all prefix caching sees, is identical.

Hashing a 12k-token prompt costs about 0.3 ms; the conversation trace repeats most prefixes, so
:class:`MooncakeTrace` memoises digests per (parent digest, hash id, length) and the whole trace
hashes in a few seconds. Prompts are lazy sequences: 145M trace tokens never sit in memory.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import overload

import numpy as np

from control_plane.index.hashing import HashConfig, hash_block_digests
from data_plane.engines.errors import TraceFormatError
from data_plane.engines.request import DEFAULT_VOCAB_SIZE, EngineRequest, mix64
from schemas.types import RequestId

#: Tokens per Mooncake trace hash id.
MOONCAKE_BLOCK_SIZE = 512


@dataclass(frozen=True, slots=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_mooncake(path: str | Path, limit: int | None = None) -> list[TraceRecord]:
    """Parse a Mooncake jsonl trace (first ``limit`` lines when given)."""
    out: list[TraceRecord] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
                out.append(
                    TraceRecord(
                        timestamp_ms=float(raw.get("timestamp", 0.0)),
                        input_length=int(raw["input_length"]),
                        output_length=int(raw["output_length"]),
                        hash_ids=tuple(int(h) for h in raw["hash_ids"]),
                    )
                )
            except (ValueError, KeyError, TypeError) as e:
                raise TraceFormatError(f"{path}:{lineno}: {e}") from e
    return out


def trace_token(hash_id: int, position: int, vocab_size: int, trace_block_size: int) -> int:
    """Token ``position`` (0..trace_block_size-1) of the block that trace hash id ``hash_id``
    stands for."""
    return mix64(hash_id * trace_block_size + position) % vocab_size


def _mix64_np(x: np.ndarray) -> np.ndarray:
    """:func:`mix64` over a uint64 array (numpy wraps uint64 arithmetic modulo 2**64)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


class SyntheticPrompt(Sequence[int]):
    """The token ids of one trace prompt, computed on access (supports ``len`` and slicing)."""

    __slots__ = ("hash_ids", "length", "trace_block_size", "vocab_size")

    def __init__(
        self, hash_ids: Sequence[int], length: int, trace_block_size: int, vocab_size: int
    ) -> None:
        self.hash_ids = tuple(hash_ids)
        self.length = length
        self.trace_block_size = trace_block_size
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.length

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        tbs, vocab, ids = self.trace_block_size, self.vocab_size, self.hash_ids
        if isinstance(i, slice):
            start, stop, step = i.indices(self.length)
            pos = np.arange(start, stop, step, dtype=np.uint64)
            if pos.size == 0:
                return []
            t = np.uint64(tbs)
            keys = np.asarray(ids, dtype=np.uint64)[pos // t] * t + pos % t
            return (_mix64_np(keys) % np.uint64(vocab)).tolist()
        if i < 0:
            i += self.length
        if not 0 <= i < self.length:
            raise IndexError(i)
        return mix64(ids[i // tbs] * tbs + i % tbs) % vocab


class MooncakeTrace:
    """Turns trace records into :class:`EngineRequest` s for one engine hash configuration."""

    def __init__(
        self,
        hash_config: HashConfig,
        *,
        trace_block_size: int = MOONCAKE_BLOCK_SIZE,
        vocab_size: int = DEFAULT_VOCAB_SIZE,
    ) -> None:
        self.hash_config = hash_config
        self.trace_block_size = trace_block_size
        self.vocab_size = vocab_size
        # Memoising by trace block needs trace blocks made of whole engine blocks.
        self._memo_ok = trace_block_size % hash_config.block_size == 0
        self._memo: dict[tuple[bytes | None, int, int], list[bytes]] = {}

    def prompt(self, rec: TraceRecord) -> SyntheticPrompt:
        length = min(rec.input_length, len(rec.hash_ids) * self.trace_block_size)
        return SyntheticPrompt(rec.hash_ids, length, self.trace_block_size, self.vocab_size)

    def digests(self, rec: TraceRecord, prompt: SyntheticPrompt | None = None) -> list[bytes]:
        """Chained digests of the prompt's full engine blocks (== ``hash_block_digests``)."""
        prompt = prompt or self.prompt(rec)
        if not self._memo_ok:
            return hash_block_digests(prompt[:], self.hash_config)
        tbs = self.trace_block_size
        out: list[bytes] = []
        parent: bytes | None = None
        remaining = prompt.length
        for k, h in enumerate(rec.hash_ids):
            if remaining <= 0:
                break
            n = tbs if remaining >= tbs else remaining
            key = (parent, h, n)
            ds = self._memo.get(key)
            if ds is None:
                ds = hash_block_digests(prompt[k * tbs : k * tbs + n], self.hash_config, parent=parent)
                self._memo[key] = ds
            out.extend(ds)
            if not ds or n < tbs:
                break
            parent = ds[-1]
            remaining -= n
        return out

    def request(
        self, rec: TraceRecord, request_id: str, *, arrival_speedup: float = 1.0
    ) -> EngineRequest:
        prompt = self.prompt(rec)
        return EngineRequest(
            request_id=RequestId(request_id),
            prompt=prompt,
            max_tokens=max(rec.output_length, 1),
            arrival_ms=rec.timestamp_ms / arrival_speedup,
            prompt_digests=self.digests(rec, prompt),
        )

    def requests(
        self,
        records: Sequence[TraceRecord],
        *,
        arrival_speedup: float = 1.0,
        id_prefix: str = "mc",
    ) -> Iterator[EngineRequest]:
        """One request per record, ids ``<id_prefix>-<line index>``, in trace order."""
        for i, rec in enumerate(records):
            yield self.request(rec, f"{id_prefix}-{i}", arrival_speedup=arrival_speedup)


def load_mooncake_requests(
    path: str | Path,
    hash_config: HashConfig,
    *,
    limit: int | None = None,
    arrival_speedup: float = 1.0,
    trace_block_size: int = MOONCAKE_BLOCK_SIZE,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> list[EngineRequest]:
    """Read a Mooncake trace and build its requests (arrival = timestamp / speed-up)."""
    records = read_mooncake(path, limit)
    trace = MooncakeTrace(hash_config, trace_block_size=trace_block_size, vocab_size=vocab_size)
    return list(trace.requests(records, arrival_speedup=arrival_speedup))
