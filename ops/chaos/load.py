"""Open-loop load against the router replicas, recording every request's fate at the client.

Open loop: arrivals follow a seeded Poisson process at ``rate`` x the overload factor of the
moment, whether or not earlier requests have finished, so a stalled system meets the traffic
it would meet in production instead of a politely waiting client. Requests go round-robin over
the replicas; a connection refused (the replica is down) is sent on to the next replica, as a
client behind a load balancer would see it. Everything else the client sees is recorded as it
is: the HTTP status and the router's error code, or the failure's name.

The generator runs in a process of its own (:mod:`ops.chaos.client`, which says why); this is
the runner's side of it: it starts that process, tells it when the overload phase runs, and
folds what it reports into :class:`Sent` records.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass

from common.settings import repo_root
from ops.chaos.client import ClientConfig
from ops.demo.loadgen import Result


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
    #: When the arrival process wanted it sent (None: not recorded); ``sent_s - due_s`` is the
    #: generator's own lateness, not the system's (TTFT counts from ``sent_s``).
    due_s: float | None = None

    @property
    def done(self) -> bool:
        return self.result is not None

    @property
    def ok(self) -> bool:
        return self.result is not None and self.result.ok

    @property
    def send_late_ms(self) -> float | None:
        return None if self.due_s is None else max(0.0, self.sent_s - self.due_s) * 1000

    @property
    def outcome(self) -> str:
        """``ok``, ``rejected:<code>`` or ``failed:<code>`` (``<code>``: the router's error
        code, ``http_<status>``, or the client failure's name)."""
        r = self.result
        if r is None:
            return "pending"
        if r.ok:
            return "ok"
        return f"{'rejected' if r.rejected else 'failed'}:{r.code}"


class OpenLoopLoad:
    """The generator's process, and what it reported so far."""

    def __init__(self, urls: list[str], rate: float, *, seed: int = 0, id_prefix: str = "chaos",
                 max_tokens: int = 8, block_size: int = 64, timeout_s: float = 60.0) -> None:
        if rate <= 0:
            raise ValueError(f"rate {rate} must be > 0 requests/s")
        self.urls = list(urls)
        self.rate = rate
        self.seed = seed
        self.id_prefix = id_prefix
        self.max_tokens = max_tokens
        self.block_size = block_size
        self.timeout_s = timeout_s
        self.sent: list[Sent] = []
        #: (seconds from the start, lag s) of each sample of the client's own event-loop lag: a
        #: client whose loop runs late reads late, and would blame the system.
        self.loop_lag: list[tuple[float, float]] = []
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._closed = threading.Event()
        #: The client process's nice value, or the error that kept it at the default.
        self.priority: str = ""
        #: The client's stderr tail when it exited abnormally.
        self.error: str = ""
        self.t0 = 0.0
        #: The wall clock (unix s) at ``t0``: maps the client's times onto the log's
        #: ``occurred_at`` (when the router took a request), so the time between the client's
        #: send and the router's admission is measured apart from the way back.
        self.wall_t0 = 0.0

    def now_s(self) -> float:
        return time.monotonic() - self.t0

    def start(self) -> None:
        self.t0, self.wall_t0 = time.monotonic(), time.time()
        cfg = ClientConfig(urls=self.urls, rate=self.rate, t0=self.t0, seed=self.seed, id_prefix=self.id_prefix,
                           max_tokens=self.max_tokens, block_size=self.block_size, timeout_s=self.timeout_s)
        self._proc = subprocess.Popen([sys.executable, "-m", "ops.chaos.client"], cwd=repo_root(),
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, bufsize=1)
        self._send({**asdict(cfg)})
        self._reader = threading.Thread(target=self._read, name="chaos-load-reader", daemon=True)
        self._reader.start()

    def set_overload(self, start_s: float, end_s: float, factor: float) -> None:
        """Arrivals x ``factor`` from ``start_s`` to ``end_s`` (seconds from the start)."""
        self._send({"overload": [start_s, end_s, factor]})

    def stop(self, drain_s: float = 90.0) -> None:
        """Stop sending; wait (at most ``drain_s``) for the requests in flight to end; the
        process is gone when this returns."""
        p = self._proc
        if p is None:
            return
        if p.poll() is None:
            self._send({"stop": drain_s})
            self._closed.wait(drain_s + 10)
        try:
            p.stdin.close()
        except OSError:
            pass
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
        if self._reader is not None:
            self._reader.join(10)
        if p.returncode not in (0, None):
            self.error = (p.stderr.read() if p.stderr else "")[-2000:]

    def snapshot(self) -> list[Sent]:
        with self._lock:
            return list(self.sent)

    def first_ok_sent_after(self, t_s: float) -> Sent | None:
        """The first request sent at or after ``t_s`` that was served in full (traffic resumed)."""
        done = [s for s in self.snapshot() if s.sent_s >= t_s and s.ok]
        return min(done, key=lambda s: s.end_s) if done else None

    def ok_count(self) -> int:
        return sum(1 for s in self.snapshot() if s.ok)

    # -- the pipe ------------------------------------------------------------------------------

    def _send(self, obj: dict) -> None:
        try:
            self._proc.stdin.write(json.dumps(obj) + "\n")
            self._proc.stdin.flush()
        except (OSError, ValueError):
            pass  # the process is gone: stop() reports how it ended

    def _read(self) -> None:
        by_index: dict[int, Sent] = {}
        for line in self._proc.stdout:
            msg = json.loads(line)
            if (d := msg.get("sent")) is not None:
                s = Sent(d["index"], d["client_id"], d["sent_s"], d["overload"], due_s=d["due_s"])
                with self._lock:
                    self.sent.append(s)
                by_index[s.index] = s
            elif (d := msg.get("done")) is not None:
                s = by_index.pop(d["index"])
                s.replica, s.attempts, s.end_s = d["replica"], d["attempts"], d["end_s"]
                s.result = Result(**d["result"])  # last: ``done`` reads it
            elif (lag := msg.get("lag")) is not None:
                self.loop_lag.append((lag[0], lag[1]))
            elif "priority" in msg:
                self.priority = msg["priority"]
            elif msg.get("closed"):
                self._closed.set()
        self._closed.set()
