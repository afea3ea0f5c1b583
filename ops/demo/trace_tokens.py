"""Mooncake trace records as token-id prompts for a small real model. Pure.

Each trace ``hash_id`` (one 512-token block in the trace) becomes one fixed run of
``block_size`` token ids seeded by the id, so requests that share hash ids share tokens,
block-aligned, and a real engine's prefix cache sees exactly the trace's sharing. Lengths are
scaled by ``block_size / 512`` and capped at ``max_prompt`` (the tiny model's context).
"""

from __future__ import annotations

import random

from data_plane.engines.trace import TraceRecord

#: Tokens per hash id in the Mooncake traces.
TRACE_BLOCK = 512


def block_tokens(hash_id: int, block_size: int, vocab: int = 1000) -> list[int]:
    """The fixed token run of one hash id (ids 3..vocab-1: clear of BOS/EOS)."""
    rng = random.Random(hash_id * 1_000_003 + 17)
    return [rng.randrange(3, vocab) for _ in range(block_size)]


def prompt_of(rec: TraceRecord, block_size: int, max_prompt: int, vocab: int = 1000) -> list[int]:
    """``rec``'s prompt: its hash ids' token runs, cut to the scaled input length."""
    n = min(max_prompt, max(1, -(-rec.input_length * block_size // TRACE_BLOCK)))
    toks: list[int] = []
    for h in rec.hash_ids:
        toks.extend(block_tokens(h, block_size, vocab))
        if len(toks) >= n:
            break
    tail = 0
    while len(toks) < n:  # an input longer than its hash ids: a tail private to this record
        tail += 1
        toks.extend(block_tokens(-(hash(rec.hash_ids) % 1_000_000) * 64 - tail, block_size, vocab))
    return toks[:n]
