"""One real worker process on the real broker, driven with the official ``openai`` client:
completions (plain and streamed), bad bodies, metrics and side channel, the events it publishes,
and a SIGTERM drain that lets an in-flight stream finish."""

from __future__ import annotations

import signal
import threading

import httpx
import openai
import pytest

from data_plane.engines import default_hash_config
from data_plane.engines.request import pseudo_token, request_seed
from data_plane.transfer import EndpointMetadata
from common.hashing import hash_blocks
from common.settings import BusSettings, worker_credential, worker_token
from schemas.events import TransferInfo
from tests.integration.workerproc import WorkerProc, of, read_log
from tests.support.waits import wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(120)]

BS = 16


def _expected(rid: str, n: int) -> list[int]:
    """The simulated engine's output: deterministic pseudo-tokens of the request id."""
    return [pseudo_token(request_seed(rid), i) for i in range(n)]


@pytest.fixture
def worker(bus: BusSettings, tmp_path):
    w = WorkerProc(bus, "w-api", tmp_path / "data", tmp_path, args=(
        "--speedup", "2", "--block-size", str(BS), "--device-blocks", "256", "--host-blocks", "32",
        "--load-interval", "0.3", "--drain-timeout-s", "20"))
    w.start()
    yield w
    w.kill()


def test_worker_serves_openai_clients_publishes_its_facts_and_drains(worker: WorkerProc, bus: BusSettings):
    client = openai.OpenAI(base_url=f"{worker.url}/v1", api_key=worker.token(), max_retries=0)
    prompt = list(range(500, 564))  # 64 tokens = 4 full blocks of 16

    # Non-streaming, token-id prompt, request id as an extension field.
    first = client.completions.create(model="switchyard-sim", prompt=prompt, max_tokens=5,
                                      extra_body={"request_id": "req-a"})
    assert first.id == "req-a" and first.object == "text_completion"
    assert first.choices[0].finish_reason == "length"
    assert first.choices[0].model_extra["token_ids"] == _expected("req-a", 5)
    assert first.choices[0].text == "".join(f" t{t}" for t in _expected("req-a", 5))
    assert (first.usage.prompt_tokens, first.usage.completion_tokens, first.usage.total_tokens) == (64, 5, 69)
    assert first.usage.prompt_tokens_details.cached_tokens == 0

    # Streaming with usage; the same prompt hits the prefix cache: 3 blocks (the last block is
    # recomputed for its logits, as in vLLM) = 48 tokens.
    chunks = list(client.completions.create(model="switchyard-sim", prompt=prompt, max_tokens=4, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_headers={"X-Request-Id": "req-b"}))
    token_chunks = [c for c in chunks if c.choices]
    assert [c.choices[0].model_extra["token_ids"][0] for c in token_chunks] == _expected("req-b", 4)
    assert [c.choices[0].finish_reason for c in token_chunks] == [None, None, None, "length"]
    assert all(c.id == "req-b" for c in chunks)
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == 4
    assert usage.prompt_tokens_details.cached_tokens == 48

    # A text prompt is tokenized with the HashTokenizer; /v1/models lists the served model.
    text = client.completions.create(model="switchyard-sim", prompt="the quick brown fox", max_tokens=2)
    assert text.usage.prompt_tokens == 4 and text.usage.completion_tokens == 2
    assert [m.id for m in client.models.list()] == ["switchyard-sim"]

    # Bad bodies are 400 with an OpenAI-shaped error, never 500.
    bad = [b"{not json", {"prompt": [[1, 2]]}, {"prompt": [1, 2], "max_tokens": 0}, {"max_tokens": 3},
           {"prompt": ""}, {"prompt": [-1]}, {"prompt": [1, 2], "stream": "maybe"},
           {"prompt": [1, 2], "kv_transfer_params": {"do_remote_prefill": True}},
           {"prompt": list(range(10_000)), "max_tokens": 10}]  # longer than the 256-block cache
    for body in bad:
        kw = ({"content": body, "headers": {"content-type": "application/json", **worker.credential()}}
              if isinstance(body, bytes) else {"json": body, "headers": worker.credential()})
        r = httpx.post(f"{worker.url}/v1/completions", timeout=10, **kw)
        assert r.status_code == 400, (body, r.status_code, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="switchyard-sim", prompt=[1, 2], max_tokens=0)

    metrics = httpx.get(f"{worker.url}/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket"):
        assert name in metrics, name
    assert 'vllm:prefix_cache_hits_total{engine="w-api",model_name="switchyard-sim"} 48.0' in metrics
    side = EndpointMetadata.decode(httpx.get(f"{worker.url}/kv/metadata", headers=worker.credential()).content)
    epoch = worker.state()["epoch"]
    assert side.agent_name == f"w-api:{epoch}"
    # The private endpoints need the cluster's worker credential: without it, or with another
    # secret, 401 (an OpenAI-shaped error), whatever the method's input.
    private = [("GET", "/kv/metadata"), ("GET", "/debug/state"), ("POST", "/admin/reset_prefix_cache"),
               ("POST", "/admin/kv_bridge/stop"), ("POST", "/v1/completions"), ("GET", "/v1/models")]
    other_worker = worker_token(worker_credential(worker.bus.secrets_dir), "w-other")
    cluster_secret = worker_credential(worker.bus.secrets_dir)
    for method, path in private:
        for headers in ({}, {"Authorization": "Bearer not-the-credential"}, {"Authorization": "Basic eDp5"},
                        {"Authorization": f"Bearer {other_worker}"}, {"Authorization": f"Bearer {cluster_secret}"}):
            r = httpx.request(method, f"{worker.url}{path}", headers=headers, timeout=10)
            assert r.status_code == 401, (method, path, headers, r.status_code, r.text)
            assert r.json()["error"]["type"] == "authentication_error"

    # SIGTERM while a stream is in flight: /health turns 503, new requests are refused, the
    # stream still finishes, then the process exits 0. (600 tokens: the stream must outlast the
    # checks below on a loaded box.)
    streamed: list[int] = []
    first_token = threading.Event()

    def long_stream() -> None:
        for c in client.completions.create(model="switchyard-sim", prompt=list(range(40)), max_tokens=600,
                                           stream=True, extra_body={"request_id": "req-long"}):
            streamed.extend(c.choices[0].model_extra["token_ids"])
            first_token.set()

    t = threading.Thread(target=long_stream)
    t.start()
    assert first_token.wait(10)
    worker.signal(signal.SIGTERM)
    wait_for(lambda: httpx.get(f"{worker.url}/health").status_code == 503, 5, "health 503 while draining")
    refused = httpx.post(f"{worker.url}/v1/completions", json={"prompt": [1, 2, 3]}, timeout=5,
                         headers=worker.credential())
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"
    t.join(30)
    assert streamed == _expected("req-long", 600)
    assert worker.wait(30) == 0

    # What the log says, in order.
    records = read_log(bus, "workers", "kv")
    lifecycle = [r.type for r in of(records, "w-api") if r.topic.endswith(".workers")]
    # Registered first, Deregistered last; load reports go on while the drain lasts.
    assert lifecycle[0] == "WorkerRegistered" and lifecycle[-1] == "WorkerDeregistered"
    assert [t for t in lifecycle if t != "WorkerLoadReported"] == [
        "WorkerRegistered", "WorkerDraining", "WorkerDeregistered"]
    assert lifecycle.index("WorkerDraining") >= 3  # reports every 0.3 s while serving
    reg = of(records, "w-api", "WorkerRegistered")[0].env
    assert reg.epoch == epoch and reg.data.endpoint == worker.url
    assert reg.data.capacity == {"device": 256, "host": 32} and reg.data.block_size == BS
    assert isinstance(reg.data.transfer, TransferInfo) and reg.data.transfer.agent_name == f"w-api:{epoch}"
    assert EndpointMetadata.from_transfer_info(reg.data.transfer) == side
    draining = of(records, "w-api", "WorkerDraining")[0].env.data
    assert draining.reason == "SIGTERM" and draining.inflight == 1

    kv = [r for r in of(records, "w-api") if r.topic.endswith(".kv")]
    assert [(r.type, r.env.data.tier.value) for r in kv[:2]] == [("AllBlocksCleared", "device"),
                                                                 ("AllBlocksCleared", "host")]
    # The drain says on kv that this process's memory tiers are gone (the index never infers it
    # from the deregistration: the two topics are read in any order).
    assert [(r.type, r.env.data.tier.value) for r in kv[-2:]] == [("AllBlocksCleared", "device"),
                                                                  ("AllBlocksCleared", "host")]
    stored = {h for r in kv if r.type == "BlockStored" and r.env.data.tier.value == "device"
              for h in r.env.data.block_hashes}
    assert set(hash_blocks(prompt, default_hash_config(BS))) <= stored
    # One producer for everything: its sequence is dense on each partition it wrote.
    for topic in {r.topic for r in of(records, "w-api")}:
        seqs = [r.env.seq for r in of(records, "w-api") if r.topic == topic]
        assert seqs == list(range(len(seqs))), topic


def _running(w: WorkerProc) -> float:
    for line in httpx.get(f"{w.url}/metrics", timeout=5).text.splitlines():
        if line.startswith("vllm:num_requests_running{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:num_requests_running on /metrics")


def test_worker_enforces_the_router_s_bounds_and_stops_for_a_client_that_left(worker: WorkerProc) -> None:
    """A direct call gets no more than through the router (issue 36): max_tokens, vocabulary,
    context and body size are the router's (common.request_limits); and a client that
    disconnects, streamed or not, stops its generation."""
    auth = worker.credential()
    url = f"{worker.url}/v1/completions"
    for body, code in (({"prompt": "hi", "max_tokens": 131_072}, "max_tokens_exceeded"),
                       ({"prompt": [2**40], "max_tokens": 1}, "invalid_token_id"),
                       ({"prompt": [1] * 131_072, "max_tokens": 1}, "context_length_exceeded")):
        r = httpx.post(url, json=body, headers=auth, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == code, (code, r.status_code, r.text[:300])
    big = b'{"prompt": "' + b"a" * (5 * 1024 * 1024) + b'"}'
    r = httpx.post(url, content=big, headers={**auth, "content-type": "application/json"}, timeout=30)
    assert r.status_code == 413, r.text[:300]
    # 4,000 tokens at speedup 2 take seconds: the client leaves after the first ones.
    for stream in (True, False):
        with httpx.Client(timeout=30, headers=auth) as c:
            if stream:
                with c.stream("POST", url, json={"prompt": [1, 2, 3], "max_tokens": 4000, "stream": True}) as r:
                    assert r.status_code == 200
                    next(r.iter_lines())
            else:
                try:
                    c.post(url, json={"prompt": [1, 2, 3], "max_tokens": 4000}, timeout=1.0)
                except httpx.ReadTimeout:
                    pass
                else:
                    raise AssertionError("4,000 tokens answered within 1 s: the test needs a longer run")
        wait_for(lambda: _running(worker) == 0, timeout=10,
                 what=lambda: f"no running request after the client left (stream={stream}): {_running(worker)}")


def test_open_generation_opens_only_the_generation_routes(bus: BusSettings, tmp_path):
    """``--open-generation`` (bench peers: a third-party router that cannot send a per-worker
    bearer fronts the worker) opens /v1/completions and /v1/models; every other private route
    still answers 401 without the worker's bearer."""
    w = WorkerProc(bus, "w-open", tmp_path / "d", tmp_path, args=["--open-generation"]).start()
    try:
        models = httpx.get(f"{w.url}/v1/models", timeout=10)
        assert models.status_code == 200, models.text
        done = httpx.post(f"{w.url}/v1/completions", json={"model": "switchyard-sim", "prompt": [1, 2, 3],
                                                           "max_tokens": 2}, timeout=30)
        assert done.status_code == 200 and done.json()["choices"], done.text
        for method, path in (("GET", "/kv/metadata"), ("GET", "/debug/state"), ("POST", "/admin/reset_prefix_cache")):
            r = httpx.request(method, f"{w.url}{path}", timeout=10)
            assert r.status_code == 401, (method, path, r.status_code, r.text)
    finally:
        w.kill()
