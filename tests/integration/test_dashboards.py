"""Dashboards and the Prometheus scrape config, checked two ways.

Static (no services): every metric name a dashboard query references is one the code defines
(the metrics processor's registry, the router's ``RouterMetrics``) or Prometheus' own ``up``;
every panel uses the ``prometheus`` data source; the rendered scrape config passes ``promtool``.

Live (real Kafka, real Prometheus): a private Prometheus (own port and data dir under
``.stack/tests/``) scrapes, every second, the metrics processor and a real router in front of
two mini workers; requests go through the router and a short stream of every other event type
is produced; then *every* query of *every* panel of *every* dashboard must return data.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from control_plane.metrics.exposition import build_registry
from control_plane.metrics.families import BrokerState, processor_families
from control_plane.metrics.projection import MetricsProjection
from control_plane.router.serving import RouterMetrics
from common.stack_settings import StackSettings
from ops.stack.prometheus import PrometheusService, render_config, write_targets
from common.log.catalog import Catalog
from common.log.kafka import EventProducer
from common.net import free_port
from common.settings import BusSettings, repo_root
from schemas import events as ev
from tests.integration.test_router import Procs, _wait_http

DASHBOARDS = repo_root() / "dashboards"
#: Grafana variables the dashboards use, and what the test substitutes for them.
VARIABLES = {"$__rate_interval": "1m", "$pool": ".*"}
#: Names Prometheus itself defines.
BUILTIN = {"up"}


# ----------------------------------------------------------------------------------------------
# Reading the dashboards
# ----------------------------------------------------------------------------------------------


def _dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def _panels(doc: dict) -> list[dict]:
    out = []
    for p in doc.get("panels", []):
        out.append(p)
        out.extend(p.get("panels", []))  # panels inside a collapsed row
    return out


def _queries() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, expr) for every target of every panel."""
    return [(name, p["title"], t["expr"]) for name, doc in _dashboards().items() for p in _panels(doc)
            for t in p.get("targets", [])]


def _substitute(expr: str) -> str:
    for var, value in VARIABLES.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
    return expr


_CLAUSE = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
             "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects: identifiers left once strings, label matchers,
    range selectors and grouping clauses are removed, that are not functions or keywords."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = _CLAUSE.sub(" ", s)
    names = set()
    for m in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", s):
        if s[m.end():].lstrip().startswith("(") or m.group().lower() in _KEYWORDS:
            continue
        names.add(m.group())
    return names


def _exposed(registry) -> set[str]:
    names = set()
    for fam in registry.collect():
        if fam.type == "counter":
            names.add(f"{fam.name}_total")
        elif fam.type == "histogram":
            names.update({f"{fam.name}_bucket", f"{fam.name}_sum", f"{fam.name}_count"})
        else:
            names.add(fam.name)
    return names


def defined_metric_names() -> set[str]:
    processor = build_registry(lambda: MetricsProjection().families() + processor_families(BrokerState(), {}))
    return _exposed(processor) | _exposed(RouterMetrics().registry) | BUILTIN


# ----------------------------------------------------------------------------------------------
# Static checks
# ----------------------------------------------------------------------------------------------


def test_metric_name_parser() -> None:
    assert metric_names('sum by (le, pool) (rate(a_bucket{pool=~"x"}[1m])) / ignoring(tier) group_left b') == {
        "a_bucket", "b"}
    assert metric_names("time() - max by (stream) (c_seconds)") == {"c_seconds"}
    assert metric_names("histogram_quantile(0.99, sum by (le) (rate(d_bucket[5m])))") == {"d_bucket"}
    assert metric_names("count(up == 0) or vector(0)") == {"up"}


def test_every_dashboard_query_references_defined_metrics() -> None:
    defined = defined_metric_names()
    unknown = {}
    for name, title, expr in _queries():
        missing = metric_names(_substitute(expr)) - defined
        if missing:
            unknown[f"{name}: {title}"] = sorted(missing)
    assert not unknown, f"dashboard queries reference metrics nothing defines: {unknown}"
    for name, doc in _dashboards().items():
        for var in doc["templating"]["list"]:
            m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", var["query"]["query"])
            assert m and m.group(1) in defined, (name, var["query"])


def test_processor_shares_only_the_index_gauges_with_the_router() -> None:
    """Both fold the same log into a prefix index and report its size and staleness under the
    same names (a dashboard compares them by job); no other name means two things."""
    processor = build_registry(lambda: MetricsProjection().families() + processor_families(BrokerState(), {}))
    ours = {f.name: f.type for f in processor.collect()}
    router = {f.name: f.type for f in RouterMetrics().registry.collect()}
    shared = set(ours) & set(router)
    assert shared == {"switchyard_index_hashes", "switchyard_index_stale_workers"}
    assert all(ours[n] == router[n] == "gauge" for n in shared)


def test_dashboards_are_grafana_v39_on_the_prometheus_datasource() -> None:
    docs = _dashboards()
    assert set(docs) == {"fleet-overview.json", "router-and-cache.json", "planner-and-slos.json",
                         "kv-tiers-and-transfers.json", "event-pipeline-health.json"}
    uids = [d["uid"] for d in docs.values()]
    assert len(set(uids)) == len(uids)
    for name, doc in docs.items():
        assert doc["schemaVersion"] == 39, name
        panels = _panels(doc)
        assert len(panels) >= 10, name
        ids = [p["id"] for p in panels]
        assert len(set(ids)) == len(ids), f"{name}: duplicate panel ids"
        for p in panels:
            assert p["datasource"] == {"type": "prometheus", "uid": "prometheus"}, (name, p["title"])
            assert p["targets"], (name, p["title"])
            assert [t["refId"] for t in p["targets"]] == [chr(65 + i) for i in range(len(p["targets"]))]
            for t in p["targets"]:
                assert t["datasource"]["uid"] == "prometheus" and t["expr"].strip(), (name, p["title"])
            g = p["gridPos"]
            assert g["x"] + g["w"] <= 24 and g["h"] > 0, (name, p["title"])


def test_provisioning_points_at_the_same_datasource() -> None:
    ds = (DASHBOARDS / "provisioning" / "datasources.yaml").read_text()
    assert "uid: prometheus" in ds and "type: prometheus" in ds
    assert "type: file" in (DASHBOARDS / "provisioning" / "dashboards.yaml").read_text()


def test_rendered_scrape_config_passes_promtool(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool (Debian package prometheus) is missing: bash scripts/install-deps.sh"
    for default in (DASHBOARDS / "targets").glob("*.json"):
        shutil.copy(default, tmp_path / default.name)
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(render_config((DASHBOARDS / "prometheus.yml").read_text(), targets_dir=tmp_path,
                                 scrape_interval="15s", self_address="127.0.0.1:59090"))
    r = subprocess.run([promtool, "check", "config", str(cfg)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    with pytest.raises(ValueError, match="no scrape job"):
        write_targets(tmp_path, "grafana", ["x:1"])


# ----------------------------------------------------------------------------------------------
# Live: every panel query returns data from a real Prometheus
# ----------------------------------------------------------------------------------------------

BS, ALGO = 64, "sha256"


class _Synthetic:
    """Producers for the events the router and mini workers do not produce themselves."""

    def __init__(self, bus: BusSettings) -> None:
        self.bus = bus
        self.p1, self.d1, self.x1 = (EventProducer(bus, w) for w in ("p1", "d1", "x1"))
        self.router, self.ops, self.planner = (EventProducer(bus, n) for n in ("router-synthetic", "ops", "planner"))

    def close(self) -> None:
        for prod in (self.p1, self.d1, self.x1, self.router, self.ops, self.planner):
            prod.close(10)


def _synthetic_events(syn: _Synthetic, wave: int) -> None:
    """A short disaggregated story plus every event type the router and mini workers do not
    produce themselves: tier moves and clears, transfers (one failing), failures, a rejection,
    a worker draining away, scaling, admin actions, a redelivered event and two poison records.
    Each wave uses new request ids and blocks, so every counter grows in every wave."""
    bus = syn.bus
    p1, d1, x1, router, ops, planner = syn.p1, syn.d1, syn.x1, syn.router, syn.ops, syn.planner
    for prod, wid, role, pool in ((p1, "p1", "prefill", "prefill"), (d1, "d1", "decode", "decode"),
                                  (x1, "x1", "decode", "decode")):
        prod.publish(ev.WorkerRegistered(worker_id=wid, role=role, pool=pool, endpoint=f"http://127.0.0.1:9/{wid}",
                                      capacity={"device": 1000, "host": 4000}, block_size=BS, hash_algo=ALGO))
        prod.publish(ev.WorkerLoadReported(worker_id=wid, running=1, waiting=2, queued_prefill_tokens=256,
                                        tier_usage={"device": 0.4, "host": 0.1}))
    chain = list(range(900_001 + 100 * wave, 900_009 + 100 * wave))
    p1.publish(ev.BlockStored(worker_id="p1", tier="device", block_hashes=chain, block_size=BS, hash_algo=ALGO))
    p1.publish(ev.BlockMoved(worker_id="p1", block_hashes=chain[4:], from_tier="device", to_tier="host"))
    p1.publish(ev.BlockRemoved(worker_id="p1", tier="host", block_hashes=chain[6:]))
    d1.publish(ev.BlockStored(worker_id="d1", tier="device", block_hashes=chain[:2], block_size=BS, hash_algo=ALGO))
    d1.publish(ev.AllBlocksCleared(worker_id="d1", tier="device"))
    x1.publish(ev.WorkerDraining(worker_id="x1", reason="scale down", inflight=0))
    x1.publish(ev.WorkerDeregistered(worker_id="x1", reason="scaled down"))

    ops.publish(ev.PoolUpdated(actor="ops", pool="decode", role="decode", ttft_slo_ms=1000.0, itl_slo_ms=30.0,
                            min_replicas=1, max_replicas=8))
    ops.publish(ev.PoolPinned(actor="ops", pool="prefill", replicas=2, reason="load test"))
    ops.publish(ev.RouterConfigChanged(actor="ops", config_version=2, config={"mode": "kv"}))
    ops.publish(ev.PlannerConfigChanged(actor="ops", config_version=1, config={}))
    ops.publish(ev.WorkerDrainRequested(actor="ops", worker_id="x1", reason="test"))
    ops.publish(ev.AdminAction(actor="ops", action="token_created", target="ci"))
    planner.publish(ev.ScalingDecision(pool="decode", decision_id=f"sd-{wave}", role="decode", from_replicas=1,
                                    to_replicas=2, reason="ttft above target", config_version=1, predictor="constant"))
    planner.publish(ev.ScalingApplied(pool="decode", decision_id=f"sd-{wave}", replicas=2, scaler="virtual"))

    for i, (ok, ttft) in enumerate(((True, 800.0), (False, 1600.0))):
        rid = f"disagg-{wave}-{i}"
        router.publish(ev.RequestAdmitted(request_id=rid, model="m", prompt_tokens=8 * BS, max_tokens=16,
                                       block_hashes=chain, block_size=BS, hash_algo=ALGO))
        router.publish(ev.RequestRouted(
            request_id=rid, worker_id="p1", phase="prefill", mode="kv", config_version=2, rng_seed=i,
            router_id="router-synthetic", view_state="EXACT",
            scores=[ev.CandidateScore(worker_id="p1", overlap_blocks=6, overlap_by_tier={"device": 4, "host": 2}),
                    ev.CandidateScore(worker_id="p9", overlap_blocks=8, overlap_by_tier={"device": 8})]))
        router.publish(ev.RequestRouted(request_id=rid, worker_id="d1", phase="decode", mode="kv", config_version=2,
                                     rng_seed=i, router_id="router-synthetic", view_state="DEGRADED",
                                     scores=[ev.CandidateScore(worker_id="d1")]))
        p1.publish(ev.PrefillCompleted(request_id=rid, worker_id="p1", prompt_tokens=8 * BS, cached_tokens=6 * BS,
                                    duration_ms=ttft - 100))
        common = dict(request_id=rid, transfer_id=f"t{wave}-{i}", src_worker="p1", dst_worker="d1", blocks=8, backend="UCX")
        d1.publish(ev.KvTransferStarted(bytes=8 * 16384, **common))
        if ok:
            d1.publish(ev.KvTransferCompleted(bytes=8 * 16384, duration_ms=3.5, **common))
        else:
            d1.publish(ev.KvTransferFailed(duration_ms=10_000.0, reason="TransferTimeout: no READ completion",
                                        fallback="recompute", **common))
        router.publish(ev.RequestCompleted(request_id=rid, worker_id="d1", prompt_tokens=8 * BS, output_tokens=16,
                                        cached_tokens=6 * BS, ttft_ms=ttft, itl_mean_ms=25.0, e2e_ms=ttft + 400))
    router.publish(ev.RequestAdmitted(request_id=f"lost-{wave}", model="m", prompt_tokens=BS, max_tokens=4, block_size=BS,
                                   hash_algo=ALGO))
    router.publish(ev.RequestFailed(request_id=f"lost-{wave}", worker_id="d1", reason="reset", code="worker_lost", retried=True))
    router.publish(ev.RequestFailed(request_id=f"lost-{wave}", worker_id="d1", reason="reset", code="worker_lost"))
    router.publish(ev.RequestRejected(request_id=f"rej-{wave}", reason="no eligible worker", code="no_workers",
                                   http_status=503))
    # A redelivered event (same envelope, new offset) and two poison records: the router's view
    # dead-letters the one on kv; the one on requests is only counted as undecodable.
    env = router.publish(ev.RequestAdmitted(request_id=f"dup-{wave}", model="m", prompt_tokens=BS, max_tokens=4,
                                         block_size=BS, hash_algo=ALGO))
    cat = Catalog(bus.topic_prefix)
    router.produce_raw(cat.topic("requests"), router.signer.sign(env.type, env.key, router.codec.encode(env)),
                       env.key.encode())
    router.produce_raw(cat.topic("kv"), b"\x00not an envelope", b"p1")
    router.produce_raw(cat.topic("requests"), b"\x00not an envelope either", b"x")
    for prod in (p1, d1, x1, router, ops, planner):
        assert prod.flush(30) == 0


def _query(prom: PrometheusService, expr: str) -> list:
    r = httpx.get(f"{prom.url}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def _processor_metrics(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text


def _sample(text: str, line_prefix: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(line_prefix):
            return float(line.rsplit(" ", 1)[1])
    return None


def _has_data(result: list) -> bool:
    return bool(result)


def _has_value(result: list) -> bool:
    """At least one sample that is a number (a rate over no increase is 0/0 = NaN)."""
    return any(r["value"][1] not in ("NaN", "+Inf", "-Inf") for r in result)


def _router_traffic(base: str, wave: int) -> None:
    """Real requests through the router: a shared document (prefix reuse), streaming, chat."""
    doc = list(range(5000, 5000 + BS * 8))
    with httpx.Client(base_url=base, timeout=30) as client:
        r = client.post("/v1/completions", json={"prompt": doc + [1, wave], "max_tokens": 4,
                                                 "request_id": f"doc-{wave}-0"})
        assert r.status_code == 200, r.text
        _wait_http(f"{base}/router/view", lambda r: r.json()["hashes"] >= 8)
        for i in range(1, 4):
            r = client.post("/v1/completions", json={"prompt": doc + [2, wave, i], "max_tokens": 4,
                                                     "request_id": f"doc-{wave}-{i}"})
            assert r.status_code == 200, r.text
        r = client.post("/v1/completions", json={"prompt": f"stream me {wave} " * 20, "max_tokens": 3, "stream": True})
        assert r.status_code == 200 and "[DONE]" in r.text
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": f"hi {wave} " * 20}],
                                                      "max_tokens": 3})
        assert r.status_code == 200, r.text


def _wait_folded(mport: int, wave: int) -> str:
    """Until the processor has folded both waves' events (the router dead-lettered the kv
    poison record) and probed the consumer groups; returns its /metrics text."""
    deadline = time.monotonic() + 30
    text = ""
    while time.monotonic() < deadline:
        text = _processor_metrics(mport)
        done = _sample(text, 'switchyard_requests_total{endpoint="completions",outcome="completed",pool="default"}')
        dlq = _sample(text, 'switchyard_deadletter_records_total{reason="malformed",source="kv"}')
        lagging = httpx.get(f"http://127.0.0.1:{mport}/health", timeout=5).json()["lag_records"]
        # The wave's redelivered and undecodable records too: the lag figure comes from the
        # last probe, which may predate the wave's last records.
        dup = _sample(text, 'switchyard_metrics_records_total{outcome="duplicate",stream="requests"}')
        bad = _sample(text, 'switchyard_metrics_records_total{outcome="undecodable",stream="requests"}')
        if (done == 5 * (wave + 1) and dlq == wave + 1 and dup == bad == wave + 1 and lagging == 0
                and "switchyard_consumer_group_lag_records{" in text):
            return text
        time.sleep(0.3)
    raise AssertionError(f"processor did not fold wave {wave}:\n{text}")


@pytest.fixture
def prometheus(bus: BusSettings):
    state = repo_root() / ".stack" / "tests" / f"dashboards-{bus.topic_prefix}"
    prom = PrometheusService(StackSettings(state_dir=state, prometheus_port=free_port()), scrape_interval="1s",
                             seed_targets=False)
    prom.start()
    yield prom
    prom.stop()
    shutil.rmtree(state, ignore_errors=True)


@pytest.mark.kafka
@pytest.mark.slow
def test_every_panel_query_returns_data(bus: BusSettings, prometheus: PrometheusService, procs: Procs) -> None:
    env = {**os.environ, "SWITCHYARD_KAFKA_BOOTSTRAP": bus.bootstrap, "SWITCHYARD_TOPIC_PREFIX": bus.topic_prefix,
           "PYTHONUNBUFFERED": "1"}
    processor = subprocess.Popen(
        [sys.executable, "-m", "control_plane.metrics.cli", "run", "--port", "0", "--processor-id", "dash",
         "--probe-every", "1", "--snapshot-every", "2", "--targets-dir", str(prometheus.targets_dir)],
        env=env, stdout=subprocess.PIPE, stderr=procs.log, text=True)
    try:
        procs.worker("w1")
        procs.worker("w2")
        router_port = free_port()
        procs.router(router_port, rid="r-dash")
        write_targets(prometheus.targets_dir, "router-r-dash", [f"127.0.0.1:{router_port}"], {"router_id": "r-dash"})
        base = f"http://127.0.0.1:{router_port}"
        _wait_http(f"{base}/health", lambda r: r.status_code == 200 and r.json()["workers"] == 2)
        ready = processor.stdout.readline()
        assert ready.startswith("READY port="), ready
        mport = int(ready.strip().split("=")[1])

        # Two waves of traffic: after the first, Prometheus has seen every series, so the second
        # makes every rate, ratio and quantile a real number rather than 0 or NaN.
        queries = _queries()
        assert len(queries) >= 60
        syn = _Synthetic(bus)
        for wave in range(2):
            _router_traffic(base, wave)
            _synthetic_events(syn, wave)
            text = _wait_folded(mport, wave)
            assert _sample(text, 'switchyard_metrics_records_total{outcome="duplicate",stream="requests"}') == wave + 1
            assert _sample(text, 'switchyard_metrics_records_total{outcome="undecodable",stream="requests"}') == wave + 1
            # 3 requests per wave reuse the 8-block document on the worker holding it.
            assert _sample(text, 'switchyard_prefix_hit_blocks_total{pool="default",tier="device"}') >= 24 * (wave + 1)
            # The log fold's index equals the router's own (same events, same fold).
            _wait_http(f"{base}/metrics", lambda r: _sample(r.text, "switchyard_index_hashes ")
                       == _sample(_processor_metrics(mport), "switchyard_index_hashes "), timeout=15)
            # Every query of every panel returns data (after the second wave: a real value).
            need = _has_data if wave == 0 else _has_value
            pending = list(queries)
            bad: list[tuple[str, str, str, list]] = []
            deadline = time.monotonic() + (60 if wave == 0 else 120)  # a condition: a slow box only waits longer
            more = 0
            while True:
                bad = [(n, t, e, res) for n, t, e in pending if not need(res := _query(prometheus, _substitute(e)))]
                pending = [(n, t, e) for n, t, e, _ in bad]
                if not bad or time.monotonic() > deadline:
                    break
                if wave > 0 and more < 5:
                    # On a slow box the 1m rate windows can move past the last wave before every
                    # query has run: keep traffic coming (new ids, so every counter grows).
                    more += 1
                    _router_traffic(base, 10 + more)
                    _synthetic_events(syn, 10 + more)
                time.sleep(1)
            assert not bad, f"wave {wave}: panels without {'data' if wave == 0 else 'a value'}:\n" + "\n".join(
                f"{n} / {t}: {e} -> {res}" for n, t, e, res in bad)
        syn.close()
        jobs = {r["metric"]["job"] for r in _query(prometheus, "up == 1")}
        assert {"switchyard-metrics", "switchyard-router", "prometheus"} <= jobs
    finally:
        processor.terminate()
        code = processor.wait(30)
    assert code == 0, "the processor exits cleanly on SIGTERM (after a final checkpoint)"
    assert not list(prometheus.targets_dir.glob("metrics-*.json")), "its target file is removed on stop"
