"""What no router and no cache could beat: every request alone on an idle worker, with one
infinite cache shared by every worker (``bench tiers``' lower bound, and ``bench routing``'s
``bound_p99_gain``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from control_plane.simulation import block_hashes
from data_plane.engines import EngineRequest, default_hash_config
from data_plane.engines.blockhash import block_digests
from data_plane.engines.profiles import HardwareProfile
from data_plane.engines.records import percentile
from data_plane.engines.tiers import prefill_ms


def ideal_uncached(requests: Sequence[EngineRequest], block_size: int) -> list[int]:
    """Per request (in arrival order), the prompt tokens one infinite cache shared by every
    worker could not serve: its blocks after the longest prefix that any earlier arrival
    already had (chained hashes: a prefix match), never its last token. No cache can hit
    more: a block is cached only once some request has computed it."""
    seen: set = set()
    out = []
    hash_config = default_hash_config(block_size)
    for r in sorted(requests, key=lambda r: r.arrival_ms or 0.0):
        # The trace loader's hashes, else the engine's own chain over the prompt.
        hashes = block_hashes(r) or block_digests(list(r.prompt), hash_config)[1]
        n = len(r.prompt)
        hit = 0
        for h in hashes[: (n - 1) // block_size]:
            if h not in seen:
                break
            hit += 1
        seen.update(hashes)
        out.append(n - hit * block_size)
    return out


def alone_ms(timing: Any, uncached: Sequence[int], chunk: int) -> np.ndarray:
    """Each request's TTFT alone on an idle worker: its uncached tokens in the engine's
    chunks, nothing queued before it, no other request's tokens in its steps."""
    return np.array([prefill_ms(timing, 0, u, chunk) for u in uncached])


def bound_ttft_ms(requests: Sequence[EngineRequest], profile: HardwareProfile, q: float) -> float:
    """The ``q`` percentile of TTFT with every request alone on an idle worker and one infinite
    cache shared by all workers, in the profile's chunks."""
    ideal = ideal_uncached(requests, profile.block_size)
    return percentile(alone_ms(profile.timing, ideal, profile.max_num_batched_tokens), q)
