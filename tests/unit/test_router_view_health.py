"""Which stale workers make the router view DEGRADED: only those a decision could route to."""

from __future__ import annotations

import msgspec
import pytest

from control_plane.index.errors import IndexRejected
from control_plane.router.health import assess
from control_plane.router.view import EndpointAllowlist, RouterView
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
                                                          endpoint="http://127.0.0.1:9", block_size=BS, hash_algo="sha256"))
    _fold(view, "w1", 1, 0, "t.kv", _stored("w1"))
    _fold(view, "w1", 1, 2, "t.kv", _stored("w1"))  # seq 1 was lost
    assert view.stale_workers() == ["w1"]
    assert assess({}, {}, {}, view.stale_workers(), 0.0, True).state == "DEGRADED"
    _fold(view, "w1", 1, 1, "t.workers", WorkerDeregistered(worker_id="w1"))
    assert view.stale_workers() == []


def _registered(worker: str, endpoint: str, epoch: int = 1):
    reg = WorkerRegistered(worker_id=worker, role=WorkerRole.AGGREGATED, pool="p", endpoint=endpoint, block_size=BS,
                           hash_algo="sha256")
    return EnvelopeFactory(worker, epoch, lambda: 1).wrap(reg, scope="t.workers:0")


# -- the worker endpoint allowlist ---------------------------------------------------------------


@pytest.mark.parametrize(("endpoint", "allowed"), [
    ("http://127.0.0.1:8001", True), ("http://127.9.9.9:1", True), ("http://[::1]:8001", True),
    ("http://localhost:8001", True), ("https://LOCALHOST", True),
    ("http://10.0.3.17:8001", False), ("http://192.168.1.5", False), ("http://attacker.example:80", False),
    ("http://[::ffff:8.8.8.8]:1", False), ("ftp://127.0.0.1/x", False), ("127.0.0.1:8001", False),
    ("http://:80", False), ("http://[::1", False),
    # host and port only: a path, query, fragment or user would steer the router's calls
    ("http://127.0.0.1:8001/admin/kv_bridge/stop", False), ("http://127.0.0.1:8001/", False),
    ("http://127.0.0.1:8001#frag", False), ("http://127.0.0.1:8001#", False), ("http://127.0.0.1:8001?x=1", False),
    ("http://user@127.0.0.1:8001", False), ("http://u:p@127.0.0.1:8001", False),
])
def test_the_default_allowlist_is_loopback(endpoint: str, allowed: bool) -> None:
    assert (EndpointAllowlist().refusal(endpoint) is None) is allowed


def test_a_registration_outside_the_allowlist_is_refused_and_changes_nothing() -> None:
    view = RouterView("sha256", 16)
    good = _registered("w-ok", "http://127.0.0.1:9000")
    view.apply(good, "t.workers", 0, 0)
    forged = _registered("w-ok", "http://10.0.3.17:18999", epoch=9)
    with pytest.raises(IndexRejected, match="endpoint_not_allowed: worker 'w-ok': endpoint address 10.0.3.17"):
        view.apply(forged, "t.workers", 0, 1)
    assert view.workers["w-ok"].endpoint == "http://127.0.0.1:9000" and view.workers["w-ok"].epoch == 1
    assert view.positions[("t.workers", 0)] == 2  # advanced past it: never re-read
    wide = RouterView("sha256", 16, EndpointAllowlist(("10.0.0.0/8",)))
    wide.apply(forged, "t.workers", 0, 0)
    assert wide.workers["w-ok"].endpoint == "http://10.0.3.17:18999"
    # A snapshot restored with the router's allowlist keeps refusing.
    back = RouterView.restore(view.snapshot(), EndpointAllowlist(("127.0.0.0/8",)))
    with pytest.raises(IndexRejected):
        back.apply(_registered("w-ok", "http://10.0.3.17:18999", epoch=10), "t.workers", 0, 2)
