"""The router's HTTP server alone: the crate's (``common/native_http.py``) beside the guarded
uvicorn the other processes keep (``common/http_server.py``), serving the same plain ASGI app
in a process of its own: it reads a 4K-token-sized JSON body and streams three SSE events, the
shape of a routed request, with nothing else to do. ``direct``: the crate's server running the
same work as a direct route (``app.state.direct_routes``, how it serves the router's generation
routes) instead of through the ASGI adapter. CPU per request of the serving process
(every thread, /proc), sequential and with 32 clients in flight; runs alternate.

``python -m benchmarks.front_bench [--n 2000] [--rounds 3]``
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

import httpx

from benchmarks.alternating import alternate
from common.net import free_port
from common.processes import cpu_s

BODY = b'{"model":"m","prompt":"' + b"word " * 4096 + b'","max_tokens":1,"stream":true}'
EVENTS = [b'data: {"choices":[{"text":" t","index":0}]}\n\n', b'data: {"choices":[],"usage":{}}\n\n',
          b"data: [DONE]\n\n"]


async def app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for e in EVENTS:
        await send({"type": "http.response.body", "body": e, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


async def direct(d) -> None:
    """The same work as :func:`app`, as a direct route of the native server."""
    async for _ in d.body():
        pass

    async def events():
        for e in EVENTS:
            yield e

    await d.stream(200, [(b"content-type", b"text/event-stream")], events())


class _DirectApp:
    """:func:`app`, with ``/v1/completions`` (POST) a direct route."""

    class state:  # noqa: N801 (the attribute the server reads: ``app.state.direct_routes``)
        direct_routes = {"/v1/completions": direct}

    async def __call__(self, scope, receive, send) -> None:
        await app(scope, receive, send)


direct_app = _DirectApp()


def serve(server: str, port: int) -> None:
    if server == "direct":
        # lazy: the serving child loads only the server it runs
        from common.native_http import serve as native_serve

        native_serve(direct_app, "127.0.0.1", port)
    elif server == "native":
        # lazy: the serving child loads only the server it runs
        from common.native_http import serve as native_serve

        native_serve(app, "127.0.0.1", port)
    else:
        # lazy: the serving child loads only the server it runs
        from common.http_server import serve as uvicorn_serve

        uvicorn_serve(app, "127.0.0.1", port, lifespan="off")


async def _fire(url: str, n: int, clients: int) -> float:
    async with httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=clients), timeout=30) as c:
        sem = asyncio.Semaphore(clients)

        async def one() -> None:
            async with sem:
                r = await c.post("/v1/completions", content=BODY, headers={"content-type": "application/json"})
                assert r.status_code == 200 and r.content.endswith(b"[DONE]\n\n"), r.status_code

        start = time.monotonic()
        await asyncio.gather(*(one() for _ in range(n)))
        return time.monotonic() - start


def run_one(server: str, n: int) -> dict[str, float]:
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "benchmarks.front_bench", "--serve", server, "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.post(f"{url}/", content=b"{}", timeout=1)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        asyncio.run(_fire(url, 200, 1))  # warm-up
        out = {}
        for clients in (1, 32):
            cpu0 = cpu_s(p.pid)
            wall = asyncio.run(_fire(url, n, clients))
            out[f"cpu_us_c{clients}"] = (cpu_s(p.pid) - cpu0) / n * 1e6
            out[f"rps_c{clients}"] = n / wall
        return out
    finally:
        p.terminate()
        p.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", choices=("native", "uvicorn", "direct"))
    ap.add_argument("--port", type=int)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    if a.serve:
        serve(a.serve, a.port)
        return
    alternate(("uvicorn", "native", "direct"), a.rounds, lambda server: run_one(server, a.n))


if __name__ == "__main__":
    main()
