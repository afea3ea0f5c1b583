"""The worker's listener: accepted connections have TCP_NODELAY set.

asyncio sets TCP_NODELAY on an accepted connection only when the listening socket's proto is
IPPROTO_TCP; a socket made with proto 0 left Nagle on, and each response from a worker waited
for the client's delayed ACK (~40 ms)."""

from __future__ import annotations

import asyncio
import socket

import uvicorn

from data_plane.workers.wiring import bind_socket
from common.http_server import server_config


async def _app(scope, receive, send):  # noqa: ANN001 - a bare ASGI app
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def test_bind_socket_names_tcp():
    sock = bind_socket("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()


async def test_accepted_connections_have_nodelay():
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(server_config(_app, "127.0.0.1", port, lifespan="off"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
        (conn,) = server.server_state.connections
        accepted = conn.transport.get_extra_info("socket")
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        writer.close()
    finally:
        server.should_exit = True
        await serving
