"""A small Kubernetes API server for tests: real HTTP on 127.0.0.1, the real REST paths.

Implements what the Kubernetes scaler uses:

* ``GET/PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}`` (merge patch of metadata, with
  the ``resourceVersion`` precondition -> 409 on mismatch);
* ``GET/PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale``;
* ``PATCH /api/v1/namespaces/{ns}/pods/{name}`` (annotations; 404 for unknown pods).

``dryRun=All`` validates and answers without persisting. Readiness is simulated: after a scale
change, ``status.readyReplicas`` reaches ``spec.replicas`` ``ready_delay_s`` later.
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

_DEP = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/deployments/([^/]+)(/scale)?$")
_POD = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)$")


class FakeCluster:
    def __init__(self, ready_delay_s: float = 0.2) -> None:
        self.ready_delay_s = ready_delay_s
        self.lock = threading.Lock()
        self.deployments: dict[tuple[str, str], dict] = {}
        self.pods: dict[tuple[str, str], dict] = {}
        self.requests: list[tuple[str, str, dict | None, dict]] = []
        self._rv = 100

    def add_deployment(self, ns: str, name: str, replicas: int) -> None:
        self._rv += 1
        self.deployments[(ns, name)] = {"replicas": replicas, "ready": replicas, "changed": 0.0,
                                        "annotations": {}, "rv": str(self._rv), "generation": 1}

    def add_pod(self, ns: str, name: str) -> None:
        self.pods[(ns, name)] = {"annotations": {}}

    def ready(self, d: dict) -> int:
        if time.monotonic() - d["changed"] >= self.ready_delay_s:
            d["ready"] = d["replicas"]
        return min(d["ready"], d["replicas"])

    def deployment_json(self, ns: str, name: str, d: dict) -> dict:
        labels = {"app": name}
        return {
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": ns, "resourceVersion": d["rv"], "generation": d["generation"],
                         "annotations": d["annotations"], "labels": labels},
            "spec": {"replicas": d["replicas"], "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels},
                                  "spec": {"containers": [{"name": "worker", "image": "switchyard:dev"}]}}},
            "status": {"observedGeneration": d["generation"], "replicas": max(d["replicas"], d["ready"]),
                       "readyReplicas": self.ready(d), "availableReplicas": self.ready(d),
                       "updatedReplicas": d["replicas"]},
        }

    def scale_json(self, ns: str, name: str, d: dict) -> dict:
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": name, "namespace": ns, "resourceVersion": d["rv"]},
                "spec": {"replicas": d["replicas"]},
                "status": {"replicas": max(d["replicas"], d["ready"]), "selector": f"app={name}"}}


def serve(cluster: FakeCluster) -> tuple[ThreadingHTTPServer, str]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):  # quiet
            pass

        def _send(self, code: int, obj: dict) -> None:
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _status(self, code: int, reason: str, msg: str) -> None:
            self._send(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": msg,
                              "reason": reason, "code": code})

        def _route(self, method: str) -> None:
            url = urlparse(self.path)
            q = parse_qs(url.query)
            dry = q.get("dryRun") == ["All"]
            body = None
            if method == "PATCH":
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                if self.headers.get("Content-Type") != "application/merge-patch+json":
                    return self._status(415, "UnsupportedMediaType", f"got {self.headers.get('Content-Type')}")
            with cluster.lock:
                cluster.requests.append((method, url.path, body, q))
                m = _DEP.match(url.path)
                if m:
                    ns, name, sub = m.group(1), m.group(2), m.group(3)
                    d = cluster.deployments.get((ns, name))
                    if d is None:
                        return self._status(404, "NotFound", f'deployments.apps "{name}" not found')
                    if method == "PATCH":
                        if sub:
                            replicas = body.get("spec", {}).get("replicas")
                            if not isinstance(replicas, int) or replicas < 0:
                                return self._status(422, "Invalid", "spec.replicas must be >= 0")
                            if not dry and replicas != d["replicas"]:
                                d["replicas"] = replicas
                                d["changed"] = time.monotonic()
                                d["ready"] = min(d["ready"], replicas)
                                cluster._rv += 1
                                d["rv"] = str(cluster._rv)
                        else:
                            md = body.get("metadata", {})
                            rv = md.get("resourceVersion")
                            if rv is not None and rv != d["rv"]:
                                return self._status(409, "Conflict", "the object has been modified")
                            if not dry:
                                d["annotations"].update(md.get("annotations", {}))
                                cluster._rv += 1
                                d["rv"] = str(cluster._rv)
                    return self._send(200, cluster.scale_json(ns, name, d) if sub else cluster.deployment_json(ns, name, d))
                m = _POD.match(url.path)
                if m and method == "PATCH":
                    p = cluster.pods.get((m.group(1), m.group(2)))
                    if p is None:
                        return self._status(404, "NotFound", f'pods "{m.group(2)}" not found')
                    if not dry:
                        p["annotations"].update(body.get("metadata", {}).get("annotations", {}))
                    return self._send(200, {"apiVersion": "v1", "kind": "Pod",
                                            "metadata": {"name": m.group(2), "namespace": m.group(1),
                                                         "annotations": p["annotations"]},
                                            "spec": {"containers": [{"name": "worker", "image": "switchyard:dev"}]}})
            return self._status(404, "NotFound", url.path)

        def do_GET(self):  # noqa: N802
            self._route("GET")

        def do_PATCH(self):  # noqa: N802
            self._route("PATCH")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"
