"""The chaos load generator's own process (``python -m ops.chaos.client``): open-loop Poisson
arrivals over a minimal HTTP/1.1 client, each request's fate reported to the runner.

Why a process of its own and a client of its own: inside the runner's process the generator
shared one GIL with the fault injector, the probe producer and the lag sampler, and paid
httpx's per-request machinery on a loaded box; its loop ran late 47-87% of the overload phase
and its sends left in clumps 0.4-0.6 s apart, which it then measured as TTFT
(docs/faults.md, "Admission under overload"). Here it is alone on its loop, at ``nice``
:data:`CLIENT_NICE` when allowed, and a request costs one connection, one write and a line
parser (:func:`post_stream`; the SSE lines are read by ``ops.demo.loadgen.read_sse_line``, the
same as every other load generator's).

Its own lateness is measured, not assumed away: each request carries when the Poisson schedule
wanted it sent (``due_s``) and when it left (``sent_s``); TTFT counts from ``sent_s``, so a send
that left late is the generator's lateness, reported apart (``send_late_ms`` per request). The
loop's lag is sampled every 50 ms as well (a late read of a first token is the client's too).

Protocol (JSON, one object per line). stdin: the config first (:class:`ClientConfig`'s
fields), then commands: ``{"overload": [start_s, end_s, factor]}`` (arrivals x ``factor`` in
that window) and ``{"stop": drain_s}``. stdout: ``{"priority": str}``, then ``{"sent": {...}}``
as each request leaves, ``{"done": {...}}`` as it ends, ``{"lag": [t_s, lag_s]}`` per sample, and
``{"closed": true}`` last. Times are seconds since the config's ``t0``, a ``CLOCK_MONOTONIC``
reading of the runner's: that clock is system-wide, so both processes share one timeline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import sys
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from control_plane.router.loop_lag_probe import LoopLagProbe
from ops.demo.loadgen import Result, end_result, read_sse_line, refusal

#: Scheduling priority (nice) of the generator's process. On one box the client shares the CPUs
#: with the system it measures; raised, it measures the system as a client on another machine
#: would. Needs CAP_SYS_NICE; without it the client runs as it is, and says so.
CLIENT_NICE = -10


@dataclass(frozen=True)
class ClientConfig:
    urls: list[str]
    #: Requests per second outside the overload window.
    rate: float
    t0: float
    seed: int = 0
    id_prefix: str = "chaos"
    max_tokens: int = 8
    block_size: int = 64
    timeout_s: float = 60.0
    connect_timeout_s: float = 10.0


def prompt(i: int, block_size: int) -> list[int]:
    """A shared 6-block document, one of 7 shared follow-up blocks, then a unique block: the
    router has prefixes to score and every request still has work of its own."""
    doc = list(range(2000, 2000 + block_size * 6))
    return doc + [10 + i % 7] * block_size + [100_000 + i] * block_size


class _Protocol(Exception):
    """The answer is not HTTP/1.1 as the router speaks it."""


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]):
    """The answer's body as it arrives: chunked, by length, or to the end of the connection."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size_line = await reader.readline()
            if not size_line:
                raise _Protocol("the connection closed inside a chunked body")
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                return
            data = await reader.readexactly(size)
            await reader.readexactly(2)
            yield data
    elif "content-length" in headers:
        n = int(headers["content-length"])
        if n:
            yield await reader.readexactly(n)
    else:
        while data := await reader.read(65536):
            yield data


async def post_stream(url: str, body: bytes, res: Result, timeout_s: float, connect_timeout_s: float) -> Result:
    """POST ``body`` to ``url`` (``http://host:port/path``) and read the SSE answer into ``res``:
    TTFT and ITLs from the moment it starts (its connection included: a router that accepts
    slowly delays the client). A refusal keeps its status and the
    router's error code; no answer keeps the failure's name (``ConnectError``,
    ``ConnectTimeout``: the replica took nothing; ``ReadTimeout``, ``ReadError``,
    ``RemoteProtocolError``), as httpx names them."""
    u = urlsplit(url)
    t0 = time.monotonic()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(u.hostname, u.port or 80), connect_timeout_s)
    except TimeoutError:
        res.code, res.error = "ConnectTimeout", f"ConnectTimeout: no connection in {connect_timeout_s:g} s"
        return end_result(res, t0, time.monotonic())
    except OSError as e:
        res.code, res.error = "ConnectError", f"ConnectError: {e}"
        return end_result(res, t0, time.monotonic())
    try:
        async with asyncio.timeout(timeout_s):
            writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                         b"Connection: close\r\n\r\n" % (u.path.encode(), u.netloc.encode(), len(body)) + body)
            status_line = await reader.readline()
            parts = status_line.split(None, 2)
            if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
                raise _Protocol(f"status line {status_line[:80]!r}")
            status = int(parts[1])
            headers: dict[str, str] = {}
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                k, _, v = line.decode("latin-1").partition(":")
                headers[k.strip().lower()] = v.strip()
            res.router_request_id = headers.get("x-request-id", "")
            if status != 200:
                refusal(res, status, b"".join([c async for c in _body(reader, headers)]))
                return res
            res.status = 200
            last, buf = None, b""
            async for data in _body(reader, headers):
                now = time.monotonic()
                *lines, buf = (buf + data).split(b"\n")
                for raw in lines:
                    over, last = read_sse_line(res, raw.decode().rstrip("\r"), t0, last, now)
                    if over:
                        return end_result(res, t0, time.monotonic())
    except TimeoutError:
        res.code, res.error = "ReadTimeout", f"ReadTimeout: no end in {timeout_s:g} s"
    except (asyncio.IncompleteReadError, _Protocol, ValueError) as e:
        res.code, res.error = "RemoteProtocolError", f"RemoteProtocolError: {e}"
    except OSError as e:
        res.code, res.error = "ReadError", f"ReadError: {e}"
    finally:
        writer.close()
    return end_result(res, t0, time.monotonic())


class Generator:
    """The loop: arrivals, sends with failover to the next replica on a refused connection,
    the lag probe; every fact written to stdout as it happens."""

    def __init__(self, cfg: ClientConfig, out=sys.stdout) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.out = out
        #: (start_s, end_s, factor) of the overload window, once the runner sets it.
        self.overload: tuple[float, float, float] | None = None
        self.stopping: asyncio.Event | None = None
        self.drain_s = 90.0

    def now_s(self) -> float:
        return time.monotonic() - self.cfg.t0

    def emit(self, obj: dict) -> None:
        self.out.write(json.dumps(obj, separators=(",", ":")) + "\n")
        self.out.flush()

    def factor(self, t_s: float) -> float:
        ov = self.overload
        return ov[2] if ov is not None and ov[0] <= t_s < ov[1] else 1.0

    def command(self, cmd: dict) -> None:
        if "overload" in cmd:
            self.overload = tuple(cmd["overload"])  # type: ignore[assignment]
        if "stop" in cmd:
            self.drain_s = float(cmd["stop"])
            self.stopping.set()

    async def run(self) -> None:
        self.stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        threading.Thread(target=self._stdin, args=(loop,), name="chaos-client-stdin", daemon=True).start()
        probe = LoopLagProbe(on_sample=lambda lag: self.emit({"lag": [round(self.now_s(), 4), round(lag, 5)]}))
        probe.start()
        tasks: set[asyncio.Task] = set()
        i, next_at = 0, self.now_s()
        while not self.stopping.is_set():
            delay = next_at - self.now_s()
            if delay > 0:
                try:
                    await asyncio.wait_for(self.stopping.wait(), delay)
                except TimeoutError:
                    pass
                continue
            factor = self.factor(next_at)
            t = asyncio.create_task(self._send(i, next_at, factor > 1.0))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            i += 1
            next_at += self.rng.expovariate(self.cfg.rate * factor)
        if tasks:
            await asyncio.wait(tasks, timeout=self.drain_s)
        await probe.stop()
        self.emit({"closed": True})

    def _stdin(self, loop: asyncio.AbstractEventLoop) -> None:
        for line in sys.stdin:
            if line.strip():
                loop.call_soon_threadsafe(self.command, json.loads(line))
        loop.call_soon_threadsafe(self.command, {"stop": 5.0})  # the runner is gone: stop

    async def _send(self, i: int, due_s: float, overload: bool) -> None:
        cfg = self.cfg
        client_id = f"{cfg.id_prefix}-{i}"
        p = prompt(i, cfg.block_size)
        body = json.dumps({"model": "switchyard-sim", "prompt": p, "max_tokens": cfg.max_tokens, "stream": True,
                           "stream_options": {"include_usage": True}, "request_id": client_id},
                          separators=(",", ":")).encode()
        sent_s = self.now_s()
        self.emit({"sent": {"index": i, "client_id": client_id, "due_s": round(due_s, 5), "sent_s": round(sent_s, 5),
                            "overload": overload}})
        res = Result(i, client_id, len(p))
        replica, attempts = -1, 0
        for k in range(len(cfg.urls)):
            replica, attempts = (i + k) % len(cfg.urls), k + 1
            res = await post_stream(f"{cfg.urls[replica]}/v1/completions", body, Result(i, client_id, len(p)),
                                    cfg.timeout_s, cfg.connect_timeout_s)
            if not (res.status == 0 and res.code in ("ConnectError", "ConnectTimeout")):
                break
        self.emit({"done": {"index": i, "replica": replica, "attempts": attempts, "end_s": round(self.now_s(), 5),
                            "result": dataclasses.asdict(res)}})


def main() -> None:
    cfg = ClientConfig(**json.loads(sys.stdin.readline()))
    try:
        os.setpriority(os.PRIO_PROCESS, 0, CLIENT_NICE)
        priority = f"nice {CLIENT_NICE}"
    except OSError as e:
        priority = f"default ({type(e).__name__}: {e})"
    gen = Generator(cfg)
    gen.emit({"priority": priority})
    asyncio.run(gen.run())


if __name__ == "__main__":
    main()
