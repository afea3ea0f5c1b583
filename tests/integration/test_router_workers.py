"""Router in front of real workers (`switchyard worker`): aggregated and disaggregated serving,
the causal chain of events on the log, and a killed worker retried without the client noticing."""

from __future__ import annotations

import signal

import openai
import pytest

from common.net import free_port
from common.settings import BusSettings
from schemas.events import (
    KvTransferCompleted,
    PrefillCompleted,
    RequestCompleted,
    RequestFailed,
    RequestRejected,
    RequestRouted,
)
from tests.integration.test_router import Procs, _wait_http
from tests.integration.workerproc import WorkerProc
from tests.support.events import read_stream, router_ids

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

WORKER_ARGS = ("--speedup", "20", "--block-size", "64", "--device-blocks", "512", "--disk-blocks", "64")


def _chain(bus: BusSettings, client_id: str) -> list[str]:
    rid = router_ids(bus)[client_id]
    return [e.type for e in read_stream(bus, "requests") if e.correlation_id == rid]


def _router_seeing_two_workers(procs: Procs) -> tuple[str, openai.OpenAI]:
    """Start a router and wait until its health counts both workers; its base URL and an OpenAI client."""
    port = free_port()
    procs.router(port)
    base = f"http://127.0.0.1:{port}"
    _wait_http(f"{base}/health", lambda r: r.status_code == 200 and r.json()["workers"] == 2)
    return base, openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)


def test_disaggregated_request_through_router_has_its_whole_chain(bus: BusSettings, procs: Procs, tmp_path) -> None:
    prefill = WorkerProc(bus, "p-0", tmp_path / "p0", tmp_path, role="prefill", args=WORKER_ARGS).start()
    decode = WorkerProc(bus, "d-0", tmp_path / "d0", tmp_path, role="decode", args=WORKER_ARGS).start()
    try:
        _, client = _router_seeing_two_workers(procs)
        prompt = list(range(300, 300 + 64 * 8))  # 8 full blocks
        out = list(client.completions.create(model="switchyard-sim", prompt=prompt, max_tokens=6, stream=True,
                                             extra_body={"request_id": "disagg-1"}))
        assert sum(1 for c in out if c.choices and c.choices[0].text) == 6
        rid = router_ids(bus)["disagg-1"]
        events = [e for e in read_stream(bus, "requests") if e.correlation_id == rid]
        types = [e.type for e in events]
        assert types[0] == "RequestAdmitted"
        routed = [e.data for e in events if isinstance(e.data, RequestRouted)]
        assert [(r.phase.value, r.worker_id) for r in routed] == [("prefill", "p-0"), ("decode", "d-0")]
        assert any(isinstance(e.data, PrefillCompleted) and e.data.worker_id == "p-0" for e in events)
        moved = [e.data for e in events if isinstance(e.data, KvTransferCompleted)]
        assert moved and moved[0].blocks == 8 and moved[0].src_worker == "p-0" and moved[0].dst_worker == "d-0"
        done = [e.data for e in events if isinstance(e.data, RequestCompleted)]
        assert len(done) == 1 and done[0].worker_id == "d-0" and done[0].output_tokens == 6
        assert types.index("RequestAdmitted") < types.index("PrefillCompleted") < types.index("KvTransferCompleted") \
            < types.index("RequestCompleted")
    finally:
        prefill.stop()
        decode.stop()


def test_aggregated_workers_prefix_reuse_and_a_killed_worker_is_retried(bus: BusSettings, procs: Procs, tmp_path) -> None:
    a = WorkerProc(bus, "a-0", tmp_path / "a0", tmp_path, args=WORKER_ARGS).start()
    b = WorkerProc(bus, "a-1", tmp_path / "a1", tmp_path, args=WORKER_ARGS).start()
    try:
        base, client = _router_seeing_two_workers(procs)
        doc = list(range(1000, 1000 + 64 * 10))
        client.completions.create(model="switchyard-sim", prompt=doc, max_tokens=2, extra_body={"request_id": "agg-0"})
        _wait_http(f"{base}/router/view", lambda r: r.json()["hashes"] >= 10)
        second = client.completions.create(model="switchyard-sim", prompt=doc + [5] * 64, max_tokens=2,
                                           extra_body={"request_id": "agg-1"})
        assert second.usage.prompt_tokens_details.cached_tokens >= 640  # the engine really reused the prefix
        ids = {rid: cid for cid, rid in router_ids(bus).items()}
        routed = {ids.get(e.data.request_id): e.data for e in read_stream(bus, "requests")
                  if isinstance(e.data, RequestRouted)}
        assert routed["agg-1"].worker_id == routed["agg-0"].worker_id

        # kill -9 the worker holding the prefix; the next request for it is retried on the other.
        holder = a if routed["agg-0"].worker_id == "a-0" else b
        holder.proc.send_signal(signal.SIGKILL)
        holder.proc.wait(10)
        third = client.completions.create(model="switchyard-sim", prompt=doc + [6] * 64, max_tokens=3,
                                          extra_body={"request_id": "agg-2"})
        assert third.usage.completion_tokens == 3
        events = [e.data for e in read_stream(bus, "requests") if e.correlation_id == router_ids(bus)["agg-2"]]
        failed = [e for e in events if isinstance(e, RequestFailed)]
        assert failed and failed[0].worker_id == holder.worker_id and failed[0].retried
        assert isinstance(events[-1], RequestCompleted) and events[-1].worker_id != holder.worker_id
    finally:
        a.stop()
        b.stop()


def test_a_request_whose_predicted_ttft_exceeds_the_budget_is_refused_at_once(bus: BusSettings, procs: Procs,
                                                                               tmp_path) -> None:
    """Issue 39 step 5: with ``ttft_slo_ms`` set below what even the best worker is predicted to
    give (the prior predicts ~34 ms for 640 uncached tokens), the official client gets 429 with
    Retry-After, and ``RequestRejected`` says why; nothing is routed."""
    a = WorkerProc(bus, "a-0", tmp_path / "a0", tmp_path, args=WORKER_ARGS).start()
    try:
        cfg = tmp_path / "router.json"
        cfg.write_text('{"ttft_slo_ms": 1.0}')
        port = free_port()
        procs.router(port, "r-slo", "--no-auth", "--config", str(cfg))
        base = f"http://127.0.0.1:{port}"
        _wait_http(f"{base}/health", lambda r: r.status_code == 200 and r.json()["workers"] == 1)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model="switchyard-sim", prompt=list(range(2000, 2000 + 640)), max_tokens=2,
                                      extra_body={"request_id": "slo-0"})
        assert int(refused.value.response.headers["retry-after"]) >= 1
        assert "exceeds the budget of 1 ms" in refused.value.message
        events = [e.data for e in read_stream(bus, "requests") if e.correlation_id == router_ids(bus)["slo-0"]]
        assert [type(e).__name__ for e in events] == ["RequestAdmitted", "RequestRejected"]
        rejected = events[-1]
        assert isinstance(rejected, RequestRejected) and rejected.code == "ttft_budget" and rejected.http_status == 429
        assert "predicted TTFT" in rejected.reason and "(a-0)" in rejected.reason
    finally:
        a.stop()


def test_a_requests_own_ttft_budget_header_tightens_admission(bus: BusSettings, procs: Procs, tmp_path) -> None:
    """The ``x-ttft-budget-ms`` header: without it (the router's budget off) the request is
    served; with a budget below the prediction it is refused with 429; a malformed one is 400."""
    a = WorkerProc(bus, "a-0", tmp_path / "a0", tmp_path, args=WORKER_ARGS).start()
    try:
        port = free_port()
        procs.router(port, "r-slo-header")
        base = f"http://127.0.0.1:{port}"
        _wait_http(f"{base}/health", lambda r: r.status_code == 200 and r.json()["workers"] == 1)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
        prompt = list(range(3000, 3000 + 640))
        ok = client.completions.create(model="switchyard-sim", prompt=prompt, max_tokens=2)
        assert ok.usage.completion_tokens == 2
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model="switchyard-sim", prompt=prompt + [7] * 640, max_tokens=2,
                                      extra_headers={"x-ttft-budget-ms": "0.5"},
                                      extra_body={"request_id": "slo-h"})
        assert "exceeds the budget of 0.5 ms" in refused.value.message
        rejected = [e.data for e in read_stream(bus, "requests") if e.correlation_id == router_ids(bus)["slo-h"]][-1]
        assert isinstance(rejected, RequestRejected) and rejected.code == "ttft_budget"
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="switchyard-sim", prompt=prompt, max_tokens=2,
                                      extra_headers={"x-ttft-budget-ms": "soon"})
    finally:
        a.stop()


def test_overload_is_shed_with_reasons_once_the_queue_would_spend_the_budget(bus: BusSettings, procs: Procs,
                                                                             tmp_path) -> None:
    """Issue 39 step 4, the overload path: one worker, the router's queue holds all but one
    request at a time (``--busy-prefill-tokens 1``) and the budget is 300 ms. Bursts of 24
    concurrent requests, until one is refused: every answer is a token stream or 429
    ``ttft_budget``, with Retry-After, and each refusal's ``RequestRejected`` on the log holds
    its code and a reason (the budget spent in the queue, or the prediction with the time spent).
    Nothing about speed is asserted: the burst is repeated until the queue refuses."""
    import asyncio

    import httpx

    a = WorkerProc(bus, "a-0", tmp_path / "a0", tmp_path, args=("--speedup", "1", *WORKER_ARGS[2:])).start()
    try:
        cfg = tmp_path / "router.json"
        cfg.write_text('{"ttft_slo_ms": 300.0}')
        port = free_port()
        procs.router(port, "r-shed", "--no-auth", "--config", str(cfg), "--busy-prefill-tokens", "1")
        base = f"http://127.0.0.1:{port}"
        _wait_http(f"{base}/health", lambda r: r.status_code == 200 and r.json()["workers"] == 1)

        async def one(client: httpx.AsyncClient, cid: str, i: int) -> tuple[str, int, str, str]:
            body = {"model": "switchyard-sim", "prompt": list(range(5000 + 640 * i, 5000 + 640 * (i + 1))),
                    "max_tokens": 2, "request_id": cid}
            r = await client.post(f"{base}/v1/completions", json=body)
            code = r.json().get("error", {}).get("code", "") if r.status_code != 200 else ""
            return cid, r.status_code, code, r.headers.get("retry-after", "")

        async def burst(n: int) -> list[tuple[str, int, str, str]]:
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(*(one(client, f"shed-{n}-{i}", 24 * n + i) for i in range(24)))

        answers: list[tuple[str, int, str, str]] = []
        for n in range(10):
            answers += asyncio.run(burst(n))
            if any(status == 429 for _, status, _, _ in answers):
                break
        refused = [(cid, code, retry) for cid, status, code, retry in answers if status != 200]
        assert refused, "ten bursts of 24 against one worker, one at a time, and nothing was refused"
        assert all(code == "ttft_budget" and int(retry) >= 1 for _, code, retry in refused), refused
        ids = router_ids(bus)
        ends = {e.correlation_id: e.data for e in read_stream(bus, "requests") if isinstance(e.data, RequestRejected)}
        for cid, _, _ in refused:
            rejected = ends[ids[cid]]
            assert rejected.code == "ttft_budget" and rejected.http_status == 429
            assert "budget" in rejected.reason and "ms" in rejected.reason
    finally:
        a.stop()
