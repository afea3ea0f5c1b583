"""The chaos load generator's HTTP client (ops/chaos/client.py) against a real socket server
speaking what the router speaks: a chunked SSE stream, a JSON refusal, a cut connection."""

from __future__ import annotations

import asyncio
import json

from ops.chaos.client import post_stream
from ops.demo.loadgen import Result


def _chunk(b: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(b), b)


async def _serve(answer: bytes):
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        n = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        await reader.readexactly(n)
        writer.write(answer)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"


async def test_a_streamed_answer_gives_ttft_tokens_and_usage() -> None:
    """Two tokens, the usage, [DONE], split across chunks mid-line: ok, 2 tokens, 16 cached."""
    events = b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in (
        {"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]},
        {"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 16}}})) + b"data: [DONE]\n\n"
    body = _chunk(events[:10]) + _chunk(events[10:]) + b"0\r\n\r\n"
    server, url = await _serve(b"HTTP/1.1 200 OK\r\nx-request-id: r-1\r\ntransfer-encoding: chunked\r\n\r\n" + body)
    async with server:
        res = await post_stream(url, b"{}", Result(0, "c-0", 10), 5.0, 5.0)
    assert (res.ok, res.output_tokens, res.cached_tokens, res.router_request_id, res.status) == (True, 2, 16, "r-1", 200)
    assert res.ttft_ms > 0 and len(res.itls_ms) == 1


async def test_a_refusal_keeps_its_code_and_counts_as_shed() -> None:
    err = json.dumps({"error": {"code": "ttft_budget", "message": "predicted 2000 ms"}}).encode()
    server, url = await _serve(b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: %d\r\n\r\n%s" % (len(err), err))
    async with server:
        res = await post_stream(url, b"{}", Result(0, "c-0", 10), 5.0, 5.0)
    assert (res.ok, res.status, res.code, res.rejected) == (False, 429, "ttft_budget", True)


async def test_a_cut_stream_and_a_refused_connection_are_named_as_httpx_names_them() -> None:
    server, url = await _serve(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + _chunk(b"data: {\"choices\""))
    async with server:
        cut = await post_stream(url, b"{}", Result(0, "c-0", 10), 5.0, 5.0)
    assert (cut.ok, cut.code) == (False, "RemoteProtocolError")
    refused = await post_stream(url, b"{}", Result(0, "c-0", 10), 5.0, 5.0)  # the server is closed
    assert (refused.status, refused.code) == (0, "ConnectError")
