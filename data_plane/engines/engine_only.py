"""The engine-only entry point: ``simulate(requests, "mocker", num_workers=4)``.

Replays requests (each with ``arrival_ms``) through ``EngineCore`` s behind a router over the
engines alone, and returns per-request TTFT, inter-token latencies, end-to-end latency, token
counts and prefix-cache hits, plus the usual aggregates. It is the simplest client of the
cluster driver (:class:`~data_plane.engines.cluster.Cluster`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from data_plane.engines.cluster import Cluster
from data_plane.engines.core import EngineCore
from data_plane.engines.hooks import Hooks, Placement
from data_plane.engines.profiles import HardwareProfile, load_profile
from data_plane.engines.records import SimulationResult
from data_plane.engines.request import EngineRequest
from data_plane.engines.tiers import OnboardCosts
from data_plane.kvbm.offload_filter import AdmissionConfig
from common.hashing import HashConfig
from common.log.sink import EventSink
from schemas.events import KvEvent
from schemas.types import Tier, WorkerId, WorkerRole

Router = Callable[[EngineRequest, Sequence[EngineCore]], int]


def round_robin() -> Router:
    """Request ``i`` (in arrival order) goes to worker ``i mod n``."""
    counter = 0

    def route(request: EngineRequest, cores: Sequence[EngineCore]) -> int:
        nonlocal counter
        i = counter % len(cores)
        counter += 1
        return i

    return route


class _EngineOnly(Hooks):
    """``simulate``'s router side: a router over the engines (no sink: nothing is buffered)."""

    def __init__(self, route: Router, cores: Callable[[], list[EngineCore]], ids: list[WorkerId]) -> None:
        self.route = route
        self.cores = cores
        self.ids = ids

    def arrive(self, request: EngineRequest, now: float) -> Placement:
        return Placement(self.ids[self.route(request, self.cores())], request)


class _EngineOnlyToSink(_EngineOnly):
    """... and every KV event to the sink, in the one-heap loop's order."""

    def __init__(self, route: Router, cores: Callable[[], list[EngineCore]], ids: list[WorkerId],
                 sink: EventSink) -> None:
        super().__init__(route, cores, ids)
        self.publish = sink.publish

    def on_kv(self, worker: WorkerId, events: list[KvEvent], t: float) -> None:
        publish = self.publish
        for ev in events:
            publish(ev)


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
    coalesce: bool = True,
    tiers: Mapping[Tier, int] | None = None,
    onboard_costs: OnboardCosts | None = None,
    tier_admission: AdmissionConfig | None = None,
) -> SimulationResult:
    """Run ``requests`` to completion on ``num_workers`` simulated workers.

    ``sink`` receives every KV event (per worker in step order, at step end). In the prefill
    role, a held request is released ``release_after_ms`` after its first token (None: never,
    e.g. to inspect held blocks). Requests without ``arrival_ms`` arrive at 0.

    ``coalesce`` (default) lets a worker apply runs of identical decode steps at once
    (:meth:`EngineCore.run_decode`); False runs every step through ``EngineCore.step``. The
    results, the KV events and their order are the same either way.

    ``tiers`` / ``onboard_costs`` / ``tier_admission``: tiers below each worker's device, see
    :class:`Cluster`.
    """
    prof = load_profile(profile) if isinstance(profile, str) else profile
    if worker_ids is None:
        worker_ids = [WorkerId(f"worker-{i}") for i in range(num_workers)]
    ids = list(worker_ids)
    if len(ids) != num_workers:
        raise ValueError(f"{len(ids)} worker ids for {num_workers} workers")
    route = round_robin() if router == "round_robin" else router
    if isinstance(route, str):
        raise ValueError(f"unknown router {router!r} (known: round_robin, or a callable)")

    def cores() -> list[EngineCore]:
        return engines

    hooks = _EngineOnly(route, cores, ids) if sink is None else _EngineOnlyToSink(route, cores, ids, sink)
    cluster = Cluster(prof, hooks, hash_config=hash_config, emit_token_ids=emit_token_ids, coalesce=coalesce,
                      release_after_ms=release_after_ms, tiers=tiers, onboard_costs=onboard_costs,
                      tier_admission=tier_admission)
    engines = [cluster.add_worker(w, role) for w in ids]
    # Round robin reads no engine: every worker runs on its own from its share of the arrivals.
    records = cluster.run(requests, fixed_routing=router == "round_robin")
    first_arrival = records[0].arrival_ms if records else 0.0
    return SimulationResult(
        requests=records,
        duration_ms=cluster.last_time - first_arrival,
        steps=cluster.steps,
        preemptions=sum(c.scheduler.num_preemptions for c in engines),
        profile=prof.name,
        num_workers=num_workers,
    )
