"""Open-loop load against the router replicas, recording every request's fate at the client.

Open loop: arrivals follow a seeded Poisson process at ``rate`` x the plan's factor of the
moment, whether or not earlier requests have finished, so a stalled system meets the traffic
it would meet in production instead of a politely waiting client. Requests go round-robin over
the replicas; a connection refused (the replica is down) is sent on to the next replica, as a
client behind a load balancer would see it. Everything else the client sees is recorded as it
is: the HTTP status and the router's error code, or the exception's name.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from control_plane.router.loop_lag_probe import LoopLagProbe
from ops.demo.loadgen import Prepared, Result, send_one

#: Scheduling priority (nice) of the client's thread. On one box the client shares the CPUs with the
#: system it measures; at its default priority it ran 0.3 s late at p50 in the overload phase,
#: and each of a request's ~10 awaits paid that again: seconds of TTFT no router could see
#: (docs/faults.md, "Admission under overload"). Raised, it measures the system as a client on
#: another machine would. Needs CAP_SYS_NICE; without it the client runs as it is, and says so.
CLIENT_NICE = -10

#: Client exceptions that mean "this replica took no request": try the next one.
_NOT_CONNECTED = frozenset({"ConnectError", "ConnectTimeout"})


@dataclass
class Sent:
    """One request as the client saw it. Times are seconds from the start of the load."""

    index: int
    client_id: str
    sent_s: float
    overload: bool
    replica: int = -1
    attempts: int = 0
    end_s: float = 0.0
    result: Result | None = None

    @property
    def done(self) -> bool:
        return self.result is not None

    @property
    def ok(self) -> bool:
        return self.result is not None and self.result.ok

    @property
    def outcome(self) -> str:
        """``ok``, ``rejected:<code>`` or ``failed:<code>`` (``<code>``: the router's error
        code, ``http_<status>``, or the client exception's name)."""
        r = self.result
        if r is None:
            return "pending"
        if r.ok:
            return "ok"
        return f"{'rejected' if r.rejected else 'failed'}:{r.code}"


def _prompt(i: int, block_size: int) -> list[int]:
    """A shared 6-block document, one of 7 shared follow-up blocks, then a unique block: the
    router has prefixes to score and every request still has work of its own."""
    doc = list(range(2000, 2000 + block_size * 6))
    return doc + [10 + i % 7] * block_size + [100_000 + i] * block_size


class OpenLoopLoad:
    """A thread running an asyncio loop of Poisson arrivals until :meth:`stop`."""

    def __init__(self, urls: list[str], rate: float, rate_factor: Callable[[float], float], *, seed: int = 0,
                 id_prefix: str = "chaos", max_tokens: int = 8, block_size: int = 64,
                 timeout_s: float = 60.0) -> None:
        if rate <= 0:
            raise ValueError(f"rate {rate} must be > 0 requests/s")
        self.urls = list(urls)
        self.rate = rate
        self.rate_factor = rate_factor
        self.rng = random.Random(seed)
        self.id_prefix = id_prefix
        self.max_tokens = max_tokens
        self.block_size = block_size
        self.timeout_s = timeout_s
        self.sent: list[Sent] = []
        #: (seconds from the start, lag s) of each sample of this client's own event-loop lag: a
        #: client whose loop runs late sends late and reads late, and would blame the system.
        self.loop_lag: list[tuple[float, float]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-load", daemon=True)
        #: The client thread's nice value once it runs, or the error that kept it at the default.
        self.priority: str = ""
        self.t0 = 0.0

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), CLIENT_NICE)
            self.priority = f"nice {CLIENT_NICE}"
        except OSError as e:
            self.priority = f"default ({type(e).__name__}: {e})"
        asyncio.run(self._main())

    def now_s(self) -> float:
        return time.monotonic() - self.t0

    def start(self) -> None:
        self.t0 = time.monotonic()
        self._thread.start()

    def stop(self, drain_s: float = 90.0) -> None:
        """Stop sending; wait (at most ``drain_s``) for the requests in flight to end."""
        self._stop.set()
        self._thread.join(drain_s)

    def snapshot(self) -> list[Sent]:
        with self._lock:
            return list(self.sent)

    def first_ok_sent_after(self, t_s: float) -> Sent | None:
        """The first request sent at or after ``t_s`` that was served in full (traffic resumed)."""
        done = [s for s in self.snapshot() if s.sent_s >= t_s and s.ok]
        return min(done, key=lambda s: s.end_s) if done else None

    def ok_count(self) -> int:
        return sum(1 for s in self.snapshot() if s.ok)

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
        # A refused connection fails at once (failover); a slow accept on a loaded box is not one.
        timeout = httpx.Timeout(self.timeout_s, connect=10.0)
        tasks: set[asyncio.Task] = set()
        probe = LoopLagProbe(on_sample=lambda lag: self.loop_lag.append((self.now_s(), lag)))
        probe.start()
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            i = 0
            next_at = 0.0
            while not self._stop.is_set():
                delay = next_at - self.now_s()
                if delay > 0:
                    await asyncio.sleep(min(delay, 0.2))
                    continue
                factor = self.rate_factor(next_at)
                s = Sent(i, f"{self.id_prefix}-{i}", self.now_s(), factor > 1.0)
                with self._lock:
                    self.sent.append(s)
                t = asyncio.create_task(self._send(client, s))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
                i += 1
                next_at += self.rng.expovariate(self.rate * factor)
            if tasks:
                await asyncio.wait(tasks, timeout=self.timeout_s + 5)
        await probe.stop()

    async def _send(self, client: httpx.AsyncClient, s: Sent) -> None:
        prompt = _prompt(s.index, self.block_size)
        body = {"model": "switchyard-sim", "prompt": prompt, "max_tokens": self.max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "request_id": s.client_id}
        p = Prepared(s.index, s.client_id, s.sent_s, len(prompt), json.dumps(body, separators=(",", ":")).encode())
        res: Result | None = None
        for k in range(len(self.urls)):
            s.replica = (s.index + k) % len(self.urls)
            s.attempts = k + 1
            res = await send_one(client, f"{self.urls[s.replica]}/v1/completions", p)
            if not (res.status == 0 and res.code in _NOT_CONNECTED):
                break
        s.end_s = self.now_s()
        s.result = res
