"""Statistics of any Mooncake-format trace (``switchyard workload stats``).

The prefix figures treat a request's hash ids as a chain, the way a prefix cache sees them: its
block ``i`` is a hit only if the same first ``i + 1`` hash ids were in an earlier request.

* ``shared_block_frac``: of all the trace's blocks (hash-id positions), the fraction whose chain
  an earlier request already had.
* ``ideal_hit_rate(records, caches=N)``: the fraction of prompt tokens an infinite prefix cache
  could serve when requests go round robin over ``N`` such caches (``N = 1``: one cache that
  sees everything, the upper bound of any router). A request's hit is its longest chain of
  hash ids already in its cache, in 512-token blocks, capped at its input length.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from data_plane.engines.trace import MOONCAKE_BLOCK_SIZE, TraceRecord


def _pct(sorted_xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default) of an ascending list."""
    if not sorted_xs:
        return math.nan
    pos = (len(sorted_xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def ideal_hit_rate(records: Sequence[TraceRecord], caches: int = 1,
                   block_size: int = MOONCAKE_BLOCK_SIZE) -> float:
    """Prompt tokens served by ``caches`` infinite prefix caches, requests round robin over
    them in trace order, as a fraction of all prompt tokens."""
    if caches < 1:
        raise ValueError(f"caches must be >= 1, got {caches}")
    tries: list[dict[tuple[int, int], int]] = [{} for _ in range(caches)]
    hit = total = 0
    for i, r in enumerate(records):
        trie = tries[i % caches]
        node = -1
        matched = 0
        hitting = True
        for h in r.hash_ids:
            key = (node, h)
            nxt = trie.get(key)
            if nxt is None:
                hitting = False
                nxt = trie[key] = len(trie)
            elif hitting:
                matched += 1
            node = nxt
        total += r.input_length
        hit += min(matched * block_size, r.input_length)
    return hit / total if total else 0.0


def shared_block_fraction(records: Sequence[TraceRecord]) -> float:
    trie: dict[tuple[int, int], int] = {}
    seen = total = 0
    for r in records:
        node = -1
        for h in r.hash_ids:
            key = (node, h)
            nxt = trie.get(key)
            if nxt is None:
                nxt = trie[key] = len(trie)
            else:
                seen += 1
            node = nxt
            total += 1
    return seen / total if total else 0.0


@dataclass(frozen=True)
class TraceStats:
    requests: int
    duration_s: float
    rate: float
    isl_mean: float
    isl_p50: float
    isl_p90: float
    isl_p99: float
    isl_max: int
    osl_mean: float
    osl_p50: float
    osl_p90: float
    osl_p99: float
    osl_max: int
    blocks: int
    shared_block_frac: float
    #: Round-robin cache count -> ideal hit rate (1 = one cache seeing every request).
    ideal_hit: dict[int, float]
    sessions: int | None
    tenants: dict[str, int]

    def result_line(self) -> str:
        return (f"RESULT requests={self.requests} isl_p50={self.isl_p50:.0f} isl_p99={self.isl_p99:.0f} "
                f"osl_p50={self.osl_p50:.0f} shared_block_frac={self.shared_block_frac:.3f} "
                f"ideal_hit_1={self.ideal_hit[1]:.3f} ideal_hit_rr8={self.ideal_hit.get(8, math.nan):.3f}")

    def report(self) -> str:
        lines = [
            f"requests      {self.requests:,} over {self.duration_s:,.1f} s ({self.rate:.2f} req/s)"
            + (f", {self.sessions:,} sessions" if self.sessions is not None else ""),
            f"input tokens  mean {self.isl_mean:,.0f}  p50 {self.isl_p50:,.0f}  p90 {self.isl_p90:,.0f}  "
            f"p99 {self.isl_p99:,.0f}  max {self.isl_max:,}",
            f"output tokens mean {self.osl_mean:,.0f}  p50 {self.osl_p50:,.0f}  p90 {self.osl_p90:,.0f}  "
            f"p99 {self.osl_p99:,.0f}  max {self.osl_max:,}",
            f"blocks        {self.blocks:,} of {MOONCAKE_BLOCK_SIZE} tokens; {self.shared_block_frac:.3f} seen before",
            "ideal prefix hit rate (infinite caches): "
            + ", ".join(("one cache" if n == 1 else f"round robin over {n}") + f" {v:.3f}"
                        for n, v in sorted(self.ideal_hit.items())),
        ]
        if self.tenants:
            lines.append("tenants       " + ", ".join(f"{k} {v:,}" for k, v in sorted(self.tenants.items())))
        return "\n".join(lines)


def trace_stats(records: Sequence[TraceRecord], caches: Sequence[int] = (1, 4, 8)) -> TraceStats:
    if not records:
        raise ValueError("the trace has no requests")
    isl = sorted(r.input_length for r in records)
    osl = sorted(r.output_length for r in records)
    t0 = min(r.timestamp_ms for r in records)
    t1 = max(r.timestamp_ms for r in records)
    span = (t1 - t0) / 1000.0
    sessions = {r.session_id for r in records if r.session_id is not None}
    tenants: dict[str, int] = {}
    for r in records:
        if r.tenant is not None:
            tenants[r.tenant] = tenants.get(r.tenant, 0) + 1
    return TraceStats(
        requests=len(records), duration_s=span,
        # n arrivals span n - 1 gaps.
        rate=(len(records) - 1) / span if span > 0 else math.nan,
        isl_mean=sum(isl) / len(isl), isl_p50=_pct(isl, 50), isl_p90=_pct(isl, 90), isl_p99=_pct(isl, 99),
        isl_max=isl[-1],
        osl_mean=sum(osl) / len(osl), osl_p50=_pct(osl, 50), osl_p90=_pct(osl, 90), osl_p99=_pct(osl, 99),
        osl_max=osl[-1],
        blocks=sum(len(r.hash_ids) for r in records),
        shared_block_frac=shared_block_fraction(records),
        ideal_hit={n: ideal_hit_rate(records, n) for n in sorted(set(caches) | {1, 8})},
        sessions=len(sessions) if sessions else None,
        tenants=tenants,
    )
