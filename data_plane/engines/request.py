"""What the engine is asked to do (``EngineRequest``) and what it tracks per request. Pure.

Output tokens are deterministic pseudo-tokens: a function of the request id and the position,
so two runs (simulated or real-time) of the same input produce the same tokens, the same
chained block hashes for generated blocks, and therefore the same KV events.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np
import xxhash

from data_plane.engines.block_pool import KVCacheBlock
from data_plane.engines.blockhash import DigestChain
from data_plane.engines.errors import RequestRejected
from schemas.types import BlockHash, RequestId, RequestPhase

try:  # the native crate is a project dependency; a stale build without it still works
    from switchyard_native import pseudo_tokens as _native_pseudo_tokens
except ImportError:  # pragma: no cover
    _native_pseudo_tokens = None

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15

#: Llama 3's vocabulary size: pseudo-tokens stay valid ids for the tokenizer the profiles model.
DEFAULT_VOCAB_SIZE = 128_256


def mix64(x: int) -> int:
    """SplitMix64 finaliser: a cheap, well-spread bijection on 64-bit ints."""
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def request_seed(request_id: str) -> int:
    """Per-request seed of the pseudo-token stream (stable across processes and runs)."""
    return xxhash.xxh64_intdigest(request_id.encode(), seed=0x5157)


def pseudo_token(seed: int, index: int, vocab_size: int = DEFAULT_VOCAB_SIZE) -> int:
    """Output token number ``index`` (0 = first generated token) of the stream ``seed``."""
    return mix64(seed ^ ((index * _GOLDEN) & _MASK64)) % vocab_size


def mix64_array(x: np.ndarray) -> np.ndarray:
    """:func:`mix64` over a uint64 array (numpy wraps uint64 arithmetic modulo 2**64)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(_GOLDEN)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def pseudo_tokens(seed: int, start: int, stop: int, vocab_size: int = DEFAULT_VOCAB_SIZE) -> list[int]:
    """``[pseudo_token(seed, i, vocab_size) for i in range(start, stop)]``, natively when the
    crate has it (the engine hashes every block it generates, 64 tokens at a time)."""
    if stop - start <= 0:
        return []
    if _native_pseudo_tokens is not None and 0 <= seed <= _MASK64 and start >= 0:
        return _native_pseudo_tokens(seed, start, stop, vocab_size)
    return [pseudo_token(seed, i, vocab_size) for i in range(start, stop)]


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One generation request as the engine receives it.

    ``prompt`` may be any sequence supporting ``len`` and slicing (a lazy one for trace replay).
    ``prompt_digests``, when given, must be the full chained digests of the prompt's full blocks
    under the engine's :class:`HashConfig` (a trace loader computes them once per shared prefix);
    the engine trusts them instead of hashing the prompt again, exactly like vLLM's ``Request``
    carrying its ``block_hashes``.

    ``output_prefix`` is for decode workers: tokens the prefill worker already produced (its
    first token). The KV of ``prompt`` counts as transferred; the prefix tokens are fed next.
    ``arrival_ms`` is the virtual time the request reaches the engine (drivers use it; the core
    ignores it).

    ``prompt_hashes``, when given with ``prompt_digests``, are their wire forms (``to_wire`` of
    each digest): a trace loader that memoises digests memoises these too, instead of every
    request converting every digest again.

    ``phase`` overrides, for this request only, what the engine's role would do with it: a worker
    registered as ``decode`` must still recompute a prompt whose transfer failed
    (``AGGREGATED``), and one registered as ``prefill`` may serve a plain request whole. None keeps
    the role's behaviour (prefill role: ``PREFILL``, decode role: ``DECODE``, else
    ``AGGREGATED``).
    """

    request_id: RequestId
    prompt: Sequence[int]
    max_tokens: int
    arrival_ms: float | None = None
    prompt_digests: Sequence[bytes] | None = None
    output_prefix: tuple[int, ...] = ()
    phase: RequestPhase | None = None
    prompt_hashes: Sequence[BlockHash] | None = None
    #: Where the request goes among those a real-time driver takes at one step boundary (lower
    #: first; the router's decision time): the hop from the router varies more than the gaps
    #: between a burst's requests, and the router predicts each one's wait behind those it sent
    #: before. None: arrival order. The core ignores it.
    router_order: float | None = None

    def __post_init__(self) -> None:
        if len(self.prompt) == 0:
            raise RequestRejected(f"request {self.request_id}: empty prompt")
        if self.max_tokens < 1:
            raise RequestRejected(f"request {self.request_id}: max_tokens must be >= 1")
        if len(self.output_prefix) >= self.max_tokens:
            raise RequestRejected(
                f"request {self.request_id}: output_prefix already has "
                f"{len(self.output_prefix)} of max_tokens={self.max_tokens} tokens"
            )
        if self.prompt_hashes is not None and (
            self.prompt_digests is None or len(self.prompt_hashes) != len(self.prompt_digests)
        ):
            raise RequestRejected(
                f"request {self.request_id}: prompt_hashes must come with prompt_digests, one each"
            )


class Status(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    #: Admitted, its blocks allocated, waiting for its prefix to load from a tier below.
    LOADING = "loading"
    #: Prefill role: prompt KV computed and first token emitted; blocks held for the transfer.
    HELD = "held"
    FINISHED = "finished"


class RequestState:
    """The engine's mutable view of one request (vLLM's ``Request``). Internal to the engine."""

    __slots__ = (
        "request",
        "request_id",
        "prompt",
        "prompt_len",
        "max_tokens",
        "output_prefix",
        "num_output",
        "vocab_size",
        "num_computed_tokens",
        "blocks",
        "digests",
        "hashes",
        "num_cached_blocks",
        "status",
        "cached_tokens",
        "onboarded_tokens",
        "num_preemptions",
        "seed",
        "transferred",
        "hold",
        "order",
    )

    def __init__(self, request: EngineRequest, order: int, vocab_size: int = DEFAULT_VOCAB_SIZE) -> None:
        self.request = request
        self.request_id = request.request_id
        self.prompt = request.prompt
        self.prompt_len = len(request.prompt)
        self.max_tokens = request.max_tokens
        #: Output tokens so far: ``output_prefix`` then pseudo-tokens. Token ``i`` (past the
        #: prefix) is ``pseudo_token(seed, i, vocab_size)``, a pure function, so the engine keeps
        #: only the count and computes token ids when something reads them (:meth:`tokens`).
        self.output_prefix: tuple[int, ...] = tuple(request.output_prefix)
        self.num_output = len(self.output_prefix)
        self.vocab_size = vocab_size
        self.num_computed_tokens = 0
        self.blocks: list[KVCacheBlock] = []
        #: Full digests of this sequence's full blocks (prompt first, then generated ones), and
        #: their wire forms. Extended lazily, only as far as a lookup or a cache insert needs.
        pd = request.prompt_digests
        # A DigestChain (trace replay) is copied without cutting its bytes into digests.
        self.digests: list[bytes] | DigestChain = (
            pd.copy() if type(pd) is DigestChain else list(pd or ())
        )
        self.hashes: list[BlockHash] = (
            list(request.prompt_hashes)
            if request.prompt_hashes is not None
            else [BlockHash(int.from_bytes(d[-8:], "big")) for d in self.digests]
        )
        #: How many of ``blocks`` are registered in the pool's cache map.
        self.num_cached_blocks = 0
        self.status = Status.WAITING
        #: Prompt tokens served from the prefix cache at first admission (-1: not admitted yet).
        self.cached_tokens = -1
        #: Of ``cached_tokens``, those loaded from a tier below the device at that admission.
        self.onboarded_tokens = 0
        self.num_preemptions = 0
        self.seed = request_seed(request.request_id)
        #: Decode role: the prompt's KV arrived by transfer (no prefill compute).
        self.transferred = False
        #: Prefill phase: stop after the first token and hold the blocks for a transfer.
        self.hold = False
        #: Arrival order in this engine (stable tie-breaker).
        self.order = order

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.num_output

    @property
    def output(self) -> list[int]:
        """The output token ids so far."""
        return self.output_tokens(0, self.num_output)

    def output_tokens(self, start: int, end: int) -> list[int]:
        """Output token ids ``[start, end)`` (clipped to the tokens generated so far)."""
        end = min(end, self.num_output)
        if start >= end:
            return []
        pre = self.output_prefix
        np_ = len(pre)
        if end <= np_:
            return list(pre[start:end])
        head = list(pre[start:]) if start < np_ else []
        return head + pseudo_tokens(self.seed, max(start, np_), end, self.vocab_size)

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids ``[start, end)`` of prompt + output."""
        pl = self.prompt_len
        if end <= pl:
            return list(self.prompt[start:end])
        if start >= pl:
            return self.output_tokens(start - pl, end - pl)
        return list(self.prompt[start:pl]) + self.output_tokens(0, end - pl)

    def __repr__(self) -> str:
        return (
            f"RequestState({self.request_id!r}, {self.status.value}, computed="
            f"{self.num_computed_tokens}/{self.num_tokens}, blocks={len(self.blocks)})"
        )
