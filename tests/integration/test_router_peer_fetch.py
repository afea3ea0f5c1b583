"""Peer fetch through the router: with a peer weight configured, a request whose prefix sits on a
busy worker goes to the idle one, and the router tells that one where to pull the prefix from.
The idle worker pulls it over NIXL, so the engine reuses it instead of recomputing it. Real
router, two real workers, the official client; the decision and the transfer are on the log."""

from __future__ import annotations

import json
import threading

import openai
import pytest

from control_plane.replay.engine import ReplayEngine
from common.log.catalog import Catalog
from common.log.reader import KafkaLogReader
from common.net import free_port
from common.settings import BusSettings
from schemas.events import KvTransferCompleted, RequestRouted
from tests.integration.test_router import Procs, _wait_http
from tests.integration.workerproc import WorkerProc, start_all
from tests.support.events import read_stream, router_ids
from tests.support.waits import wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(180)]

# Speedup 2: the first request's 4,000 tokens keep its worker busy for about 13 s.
ARGS = ("--speedup", "2", "--block-size", "64", "--device-blocks", "512", "--host-blocks", "64",
        "--load-interval", "0.3")


def test_the_idle_worker_is_chosen_and_pulls_the_prefix_from_the_busy_one(bus: BusSettings, procs: Procs,
                                                                            tmp_path) -> None:
    a = WorkerProc(bus, "pf-a", tmp_path / "a", tmp_path, args=ARGS)
    b = WorkerProc(bus, "pf-b", tmp_path / "b", tmp_path, args=ARGS)
    start_all(a, b, timeout=60)
    cfg = tmp_path / "router.json"
    cfg.write_text(json.dumps({"tier_weights": {"peer": 0.9}}))
    port = free_port()
    procs.router(port, "r-peer", "--no-auth", "--config", str(cfg))
    base = f"http://127.0.0.1:{port}"
    _wait_http(f"{base}/health", lambda r: r.status_code == 200 and r.json()["workers"] == 2)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
    doc = list(range(7000, 7000 + 64 * 10))  # 10 full blocks
    stop = threading.Event()

    def long_request() -> None:
        stream = client.completions.create(model="switchyard-sim", prompt=doc, max_tokens=4000, stream=True,
                                           extra_body={"request_id": "pf-long"})
        for _ in stream:
            if stop.is_set():
                break
        stream.close()

    t = threading.Thread(target=long_request, daemon=True)
    t.start()
    try:
        _wait_http(f"{base}/router/view", lambda r: r.json()["hashes"] >= 10)
        wait_for(lambda: "pf-long" in router_ids(bus), 10, "the long request routed")
        second = client.completions.create(model="switchyard-sim", prompt=doc + [5] * 64, max_tokens=2,
                                           extra_body={"request_id": "pf-short"})
        ids = router_ids(bus)
        routed = {e.data.request_id: e.data for e in read_stream(bus, "requests") if isinstance(e.data, RequestRouted)}
        long_w, short = routed[ids["pf-long"]].worker_id, routed[ids["pf-short"]]
        assert short.worker_id != long_w
        row = {r.worker_id: r for r in short.scores}[short.worker_id]
        assert row.peer_from == long_w and row.overlap_by_tier.get("peer") == 10
        # The engine reused the pulled prefix: 10 blocks.
        assert second.usage.prompt_tokens_details.cached_tokens == 640

        def pulled():
            return [e.data for e in read_stream(bus, "requests")
                    if isinstance(e.data, KvTransferCompleted) and e.data.purpose == "peer_fetch"
                    and e.correlation_id == ids["pf-short"]]

        wait_for(pulled, 10, "the peer fetch on the log")
        ev = pulled()[0]
        assert ev.src_worker == long_w and ev.dst_worker == short.worker_id and ev.blocks == 10
        # Replay re-executes the decision, peer reach included, from the log alone.
        report = ReplayEngine(KafkaLogReader(bus.bootstrap), Catalog(bus.topic_prefix)).verify("start", "end")
        assert report.decisions >= 2 and report.identical == report.decisions, report.summary()
    finally:
        stop.set()
        t.join(30)
        a.kill()
        b.kill()
