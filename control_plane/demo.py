"""``switchyard up --demo`` / ``switchyard down``: the whole system on one box.

Starts the stack (Kafka, PostgreSQL, Redis, Prometheus), then Switchyard's processes, each a
real ``switchyard ...`` subprocess with its own log under ``.stack/demo/``: the event-derived
metrics processor, the router, the admin API, the planner, and simulated prefill/decode workers.
Their pids go to ``.stack/demo/procs.json`` so ``switchyard down`` (another process) can stop
them: SIGTERM first (workers drain), SIGKILL after a grace period, then the stack.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from control_plane.settings import StackSettings
from control_plane.stack.process import alive, terminate


@dataclass
class Proc:
    name: str
    pid: int
    url: str = ""
    log: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Supervisor:
    def __init__(self, settings: StackSettings) -> None:
        self.dir = settings.state_dir / "demo"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.file = self.dir / "procs.json"
        self.procs: list[Proc] = self.load()

    def load(self) -> list[Proc]:
        try:
            return [Proc(**p) for p in json.loads(self.file.read_text())]
        except (FileNotFoundError, ValueError):
            return []

    def save(self) -> None:
        self.file.write_text(json.dumps([asdict(p) for p in self.procs], indent=2))

    def start(self, name: str, args: list[str], url: str = "", env: dict[str, str] | None = None) -> Proc:
        log = self.dir / f"{name}.log"
        with open(log, "ab") as out:
            p = subprocess.Popen([sys.executable, "-m", "control_plane.cli", *args], stdout=out,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                 env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"})
        proc = Proc(name, p.pid, url, str(log))
        self.procs.append(proc)
        self.save()
        return proc

    def running(self) -> list[Proc]:
        return [p for p in self.procs if alive(p.pid)]

    def stop_all(self, grace: float = 20.0) -> list[str]:
        """Workers first (they drain), then the rest; returns names that needed SIGKILL."""
        killed = []
        order = sorted(self.procs, key=lambda p: (not p.name.startswith("worker"), p.name))
        for p in order:
            if alive(p.pid):
                os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in order:
            while alive(p.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if alive(p.pid):
                killed.append(p.name)
                terminate(p.pid, 5, signal.SIGKILL)
        self.procs = []
        self.save()
        return killed


def wait_http(url: str, pred=lambda r: r.status_code == 200, timeout: float = 90.0, what: str = "") -> dict:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url, timeout=2)
            if pred(r):
                try:
                    return r.json()
                except ValueError:
                    return {}
            last = r.text[:200]
        except httpx.HTTPError as e:
            last = str(e)
        time.sleep(0.3)
    raise RuntimeError(f"{what or url} not ready after {timeout:.0f}s: {last}")


def write_prometheus_targets(targets_dir: Path, groups: dict[str, list[str]]) -> None:
    """file_sd targets for Prometheus: {job: [host:port, ...]}."""
    targets_dir.mkdir(parents=True, exist_ok=True)
    for job, hosts in groups.items():
        (targets_dir / f"{job}.json").write_text(json.dumps([{"targets": hosts, "labels": {"job": job}}], indent=2))
