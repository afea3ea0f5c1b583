"""Kubernetes manifests under deploy/k8s/: every object validates (strict: no unknown fields)
against the Kubernetes 1.35 OpenAPI schemas kubernetes-validate ships offline, and they hang
together: probes everywhere, selectors that select, the planner config names the worker
Deployments, RBAC grants exactly what the Kubernetes scaler calls."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import msgspec
import pytest
import yaml

from control_plane.planner.config import PlannerConfig

K8S_VERSION = "1.35.0"
DIR = Path(__file__).resolve().parents[2] / "deploy" / "k8s"


def _objects() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(DIR.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path.name, doc))
    return out


OBJECTS = _objects()


def _kind(kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for _, o in OBJECTS if o["kind"] == kind}


@pytest.mark.parametrize("name,obj", OBJECTS, ids=[f"{f}:{o['kind']}/{o['metadata']['name']}" for f, o in OBJECTS])
def test_every_object_validates_strictly(name: str, obj: dict) -> None:
    assert kubernetes_validate.validate(obj, K8S_VERSION, strict=True) == "1.35"


def test_the_components_are_all_there() -> None:
    assert set(_kind("Deployment")) == {"switchyard-router", "switchyard-planner", "switchyard-metrics",
                                        "switchyard-prefill", "switchyard-decode"}


def test_every_container_has_a_readiness_probe_and_selectors_select() -> None:
    for name, dep in _kind("Deployment").items():
        tmpl = dep["spec"]["template"]
        for c in tmpl["spec"]["containers"]:
            assert "readinessProbe" in c, f"{name}/{c['name']} has no readiness probe"
            ports = {p["name"] for p in c.get("ports", [])}
            probe_port = c["readinessProbe"].get("httpGet", {}).get("port")
            assert probe_port in ports, f"{name}: probe port {probe_port} not declared"
        labels = tmpl["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in dep["spec"]["selector"]["matchLabels"].items()), name
    for name, svc in _kind("Service").items():
        selected = [d for d in _kind("Deployment").values()
                    if all(d["spec"]["template"]["metadata"]["labels"].get(k) == v
                           for k, v in svc["spec"]["selector"].items())]
        assert selected, f"service {name} selects nothing"


def test_planner_config_decodes_and_names_the_worker_deployments() -> None:
    cm = _kind("ConfigMap")["switchyard-planner"]
    cfg = msgspec.toml.decode(cm["data"]["planner.toml"].encode(), type=PlannerConfig)
    deployments = _kind("Deployment")
    for pool in cfg.pools:
        dep = deployments[pool.deployment_name]
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--pool") + 1] == pool.name
        assert args[args.index("--role") + 1] == pool.role.value
        # the pod must outlive the worker's drain, else SIGKILL cuts in-flight requests
        drain = float(args[args.index("--drain-timeout-s") + 1])
        assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain
    planner = deployments["switchyard-planner"]["spec"]["template"]["spec"]
    assert planner["serviceAccountName"] == "switchyard-planner"


def test_rbac_grants_what_the_kubernetes_scaler_calls() -> None:
    rules = _kind("Role")["switchyard-planner"]["rules"]
    granted = {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    needed = {("apps", "deployments", "get"), ("apps", "deployments", "patch"),
              ("apps", "deployments/scale", "get"), ("apps", "deployments/scale", "patch"), ("", "pods", "patch")}
    assert needed <= granted
    assert not any(v in ("delete", "create", "*") for _, _, v in granted), "the planner never creates or deletes"
