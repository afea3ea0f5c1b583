"""What a vLLM engine will report as cached for a prompt, from the router's predicted overlap.
Pure.

The router's index says how many of the prompt's full blocks a worker holds. vLLM's prefix
cache never serves the prompt's last token from cache (it must compute that token to sample
the first output: ``max_cache_hit_length = num_tokens - 1`` in ``KVCacheManager``), so a prompt
of exactly ``k`` full blocks hits at most ``k - 1`` of them, and the hit is always whole blocks.
``num_cached_tokens`` is then ``block_size * min(overlap, (prompt_len - 1) // block_size)``.
This is the comparison the vLLM tier and ``switchyard bench vllm`` score the index against.
"""

from __future__ import annotations


def expected_cached_tokens(overlap_blocks: int, prompt_len: int, block_size: int) -> int:
    """``num_cached_tokens`` vLLM reports for a prompt of ``prompt_len`` tokens when its device
    cache holds the first ``overlap_blocks`` blocks of it."""
    if prompt_len <= 0 or block_size <= 0:
        return 0
    return block_size * max(0, min(overlap_blocks, (prompt_len - 1) // block_size))
