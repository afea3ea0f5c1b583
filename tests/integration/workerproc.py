"""Helpers for tests that run real worker processes (``python -m switchyard.cli worker``)
against the local broker, and read back what they published."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import httpx

from common.log.catalog import Catalog
from common.log.reader import KafkaLogReader, scan_events
from common.net import free_port
from common.settings import BusSettings, worker_credential, worker_token
from schemas import Envelope

ROOT = Path(__file__).resolve().parents[2]


class WorkerProc:
    """One worker process. ``args`` are extra CLI options; output goes to ``<log_dir>/<id>.log``."""

    #: Every worker launched in this test session: a failed test's report shows the tail of the
    #: logs written during it (tests/conftest.py), which is all a CI run leaves behind.
    launched: ClassVar[list[WorkerProc]] = []

    def __init__(self, bus: BusSettings, worker_id: str, data_dir: Path, log_dir: Path, *,
                 role: str = "aggregated", args: tuple[str, ...] = (), python: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.bus = bus
        self.worker_id = worker_id
        self.data_dir = data_dir
        self.role = role
        self.args = args
        #: Interpreter of the worker (the vLLM tier runs workers in .venv-vllm).
        self.python = python or sys.executable
        self.extra_env = env or {}
        self.log_dir = log_dir
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> WorkerProc:
        """Launch and wait until ``/health`` answers 200."""
        return self.launch().wait_ready(timeout)

    def launch(self) -> WorkerProc:
        env = dict(os.environ, SWITCHYARD_TOPIC_PREFIX=self.bus.topic_prefix,
                   SWITCHYARD_KAFKA_BOOTSTRAP=self.bus.bootstrap, PYTHONUNBUFFERED="1", **self.extra_env)
        cmd = [self.python, "-m", "switchyard.cli", "worker", "--worker-id", self.worker_id,
               "--role", self.role, "--port", str(self.port), "--data-dir", str(self.data_dir), *self.args]
        self.starts += 1
        if self not in WorkerProc.launched:
            WorkerProc.launched.append(self)
        log = open(self.log_dir / f"{self.worker_id}.{self.starts}.log", "wb")  # noqa: SIM115
        # Its own process group: a vLLM worker's engine core is a child process, and "the
        # worker died" (kill) or "is gone" (stop) must take it along.
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        log.close()
        return self

    def wait_ready(self, timeout: float = 30.0) -> WorkerProc:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"worker {self.worker_id} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"worker {self.worker_id} not ready after {timeout}s:\n{self.log()}")

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.worker_id}.{self.starts}.log"

    def log(self, chars: int = 6000) -> str:
        path = self.log_path
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def credential(self) -> dict[str, str]:
        """The header the worker's routes require: its own bearer (common.settings.worker_token)."""
        return {"Authorization": f"Bearer {self.token()}"}

    def token(self) -> str:
        return worker_token(worker_credential(self.bus.secrets_dir), self.worker_id)

    def state(self) -> dict:
        return httpx.get(f"{self.url}/debug/state", timeout=5, headers=self.credential()).json()

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def _kill_group(self) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        """SIGKILL to the worker and its children: no drain, no flush."""
        if self.proc is not None and self.proc.poll() is None:
            self._kill_group()
            self.proc.wait(10)

    def stop(self) -> int | None:
        """SIGTERM and wait (SIGKILL if it does not exit)."""
        if self.proc is None:
            return None
        if self.proc.poll() is not None:
            self._kill_group()
            return self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        return self._wait_stopped()

    def _wait_stopped(self) -> int | None:
        assert self.proc is not None
        try:
            rc = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.kill()
            return None
        self._kill_group()  # leftovers (an engine core orphaned by a worker that died starting)
        return rc


def stop_all(workers: Sequence[WorkerProc]) -> None:
    """SIGTERM every worker, then wait for each (SIGKILL one that does not exit): their drains
    and engine shutdowns overlap."""
    for w in workers:
        if w.proc is not None and w.proc.poll() is None:
            w.proc.send_signal(signal.SIGTERM)
    for w in workers:
        if w.proc is not None:
            w._wait_stopped()


def start_all(*workers: WorkerProc, timeout: float = 30.0) -> tuple[WorkerProc, ...]:
    """Launch every worker, then wait until each is ready (``timeout`` each): their start-ups
    overlap."""
    for w in workers:
        w.launch()
    for w in workers:
        w.wait_ready(timeout)
    return workers


@dataclass(frozen=True)
class Record:
    topic: str
    partition: int
    offset: int
    env: Envelope

    @property
    def type(self) -> str:
        return self.env.type


def read_log(bus: BusSettings, *streams: str) -> list[Record]:
    """Every record of ``streams`` up to their current end, per partition in offset order."""
    cat = Catalog(bus.topic_prefix)
    out: list[Record] = []
    with KafkaLogReader(bus.bootstrap) as reader:
        for stream in streams:
            topic = cat.topic(stream)
            out += [Record(topic, rec.partition, rec.offset, env) for rec, env in scan_events(reader, topic)]
    return out


def of(records: list[Record], producer: str | None = None, *types: str) -> list[Record]:
    return [r for r in records if (producer is None or r.env.producer == producer)
            and (not types or r.type in types)]
