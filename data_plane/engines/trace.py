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

The conversation trace repeats most prefixes, so :class:`MooncakeTrace` memoises digests per
(parent, hash id, length) and hashes each distinct trace block once (183k of 289k); the native
crate synthesizes and hashes a new run of trace blocks in one call (``blockhash.mooncake_chain``,
~0.3 us an engine block), so the whole trace hashes in well under a second. Prompts are lazy
sequences: 145M trace tokens never sit in memory.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import overload

import numpy as np

from data_plane.engines.blockhash import (
    DigestChain,
    block_digests,
    mooncake_chain,
    mooncake_hasher,
    split_digests,
    wire_hashes,
)
from data_plane.engines.errors import TraceFormatError
from data_plane.engines.gcpause import paused_gc
from data_plane.engines.request import DEFAULT_VOCAB_SIZE, EngineRequest, mix64, mix64_array
from common.hashing import HashConfig, hash_block_digests
from schemas.types import RequestId

try:  # the native crate is a project dependency; a stale build without it still works
    from switchyard_native import trace_tokens as _native_trace_tokens
except ImportError:  # pragma: no cover
    _native_trace_tokens = None

_MASK64 = (1 << 64) - 1

#: Tokens per Mooncake trace hash id.
MOONCAKE_BLOCK_SIZE = 512


@dataclass(frozen=True, slots=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    #: Optional fields of generated traces (``workloads``; Mooncake's own traces have none):
    #: the conversation or agent task the request belongs to, its turn in it (0 first), a
    #: scheduling priority (0 most urgent) and the tenant that sent it.
    session_id: str | None = None
    turn: int | None = None
    priority: int | None = None
    tenant: str | None = None


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
                session, turn, priority, tenant = (raw.get(k) for k in ("session_id", "turn", "priority", "tenant"))
                out.append(
                    TraceRecord(
                        timestamp_ms=float(raw.get("timestamp", 0.0)),
                        input_length=int(raw["input_length"]),
                        output_length=int(raw["output_length"]),
                        hash_ids=tuple(int(h) for h in raw["hash_ids"]),
                        session_id=None if session is None else str(session),
                        turn=None if turn is None else int(turn),
                        priority=None if priority is None else int(priority),
                        tenant=None if tenant is None else str(tenant),
                    )
                )
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise TraceFormatError(f"{path}:{lineno}: {e}") from e
    return out


def trace_token(hash_id: int, position: int, vocab_size: int, trace_block_size: int) -> int:
    """Token ``position`` (0..trace_block_size-1) of the block that trace hash id ``hash_id``
    stands for."""
    return mix64(hash_id * trace_block_size + position) % vocab_size


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
            if step == 1 and _native_trace_tokens is not None:
                # Trace block by trace block, natively (the engine reads short slices: the prompt
                # part of its first generated block; numpy's fixed cost dominates those).
                out: list[int] = []
                pos = start
                while pos < stop:
                    k, off = divmod(pos, tbs)
                    n = min(stop - pos, tbs - off)
                    out.extend(_native_trace_tokens((ids[k] * tbs) & _MASK64, off, off + n, vocab))
                    pos += n
                return out
            pos = np.arange(start, stop, step, dtype=np.uint64)
            if pos.size == 0:
                return []
            t = np.uint64(tbs)
            keys = np.asarray(ids, dtype=np.uint64)[pos // t] * t + pos % t
            return (mix64_array(keys) % np.uint64(vocab)).tolist()
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
        # One segment per distinct (parent segment, hash id, tokens used): the digests (and wire
        # hashes) of those tokens' full engine blocks. A segment's digests are a pure function
        # of its parent's last digest and its tokens, so keying by the parent *segment* (an int)
        # memoises exactly what keying by the parent digest did, without hashing 32 bytes.
        self._seg_ids: dict[tuple[int, int, int], int] = {}
        self._seg_digests: list[list[bytes]] = []
        self._seg_hashes: list[list[int]] = []
        # The same memo natively, a record per call (sha256 only; the Python one otherwise).
        self._native = mooncake_hasher(hash_config, trace_block_size, vocab_size) if self._memo_ok else None

    def prompt(self, rec: TraceRecord) -> SyntheticPrompt:
        length = min(rec.input_length, len(rec.hash_ids) * self.trace_block_size)
        return SyntheticPrompt(rec.hash_ids, length, self.trace_block_size, self.vocab_size)

    def digests(self, rec: TraceRecord, prompt: SyntheticPrompt | None = None) -> list[bytes]:
        """Chained digests of the prompt's full engine blocks (== ``hash_block_digests``)."""
        return list(self.digests_and_hashes(rec, prompt)[0])

    def digests_and_hashes(
        self, rec: TraceRecord, prompt: SyntheticPrompt | None = None
    ) -> tuple[Sequence[bytes], list[int]]:
        """:meth:`digests` and their wire forms (``to_wire`` of each). The digests are a
        :class:`~data_plane.engines.blockhash.DigestChain` on the native path (it reads like a
        list)."""
        prompt = prompt or self.prompt(rec)
        if not self._memo_ok:
            ds = hash_block_digests(prompt[:], self.hash_config)
            return ds, wire_hashes(ds)
        if self._native is not None:
            try:
                nat = self._native.digests(list(rec.hash_ids), prompt.length)
            except OverflowError:  # a hash id beyond 64 bits
                nat = None
            if nat is not None:
                return DigestChain(nat[0]), nat[1]
        tbs = self.trace_block_size
        bs = self.hash_config.block_size
        seg_ids = self._seg_ids
        out: list[bytes] = []
        out_h: list[int] = []
        parent = -1
        remaining = prompt.length
        hash_ids = rec.hash_ids
        k = 0
        # The known prefix: segments hashed before (the trace repeats most prefixes).
        for h in hash_ids:
            if remaining <= 0:
                return out, out_h
            n = tbs if remaining >= tbs else remaining
            seg = seg_ids.get((parent, h, n))
            if seg is None:
                break
            out.extend(self._seg_digests[seg])
            out_h.extend(self._seg_hashes[seg])
            if n < bs or n < tbs:  # no full block, or the partial last trace block
                return out, out_h
            parent = seg
            remaining -= n
            k += 1
        else:
            return out, out_h
        # The rest is new, and each new segment's parent is the one before: one chain.
        new: list[tuple[int, int]] = []  # (hash id, tokens used)
        for h in hash_ids[k:]:
            if remaining <= 0:
                break
            n = tbs if remaining >= tbs else remaining
            new.append((h, n))
            if n < tbs:
                break
            remaining -= n
        if new[-1][1] < bs:
            new.pop()  # a trace block shorter than one engine block adds no digest
        if not new:
            return out, out_h
        parent_digest = out[-1] if out else self.hash_config.none_hash
        nat = mooncake_chain(
            parent_digest, [h for h, _ in new], [n // bs for _, n in new], self.hash_config, tbs,
            self.vocab_size,
        )
        if nat is not None:
            all_d, all_h = split_digests(nat[0]), nat[1]
        else:
            start = k * tbs
            end = start + sum(n for _, n in new)
            all_d, all_h = block_digests(prompt[start:end], self.hash_config, parent=out[-1] if out else None)
        i = 0
        for h, n in new:
            j = i + n // bs
            ds, hs = all_d[i:j], all_h[i:j]
            seg = len(self._seg_digests)
            seg_ids[(parent, h, n)] = seg
            self._seg_digests.append(ds)
            self._seg_hashes.append(hs)
            out.extend(ds)
            out_h.extend(hs)
            parent = seg
            i = j
        return out, out_h

    def request(
        self, rec: TraceRecord, request_id: str, *, arrival_speedup: float = 1.0
    ) -> EngineRequest:
        prompt = self.prompt(rec)
        digests, hashes = self.digests_and_hashes(rec, prompt)
        return EngineRequest(
            request_id=RequestId(request_id),
            prompt=prompt,
            max_tokens=max(rec.output_length, 1),
            arrival_ms=rec.timestamp_ms / arrival_speedup,
            prompt_digests=digests,
            prompt_hashes=hashes,
        )

    def requests(
        self,
        records: Sequence[TraceRecord],
        *,
        arrival_speedup: float = 1.0,
        id_prefix: str = "mc",
    ) -> Iterator[EngineRequest]:
        """One request per record, ids ``<id_prefix>-<line index>``, in trace order."""
        # Built a batch at a time with the cyclic GC paused (see gcpause: pausing it around
        # each request would not spare the collections, which are what costs).
        for lo in range(0, len(records), self._BATCH):
            with paused_gc():
                batch = [
                    self.request(rec, f"{id_prefix}-{i}", arrival_speedup=arrival_speedup)
                    for i, rec in enumerate(records[lo : lo + self._BATCH], lo)
                ]
            yield from batch

    #: Requests built per GC pause by :meth:`requests`.
    _BATCH = 2048


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
