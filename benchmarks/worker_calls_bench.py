"""The router's worker hop alone: :class:`~control_plane.router.worker_calls.HttpWorkerCalls`
against an instant local worker in another process, the way the router uses it (a 4K-token JSON
body, a streamed SSE answer read line by line up to ``[DONE]``, the rest drained).

Per call: wall time p50 one at a time, this process's CPU (every thread: the native client's
tokio thread counts), and calls per second with 32 in flight. The worker is a plain asyncio
server answering each request at once with a chunked SSE stream (two events, ``[DONE]``, then
the last chunk), keep-alive, as uvicorn does.

``--tokens N --relay``: the answer has N tokens, and two ways of reading it alternate: ``chunks``, each
event up to Python and a ``Chunk`` made of it (how a streamed answer is read), and ``relay``, the
answer read to its end by the crate, Python woken at its first token and its end (how a
non-streamed answer is read, ``Reply.relay``).

Run: ``python -m benchmarks.worker_calls_bench [--n 2000] [--tokens 2] [--relay]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

from common.net import free_port
import msgspec

from control_plane.router.proxy import Chunk
from control_plane.router.worker_calls import SSE_DONE, HttpWorkerCalls, sse_events

_decode = msgspec.json.decode

def _sse(n: int) -> bytes:
    return (b"".join(b"data: " + json.dumps({"choices": [{"text": f" t{i}", "token_ids": [i], "finish_reason": None}]}).encode()
                     + b"\n\n" for i in range(n)) + b"data: [DONE]\n\n")


_SSE = _sse(2)


async def _serve(port: int) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
            await reader.readexactly(length)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                         b"%x\r\n%s\r\n0\r\n\r\n" % (len(_SSE), _SSE))
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=512)
    print("ready", flush=True)
    await server.serve_forever()


async def _call(calls: HttpWorkerCalls, url: str, body: bytes, i: int) -> None:
    async with calls.post(url, body, f"bench-{i}", "w") as r:
        assert r.status == 200
        async for ev in sse_events(r.chunks()):
            if ev[0] == SSE_DONE:
                break
            Chunk(ev[1], ev[2], ev[3], None if ev[4] is None else _decode(ev[4]))


async def _relayed(calls: HttpWorkerCalls, url: str, body: bytes, i: int) -> None:
    async with calls.post(url, body, f"bench-{i}", "w", relay=True) as r:
        assert r.status == 200
        answer = r.relay()
        await answer.first_token()
        assert (await answer.end()).end == 0


async def _run(url: str, n: int, call=_call) -> dict[str, float]:
    body = json.dumps({"model": "m", "prompt": list(range(4096)), "max_tokens": 2, "stream": True}).encode()
    calls = HttpWorkerCalls(connect_timeout_s=2.0, read_timeout_s=60.0)
    try:
        for i in range(200):  # warm-up: connections, caches
            await call(calls, url, body, i)
        walls = []
        cpu0 = time.process_time()
        for i in range(n):
            t = time.perf_counter()
            await call(calls, url, body, i)
            walls.append(time.perf_counter() - t)
        seq_cpu = (time.process_time() - cpu0) / n
        sem = asyncio.Semaphore(32)

        async def one(i: int) -> None:
            async with sem:
                await call(calls, url, body, i)

        t, cpu0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(one(i) for i in range(n)))
        wall, conc_cpu = time.perf_counter() - t, (time.process_time() - cpu0) / n
        await calls.drained()
    finally:
        await calls.close()
    return {"seq_p50_us": statistics.median(walls) * 1e6, "seq_cpu_us_per_call": seq_cpu * 1e6,
            "c32_calls_per_s": n / wall, "c32_cpu_us_per_call": conc_cpu * 1e6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=2000, help="calls per measurement")
    p.add_argument("--tokens", type=int, default=2, help="tokens per answer")
    p.add_argument("--relay", action="store_true", help="alternate chunks and relay (module docstring)")
    p.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        global _SSE
        _SSE = _sse(args.tokens)
        asyncio.run(_serve(args.serve))
        return
    port = free_port()
    worker = subprocess.Popen([sys.executable, "-m", "benchmarks.worker_calls_bench", "--serve", str(port),
                               "--tokens", str(args.tokens)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout is not None and worker.stdout.readline().strip() == "ready"
        url = f"http://127.0.0.1:{port}/v1/completions"
        if args.relay:
            got = {}
            for rnd in range(2):
                for name, call in (("chunks", _call), ("relay", _relayed)):
                    one = asyncio.run(_run(url, args.n, call))
                    print(f"round {rnd + 1} {name} " + " ".join(f"{k}={v:.1f}" for k, v in one.items()), flush=True)
                    got.update({f"{name}_{k}": v for k, v in one.items()})
        else:
            got = asyncio.run(_run(url, args.n))
    finally:
        worker.terminate()
        worker.wait()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print("RESULT " + " ".join(f"{k}={v:.1f}" for k, v in got.items()) + f" load={load.replace(' ', '/')}")


if __name__ == "__main__":
    main()
