"""The vLLM tier: real vLLM engines (the CPU build here, CUDA vLLM on GPU hosts) as Switchyard
workers. Workers run in the vLLM environment (``.venv-vllm``, made by ``scripts/vllm-env.sh``;
``SWITCHYARD_VLLM_PYTHON`` names another interpreter); the tests, the router and the stack run
in the project environment. Engines are started once per module (about 1-2 minutes each on the
2-core box) and shared by the module's tests. A missing vLLM environment fails, never skips."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from common.net import free_port
from common.settings import BusSettings
from tests.integration.test_router import Procs, _wait_http
from tests.integration.workerproc import ROOT, WorkerProc, start_all, stop_all

#: Seconds a vLLM worker may take to serve (engine start on a loaded 2-core box is ~2 min).
READY_TIMEOUT = float(os.environ.get("SWITCHYARD_VLLM_READY_TIMEOUT", "900"))
BLOCK = 32


def vllm_prompt(seed: int, n: int) -> list[int]:
    """``n`` token ids below the tiny model's vocabulary (1024), distinct per seed (they repeat
    every 1,000 seeds)."""
    return [(seed * 7919 + i * 31) % 1000 + 3 for i in range(n)]


def pytest_collection_modifyitems(items):  # noqa: ANN001
    for item in items:
        if "tests/vllm/" in str(item.fspath):
            item.add_marker(pytest.mark.vllm)
            item.add_marker(pytest.mark.kafka)
            item.add_marker(pytest.mark.slow)
            # The first test of a module also waits for its module's engines to start.
            item.add_marker(pytest.mark.timeout(int(READY_TIMEOUT) + 600))


def vllm_python() -> str:
    py = os.environ.get("SWITCHYARD_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(py).exists():
        pytest.fail(f"no vLLM environment at {py}: run `bash scripts/vllm-env.sh` (scripts/test.sh does)")
    return py


#: Environment of every vLLM worker: loopback only, small KV cache, deterministic hashing.
WORKER_ENV = {"UCX_NET_DEVICES": "lo", "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1",
              "VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "1",
              # auto binds every engine to core 0 (and reserves core 1): let the OS spread them.
              "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


@pytest.fixture(scope="module")
def vbus(kafka_bootstrap: str) -> BusSettings:
    from common.log.admin import apply_topics

    settings = BusSettings(bootstrap=kafka_bootstrap, topic_prefix=f"v{uuid.uuid4().hex[:10]}")
    apply_topics(settings)
    return settings


def listeners_outside_loopback(pids: list[int]) -> list[str]:
    """Listening sockets of ``pids`` (and their children) not bound to 127.0.0.0/8."""
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True).stdout
    fam = set(map(str, pids))
    for pid in pids:
        kids = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
        fam.update(kids)
    bad = []
    for line in out.splitlines():
        if not any(f"pid={p}," in line for p in fam):
            continue
        local = line.split()[3]
        if not (local.startswith("127.") or local.startswith("[::ffff:127.")):
            bad.append(line)
    return bad


def start_router(procs, port: int, rid: str, mode: str = "kv"):  # noqa: ANN001, ANN201 - test_router.Procs
    """A router (project environment) hashing prompts as vLLM does here: 32-token blocks."""
    import sys

    p = subprocess.Popen([sys.executable, "-m", "switchyard.cli", "router", "--port", str(port),
                          "--router-id", rid, "--mode", mode, "--block-size", str(BLOCK), "--hash-algo", "sha256",
                          "--snapshot-every", "5", "--no-auth"], env=procs.env, stdout=procs.log, stderr=subprocess.STDOUT)
    procs.procs.append(p)
    return p


@contextmanager
def serving(bus: BusSettings, workers: Sequence[WorkerProc]) -> Iterator[str]:
    """``workers`` launched together (their engines load in parallel), each ready, and a router
    ``r-vllm`` seeing them all; yields the router's base URL, and stops everything on exit."""
    procs = Procs(bus)
    try:
        start_all(*workers, timeout=READY_TIMEOUT)
        port = free_port()
        router = start_router(procs, port, "r-vllm")
        base = f"http://127.0.0.1:{port}"
        try:
            _wait_http(f"{base}/health", lambda r: r.status_code == 200 and r.json()["workers"] == len(workers),
                       timeout=120)
        except AssertionError as e:  # say why: the router's own output (its log is removed on close)
            procs.log.flush()
            tail = Path(procs.log.name).read_text(errors="replace")[-4000:]
            raise AssertionError(f"{e}; router exit code {router.poll()}; its log ends:\n{tail}") from None
        yield base
    finally:
        procs.close()
        stop_all(workers)


def wait_router_caught_up(base: str, bus: BusSettings, stream: str = "kv", timeout: float = 30.0) -> None:
    """Until the router's view has applied every record now in ``stream`` (its positions are
    the next offsets to read, per ``topic:partition``)."""
    import time

    import httpx
    from confluent_kafka import Consumer, TopicPartition

    from common.log.catalog import Catalog

    topic = Catalog(bus.topic_prefix).topic(stream)
    c = Consumer({**bus.client_conf(), "group.id": "vllm-tier-hw"})
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        ends = {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in parts}
    finally:
        c.close()
    deadline = time.monotonic() + timeout
    while True:
        pos = httpx.get(f"{base}/router/view", timeout=5).json()["positions"]
        if all(hw == 0 or pos.get(f"{topic}:{p}", 0) >= hw for p, hw in ends.items()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"router view behind the log: {pos} vs {ends}")
        time.sleep(0.05)
