"""Which stale workers make the router view DEGRADED: only those a decision could route to."""

from __future__ import annotations

import msgspec

from control_plane.router.health import assess
from control_plane.router.view import RouterView
from schemas import EnvelopeFactory
from schemas.events import BlockStored, WorkerDeregistered, WorkerRegistered
from schemas.types import Tier, WorkerRole

BS = 16


def _fold(view: RouterView, producer: str, epoch: int, seq: int, topic: str, ev) -> None:
    f = EnvelopeFactory(producer, epoch, lambda: 1)
    env = msgspec.structs.replace(f.wrap(ev, scope=f"{topic}:0"), seq=seq)
    view.apply(env, topic, 0, view.positions.get((topic, 0), 0))


def _stored(worker: str) -> BlockStored:
    return BlockStored(worker_id=worker, tier=Tier.DEVICE, block_hashes=[1, 2], block_size=BS, hash_algo="sha256")


def test_a_stray_kv_event_of_an_unregistered_worker_does_not_degrade_the_view() -> None:
    """A BlockStored at seq 1 from a worker id nobody registered: the index flags the gap, but the
    worker is never a candidate, so the view stays EXACT."""
    view = RouterView("sha256", BS)
    _fold(view, "ghost", 1, 1, "t.kv", _stored("ghost"))
    assert view.index.stale_workers() and view.stale_workers() == []
    assert assess({}, {}, {}, view.stale_workers(), 0.0, True).state == "EXACT"


def test_a_registered_workers_gap_degrades_the_view_until_it_is_gone() -> None:
    view = RouterView("sha256", BS)
    _fold(view, "w1", 1, 0, "t.workers", WorkerRegistered(worker_id="w1", role=WorkerRole.AGGREGATED, pool="p",
                                                          endpoint="http://w1", block_size=BS, hash_algo="sha256"))
    _fold(view, "w1", 1, 0, "t.kv", _stored("w1"))
    _fold(view, "w1", 1, 2, "t.kv", _stored("w1"))  # seq 1 was lost
    assert view.stale_workers() == ["w1"]
    assert assess({}, {}, {}, view.stale_workers(), 0.0, True).state == "DEGRADED"
    _fold(view, "w1", 1, 1, "t.workers", WorkerDeregistered(worker_id="w1"))
    assert view.stale_workers() == []
