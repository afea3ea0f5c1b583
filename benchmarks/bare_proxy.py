"""The floor of a Python router on this machine: a bare ASGI app on the router's HTTP server
(:mod:`common.http_server`: uvicorn, httptools, the same connection limits) that only forwards
each request's body to one worker with the router's worker port
(:class:`~control_plane.router.worker_calls.HttpWorkerCalls`: the crate's hyper client) and
sends the answer back. No parsing, no decision, no events, no ledger. ``switchyard bench
router`` runs it in front of the same instant worker as the router and nginx: what any Python
router built on these parts can reach here, beside what nginx reaches.

Run: ``python -m benchmarks.bare_proxy --port P --worker http://127.0.0.1:W``.
"""

from __future__ import annotations

import argparse

from control_plane.router.worker_calls import HttpWorkerCalls
from common.http_server import serve
from starlette.types import Receive, Scope, Send


def bare_proxy(worker: str):
    """The ASGI app: ``/health`` answers 200; any other request's body goes to ``worker`` at the
    same path, and its status and body come back as JSON."""
    calls = HttpWorkerCalls(connect_timeout_s=2.0, read_timeout_s=60.0)
    served = 0

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal served
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await calls.close()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["path"] == "/health":
            status, answer = 200, b"{}"
        else:
            chunks, more = [], True
            while more:
                message = await receive()
                chunks.append(message.get("body", b""))
                more = message.get("more_body", False)
            served += 1
            async with calls.post(worker + scope["path"], b"".join(chunks), f"bare-{served}", "") as reply:
                status, answer = reply.status, await reply.read()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": answer})

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--worker", required=True, help="the worker's base URL")
    args = p.parse_args()
    serve(bare_proxy(args.worker.rstrip("/")), "127.0.0.1", args.port)


if __name__ == "__main__":
    main()
