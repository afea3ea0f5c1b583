"""The router's generation path in one process, without a broker: its app (API keys on, a
``MemorySink`` for the log) on its own server in front of a fake worker (uvicorn, a thread of
the same process), as ``tests/integration/test_router_input.py`` builds it. ``direct``: the
generation routes served directly by the native server (the product); ``asgi``: the same app
with its direct routes taken away, so they go through the ASGI app (Starlette's middleware,
routing, request and response), as before. CPU per request of the serving process (router and
fake worker: the worker's share is the same on both sides), one at a time and 32 in flight,
non-streaming and streaming 256-word completions (short: the fake worker parses the prompt in
Python) of 1 and 16 tokens; sides alternate.

``python -m benchmarks.gen_path_bench [--n 400] [--rounds 3]``; last line ``RESULT``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time

import httpx

from benchmarks.alternating import alternate
from common.processes import cpu_s

PROMPT = "word " * 256


def serve(via: str) -> None:
    # lazy: only the serving child builds the router's test stack (uvicorn, FastAPI, the fake worker)
    import tests.integration.test_router_input as t

    make = t.create_app

    def create_app(ctx):
        app = make(ctx)
        if via == "asgi":
            app.state.direct_routes = {}
        return app

    t.create_app = create_app
    with t.router_stack() as s:
        print(json.dumps({"url": s.url, "key": s.key}), flush=True)
        sys.stdin.read()  # until the parent closes it


async def _fire(url: str, key: str, body: bytes, n: int, clients: int) -> float:
    async with httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=clients), timeout=60,
                                 headers={"Authorization": f"Bearer {key}",
                                          "content-type": "application/json"}) as c:
        sem = asyncio.Semaphore(clients)

        async def one() -> None:
            async with sem:
                r = await c.post("/v1/completions", content=body)
                assert r.status_code == 200, r.text[:300]

        start = time.monotonic()
        await asyncio.gather(*(one() for _ in range(n)))
        return time.monotonic() - start


CASES = {"t1": (1, False), "t16": (16, False), "t16s": (16, True)}


def run_one(via: str, n: int) -> dict[str, float]:
    p = subprocess.Popen([sys.executable, "-m", "benchmarks.gen_path_bench", "--serve", via],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(p.stdout.readline())  # type: ignore[union-attr]
        out = {}
        for case, (tokens, stream) in CASES.items():
            body = json.dumps({"model": "switchyard-sim", "prompt": PROMPT, "max_tokens": tokens,
                               "stream": stream}).encode()
            asyncio.run(_fire(info["url"], info["key"], body, 50, 1))  # warm-up
            for clients in (1, 32):
                cpu0 = cpu_s(p.pid)
                wall = asyncio.run(_fire(info["url"], info["key"], body, n, clients))
                out[f"{case}_cpu_us_c{clients}"] = (cpu_s(p.pid) - cpu0) / n * 1e6
                out[f"{case}_rps_c{clients}"] = n / wall
        return out
    finally:
        p.stdin.close()  # type: ignore[union-attr]
        p.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", choices=("direct", "asgi"))
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    if a.serve:
        serve(a.serve)
        return
    alternate(("asgi", "direct"), a.rounds, lambda via: run_one(via, a.n))


if __name__ == "__main__":
    main()
