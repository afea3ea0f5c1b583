"""The router's HTTP server (common/native_http.py over native/src/front.rs): the ASGI contract
uvicorn gave the app, message for message, and the lifespan.

A real server in a thread on loopback, a plain ASGI app; clients are ``httpx`` and raw sockets.
(The connection limits: tests/integration/test_router_connections.py and the crate's own tests.)
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest

from common.connection_limits import ConnectionLimits
from common.native_http import Server
from common.net import free_port
from tests.support.waits import wait_for


class App:
    """Answers by path: ``/echo`` the scope and body as JSON, ``/stream`` three pieces (one per
    turn of the loop), ``/fail``
    raises before answering, ``/cut`` raises after the head, ``/wait`` streams until the client
    goes (recording the disconnect)."""

    def __init__(self) -> None:
        self.lifespan: list[str] = []
        self.disconnected = threading.Event()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                self.lifespan.append(msg["type"])
                await send({"type": msg["type"] + ".complete"})
                if msg["type"] == "lifespan.shutdown":
                    return
        path = scope["path"]
        body, pieces = b"", 0
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            pieces += 1
            if not msg.get("more_body"):
                break
        if path == "/fail":
            raise RuntimeError("boom")
        head = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
        if path == "/echo/a b":
            out = {"path": path, "raw_path": scope["raw_path"].decode(), "query": scope["query_string"].decode(),
                   "method": scope["method"], "client": scope["client"][0], "body": body.decode(),
                   "x": dict(scope["headers"]).get(b"x-test", b"").decode()}
            await send(head)
            await send({"type": "http.response.body", "body": json.dumps(out).encode()})
        elif path == "/stream":
            await send(head)
            for i in range(3):
                await send({"type": "http.response.body", "body": f"{i};".encode(), "more_body": True})
                await asyncio.sleep(0)  # the next turn of the loop: each piece goes on its own
            await send({"type": "http.response.body", "body": b""})
        elif path == "/cut":
            await send(head)
            await send({"type": "http.response.body", "body": b"part", "more_body": True})
            await asyncio.sleep(0)  # the head is sent
            raise RuntimeError("boom after the head")
        elif path == "/wait":
            await send(head)
            await send({"type": "http.response.body", "body": b"first", "more_body": True})
            msg = await receive()
            if msg["type"] == "http.disconnect":
                self.disconnected.set()


@pytest.fixture
def served() -> Iterator[tuple[Server, App]]:
    app = App()
    server = Server(app, "127.0.0.1", free_port(), ConnectionLimits(request_timeout_s=5.0))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout=20, what="the native server")
    yield server, app
    server.should_exit = True
    thread.join(20)
    assert not thread.is_alive()
    assert app.lifespan == ["lifespan.startup", "lifespan.shutdown"]


def test_the_scope_and_body_reach_the_app_and_answers_stream_over_one_connection(served) -> None:
    server, _ = served
    with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", limits=httpx.Limits(max_connections=1)) as c:
        r = c.post("/echo/a%20b?q=1", content=b"hello", headers={"x-test": "yes"})
        assert r.status_code == 200
        assert r.json() == {"path": "/echo/a b", "raw_path": "/echo/a%20b", "query": "q=1", "method": "POST",
                            "client": "127.0.0.1", "body": "hello", "x": "yes"}
        with c.stream("GET", "/stream") as r:
            assert b"".join(r.iter_bytes()) == b"0;1;2;"
        assert c.get("/stream").text == "0;1;2;"  # the same connection, kept alive


def test_a_body_sent_slowly_comes_in_pieces_and_whole(served) -> None:
    server, _ = served
    body = b"x" * 1000
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /echo/a%20b HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\nConnection: close\r\n\r\n"
                  + body[:10])
        wait_for(lambda: server.stats().get("busy") == 1, timeout=10, what="the request handed over")
        s.sendall(body[10:])
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    assert got.startswith(b"HTTP/1.1 200 "), got[:100]
    assert json.loads(got.split(b"\r\n\r\n", 1)[1])["body"] == body.decode()


def test_an_app_that_fails_is_a_500_before_its_head_and_a_cut_connection_after(served) -> None:
    server, _ = served
    url = f"http://127.0.0.1:{server.port}"
    r = httpx.post(f"{url}/fail", content=b"{}")
    assert (r.status_code, r.text, r.headers["connection"]) == (500, "Internal Server Error", "close")
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.get(f"{url}/cut")
    assert httpx.get(f"{url}/stream").text == "0;1;2;"


def test_a_client_that_goes_away_mid_answer_is_a_disconnect(served) -> None:
    server, app = served
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    s.sendall(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b"first" in s.recv(65536) or b"first" in s.recv(65536)
    s.close()
    assert app.disconnected.wait(10)
    wait_for(lambda: server.stats().get("open") == 0, timeout=10, what="the connection forgotten")


def test_an_app_without_lifespan_is_served() -> None:
    async def bare(scope, receive, send):
        assert scope["type"] == "http"
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    server = Server(bare, "127.0.0.1", 0)

    async def main() -> int:
        task = asyncio.get_running_loop().create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient() as c:
            status = (await c.get(f"http://127.0.0.1:{server.port}/")).status_code
        server.should_exit = True
        await task
        return status

    assert asyncio.run(main()) == 204


class DirectApp(App):
    """:class:`App` with direct routes (``app.state.direct_routes``): ``/d/echo`` answers the
    body and a header at once, ``/d/stream`` streams three pieces, ``/d/wait`` streams until the
    client goes (its pieces' generator is then cancelled and closed), ``/d/fail`` raises."""

    def __init__(self) -> None:
        super().__init__()
        self.closed = threading.Event()
        self.state = type("State", (), {})()
        self.state.direct_routes = {"/d/echo": self.echo, "/d/stream": self.stream, "/d/wait": self.wait,
                                    "/d/fail": self.fail}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/d/"):  # another method: the app's answer
            await send({"type": "http.response.start", "status": 405, "headers": []})
            await send({"type": "http.response.body", "body": b"app"})
            return
        await super().__call__(scope, receive, send)

    async def echo(self, d) -> None:
        body = b"".join([piece async for piece in d.body()])
        out = json.dumps({"body": body.decode(), "x": d.header("x-test"), "none": d.header("x-none")}).encode()
        d.respond(200, [(b"content-type", b"application/json")], out)

    async def stream(self, d) -> None:
        async def pieces():
            for i in range(3):
                yield f"{i};".encode()
                await asyncio.sleep(0)

        await d.stream(200, [(b"content-type", b"text/plain")], pieces())

    async def wait(self, d) -> None:
        async def pieces():
            try:
                yield b"first"
                await asyncio.Event().wait()  # until cancelled
            finally:
                self.closed.set()

        await d.stream(200, [(b"content-type", b"text/plain")], pieces())

    async def fail(self, d) -> None:
        raise RuntimeError("boom")


def test_direct_routes_skip_the_app_and_answer_whole_streamed_or_cancelled() -> None:
    app = DirectApp()
    server = Server(app, "127.0.0.1", free_port(), ConnectionLimits(request_timeout_s=5.0))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout=20, what="the native server")
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", limits=httpx.Limits(max_connections=1)) as c:
            r = c.post("/d/echo", content=b"hello", headers={"x-test": "yes"})
            assert (r.status_code, r.json()) == (200, {"body": "hello", "x": "yes", "none": None})
            assert c.post("/d/stream").text == "0;1;2;"
            assert c.post("/d/stream").text == "0;1;2;"  # the same connection, kept alive
            # Another method on a direct route's path goes to the app.
            r = c.request("GET", "/d/echo")
            assert (r.status_code, r.text) == (405, "app")
            r = c.post("/d/fail", content=b"{}")
            assert (r.status_code, r.text) == (500, "Internal Server Error")
        s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        s.sendall(b"POST /d/wait HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        assert b"first" in s.recv(65536) or b"first" in s.recv(65536)
        s.close()
        assert app.closed.wait(10)
        wait_for(lambda: server.stats().get("open") == 0, timeout=10, what="the connection forgotten")
    finally:
        server.should_exit = True
        thread.join(20)
    assert not thread.is_alive()
