"""The fleet (common/fleet.py): every worker's lifecycle folded once, the rule every view that
folds the ``workers`` stream applies (router view, planner load view, admin audit, metrics,
a worker's peer directory).

Transitions, the replay rule (issue 36: a worker's signed ``WorkerRegistered``, copied
unchanged to another partition after it stopped, never brings it back), old snapshots, and
the property: any interleaving that keeps each partition's order ends in the same fleet, a
copy of an event changes nothing, and the views agree with it."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.admin.audit.projection import fold_worker
from control_plane.metrics.projection import MetricsProjection, ProjectionConfig
from control_plane.planner.load_view import LoadView
from control_plane.router.view import RouterView
from data_plane.transfer import BlockRegion, EndpointMetadata
from data_plane.workers.peers import PeerDirectory
from common.fleet import DRAINING, GONE, NEW, READY, Fleet, Lifecycle, step
from schemas import EnvelopeFactory
from schemas.events import (
    TransferInfo,
    WorkerDeregistered,
    WorkerDraining,
    WorkerLoadReported,
    WorkerRegistered,
)
from schemas.types import WorkerRole

BS = 16
T = "t.workers"


def _reg(wid: str = "w1", **overrides) -> WorkerRegistered:
    fields = {"worker_id": wid, "role": WorkerRole.AGGREGATED, "pool": "p", "endpoint": "http://127.0.0.1:9",
              "block_size": BS, "hash_algo": "sha256"}
    fields.update(overrides)
    return WorkerRegistered(**fields)


def _env(ev, epoch: int = 1, at: int = 10, seq_scope: str = f"{T}:0"):
    return EnvelopeFactory(ev.worker_id, epoch, lambda: at).wrap(ev, scope=seq_scope)


# -- transitions ------------------------------------------------------------------------------


def test_a_registration_is_admitted_once_per_epoch_and_only_when_newer() -> None:
    life = Lifecycle(registered=2)
    assert not life.admits(2) and not life.admits(1) and life.admits(3)
    assert NEW.admits(0) and NEW.current is None


def test_ready_draining_gone_and_gone_stays_gone_until_a_newer_registration() -> None:
    life = NEW.after("WorkerRegistered", 5)
    assert life.current == READY
    life = life.after("WorkerDraining", 5)
    assert life.current == DRAINING
    life = life.after("WorkerDeregistered", 5, at_ns=70)
    assert life.current == GONE and life.ended_at_ns == 70
    life = life.after("WorkerRegistered", 5)  # a copy of the registration: still gone
    assert life.current == GONE and not life.admits(5)
    life = life.after("WorkerRegistered", 6)
    assert life.current == READY and life.state(5) == GONE


def test_a_deregistration_of_a_newer_incarnation_ends_the_older_ones() -> None:
    life = NEW.after("WorkerRegistered", 5).after("WorkerDeregistered", 7, at_ns=90)
    assert life.state(5) == GONE and life.current == GONE
    assert life.after("WorkerRegistered", 7).current == GONE  # its registration, folded late
    assert life.after("WorkerRegistered", 8).current == READY


def test_other_events_leave_the_lifecycle_alone() -> None:
    life = NEW.after("WorkerRegistered", 1)
    assert life.after("WorkerLoadReported", 9) is life
    assert step(life, _env(WorkerLoadReported(worker_id="w1", running=1, waiting=0))) is None


def test_a_change_names_the_registration_it_admitted_in_plain_values() -> None:
    fleet = Fleet()
    transfer = TransferInfo(agent_name="w1:3")
    ch = fleet.fold(_env(_reg(capacity={"device": 64}, transfer=transfer), epoch=3, at=33))
    reg = ch.registration
    assert (reg.worker_id, reg.epoch, reg.role, reg.pool, reg.registered_at_ns) == ("w1", 3, "aggregated", "p", 33)
    assert reg.capacity == {"device": 64} and reg.transfer == transfer and ch.state == READY
    again = fleet.fold(_env(_reg(), epoch=3, at=34))
    assert again.registration is None and again.after is again.before
    assert fleet.fold(_env(WorkerDraining(worker_id="w1"), epoch=3)).state == DRAINING


# -- the replay rule through the views ----------------------------------------------------------


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


def test_a_router_snapshot_written_before_lifecycles_were_kept_still_restores_with_the_rule() -> None:
    own, copy = _log()
    snap = msgspec.msgpack.decode(_router(own).snapshot())
    del snap["lifecycles"]
    view = RouterView.restore(msgspec.msgpack.encode(snap))
    assert view.fleet.get("w1") == Lifecycle(registered=1000, ended=1000)
    view.apply(copy[0][1], T, 1, 0)
    assert view.workers["w1"].state == GONE


def test_a_load_view_snapshot_without_lifecycles_restores_with_the_rule() -> None:
    own, copy = _log()
    lv = LoadView()
    for _, env in own:
        lv.apply(env)
    state = msgspec.msgpack.decode(lv.to_bytes())
    del state["lifecycles"]
    again = LoadView.from_bytes(msgspec.msgpack.encode(state))
    assert again.fleet.get("w1").current == GONE
    again.apply(copy[0][1])
    assert again.workers["w1"].state == GONE and again.digest() == lv.digest()


def test_the_load_view_the_metrics_and_the_audit_agree_with_the_router() -> None:
    own, copy = _log()
    for order in _orders(own, copy):
        lv = LoadView()
        mp = MetricsProjection(ProjectionConfig(hash_algo="sha256", block_size=BS))
        row = None
        offsets: dict[int, int] = {}
        for part, env in order:
            off = offsets.get(part, 0)
            offsets[part] = off + 1
            lv.apply(env)
            mp.apply(env, "workers", part, off)
            row = fold_worker(row, env) or row
        assert lv.workers["w1"].state == GONE, order
        assert mp._workers["w1"].state == GONE, order
        assert row["state"] == GONE and row["epoch"] == 1000, order


def test_the_audit_row_of_an_incarnation_whose_registration_comes_last() -> None:
    """Draining folded before its registration (another partition ran ahead): unregistered,
    then draining; the registration fills the row's fields and leaves it draining."""
    row = fold_worker(None, _env(WorkerLoadReported(worker_id="w1", running=2, waiting=0), epoch=4, at=41))
    assert (row["state"], row["epoch"], row["running"]) == ("unregistered", 4, 2)
    row = fold_worker(row, _env(WorkerDraining(worker_id="w1"), epoch=4, at=42))
    assert row["state"] == DRAINING
    row = fold_worker(row, _env(_reg(pool="q"), epoch=4, at=40))
    assert (row["state"], row["pool"], row["running"], row["registered_epoch"]) == (DRAINING, "q", 2, 4)
    assert fold_worker(row, _env(_reg(pool="q"), epoch=4, at=40)) is None  # a copy changes nothing


# -- the property: order-independent, idempotent, and every view agrees ----------------------------

WORKERS = ("w1", "w2")


def _lives(draw_plan) -> list[tuple[str, list]]:
    """Each worker's own partition: its incarnations in epoch order, each registration then
    optionally a load report, a drain and a deregistration."""
    out = []
    clock = iter(range(1, 10_000))
    for p, (wid, incarnations) in enumerate(zip(WORKERS, draw_plan)):
        envs = []
        for epoch, (registered, loaded, drained, ended) in enumerate(incarnations, start=1):
            f = EnvelopeFactory(wid, epoch, lambda: next(clock) * 1000)
            scope = f"{T}:{p}"
            if registered:
                envs.append(f.wrap(_reg(wid), scope=scope))
            if loaded:
                envs.append(f.wrap(WorkerLoadReported(worker_id=wid, running=1, waiting=0), scope=scope))
            if drained:
                envs.append(f.wrap(WorkerDraining(worker_id=wid), scope=scope))
            if ended:
                envs.append(f.wrap(WorkerDeregistered(worker_id=wid), scope=scope))
        out.append((f"{T}:{p}", envs))
    return out


_incarnation = st.tuples(st.booleans(), st.booleans(), st.booleans(), st.booleans())
_plan = st.lists(st.lists(_incarnation, min_size=1, max_size=3), min_size=len(WORKERS), max_size=len(WORKERS))


@st.composite
def _interleaved(draw):
    """Two runs over the same records: each partition's order kept, merged at random; the
    second with copies of lifecycle events on a third partition (the attacker's, or a retry's)."""
    parts = _lives(draw(_plan))
    lifecycle = [e for _, envs in parts for e in envs if e.type != "WorkerLoadReported"]
    copies = draw(st.lists(st.sampled_from(lifecycle), max_size=6)) if lifecycle else []
    runs = []
    for extra in ([], [(f"{T}:9", copies)]):
        queues = [list(envs) for _, envs in parts + extra]
        names = [name for name, _ in parts + extra]
        merged = []
        while any(queues):
            i = draw(st.sampled_from([i for i, q in enumerate(queues) if q]))
            merged.append((names[i], queues[i].pop(0)))
        runs.append(merged)
    return runs


def _fold_all(records):
    fleet, router, lv = Fleet(), RouterView("sha256", BS), LoadView()
    mp = MetricsProjection(ProjectionConfig(hash_algo="sha256", block_size=BS))
    rows: dict[str, dict] = {}
    offsets: dict[str, int] = {}
    for scope, env in records:
        topic, part = scope.rsplit(":", 1)
        off = offsets.get(scope, 0)
        offsets[scope] = off + 1
        fleet.fold(env)
        router.apply(env, topic, int(part), off)
        lv.apply(env)
        mp.apply(env, "workers", int(part), off)
        row = fold_worker(rows.get(env.data.worker_id), env)
        if row is not None:
            rows[env.data.worker_id] = row
    return fleet, router, lv, mp, rows


@settings(max_examples=150, deadline=None)
@given(_interleaved())
def test_any_interleaving_and_any_copies_end_in_the_same_fleet_and_the_views_agree(runs) -> None:
    """Copies included, the fleet, the load view's and the audit rows' lifecycles are the same.
    The router and the metrics fence an older epoch once a newer one of the worker was seen
    (docs/prefix-index.md), before the fold: a copy of a newer incarnation's event, folded
    early, can hide an older one's from them; without copies every view agrees on every
    worker's registered incarnation and its state."""
    (fleet, router, lv, mp, rows), (fleet2, _, lv2, _, rows2) = [_fold_all(r) for r in runs]
    assert fleet.by_worker == fleet2.by_worker == lv.fleet.by_worker == lv2.fleet.by_worker
    assert router.fleet.by_worker == mp.fleet.by_worker == fleet.by_worker
    for wid, life in fleet.by_worker.items():
        for row in (rows[wid], rows2[wid]):
            assert (row["registered_epoch"], row["draining_epoch"], row["ended_epoch"]) == (
                life.registered, life.draining, life.ended)
            if row["epoch"] == life.registered:
                assert row["state"] == life.current
        if life.registered < 0:
            assert wid not in router.workers and wid not in lv.workers and wid not in mp._workers
            continue
        state = life.current
        for view in (lv, lv2):
            assert view.workers[wid].epoch == life.registered
            assert {"starting": READY}.get(view.workers[wid].state, view.workers[wid].state) == state
        assert router.workers[wid].epoch == mp._workers[wid].epoch == life.registered
        assert router.workers[wid].state == mp._workers[wid].state == state


def test_the_peer_directory_follows_the_fleet() -> None:
    """A registration's agent is remembered; a copy of it after the deregistration, or a
    registration the log already says is gone, never brings the agent back."""
    def transfer(epoch: int) -> TransferInfo:
        return EndpointMetadata(agent_name=f"w1:{epoch}", agent_metadata=b"md",
                                region=BlockRegion(base_addr=0x1000, block_len=64, n_blocks=4)).to_transfer_info()

    forgotten: list[str] = []
    peers, fleet = PeerDirectory(on_forget=forgotten.append), Fleet()
    reg1 = _env(_reg(transfer=transfer(1)), epoch=1)
    for env in (reg1, _env(WorkerDeregistered(worker_id="w1"), epoch=1), reg1):
        peers.apply(fleet.fold(env))
    assert peers.known("w1:1") is None and forgotten == ["w1:1"]
    peers.apply(fleet.fold(_env(WorkerDeregistered(worker_id="w1"), epoch=3)))
    peers.apply(fleet.fold(_env(_reg(transfer=transfer(3)), epoch=3)))  # its own end folded first
    assert peers.known("w1:3") is None
    peers.apply(fleet.fold(_env(_reg(transfer=transfer(4)), epoch=4)))
    assert peers.known("w1:4").agent_name == "w1:4"
