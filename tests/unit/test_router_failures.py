"""The router's request path against workers that fail in each way a worker can fail before the
first token: refused, stalled, reset, 5xx. In-memory ports (an event sink, a view filled by
hand), real sockets and real HTTP; no broker."""

from __future__ import annotations

import asyncio
import json

import pytest

from control_plane.router import RouterConfig
from control_plane.router.admission import AdmissionConfig
from control_plane.router.proxy import Router, RouterRejected
from control_plane.router.view import RouterView, WorkerState
from control_plane.router.worker_calls import DRAIN_S, CallLoad
from common.hashing import HashAlgo, HashConfig
from common.log.sink import MemorySink
from common.net import free_port
from schemas.events import RequestFailed, RequestRouted


async def _serve(kind: str) -> tuple[asyncio.AbstractServer | None, int]:
    """A fake worker that behaves as ``kind``; returns (server, port)."""
    if kind in ("refuse", "https"):  # https: the worker client speaks plain HTTP only
        return None, free_port()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")), 0)
        await reader.readexactly(length)
        if kind == "stall":
            await asyncio.sleep(30)
        elif kind == "reset":
            writer.transport.abort()
            return
        elif kind == "refuse-input":  # the engine refuses the request itself (client input)
            body = b'{"error": {"message": "token id out of vocabulary"}}'
            writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
        elif kind == "redirect":  # followed, it would fail as worker_unreachable (nothing listens there)
            writer.write(b"HTTP/1.1 307 Temporary Redirect\r\nlocation: http://127.0.0.1:%d/v1/completions\r\n"
                         b"content-length: 0\r\n\r\n" % free_port())
        elif kind == "error":
            body = b'{"error": "boom"}'
            writer.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
        else:  # good: two tokens, SSE
            chunks = [{"choices": [{"text": "a", "token_ids": [7], "finish_reason": None}]},
                      {"choices": [{"text": "b", "token_ids": [8], "finish_reason": "length"}]}]
            sse = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(sse), sse))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _router(kinds: list[str], *, max_attempts: int = 3, read_timeout_s: float = 0.5
                  ) -> tuple[Router, MemorySink, list]:
    view = RouterView("sha256", 16)
    servers = []
    for i, kind in enumerate(kinds):
        server, port = await _serve(kind)
        servers.append(server)
        wid = f"{kind}-{i}"
        view.workers[wid] = WorkerState(worker_id=wid, epoch=1, role="aggregated", pool="p",
                                        endpoint=f"{'https' if kind == 'https' else 'http'}://127.0.0.1:{port}",
                                        capacity={"device": 1000})
    sink = MemorySink()
    router = Router(router_id="r-test", view=view, producer=sink, config=RouterConfig(),
                    hash_config=HashConfig(HashAlgo.SHA256, 16), max_attempts=max_attempts,
                    connect_timeout_s=1.0, read_timeout_s=read_timeout_s)
    return router, sink, servers


async def _collect(router: Router, rid: str | None) -> list:
    adm = router.admit(request_id=rid, model="m", tokens=list(range(40)), max_tokens=2, stream=True,
                       endpoint="completions")
    await router.queue(adm)
    return [c async for c in router.serve(adm)]


async def _close(router: Router, servers: list) -> None:
    await router.close()
    for s in servers:
        if s is not None:
            s.close()


@pytest.mark.parametrize(("kind", "code"), [("refuse", "worker_unreachable"), ("stall", "timeout"),
                                             ("reset", "worker_lost"), ("error", "worker_error"),
                                             ("redirect", "worker_lost"), ("https", "worker_unreachable")])
async def test_each_failure_before_the_first_token_is_a_recorded_503(kind: str, code: str) -> None:
    router, sink, servers = await _router([kind])
    try:
        with pytest.raises(RouterRejected) as exc:
            await _collect(router, f"req-{kind}")
        assert exc.value.status == 503 and exc.value.retry_after_s
        failed = sink.of_type(RequestFailed)
        assert failed[-1].retried is False  # the request's end is on the log: no rejection follows
        assert failed[0].code == code and failed[0].worker_id == f"{kind}-0"
        assert failed[-1].retried is False  # the request's end is on the log
        assert len(router.ledger) == 0
    finally:
        await _close(router, servers)


async def test_failures_are_retried_on_another_worker_until_one_serves() -> None:
    router, sink, servers = await _router(["refuse", "stall", "reset", "error", "good"], max_attempts=5)
    try:
        chunks = await _collect(router, "req-mixed")
        assert [c.text for c in chunks if c.text] == ["a", "b"]
        failed = sink.of_type(RequestFailed)
        assert all(f.retried for f in failed)
        routed = sink.of_type(RequestRouted)
        assert routed[-1].worker_id == "good-4"
        assert [r.excluded_workers for r in routed] == [sorted(f.worker_id for f in failed[:i]) for i in range(len(routed))]
    finally:
        await _close(router, servers)


async def test_a_full_admission_queue_refuses_with_429_and_its_reason() -> None:
    router, sink, servers = await _router(["good"])
    router.admission.cfg = AdmissionConfig(busy_prefill_tokens=10, queue_max=1, queue_timeout_s=0.2)
    try:
        # The first request is granted (nothing pending); its tokens now count until routed.
        first = router.admit(request_id="q-1", model="m", tokens=list(range(40)), max_tokens=2, stream=True,
                             endpoint="completions")
        await router.queue(first)
        waiter = asyncio.ensure_future(_collect(router, "q-2"))
        while len(router.admission) == 0:
            await asyncio.sleep(0.005)
        with pytest.raises(RouterRejected) as full:
            await _collect(router, "q-3")
        assert full.value.status == 429 and full.value.code == "queue_full" and full.value.retry_after_s
        with pytest.raises(RouterRejected) as late:
            await waiter
        assert late.value.status == 503 and late.value.code == "queue_timeout"
        # Once the first is served, the queue has room again.
        assert [c.text async for c in router.serve(first) if c.text] == ["a", "b"]
        assert [c.text for c in await _collect(router, "q-4") if c.text] == ["a", "b"]
    finally:
        await _close(router, servers)


@pytest.mark.parametrize(("kind", "rid", "code"), [("refuse-input", None, "bad_request"),
                                                   ("good", "a\nb", "invalid_request")],
                         ids=["the worker answers 400", "the request cannot be put on the wire"])
async def test_a_request_the_worker_cannot_take_is_a_4xx_that_never_blames_the_worker(kind, rid, code) -> None:
    """A 4xx from the worker, or a request httpx refuses to send (an illegal header: what a
    client-chosen id with a newline did), is the request's fault: no RequestFailed, no retry on
    another worker, no worker excluded or dropped from the ledger."""
    router, sink, servers = await _router([kind])
    try:
        with pytest.raises(RouterRejected) as exc:
            await _collect(router, rid)
        assert (exc.value.status, exc.value.code) == (400, code)
        assert sink.of_type(RequestFailed) == [] and len(sink.of_type(RequestRouted)) == 1
        assert all(w.routable for w in router.view.workers.values())
    finally:
        await _close(router, servers)


async def _keep_alive_worker(close_after_answer: bool) -> tuple[asyncio.AbstractServer, int, list[int]]:
    """A worker that answers each request with a chunked SSE stream whose end (the last chunk)
    follows ``[DONE]`` a moment later, as uvicorn's does, and keeps the connection (or closes it
    after each answer, without saying so). Returns (server, port, requests per connection)."""
    served: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served.append(0)
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
            await reader.readexactly(length)
            served[-1] += 1
            sse = b'data: {"choices": [{"text": "a", "token_ids": [7], "finish_reason": "length"}]}\n\ndata: [DONE]\n\n'
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                         b"%x\r\n%s\r\n" % (len(sse), sse))
            await writer.drain()
            await asyncio.sleep(0.01)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            if close_after_answer:
                break
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], served


@pytest.mark.parametrize("close_after_answer", [False, True], ids=["kept", "closed by the worker"])
async def test_requests_reuse_a_connection_and_one_the_worker_closed_is_not_a_failure(close_after_answer) -> None:
    """The router stops reading at ``[DONE]``; the rest of the answer is drained so the
    connection is reused. A pooled connection the worker closed meanwhile is replaced by a new
    one: the request is served, nothing is recorded against the worker."""
    server, port, served = await _keep_alive_worker(close_after_answer)
    router, sink, _ = await _router([])
    router.view.workers["w"] = WorkerState(worker_id="w", epoch=1, role="aggregated", pool="p",
                                           endpoint=f"http://127.0.0.1:{port}", capacity={"device": 1000})
    try:
        for i in range(4):
            assert [c.text for c in await _collect(router, f"keep-{i}") if c.text] == ["a"]
            await router.workers.drained()  # the connection is back in the pool
            # Nothing in flight or waiting for the loop; the connection in the pool (one the worker
            # closed is pooled or not, as its close was seen before or after the answer's end).
            # The drain's end is signalled from inside the call's task, which drops its counters
            # just after: wait for them (a gauge, not the pool's state).
            for _ in range(200):
                load = router.workers.load()
                if (load.in_flight, load.ready, load.busy_connections) == (0, 0, 0):
                    break
                await asyncio.sleep(0.01)
            assert (load.in_flight, load.ready, load.busy_connections) == (0, 0, 0)
            assert load.idle_connections in ((0, 1) if close_after_answer else (1,))
        assert sink.of_type(RequestFailed) == []
        assert served == ([4] if not close_after_answer else [1, 1, 1, 1]), served
    finally:
        await _close(router, [server])


async def test_a_stream_the_router_gives_up_on_closes_the_worker_connection() -> None:
    """The client went away after a token: the router closes the worker's connection (never
    drains or pools it), which is how an engine learns to stop generating for it."""
    gone = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        sse = b'data: {"choices": [{"text": "a", "token_ids": [7], "finish_reason": null}]}\n\n'
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                     b"%x\r\n%s\r\n" % (len(sse), sse))
        await writer.drain()
        if await reader.read() == b"":  # still generating, until the router hangs up
            gone.set()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    router, sink, _ = await _router([], read_timeout_s=60)  # no read timeout ends it for the router
    router.view.workers["w"] = WorkerState(worker_id="w", epoch=1, role="aggregated", pool="p",
                                           endpoint=f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}",
                                           capacity={"device": 1000})
    try:
        adm = router.admit(request_id="gone-1", model="m", tokens=list(range(40)), max_tokens=2, stream=True,
                           endpoint="completions")
        await router.queue(adm)
        stream = router.serve(adm)
        assert (await stream.__anext__()).text == "a"
        assert router.workers.load() == CallLoad(in_flight=1, busy_connections=1)  # the saturation gauges' source
        await stream.aclose()  # what the HTTP front does when its client is gone
        await asyncio.wait_for(gone.wait(), timeout=DRAIN_S / 2)  # closed, not drained
        assert [f.code for f in sink.of_type(RequestFailed)] == ["client_cancelled"]
        for _ in range(200):  # the aborted call's task is dropped on the client's own thread
            if router.workers.load() == CallLoad():
                break
            await asyncio.sleep(0.01)
        assert router.workers.load() == CallLoad()  # over, its connection gone
    finally:
        await _close(router, [server])
