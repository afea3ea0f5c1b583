"""Kubernetes scaler: the official ``kubernetes`` client over real HTTP against a small API
server on 127.0.0.1 (``tests/support/fake_k8s.py``) that implements the Deployment, its
``scale`` subresource and pod patches with the real paths, merge patches, ``dryRun=All`` and the
``resourceVersion`` precondition."""

from __future__ import annotations

import pytest

from control_plane.planner.k8s import DELETION_COST, FENCE_ANNOTATION, KubernetesScaler
from schemas.events import ScalingDecision
from schemas.types import WorkerRole
from tests.support.fake_k8s import FakeCluster, serve

NS_, DEP = "llm", "switchyard-decode"


def _decision(to: int, frm: int, token: int, drain: str = "") -> ScalingDecision:
    return ScalingDecision(pool="decode", decision_id=f"d-{to}-{token}", role=WorkerRole.DECODE, from_replicas=frm,
                           to_replicas=to, reason="test", inputs={"drain_workers": drain} if drain else {},
                           config_version=3, fencing_token=token)


@pytest.fixture
def cluster():
    c = FakeCluster(ready_delay_s=0.3)
    c.add_deployment(NS_, DEP, 2)
    c.add_pod(NS_, "switchyard-decode-7c9d-abcde")
    server, url = serve(c)
    yield c, url
    server.shutdown()


def _scaler(url: str, **kw) -> KubernetesScaler:
    return KubernetesScaler.connect(NS_, {"decode": DEP}, host=url, **kw)


def test_scale_up_reads_and_patches_the_scale_subresource_and_waits_for_readiness(cluster) -> None:
    c, url = cluster
    s = _scaler(url)
    assert s.desired() == {"decode": 2}
    out = s.apply(_decision(4, 2, token=7))
    assert out.success and out.replicas == 4 and out.scaler == "kubernetes"
    st = s.status("decode")
    assert (st.desired, st.ready) == (4, 2)
    assert s.wait_ready("decode", 4, timeout_s=5, poll_s=0.05).ready == 4
    d = c.deployments[(NS_, DEP)]
    assert d["replicas"] == 4 and d["annotations"][FENCE_ANNOTATION] == "7"
    paths = [(m, p) for m, p, _, _ in c.requests]
    assert ("PATCH", f"/apis/apps/v1/namespaces/{NS_}/deployments/{DEP}/scale") in paths
    assert ("GET", f"/apis/apps/v1/namespaces/{NS_}/deployments/{DEP}/scale") in paths
    scale_patch = [b for m, p, b, _ in c.requests if m == "PATCH" and p.endswith("/scale")]
    assert scale_patch == [{"spec": {"replicas": 4}}]


def test_scale_down_marks_the_named_pods_for_deletion_first(cluster) -> None:
    c, url = cluster
    out = _scaler(url).apply(_decision(1, 2, token=1, drain="switchyard-decode-7c9d-abcde,gone-pod"))
    assert out.success and c.deployments[(NS_, DEP)]["replicas"] == 1
    assert c.pods[(NS_, "switchyard-decode-7c9d-abcde")]["annotations"][DELETION_COST] == "-1000"


def test_stale_fencing_token_is_rejected_even_by_a_fresh_scaler(cluster) -> None:
    """The newest token lives on the Deployment: a scaler that never saw token 9 (another
    process) still rejects 8 once 9 was applied."""
    c, url = cluster
    assert _scaler(url).apply(_decision(3, 2, token=9)).success
    out = _scaler(url).apply(_decision(5, 3, token=8))
    assert not out.success and "stale fencing token 8 < newest seen 9" in out.error
    assert c.deployments[(NS_, DEP)]["replicas"] == 3


def test_a_concurrent_change_between_read_and_write_is_a_conflict(cluster) -> None:
    """Two planners racing: the fencing annotation patch carries the resourceVersion read, so the
    loser's write gets 409 and its decision is not applied."""
    c, url = cluster
    s = _scaler(url)
    orig = s.apps.read_namespaced_deployment

    def read_then_someone_writes(name, ns):
        dep = orig(name, ns)
        c.deployments[(NS_, DEP)]["rv"] = "999"  # another writer got in between
        return dep

    s.apps.read_namespaced_deployment = read_then_someone_writes
    out = s.apply(_decision(6, 2, token=3))
    assert not out.success and "conflict" in out.error
    assert c.deployments[(NS_, DEP)]["replicas"] == 2


def test_dry_run_sends_dry_run_all_and_changes_nothing(cluster) -> None:
    c, url = cluster
    out = _scaler(url, dry_run=True).apply(_decision(5, 2, token=4))
    assert out.success and out.scaler == "kubernetes(dry-run)"
    d = c.deployments[(NS_, DEP)]
    assert d["replicas"] == 2 and FENCE_ANNOTATION not in d["annotations"]
    writes = [q for m, _, _, q in c.requests if m == "PATCH"]
    assert writes and all(q.get("dryRun") == ["All"] for q in writes)


def test_unknown_pool_is_reported_not_raised(cluster) -> None:
    _, url = cluster
    d = ScalingDecision(pool="nope", decision_id="x", role=WorkerRole.DECODE, from_replicas=0, to_replicas=1,
                        reason="t", config_version=1, fencing_token=1)
    out = _scaler(url).apply(d)
    assert not out.success and "no Deployment configured" in out.error
