"""Input that cannot hurt (issue 14, item 4): every bad request an attacker sent the router is
answered with an OpenAI-style 4xx that says why, over a keep-alive connection that stays usable;
the router's health stays EXACT and the worker's state (registry entry, ledger, failures on
the log) does not change. The router runs with API keys on, and every request here carries a
valid key: what is under test is the input, past the key check.

Real HTTP on both sides: the router's FastAPI app, served by the router's own server (the
crate's, common/native_http.py), and a fake worker served by uvicorn, each on a local port; the router's log is a ``MemorySink`` (no broker). The client is the official
``openai`` client where it can express the request, else ``httpx`` with the raw bytes. Every
request of a test goes over one TCP connection (a one-connection pool), and the test checks the
client port never changed: a reset would have forced a new connection.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from control_plane.router import RouterConfig
from control_plane.router.health import assess
from control_plane.router.server import create_app
from control_plane.router.serving import RouterApp, RouterAuth, RouterMetrics
from control_plane.router.keys import KEY_PREFIX, KeyTable
from control_plane.router.limits import RequestLimits
from control_plane.router.proxy import Router
from control_plane.router.view import RouterView, WorkerState
from common import bearer
from common.hashing import HashAlgo, HashConfig
from common.connection_limits import ConnectionLimits
from common.native_http import Server as NativeServer
from common.log.sink import MemorySink
from common.net import free_port
from common.tokenizer import HashTokenizer
from schemas import EnvelopeFactory
from schemas.events import RequestAdmitted, RequestFailed, RequestRejected, RequestRouted, RouterKeyIssued
from tests.support.waits import wait_for

MODEL = "switchyard-sim"
#: The fake worker's vocabulary: smaller than the router's limit, so a request can pass the
#: router and still be refused by the worker (a worker-side 4xx caused by client input).
WORKER_VOCAB = 32_000
GOOD = {"model": MODEL, "prompt": [300, 301, 302, 303], "max_tokens": 2}


# -- servers ----------------------------------------------------------------------------------


class Served:
    """An ASGI app on a local port, served in a thread: by uvicorn (the fake worker), or with
    ``connections`` by the router's own server (common/native_http.py) with those limits."""

    def __init__(self, app: FastAPI, connections: ConnectionLimits | None = None) -> None:
        self.port = free_port()
        self.server: uvicorn.Server | NativeServer
        if connections is None:
            self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                        loop="asyncio", access_log=False))
        else:
            self.server = NativeServer(app, "127.0.0.1", self.port, connections)
        self.thread = threading.Thread(target=self.server.run, name=f"served-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Served:
        self.thread.start()
        wait_for(lambda: self.server.started, timeout=20, what=f"a server on {self.port}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(20)


def fake_worker(calls: list[dict]) -> FastAPI:
    """A worker that streams ``max_tokens`` pseudo tokens and, like an engine, refuses token ids
    outside its vocabulary with a 400."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        calls.append(body)
        bad = [t for t in body["prompt"] if not 0 <= t < WORKER_VOCAB]
        if bad:
            return JSONResponse(status_code=400, content={"error": {
                "message": f"token id {bad[0]} is out of vocabulary", "type": "invalid_request_error",
                "param": "prompt", "code": 400}})
        n = body["max_tokens"]

        def sse() -> Iterator[str]:
            for i in range(n):
                chunk = {"choices": [{"text": f" t{i}", "token_ids": [256 + i],
                                      "finish_reason": "length" if i == n - 1 else None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                     "total_tokens": len(body["prompt"]) + n}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    return app


@dataclass
class Stack:
    router: Router
    sink: MemorySink
    ctx: RouterApp
    worker_calls: list[dict]
    url: str
    http: httpx.Client
    key: str
    ports: set[int] = field(default_factory=set)

    def post(self, path: str, body: dict | None = None, content: bytes | None = None, **kw) -> httpx.Response:
        if content is None:
            content = json.dumps(body).encode()
        r = self.http.post(path, content=content, headers={"Content-Type": "application/json", **kw.pop("headers", {})},
                           **kw)
        self.ports.add(client_port(r))
        return r

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.key, max_retries=0, http_client=self.http)

    def worker(self) -> WorkerState:
        return self.router.view.workers["w-0"]


def client_port(r: httpx.Response) -> int:
    """The client side's port of the connection ``r`` came over."""
    return r.extensions["network_stream"].get_extra_info("client_addr")[1]


@pytest.fixture
def stack() -> Iterator[Stack]:
    with router_stack() as s:
        yield s


@contextmanager
def router_stack(limits: RequestLimits = RequestLimits(), connections: ConnectionLimits = ConnectionLimits(),
                 plain: bool = False) -> Iterator[Stack]:
    """The router's app with API keys on, in front of the fake worker, and a keep-alive client
    holding a valid key; ``plain``: the app served by plain uvicorn instead of the router's server."""
    calls: list[dict] = []
    with Served(fake_worker(calls)) as worker:
        view = RouterView("sha256", 16)
        view.workers["w-0"] = WorkerState(worker_id="w-0", epoch=1, role="aggregated", pool="default",
                                          endpoint=worker.url, model=MODEL, capacity={"device": 4096})
        sink = MemorySink()

        def health():
            return assess(view.positions, {}, view.last_ts_ms, view.stale_workers(), time.time() * 1000, True)

        router = Router(router_id="r-input", view=view, producer=sink, config=RouterConfig(),
                        hash_config=HashConfig(HashAlgo.SHA256, 16), health=health, max_attempts=3)
        keys, issued = KeyTable(), bearer.issue(KEY_PREFIX)
        keys.apply(EnvelopeFactory("admin-api", 1, time.time_ns).wrap(RouterKeyIssued(
            actor="test", key_id=issued.id, name="input-tests", salt=issued.salt, key_hash=issued.hash)))
        ctx = RouterApp(router=router, tokenizer=HashTokenizer(), metrics=RouterMetrics(), served_model=MODEL,
                        health=health, stop=router.close, limits=limits, auth=RouterAuth(keys))
        with Served(create_app(ctx), None if plain else connections) as served:
            with httpx.Client(base_url=served.url, timeout=60, limits=httpx.Limits(max_connections=1),
                              headers={"Authorization": f"Bearer {issued.plain}"}) as http:
                yield Stack(router, sink, ctx, calls, served.url, http, issued.plain)


def assert_unhurt(s: Stack, worker_calls: int) -> None:
    """One good request on the same connection works; nothing about the worker changed."""
    r = s.post("/v1/completions", GOOD)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == " t0 t1"
    assert len(s.ports) == 1, f"the connection was replaced: client ports {s.ports}"
    assert s.ctx.health().state == "EXACT", s.ctx.health()
    assert s.worker().state == "ready" and s.worker().routable
    assert s.sink.of_type(RequestFailed) == []
    assert len(s.worker_calls) == worker_calls + 1  # only the good request reached the worker
    load = s.router.ledger.load_for("w-0")
    assert load.requests == 0 and s.router.ledger.open_requests() == 0


def assert_refused(r: httpx.Response, status: int, code: str, param: str | None, says: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["code"], err["param"], err["type"]) == (code, param, "invalid_request_error"), err
    assert says in err["message"], err
    return err


# -- the attacker's requests ------------------------------------------------------------------

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"


def _chat(**over) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **over}


#: (id, path, raw body, status, code, param, words in the message)
RAW_CASES = [
    ("lone surrogate in the prompt", CMPL, b'{"prompt":"\\ud800","max_tokens":2}', 400, "invalid_unicode", "prompt",
     "invalid Unicode"),
    ("lone surrogate in chat content", CHAT,
     b'{"messages":[{"role":"user","content":"a\\udfffb"}]}', 400, "invalid_unicode", "messages.0.content",
     "invalid Unicode"),
    ("chat text part is a number", CHAT, json.dumps(_chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": 123}]}])).encode(), 400, "invalid_body", "messages.0.content.0.text",
     "messages.0.content.0.text: Input should be a valid string"),
    ("chat text part is null", CHAT, json.dumps(_chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": None}]}])).encode(), 400, "invalid_body", "messages.0.content.0.text",
     "messages.0.content.0.text: Input should be a valid string"),
    ("chat content null", CHAT, json.dumps(_chat(messages=[{"role": "user", "content": None}])).encode(),
     400, "invalid_type", "messages.0.content", "null only for an assistant"),
    ("chat image part", CHAT, json.dumps(_chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}])).encode(), 400, "invalid_body",
     "messages.0.content.0.type", "messages.0.content.0.type: Input should be 'text'"),
    ("messages empty", CHAT, json.dumps(_chat(messages=[])).encode(), 400, "invalid_body", "messages",
     "at least 1 item"),
    ("max_completion_tokens -1", CHAT, json.dumps(_chat(max_completion_tokens=-1)).encode(), 400, "invalid_value",
     "max_completion_tokens", "at least 1"),
    ("max_tokens 0", CMPL, json.dumps({**GOOD, "max_tokens": 0}).encode(), 400, "invalid_value", "max_tokens",
     "at least 1"),
    ("max_tokens 131072", CMPL, json.dumps({**GOOD, "max_tokens": 131072}).encode(), 400, "max_tokens_exceeded",
     "max_tokens", "limit of 4096"),
    ("token id 2**64", CMPL, json.dumps({**GOOD, "prompt": [5, 2**64]}).encode(), 400, "invalid_token_id", "prompt",
     f"token id {2**64} is outside the model's vocabulary"),
    ("token id 10**30", CMPL, json.dumps({**GOOD, "prompt": [10**30]}).encode(), 400, "invalid_token_id", "prompt",
     "outside the model's vocabulary [0, 128256)"),
    ("negative token id", CMPL, json.dumps({**GOOD, "prompt": [-1, 5]}).encode(), 400, "invalid_token_id", "prompt",
     "token id -1"),
    ("float token id", CMPL, json.dumps({**GOOD, "prompt": [1.5]}).encode(), 400, "invalid_body", "prompt.0",
     "prompt.0: Input should be a valid integer"),
    ("empty prompt", CMPL, json.dumps({**GOOD, "prompt": ""}).encode(), 400, "empty_prompt", "prompt", "no tokens"),
    ("empty token list", CMPL, json.dumps({**GOOD, "prompt": []}).encode(), 400, "empty_prompt", "prompt",
     "no tokens"),
    ("batched prompts", CMPL, json.dumps({**GOOD, "prompt": [[1, 2], [3, 4]]}).encode(), 400,
     "unsupported_parameter", "prompt", "batched prompts"),
    ("1M token ids", CMPL, json.dumps({**GOOD, "prompt": [7] * 1_000_000}).encode(), 400,
     "context_length_exceeded", "prompt", "maximum context length is 131072 tokens"),
    ("1M-token text", CMPL, json.dumps({**GOOD, "prompt": "a " * 1_000_000}).encode(), 400,
     "context_length_exceeded", "prompt", "1000002 tokens (1000000 in the prompt"),
    ("prompt + max_tokens over the context", CMPL, json.dumps({**GOOD, "prompt": [7] * 130_000,
                                                               "max_tokens": 4000}).encode(),
     400, "context_length_exceeded", "max_tokens", "Please reduce the prompt or max_tokens"),
    ("unknown model", CMPL, json.dumps({**GOOD, "model": "gpt-attacker"}).encode(), 404, "model_not_found", "model",
     "The model 'gpt-attacker' does not exist"),
    ("n 2", CMPL, json.dumps({**GOOD, "n": 2}).encode(), 400, "unsupported_parameter", "n", "only n=1"),
    ("best_of 3", CMPL, json.dumps({**GOOD, "best_of": 3}).encode(), 400, "unsupported_parameter", "best_of",
     "best_of=1"),
    ("stop sequences", CMPL, json.dumps({**GOOD, "stop": ["\n"]}).encode(), 400, "unsupported_parameter", "stop",
     "stop sequences"),
    ("chat tools", CHAT, json.dumps(_chat(tools=[{"type": "function", "function": {"name": "f"}}])).encode(), 400,
     "unsupported_parameter", "tools", "tools are not supported"),
    ("unknown argument", CMPL, json.dumps({**GOOD, "frobnicate": True}).encode(), 400, "invalid_body", "frobnicate",
     "Unrecognized request argument supplied: frobnicate"),
    ("stream is a string", CMPL, json.dumps({**GOOD, "stream": "yes"}).encode(), 400, "invalid_body", "stream",
     "valid boolean"),
    ("request_id with a newline", CMPL, json.dumps({**GOOD, "request_id": "a\nb"}).encode(), 400, "invalid_value",
     "request_id", "printable ASCII"),
    ("request_id too long", CMPL, json.dumps({**GOOD, "request_id": "x" * 201}).encode(), 400, "invalid_value",
     "request_id", "at most 200"),
    ("not JSON", CMPL, b"{not json", 400, "invalid_json", None, "not valid JSON"),
    ("NaN", CMPL, b'{"prompt":[1],"max_tokens":NaN}', 400, "invalid_json", None, "NaN is not valid JSON"),
    ("nested 100k deep", CMPL, b"[" * 100_000 + b"]" * 100_000, 400, "invalid_json", None, "not valid JSON"),
    ("a JSON array body", CMPL, b"[1, 2]", 400, "invalid_body", None, "valid dictionary"),
    ("invalid UTF-8 bytes", CMPL, b'{"prompt":"\xff\xfe"}', 400, "invalid_json", None, "not valid JSON"),
]


@pytest.mark.parametrize(("path", "raw", "status", "code", "param", "says"), [c[1:] for c in RAW_CASES],
                         ids=[c[0] for c in RAW_CASES])
def test_a_bad_request_is_a_4xx_with_a_reason_and_hurts_nothing(stack: Stack, path, raw, status, code, param,
                                                                 says) -> None:
    assert_unhurt(stack, 0)  # the connection is open before the bad request
    r = stack.post(path, content=raw)
    assert_refused(r, status, code, param, says)
    assert stack.sink.of_type(RequestAdmitted)[1:] == []  # refused before admission: not on the log
    assert_unhurt(stack, 1)


def test_unknown_paths_and_methods_get_openai_error_bodies(stack: Stack) -> None:
    r = stack.post("/v1/embeddings", {"input": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = stack.http.get(CMPL)
    stack.ports.add(client_port(r))
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert_unhurt(stack, 0)


def test_a_50_mb_body_is_413_and_the_connection_survives(stack: Stack) -> None:
    r = stack.post(CMPL, content=b'{"prompt":"' + b"a" * (50 * 1024 * 1024) + b'"}')
    assert_refused(r, 413, "request_too_large", None, f"exceeds {4 * 1024 * 1024} bytes")
    assert r.headers.get("connection") != "close"
    assert_unhurt(stack, 0)


def test_the_official_client_gets_openai_errors(stack: Stack) -> None:
    """What an ``openai`` user sees: typed exceptions carrying the error body."""
    client = stack.openai()
    cases = [
        (openai.NotFoundError, "model_not_found",
         lambda: client.completions.create(model="nope", prompt="hi", max_tokens=2)),
        (openai.BadRequestError, "unsupported_parameter",
         lambda: client.completions.create(model=MODEL, prompt="hi", max_tokens=2, n=2)),
        (openai.BadRequestError, "max_tokens_exceeded",
         lambda: client.completions.create(model=MODEL, prompt="hi", max_tokens=131072)),
        (openai.BadRequestError, "invalid_token_id",
         lambda: client.completions.create(model=MODEL, prompt=[2**64], max_tokens=2)),
        (openai.BadRequestError, "invalid_body",
         lambda: client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)),
        (openai.BadRequestError, "invalid_value",
         lambda: client.chat.completions.create(model=MODEL, max_completion_tokens=-1,
                                                messages=[{"role": "user", "content": "hi"}])),
        (openai.BadRequestError, "invalid_body",
         lambda: client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
             {"role": "user", "content": [{"type": "text", "text": 123}]}])),
        (openai.BadRequestError, "invalid_value",
         lambda: client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"request_id": "a\nb"})),
    ]
    for i, (exc, code, call) in enumerate(cases):
        with pytest.raises(exc) as got:
            call()
        assert got.value.body["code"] == code and got.value.body["message"], (i, got.value.body)
        stack.ports.add(client_port(got.value.response))
    ok = client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert ok.choices[0].message.content == " t0 t1" and ok.id.startswith("chatcmpl-")
    assert_unhurt(stack, 1)


def test_a_worker_4xx_caused_by_the_client_is_passed_on_and_never_blames_the_worker(stack: Stack) -> None:
    """Token id 40000 is inside the router's vocabulary bound but outside this worker's: the
    worker answers 400. The client gets it with the worker's reason; the request ends as
    rejected, the worker stays ready with an empty ledger, and no failure is recorded."""
    r = stack.post(CMPL, {**GOOD, "prompt": [1, 40_000]})
    assert r.status_code == 400, r.text
    assert "out of vocabulary" in r.json()["error"]["message"]
    rid = r.headers["x-request-id"]
    assert [type(e).__name__ for e in stack.sink.events if e.request_id == rid] == [
        "RequestAdmitted", "RequestRouted", "RequestRejected"]
    [rejected] = stack.sink.of_type(RequestRejected)
    assert rejected.http_status == 400
    assert_unhurt(stack, 1)


def test_request_ids_are_the_servers_and_a_client_id_is_metadata(stack: Stack) -> None:
    """The same client id twice: two requests, two server ids, both routed; the client id is
    kept on RequestAdmitted and echoed in X-Client-Request-Id, never used as a key."""
    ids = []
    for _ in range(2):
        r = stack.post(CMPL, {**GOOD, "request_id": "mine-1"})
        assert r.status_code == 200, r.text
        assert r.headers["x-client-request-id"] == "mine-1"
        assert r.json()["id"] == r.headers["x-request-id"]
        ids.append(r.json()["id"])
    r = stack.post(CHAT, _chat(), headers={"X-Client-Request-Id": "mine-2"})
    assert r.status_code == 200 and r.headers["x-client-request-id"] == "mine-2"
    ids.append(r.json()["id"])
    assert len(set(ids)) == 3 and all(i.startswith(("cmpl-", "chatcmpl-")) for i in ids)
    assert ids[2].startswith("chatcmpl-")
    admitted = stack.sink.of_type(RequestAdmitted)
    assert [(a.request_id, a.client_request_id) for a in admitted] == list(zip(ids, ["mine-1", "mine-1", "mine-2"]))
    assert sorted({e.request_id for e in stack.sink.of_type(RequestRouted)}) == sorted(ids)
    assert_unhurt(stack, 3)


def test_schemathesis_against_the_openai_api_finds_no_5xx_and_hurts_nothing(stack: Stack) -> None:
    """Generated bodies, valid and invalid by the published schema, for every route: none is a
    5xx, every refusal is an OpenAI error body, and afterwards the router is EXACT, the worker
    routable and never blamed."""
    import schemathesis
    from schemathesis.checks import not_a_server_error

    from tests.support.schemathesis_run import run_schemathesis

    def openai_error_body(response) -> None:
        if response.status_code >= 400:
            err = response.json()["error"]
            assert {"message", "type", "param", "code"} <= set(err), err

    schema = schemathesis.openapi.from_url(f"{stack.url}/openapi.json")
    failures, seen = run_schemathesis(schema, [not_a_server_error], call=openai_error_body, default_examples=40,
                                      timeout=60, headers={"Authorization": f"Bearer {stack.key}"})
    assert not failures, "\n\n".join(failures)
    generation = {k: n for k, n in seen.items() if k[1].startswith("/v1/") and k[0] == "POST"}
    # Both generation routes were reached, and some generated requests were served in full.
    assert {p for _, p, _ in generation} == {CMPL, CHAT}, seen
    assert any(code == 200 for _, _, code in generation), seen
    print(sorted(seen.items()))
    assert stack.ctx.health().state == "EXACT", stack.ctx.health()
    assert stack.worker().state == "ready" and stack.worker().routable
    assert stack.sink.of_type(RequestFailed) == []
    assert stack.router.ledger.open_requests() == 0
