"""Kubernetes scaler: one Deployment per pool, scaled through its ``scale`` subresource with the
official ``kubernetes`` client.

``apply(decision)``:

1. ``GET /apis/apps/v1/namespaces/{ns}/deployments/{name}``: the Deployment carries the newest
   fencing token any planner applied, in the annotation ``switchyard.io/fencing-token``. A
   decision older than that (or than the newest this scaler saw) is rejected.
2. A newer token is written first (JSON merge patch of the annotation *with the resourceVersion
   just read*: if another planner changed the Deployment in between, the API server answers 409
   and the decision is rejected, so two planners can never interleave).
3. For a scale-down, the pods the decision names (``inputs["drain_workers"]``; our manifests use
   the pod name as the worker id) get ``controller.kubernetes.io/pod-deletion-cost: -1000`` so
   the ReplicaSet removes those first. Removal sends SIGTERM: the worker drains
   (``terminationGracePeriodSeconds`` covers the drain timeout).
4. ``PATCH .../deployments/{name}/scale`` with ``{"spec": {"replicas": to}}``.

Dry-run mode sends every write with ``dryRun=All``: the API server validates and answers as if
it applied, nothing is persisted. ``status``/``wait_ready`` read ``status.readyReplicas``
(readiness probes on ``/health``: a draining worker answers 503 and leaves the Service).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from control_plane.planner.errors import ScalerError, StaleFencingToken
from control_plane.planner.scalers import Emit, MemoryFence, ReplicaStatus, _emitted, _rejected, drain_list
from schemas.events import ScalingApplied, ScalingDecision

log = logging.getLogger(__name__)

FENCE_ANNOTATION = "switchyard.io/fencing-token"
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
MERGE_PATCH = "application/merge-patch+json"


class KubernetesScaler:
    name = "kubernetes"

    def __init__(self, api_client, namespace: str, deployments: Mapping[str, str], *, dry_run: bool = False,
                 emit: Emit | None = None) -> None:
        from kubernetes import client

        self.apps = client.AppsV1Api(api_client)
        self.core = client.CoreV1Api(api_client)
        self.namespace = namespace
        self.deployments = dict(deployments)
        self.dry_run = dry_run
        self.emit = emit
        self.fence = MemoryFence()

    @classmethod
    def connect(cls, namespace: str, deployments: Mapping[str, str], *, host: str | None = None,
                kubeconfig: str | None = None, in_cluster: bool = False, dry_run: bool = False,
                emit: Emit | None = None) -> KubernetesScaler:
        """In-cluster config, a kubeconfig file, or a plain API server URL (tests)."""
        from kubernetes import client, config

        if host is not None:
            cfg = client.Configuration(host=host)
            api = client.ApiClient(cfg)
        elif in_cluster:
            config.load_incluster_config()
            api = client.ApiClient()
        else:
            config.load_kube_config(config_file=kubeconfig)
            api = client.ApiClient()
        return cls(api, namespace, deployments, dry_run=dry_run, emit=emit)

    @property
    def _dry(self) -> str | None:
        return "All" if self.dry_run else None

    @property
    def _label(self) -> str:
        return "kubernetes(dry-run)" if self.dry_run else "kubernetes"

    def _deployment(self, pool: str) -> str:
        try:
            return self.deployments[pool]
        except KeyError:
            raise ScalerError(f"no Deployment configured for pool {pool!r}") from None

    def apply(self, decision: ScalingDecision, *, now_ns: int | None = None) -> ScalingApplied:
        from kubernetes.client.exceptions import ApiException

        ns = self.namespace
        try:
            name = self._deployment(decision.pool)
            dep = self.apps.read_namespaced_deployment(name, ns)
            current = int(dep.spec.replicas or 0)
            annotations = dict(dep.metadata.annotations or {})
            stored = int(annotations.get(FENCE_ANNOTATION, "0") or 0)
            token = decision.fencing_token
            if token < stored:
                raise StaleFencingToken(token, stored)
            self.fence.admit(token)
            if token > stored:
                self.apps.patch_namespaced_deployment(
                    name, ns, {"metadata": {"annotations": {FENCE_ANNOTATION: str(token)},
                                            "resourceVersion": dep.metadata.resource_version}},
                    dry_run=self._dry, _content_type=MERGE_PATCH)
            if decision.to_replicas < current:
                for pod in drain_list(decision):
                    try:
                        self.core.patch_namespaced_pod(
                            pod, ns, {"metadata": {"annotations": {DELETION_COST: "-1000"}}},
                            dry_run=self._dry, _content_type=MERGE_PATCH)
                    except ApiException as e:
                        if e.status != 404:
                            raise
                        log.info("pod %s to drain is already gone", pod)
            scale = self.apps.patch_namespaced_deployment_scale(
                name, ns, {"spec": {"replicas": decision.to_replicas}}, dry_run=self._dry,
                _content_type=MERGE_PATCH)
        except StaleFencingToken as e:
            log.warning("rejected %s: %s", decision.decision_id, e)
            return _emitted(self.emit, _rejected(decision, e, self._label, decision.from_replicas))
        except ApiException as e:
            why = ("conflict: the Deployment changed since it was read (another planner?)" if e.status == 409
                   else f"API error {e.status}: {e.reason}")
            return _emitted(self.emit, _rejected(decision, ScalerError(why), self._label, decision.from_replicas))
        except (ScalerError, OSError) as e:
            return _emitted(self.emit, _rejected(decision, e, self._label, decision.from_replicas))
        replicas = int(scale.spec.replicas or 0) if scale.spec is not None else decision.to_replicas
        return _emitted(self.emit, ScalingApplied(pool=decision.pool, decision_id=decision.decision_id,
                                                  replicas=replicas, scaler=self._label))

    def status(self, pool: str) -> ReplicaStatus:
        from kubernetes.client.exceptions import ApiException

        try:
            dep = self.apps.read_namespaced_deployment(self._deployment(pool), self.namespace)
        except ApiException as e:
            raise ScalerError(f"reading Deployment of pool {pool}: API error {e.status}") from e
        st = dep.status
        desired = int(dep.spec.replicas or 0)
        running = int((st.replicas if st else 0) or 0)
        ready = int((st.ready_replicas if st else 0) or 0)
        return ReplicaStatus(pool, desired, min(running, desired), ready, max(running - desired, 0))

    def desired(self) -> dict[str, int]:
        out = {}
        for pool, name in self.deployments.items():
            scale = self.apps.read_namespaced_deployment_scale(name, self.namespace)
            out[pool] = int(scale.spec.replicas or 0)
        return out

    def wait_ready(self, pool: str, n: int, timeout_s: float = 300.0, poll_s: float = 1.0) -> ReplicaStatus:
        """Poll the Deployment until ``n`` replicas are ready (readiness probes passed)."""
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.status(pool)
            if st.ready >= n:
                return st
            if time.monotonic() > deadline:
                raise ScalerError(f"pool {pool}: {st.ready} of {n} replicas ready after {timeout_s:g}s")
            time.sleep(poll_s)

    def close(self) -> None:
        self.apps.api_client.close()
