"""One contract, every scaler: the in-memory one, the local-process one (real ``switchyard
worker`` processes) and the Kubernetes one (official client, real HTTP, a small API server).

* ``apply`` moves the desired replicas up and down, reports it as a successful
  ``ScalingApplied`` (returned and emitted), and ``status``/``desired`` agree;
* a decision with a fencing token older than the newest seen is rejected (``success=False``,
  the reason says so) and changes nothing; an equal token (the same leader's term) is fine.
"""

from __future__ import annotations

import os

import pytest

from control_plane.planner.k8s import KubernetesScaler
from control_plane.planner.scalers import LocalProcessScaler, PoolLaunch, Scaler, VirtualScaler
from common.settings import BusSettings
from schemas.events import ScalingApplied, ScalingDecision
from schemas.types import WorkerRole
from tests.support.fake_k8s import FakeCluster, serve

POOL = "agg"


@pytest.fixture(params=["virtual", "kubernetes", "local"])
def scaler(request, tmp_path):
    emitted: list[ScalingApplied] = []
    if request.param == "virtual":
        s: Scaler = VirtualScaler(emit=emitted.append)
        yield s, emitted
        return
    if request.param == "kubernetes":
        cluster = FakeCluster(ready_delay_s=0.0)
        cluster.add_deployment("ns", "switchyard-agg", 1)
        server, url = serve(cluster)
        s = KubernetesScaler.connect("ns", {POOL: "switchyard-agg"}, host=url, emit=emitted.append)
        yield s, emitted
        server.shutdown()
        return
    bus: BusSettings = request.getfixturevalue("bus")
    env = {**os.environ, "SWITCHYARD_KAFKA_BOOTSTRAP": bus.bootstrap, "SWITCHYARD_TOPIC_PREFIX": bus.topic_prefix}
    s = LocalProcessScaler(tmp_path / "local", [PoolLaunch(POOL, WorkerRole.AGGREGATED)], env=env,
                           emit=emitted.append)
    yield s, emitted
    s.close(stop_workers=True)


def _d(to: int, frm: int, token: int) -> ScalingDecision:
    return ScalingDecision(pool=POOL, decision_id=f"c-{to}-{token}", role=WorkerRole.AGGREGATED, from_replicas=frm,
                           to_replicas=to, reason="contract", config_version=1, fencing_token=token)


def _desired(s: Scaler) -> int:
    return s.desired().get(POOL, 0)


def test_apply_moves_the_desired_replicas_and_reports_it(scaler) -> None:
    s, emitted = scaler
    n0 = _desired(s)
    up = s.apply(_d(n0 + 2, n0, token=1))
    assert up.success and up.replicas == n0 + 2 and up.pool == POOL and up.decision_id == f"c-{n0 + 2}-1"
    assert _desired(s) == n0 + 2 and s.status(POOL).desired == n0 + 2
    down = s.apply(_d(n0 + 1, n0 + 2, token=1))
    assert down.success and _desired(s) == n0 + 1 and s.status(POOL).desired == n0 + 1
    assert emitted == [up, down]


def test_a_stale_fencing_token_is_rejected_and_changes_nothing(scaler) -> None:
    s, emitted = scaler
    n0 = _desired(s)
    assert s.apply(_d(n0 + 1, n0, token=7)).success
    stale = s.apply(_d(n0 + 2, n0 + 1, token=6))
    assert not stale.success and "stale fencing token 6 < newest seen 7" in stale.error
    assert _desired(s) == n0 + 1
    assert s.apply(_d(n0, n0 + 1, token=7)).success and _desired(s) == n0
    assert [a.success for a in emitted] == [True, False, True]
