"""Connections that cannot hurt (issue 14, item 4): a client that opens connections and sends
nothing, sends its headers a byte at a time (slowloris), or stalls in its body, holds a socket
for a bounded time only; past ``max_connections`` a new client closes the oldest idle
connection instead of being refused; and once the bad connections are gone, clients are served as before.

The router's app is served by the router's own server (``common.native_http``: the crate's hyper
server, which enforces the limits) with short limits, in front of the fake worker of test_router_input. The
attacks are raw sockets on loopback; the good client is ``httpx``.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from control_plane.router.limits import RequestLimits
from ops.security.check import ACCEPTED, REFUSED, probe_router_connections
from common.connection_limits import ConnectionLimits
from tests.integration.test_router_input import GOOD, Stack, router_stack
from tests.support.waits import wait_for

HEADER_S = 1.0  # request_timeout_s: the headers' deadline
BODY_S = 1.0  # body_timeout_s
MAX_CONNECTIONS = 4


@pytest.fixture
def guarded() -> Iterator[Stack]:
    limits = ConnectionLimits(max_connections=MAX_CONNECTIONS, max_open=MAX_CONNECTIONS, max_per_ip=MAX_CONNECTIONS,
                              request_timeout_s=HEADER_S, keep_alive_s=5.0)
    with router_stack(RequestLimits(body_timeout_s=BODY_S), limits) as s:
        yield s


def _connect(s: Stack) -> socket.socket:
    port = int(s.url.rsplit(":", 1)[1])
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _closed_within(sock: socket.socket, timeout_s: float) -> tuple[bool, bytes]:
    """Whether the server closed ``sock`` within ``timeout_s``, and what it sent before that."""
    sock.settimeout(timeout_s)
    got = b""
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                return True, got
            got += chunk
    except (TimeoutError, socket.timeout):
        return False, got
    except (ConnectionResetError, BrokenPipeError):
        return True, got
    return False, got


def _good(s: Stack) -> None:
    r = s.post("/v1/completions", GOOD)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == " t0 t1"


def _request_head(s: Stack, content_length: int, extra: str = "") -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {s.key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {content_length}\r\n{extra}\r\n").encode()


def test_a_connection_that_sends_nothing_is_closed_at_the_header_deadline(guarded: Stack) -> None:
    sock = _connect(guarded)
    start = time.monotonic()
    closed, got = _closed_within(sock, HEADER_S + 5)
    took = time.monotonic() - start
    sock.close()
    assert closed and got == b"", (closed, got)
    assert HEADER_S * 0.4 <= took <= HEADER_S + 3, took  # the deadline is drawn in [1/2, 1] x HEADER_S
    _good(guarded)


def test_headers_sent_a_byte_at_a_time_do_not_hold_the_connection(guarded: Stack) -> None:
    """Every byte would reset an idle timer; the header deadline runs from the connection's start."""
    head = _request_head(guarded, 2)
    sock = _connect(guarded)
    start, sent, closed = time.monotonic(), 0, False
    try:
        while sent < len(head) and time.monotonic() - start < HEADER_S + 5:
            sock.sendall(head[sent:sent + 1])
            sent += 1
            closed, _ = _closed_within(sock, 0.05)  # the attacker's pace: a byte every 50 ms
            if closed:
                break
    except (ConnectionResetError, BrokenPipeError):
        closed = True
    took = time.monotonic() - start
    sock.close()
    assert closed and sent < len(head), f"not closed after {sent} of {len(head)} header bytes in {took:.1f}s"
    assert took <= HEADER_S + 3, took
    _good(guarded)


def test_a_body_that_stalls_is_408_and_the_connection_closed(guarded: Stack) -> None:
    body = b'{"model":"switchyard-sim","prompt":[300,301],"max_tokens":2}'
    sock = _connect(guarded)
    sock.sendall(_request_head(guarded, len(body)) + body[:10])  # headers, then a tenth of the body
    start = time.monotonic()
    closed, got = _closed_within(sock, BODY_S + 5)
    took = time.monotonic() - start
    sock.close()
    assert got.startswith(b"HTTP/1.1 408 "), got[:200]
    assert b"request_timeout" in got and b"connection: close" in got.lower(), got
    assert closed and BODY_S * 0.8 <= took <= BODY_S + 3, (closed, took)
    assert guarded.worker_calls == []  # nothing of it reached the worker
    _good(guarded)


def test_a_keep_alive_connection_between_requests_is_served(guarded: Stack) -> None:
    """The deadline is re-armed after each response: a client that is quick on each request
    keeps its connection for as many requests as it sends."""
    for _ in range(5):
        _good(guarded)
    assert len(guarded.ports) == 1, guarded.ports


def test_idle_connections_past_max_connections_make_room_for_a_client(guarded: Stack) -> None:
    """Idle connections cannot fill the server: a client's request on a new connection closes the
    oldest idle one instead of being answered 503 (busy connections: tests/unit/test_http_connections.py)."""
    idle = [_connect(guarded) for _ in range(MAX_CONNECTIONS)]
    try:
        assert _status(guarded) == 200
        assert _closed_within(idle[0], 5)[0]
        _good(guarded)
    finally:
        for sock in idle:
            sock.close()


def _status(s: Stack) -> int:
    """One request on a new connection (the stack's client holds its own one)."""
    sock = _connect(s)
    try:
        body = b'{"model":"switchyard-sim","prompt":[300,301],"max_tokens":2}'
        sock.sendall(_request_head(s, len(body), "Connection: close\r\n") + body)
        _, got = _closed_within(sock, 5)
        return int(got.split(b" ", 2)[1]) if got.startswith(b"HTTP/1.1 ") else -1
    finally:
        sock.close()


def test_the_security_check_probe_tells_a_guarded_router_from_plain_uvicorn(guarded: Stack) -> None:
    """``switchyard security-check``'s connection probe: refused here, accepted against the same
    app served by plain uvicorn (which bounds neither connection)."""
    got = probe_router_connections(guarded.url, timeout_s=HEADER_S + 4)
    assert [p.verdict for p in got] == [REFUSED] * 3, got
    with router_stack(plain=True) as plain:
        got = probe_router_connections(plain.url, timeout_s=HEADER_S + 2)
    assert [p.verdict for p in got] == [ACCEPTED, ACCEPTED, REFUSED], got
