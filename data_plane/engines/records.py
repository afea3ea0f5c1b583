"""What a simulation reports: one record per request and the run's aggregates.

The driver (:class:`~data_plane.engines.cluster.Cluster`) fills the records as the virtual clock
runs; :meth:`SimulationResult.summary` aggregates them the way Dynamo's replay report does.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from schemas.types import RequestId, WorkerId


def percentile(values: Any, q: float) -> float:
    """The percentile of every simulation figure, ours and the anchor's: linear interpolation
    between the closest ranks (numpy's default), nan when there is nothing.

    Dynamo's replay (``ai-dynamo-runtime`` 1.6.1) reports the *nearest* rank instead
    (``round(q * (n - 1))``). On a case of a few hundred requests with a heavy tail the two
    differ by far more than any router does (long-context:2, 257 requests: p99 2,528 vs 2,123
    ms for the same TTFTs), so the benches recompute the anchor's percentiles from its
    per-request records with this one (``benchmarks/routing_bench.py``)."""
    a = np.asarray(values, dtype=np.float64)
    return float(np.percentile(a, q)) if a.size else math.nan


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request (times in virtual ms from the clock origin)."""

    request_id: RequestId
    #: The worker of its last placed phase (None until placed).
    worker_id: WorkerId | None
    arrival_ms: float
    prompt_tokens: int
    max_tokens: int
    #: Prompt tokens served from the prefix cache at its first admission (0 until admitted);
    #: disaggregated: on the prefill worker.
    cached_tokens: int = 0
    #: Delivery time of every output token, in order (disaggregated: the prefill worker's first
    #: token, then the decode worker's).
    token_times: array = field(default_factory=lambda: array("d"))
    #: Through its last phase (its last token came from an aggregated or decode worker, or the
    #: hooks said it has no decode phase).
    finished: bool = False
    #: Disaggregated: the prefill worker and the instant it handed the request off.
    prefill_worker_id: WorkerId | None = None
    handoff_ms: float | None = None
    #: Of ``cached_tokens``, those loaded from a tier below the device (``Cluster(tiers=...)``).
    onboarded_tokens: int = 0
    #: Start of the step that first admitted it (its wait in the queue ends there; None until
    #: admitted). Disaggregated: on the prefill worker.
    admitted_ms: float | None = None
    #: Steps its worker ran from that admission through its first token (stalls included).
    prefill_steps: int = 0
    #: From its admission, ms until its onboarded prefix was in (0: nothing loaded).
    onboard_ms: float = 0.0

    @property
    def output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def first_token_ms(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def ttft_ms(self) -> float | None:
        return self.token_times[0] - self.arrival_ms if self.token_times else None

    @property
    def e2e_ms(self) -> float | None:
        return self.token_times[-1] - self.arrival_ms if self.token_times else None

    @property
    def itl_ms(self) -> list[float]:
        t = self.token_times
        return [t[i + 1] - t[i] for i in range(len(t) - 1)]


@dataclass(slots=True)
class SimulationResult:
    requests: list[RequestRecord]
    #: Last token delivery minus first arrival.
    duration_ms: float
    steps: int
    preemptions: int
    profile: str
    num_workers: int

    def summary(self) -> dict[str, Any]:
        """Aggregates comparable with Dynamo's replay report.

        ``itl_p50_ms`` is over all inter-token intervals of all requests (Dynamo's
        ``median_itl_ms``); ``tpot_p50_ms`` over requests of (e2e - ttft) / (tokens - 1).
        ``prefix_reuse_ratio`` = cached prompt tokens / prompt tokens (Dynamo's
        ``prefix_cache_reused_ratio``).
        """
        done = [r for r in self.requests if r.token_times]
        ttft = np.array([r.ttft_ms for r in done])
        e2e = np.array([r.e2e_ms for r in done])
        itl = (
            np.concatenate([np.diff(np.frombuffer(r.token_times, dtype=np.float64)) for r in done])
            if done
            else np.array([])
        )
        tpot = np.array(
            [(r.e2e_ms - r.ttft_ms) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
        )
        out_tokens = sum(r.output_tokens for r in done)
        prompt = sum(r.prompt_tokens for r in self.requests)
        cached = sum(r.cached_tokens for r in self.requests)

        pct = percentile
        return {
            "profile": self.profile,
            "num_workers": self.num_workers,
            "requests": len(self.requests),
            "completed": sum(1 for r in self.requests if r.finished),
            "duration_ms": self.duration_ms,
            "steps": self.steps,
            "preemptions": self.preemptions,
            "output_tokens": out_tokens,
            "output_tok_s": out_tokens / (self.duration_ms / 1e3) if self.duration_ms > 0 else math.nan,
            "ttft_mean_ms": float(ttft.mean()) if ttft.size else math.nan,
            "ttft_p50_ms": pct(ttft, 50),
            "ttft_p90_ms": pct(ttft, 90),
            "ttft_p99_ms": pct(ttft, 99),
            "itl_mean_ms": float(itl.mean()) if itl.size else math.nan,
            "itl_p50_ms": pct(itl, 50),
            "itl_p99_ms": pct(itl, 99),
            "tpot_p50_ms": pct(tpot, 50),
            "e2e_p50_ms": pct(e2e, 50),
            "e2e_p99_ms": pct(e2e, 99),
            "prefix_reuse_ratio": cached / prompt if prompt else 0.0,
        }

