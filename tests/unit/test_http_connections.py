"""Connection limits that idle sockets cannot fill (issue 36, item 4; common/http_server.py).

A real uvicorn server with the guarded protocol, in a thread, on loopback; the clients are raw
sockets. ``/hold`` keeps its connection serving until the test releases it, so a test can make
connections busy; everything else answers at once. Client addresses other than 127.0.0.1 are
other loopback addresses (127.0.0.2, ...), which Linux routes to the same listener: the per-IP
cap seen from distinct sources.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import pytest
import uvicorn

from common.http_server import ConnectionLimits, server_config
from tests.support.waits import wait_for


class _App:
    def __init__(self) -> None:
        self.release: asyncio.Event | None = None
        self.held = 0

    async def __call__(self, scope, receive, send):  # noqa: ANN001 - a bare ASGI app
        if scope["type"] != "http":
            return
        if scope["path"] == "/hold":
            self.held += 1
            await self.release.wait()  # type: ignore[union-attr]
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


class _Server:
    def __init__(self, limits: ConnectionLimits) -> None:
        self.app = _App()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.config = server_config(self.app, "127.0.0.1", self.port, limits, lifespan="off")
        self.server = uvicorn.Server(self.config)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, args=(sock,), daemon=True)

    def _run(self, sock: socket.socket) -> None:
        asyncio.set_event_loop(self.loop)
        self.app.release = asyncio.Event()
        self.loop.run_until_complete(self.server.serve(sockets=[sock]))

    def release(self) -> None:
        self.loop.call_soon_threadsafe(self.app.release.set)  # type: ignore[union-attr]

    @property
    def connections(self):
        return self.config.http.connections_of  # type: ignore[union-attr]


@pytest.fixture
def serve() -> Iterator:
    started: list[_Server] = []

    def start(**limits) -> _Server:
        s = _Server(ConnectionLimits(request_timeout_s=30, **limits))
        s.thread.start()
        wait_for(lambda: s.server.started, timeout=10, what="the server started")
        started.append(s)
        return s

    yield start
    for s in started:
        s.release()
        s.server.should_exit = True
        s.thread.join(10)


def _connect(s: _Server, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket()
    sock.bind((source, 0))
    sock.settimeout(10)
    sock.connect(("127.0.0.1", s.port))
    return sock


def _send(sock: socket.socket, path: str = "/") -> None:
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())


def _status(sock: socket.socket) -> int:
    got = b""
    while b"\r\n" not in got:
        chunk = sock.recv(4096)
        if not chunk:
            return -1
        got += chunk
    return int(got.split(b" ", 2)[1])


def _closed(sock: socket.socket) -> bool:
    """Whether the server closes ``sock`` (what it still sends before that is read and dropped)."""
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return True


def _get(s: _Server, source: str = "127.0.0.1") -> int:
    with _connect(s, source) as sock:
        _send(sock)
        return _status(sock)


def test_idle_connections_hold_no_request_slot(serve) -> None:
    """1,030 silent sockets made every client a 503 when the limit counted them (issue 36)."""
    s = serve(max_connections=2, max_open=100, max_per_ip=100)
    idle = [_connect(s) for _ in range(50)]
    wait_for(lambda: s.connections.total == 50, timeout=10, what="50 connections counted")
    try:
        assert [_get(s) for _ in range(3)] == [200] * 3
        assert s.connections.evicted == 0 and s.connections.refused == 0
    finally:
        for sock in idle:
            sock.close()


def test_past_max_open_idle_connections_make_room_oldest_first(serve) -> None:
    s = serve(max_connections=4, max_open=4, max_per_ip=4)
    idle = [_connect(s) for _ in range(4)]
    wait_for(lambda: s.connections.total == 4, timeout=10, what="4 connections counted")
    try:
        assert _get(s) == 200  # the new client is served at once, not 503
        assert _closed(idle[0])  # the oldest idle connection made room
        assert s.connections.evicted == 1 and s.connections.refused == 0
        idle[1].settimeout(0.2)
        with pytest.raises(TimeoutError):
            idle[1].recv(1)  # the others stay open
    finally:
        for sock in idle:
            sock.close()


def test_a_keep_alive_connection_between_requests_is_idle_and_can_be_closed(serve) -> None:
    s = serve(max_connections=2, max_open=2, max_per_ip=2)
    kept = _connect(s)
    _send(kept)
    assert _status(kept) == 200  # kept alive after its response: idle again
    other = _connect(s)
    try:
        assert _get(s) == 200
        assert _closed(kept)
    finally:
        kept.close()
        other.close()


def test_past_max_connections_serving_a_request_is_503_and_closed(serve) -> None:
    s = serve(max_connections=3, max_open=10, max_per_ip=10)
    busy = [_connect(s) for _ in range(3)]
    for sock in busy:
        _send(sock, "/hold")
    wait_for(lambda: s.app.held == 3, timeout=10, what="3 requests held")
    try:
        with _connect(s) as late:
            _send(late)
            assert _status(late) == 503
            assert _closed(late)
        assert s.connections.refused == 1 and s.connections.evicted == 0
        s.release()
        assert [_status(sock) for sock in busy] == [200] * 3  # nothing served was cut
        assert _get(s) == 200
    finally:
        for sock in busy:
            sock.close()


def test_the_per_address_cap_closes_that_address_s_idle_connections_not_others(serve) -> None:
    s = serve(max_connections=100, max_open=100, max_per_ip=2)
    theirs = [_connect(s, "127.0.0.2") for _ in range(2)]
    mine = _connect(s, "127.0.0.3")
    wait_for(lambda: s.connections.total == 3, timeout=10, what="3 connections counted")
    try:
        assert _get(s, "127.0.0.2") == 200  # its own oldest idle connection made room
        assert _closed(theirs[0])
        mine.settimeout(0.2)
        with pytest.raises(TimeoutError):
            mine.recv(1)  # another address's connection is untouched
        for sock in theirs[1:]:
            _send(sock, "/hold")
        extra = _connect(s, "127.0.0.2")
        _send(extra, "/hold")
        wait_for(lambda: s.app.held == 2, timeout=10, what="2 requests of 127.0.0.2 held")
        with _connect(s, "127.0.0.2") as late:  # both of its connections serve: refused
            _send(late)
            assert _status(late) == 503
        assert _get(s, "127.0.0.3") == 200  # another address is still served
    finally:
        for sock in (*theirs, mine):
            sock.close()


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="max_per_ip"):
        ConnectionLimits(max_per_ip=0)
    with pytest.raises(ValueError, match="must not exceed max_open"):
        ConnectionLimits(max_connections=10, max_open=5, max_per_ip=5)
