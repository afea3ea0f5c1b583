"""Discrete-event simulation of one or more engine workers on a virtual clock.

``simulate(requests, "mocker", num_workers=4)`` replays requests (each with ``arrival_ms``)
through ``EngineCore`` s and returns per-request TTFT, inter-token latencies, end-to-end
latency, token counts and prefix-cache hits, plus the usual aggregates.

Clock rules (shared with :class:`~data_plane.engines.async_engine.AsyncEngine`, and what
Dynamo's mocker does):

* A worker runs steps back to back while it has work. A step that starts at ``t`` and lasts
  ``d`` (the timing model's answer) delivers its tokens and KV events at ``t + d``; the next
  step starts at ``t + d``.
* A request arriving at ``t`` joins at the first step boundary ``>= t`` (a request arriving
  exactly at a boundary joins that step). An idle worker starts a step at the arrival time.
* Events at the same instant apply in this order: arrivals, releases, step boundaries; equal
  kinds in submission order. Everything is deterministic: same input, same output.

The router picks a worker for each request at its arrival: ``"round_robin"`` (request ``i`` in
arrival order goes to worker ``i mod n``) or any ``router(request, cores) -> index``.
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from control_plane.index.hashing import HashConfig
from data_plane.engines.core import EngineCore
from data_plane.engines.profiles import HardwareProfile, load_profile
from data_plane.engines.request import EngineRequest
from data_plane.ports import EventSink
from schemas.types import RequestId, WorkerId, WorkerRole

Router = Callable[[EngineRequest, Sequence[EngineCore]], int]

_ARRIVAL, _RELEASE, _BOUNDARY = 0, 1, 2


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request (times in virtual ms from the clock origin)."""

    request_id: RequestId
    worker_id: WorkerId
    arrival_ms: float
    prompt_tokens: int
    max_tokens: int
    #: Prompt tokens served from the prefix cache at first admission (0 until admitted).
    cached_tokens: int = 0
    #: Delivery time of every output token, in order.
    token_times: array = field(default_factory=lambda: array("d"))
    finished: bool = False

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

        def pct(a: np.ndarray, q: float) -> float:
            return float(np.percentile(a, q)) if a.size else math.nan

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


def round_robin() -> Router:
    """Request ``i`` (in arrival order) goes to worker ``i mod n``."""
    counter = 0

    def route(request: EngineRequest, cores: Sequence[EngineCore]) -> int:
        nonlocal counter
        i = counter % len(cores)
        counter += 1
        return i

    return route


def simulate(
    requests: Iterable[EngineRequest],
    profile: HardwareProfile | str = "mocker",
    *,
    num_workers: int = 1,
    role: WorkerRole = WorkerRole.AGGREGATED,
    router: Router | str = "round_robin",
    sink: EventSink | None = None,
    hash_config: HashConfig | None = None,
    worker_ids: Sequence[WorkerId] | None = None,
    release_after_ms: float | None = 0.0,
    emit_token_ids: bool = False,
) -> SimulationResult:
    """Run ``requests`` to completion on ``num_workers`` simulated workers.

    ``sink`` receives every KV event (per worker in step order, at step end). In the prefill
    role, a held request is released ``release_after_ms`` after its first token (None: never,
    e.g. to inspect held blocks). Requests without ``arrival_ms`` arrive at 0.
    """
    prof = load_profile(profile) if isinstance(profile, str) else profile
    if worker_ids is None:
        worker_ids = [WorkerId(f"worker-{i}") for i in range(num_workers)]
    ids = list(worker_ids)
    if len(ids) != num_workers:
        raise ValueError(f"{len(ids)} worker ids for {num_workers} workers")
    cores = [
        EngineCore(prof, worker_id=w, role=role, hash_config=hash_config, emit_token_ids=emit_token_ids)
        for w in ids
    ]
    route = round_robin() if router == "round_robin" else router
    if isinstance(route, str):
        raise ValueError(f"unknown router {router!r} (known: round_robin, or a callable)")

    reqs = sorted(requests, key=lambda r: r.arrival_ms or 0.0)  # stable: ties keep input order
    records: dict[RequestId, RequestRecord] = {}
    ordered: list[RequestRecord] = []
    heap: list[tuple[float, int, int, int, Any]] = []
    seq = 0
    for r in reqs:
        heap.append((r.arrival_ms or 0.0, _ARRIVAL, seq, -1, r))
        seq += 1
    heapq.heapify(heap)

    busy = [False] * num_workers  # a boundary event is pending for the worker
    steps = 0
    last_time = 0.0
    first_arrival = (reqs[0].arrival_ms or 0.0) if reqs else 0.0
    pop, push = heapq.heappop, heapq.heappush
    publish = sink.publish if sink is not None else None

    while heap:
        t, kind, _, w, payload = pop(heap)
        if kind == _ARRIVAL:
            req: EngineRequest = payload
            w = route(req, cores)
            rec = RequestRecord(req.request_id, ids[w], t, len(req.prompt), req.max_tokens)
            records[req.request_id] = rec
            ordered.append(rec)
            cores[w].add_request(req)
            if not busy[w]:
                busy[w] = True
                push(heap, (t, _BOUNDARY, seq, w, None))
                seq += 1
            continue
        core = cores[w]
        if kind == _RELEASE:
            core.release(payload)
            if not busy[w] and core.has_work():
                busy[w] = True
                push(heap, (t, _BOUNDARY, seq, w, None))
                seq += 1
            continue
        # A step boundary: deliver the step that just ended, then start the next one.
        if payload is not None:
            res = payload
            for tok in res.tokens:
                rec = records[tok.request_id]
                rec.token_times.append(t)
                if tok.finished:
                    rec.finished = True
            for rid, cached in res.admitted:
                records[rid].cached_tokens = cached
            if role is WorkerRole.PREFILL and release_after_ms is not None:
                for rid in res.finished:
                    push(heap, (t + release_after_ms, _RELEASE, seq, w, rid))
                    seq += 1
            events = core.take_kv_events()
            if publish is not None:
                for ev in events:
                    publish(ev)
            last_time = t
        res = core.step()
        if res.num_scheduled == 0:
            busy[w] = False
            continue
        steps += 1
        push(heap, (t + res.duration_ms, _BOUNDARY, seq, w, res))
        seq += 1

    return SimulationResult(
        requests=ordered,
        duration_ms=last_time - first_arrival,
        steps=steps,
        preemptions=sum(c.scheduler.num_preemptions for c in cores),
        profile=prof.name,
        num_workers=num_workers,
    )
