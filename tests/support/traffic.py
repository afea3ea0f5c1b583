"""Recorded traffic for tests that fold the requests/workers streams from the real broker: an
aggregated worker's registration and one request's admitted / routed / completed events, at
event times the test sets (tests only)."""

from __future__ import annotations

from typing import Any

from control_plane.planner.load_view import NS
from common.log.kafka import EventProducer
from schemas.events import RequestAdmitted, RequestCompleted, RequestRouted, WorkerRegistered


class Clock:
    """A settable event clock (``clock_ns`` of the producers): ``t`` is the next event's time."""

    def __init__(self, t: int) -> None:
        self.t = t

    def __call__(self) -> int:
        return self.t


def register_worker(producer: EventProducer, worker_id: str, *, block_size: int, pool: str = "agg") -> None:
    producer.publish(WorkerRegistered(worker_id=worker_id, role="aggregated", pool=pool,
                                      endpoint=f"http://{worker_id}", block_size=block_size, hash_algo="sha256"))


def serve_request(router: EventProducer, clock: Clock, rid: str, worker_id: str, *, at_ns: int, served_s: float,
                  prompt_tokens: int, output_tokens: int, block_size: int, **completed: Any) -> None:
    """``rid`` admitted and routed to ``worker_id`` at ``at_ns``, completed ``served_s`` later
    with all its ``output_tokens``; ``completed`` holds the rest of RequestCompleted (latencies)."""
    clock.t = at_ns
    router.publish(RequestAdmitted(request_id=rid, model="m", prompt_tokens=prompt_tokens, max_tokens=output_tokens,
                                   block_size=block_size, hash_algo="sha256"))
    router.publish(RequestRouted(request_id=rid, worker_id=worker_id, mode="kv", config_version=1, rng_seed=0))
    clock.t += int(served_s * NS)
    router.publish(RequestCompleted(request_id=rid, worker_id=worker_id, prompt_tokens=prompt_tokens,
                                    output_tokens=output_tokens, **completed))
