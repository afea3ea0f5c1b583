"""Replay-proof registration (issue 36, item 2): a worker's signed ``WorkerRegistered``, copied
unchanged to another partition after the worker stopped, must not bring it back, in any order
the partitions are folded, and every view that folds registrations agrees (the one rule is
kernel/lifecycle.py)."""

from __future__ import annotations

import itertools

import msgspec

from control_plane.router.view import RouterView
from kernel.lifecycle import GONE, READY, Lifecycle
from schemas import EnvelopeFactory
from schemas.events import WorkerDeregistered, WorkerLoadReported, WorkerRegistered
from schemas.types import WorkerRole

BS = 16
T = "t.workers"


def _reg(wid: str = "w1") -> WorkerRegistered:
    return WorkerRegistered(worker_id=wid, role=WorkerRole.AGGREGATED, pool="p", endpoint="http://127.0.0.1:9",
                            block_size=BS, hash_algo="sha256")


def _log(epoch: int = 1000):
    """(partition, envelope): the worker's own life on partition 0, then the attacker's copy of
    its registration (same bytes: same event id, epoch and seq) on partition 1."""
    f = EnvelopeFactory("w1", epoch, lambda: epoch * 10)
    reg = f.wrap(_reg(), scope=f"{T}:0")
    load = msgspec.structs.replace(f.wrap(WorkerLoadReported(worker_id="w1", running=1, waiting=0), scope=f"{T}:0"),
                                   occurred_at_ns=epoch * 10 + 1)
    gone = f.wrap(WorkerDeregistered(worker_id="w1"), scope=f"{T}:0")
    return [(0, reg), (0, load), (0, gone)], [(1, reg)]


def _orders(own, copy):
    """Every interleaving keeping each partition's order (the copy can land anywhere)."""
    for at in range(len(own) + 1):
        yield own[:at] + copy + own[at:]


def _router(records) -> RouterView:
    view = RouterView("sha256", BS)
    offsets: dict[int, int] = {}
    for part, env in records:
        off = offsets.get(part, 0)
        offsets[part] = off + 1
        view.apply(env, T, part, off)
    return view


def test_a_registration_copied_to_another_partition_never_brings_a_gone_worker_back() -> None:
    own, copy = _log()
    for order in _orders(own, copy):
        view = _router(order)
        assert view.workers["w1"].state == GONE, order
        assert view.routable() == []


def test_a_new_incarnation_registers_again_and_a_restored_view_keeps_the_rule() -> None:
    own, copy = _log(1000)
    newer, _ = _log(2000)
    view = _router([*own, newer[0]])
    assert view.workers["w1"].state == READY and view.workers["w1"].epoch == 2000
    again = RouterView.restore(_router(own).snapshot())
    again.apply(copy[0][1], T, 1, 0)
    assert again.workers["w1"].state == GONE


def test_the_lifecycle_fold_is_order_insensitive_and_idempotent() -> None:
    events = [("WorkerRegistered", 1), ("WorkerDraining", 1), ("WorkerDeregistered", 1), ("WorkerRegistered", 2),
              ("WorkerRegistered", 1), ("WorkerDraining", 2)]
    ends = set()
    for perm in itertools.permutations(events):
        lc = Lifecycle()
        for t, e in perm:
            lc = lc.after(t, e)
        ends.add((lc, lc.state(2), lc.state(1)))
    assert ends == {(Lifecycle(registered=2, draining=2, ended=1), "draining", GONE)}
    assert not Lifecycle(registered=2).admits(2) and Lifecycle(registered=2).admits(3)


def test_the_load_view_and_the_metrics_agree_with_the_router() -> None:
    from control_plane.metrics.projection import MetricsProjection, ProjectionConfig
    from control_plane.planner.load_view import LoadView

    own, copy = _log()
    for order in _orders(own, copy):
        lv = LoadView()
        mp = MetricsProjection(ProjectionConfig(hash_algo="sha256", block_size=BS))
        offsets: dict[int, int] = {}
        for part, env in order:
            off = offsets.get(part, 0)
            offsets[part] = off + 1
            lv.apply(env)
            mp.apply(env, "workers", part, off)
        assert lv.workers["w1"].state == GONE, order
        assert mp._workers["w1"].state == GONE, order
