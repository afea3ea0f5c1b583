"""Helpers for tests that run real worker processes (``python -m control_plane.cli worker``)
against the local broker, and read back what they published."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from confluent_kafka import Consumer, TopicPartition

from control_plane.bus.catalog import Catalog
from control_plane.settings import BusSettings
from schemas import Envelope, EventCodec

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerProc:
    """One worker process. ``args`` are extra CLI options; output goes to ``<log_dir>/<id>.log``."""

    def __init__(self, bus: BusSettings, worker_id: str, data_dir: Path, log_dir: Path, *,
                 role: str = "aggregated", args: tuple[str, ...] = ()) -> None:
        self.bus = bus
        self.worker_id = worker_id
        self.data_dir = data_dir
        self.role = role
        self.args = args
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
                   SWITCHYARD_KAFKA_BOOTSTRAP=self.bus.bootstrap, PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "control_plane.cli", "worker", "--worker-id", self.worker_id,
               "--role", self.role, "--port", str(self.port), "--data-dir", str(self.data_dir), *self.args]
        self.starts += 1
        log = open(self.log_dir / f"{self.worker_id}.{self.starts}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
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

    def log(self) -> str:
        path = self.log_dir / f"{self.worker_id}.{self.starts}.log"
        return path.read_text(errors="replace")[-6000:] if path.exists() else ""

    def state(self) -> dict:
        return httpx.get(f"{self.url}/debug/state", timeout=5).json()

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL: no drain, no flush."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> int | None:
        """SIGTERM and wait (SIGKILL if it does not exit)."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.kill()
            return None


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
    codec = EventCodec()
    cat = Catalog(bus.topic_prefix)
    c = Consumer({"bootstrap.servers": bus.bootstrap, "group.id": "test-reader", "enable.auto.commit": False})
    out: list[Record] = []
    try:
        for stream in streams:
            topic = cat.topic(stream)
            for p in sorted(c.list_topics(topic, timeout=10).topics[topic].partitions):
                lo, hi = c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
                if hi <= lo:
                    continue
                c.assign([TopicPartition(topic, p, lo)])
                pos = lo
                deadline = time.monotonic() + 20
                while pos < hi and time.monotonic() < deadline:
                    for m in c.consume(1000, 0.5):
                        if m.error():
                            continue
                        pos = m.offset() + 1
                        out.append(Record(topic, p, m.offset(), codec.decode(m.value())))
    finally:
        c.close()
    return out


def wait_for(pred, timeout: float = 20.0, what: str = "", interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or pred}")
        time.sleep(interval)


def of(records: list[Record], producer: str | None = None, *types: str) -> list[Record]:
    return [r for r in records if (producer is None or r.env.producer == producer)
            and (not types or r.type in types)]
