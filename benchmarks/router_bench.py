"""``switchyard bench router``: decision latency, and the router's HTTP overhead.

1. Decision latency (pure, in process): ``benchmarks.router_decide`` — kv mode at 8, 64 and 256
   workers for 4K- and 32K-token prompts, every worker with requests in flight.
2. HTTP overhead (needs the local broker): an instant worker (``tests/support/mini_worker.py``
   with no token delay) is called directly and through a router replica in front of it, with the
   same non-streaming 1-token completions of a 4K-token prompt, one at a time; overhead is the
   difference of the percentiles. The router's path includes tokenizer-free hashing of the
   prompt (token ids are sent), the decision, two events published, and the proxy hop.

Last line: ``RESULT decide_p99_us=<256 workers, 32K tokens> http_overhead_p99_ms=...``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid

import httpx

from benchmarks import router_decide
from kernel.log.admin import apply_topics
from kernel.settings import BusSettings


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, pred, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url, timeout=2)
            if pred(r):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become ready")


def _latencies(client: httpx.Client, url: str, body: dict, n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        r = client.post(url, json={**body, "request_id": f"bench-{uuid.uuid4().hex}"})
        r.raise_for_status()
        out.append((time.perf_counter() - t0) * 1000)
    return sorted(out)


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def http_overhead(n: int = 400) -> dict:
    bus = BusSettings.from_env(topic_prefix=f"benchr{uuid.uuid4().hex[:6]}")
    apply_topics(bus)
    env = {**os.environ, "SWITCHYARD_KAFKA_BOOTSTRAP": bus.bootstrap, "SWITCHYARD_TOPIC_PREFIX": bus.topic_prefix}
    wport, rport = _port(), _port()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.support.mini_worker", "--worker-id", "instant",
                               "--port", str(wport), "--token-delay", "0"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        _wait(f"http://127.0.0.1:{wport}/health", lambda r: r.status_code == 200)
        procs.append(subprocess.Popen([sys.executable, "-m", "switchyard.cli", "router", "--port", str(rport),
                                       "--router-id", "bench", "--no-auth"], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _wait(f"http://127.0.0.1:{rport}/health", lambda r: r.status_code == 200 and r.json()["workers"] >= 1)
        body = {"model": "switchyard-sim", "prompt": list(range(5000, 5000 + 4096)), "max_tokens": 1}
        with httpx.Client(timeout=30) as client:
            _latencies(client, f"http://127.0.0.1:{wport}/v1/completions", body, 50)
            _latencies(client, f"http://127.0.0.1:{rport}/v1/completions", body, 50)
            direct = _latencies(client, f"http://127.0.0.1:{wport}/v1/completions", body, n)
            routed = _latencies(client, f"http://127.0.0.1:{rport}/v1/completions", body, n)
        return {"direct_p50_ms": _pct(direct, 0.5), "direct_p99_ms": _pct(direct, 0.99),
                "routed_p50_ms": _pct(routed, 0.5), "routed_p99_ms": _pct(routed, 0.99),
                "overhead_p50_ms": _pct(routed, 0.5) - _pct(direct, 0.5),
                "overhead_p99_ms": _pct(routed, 0.99) - _pct(direct, 0.99)}
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


def main(n: int = 400) -> dict:
    decide = router_decide.run()
    print(f"{'kv decide':<22}{'p50 us':>10}{'p99 us':>10}{'p99 idle':>10}")
    for name, r in decide["decide"].items():
        print(f"{name:<22}{r['p50_us']:>10.1f}{r['p99_us']:>10.1f}{r['no_inflight_p99_us']:>10.1f}")
    http = http_overhead(n)
    print(f"\nHTTP, 4K-token prompt, 1 output token, {n} sequential requests")
    print(f"  direct to worker   p50 {http['direct_p50_ms']:.2f} ms  p99 {http['direct_p99_ms']:.2f} ms")
    print(f"  through the router p50 {http['routed_p50_ms']:.2f} ms  p99 {http['routed_p99_ms']:.2f} ms")
    worst = decide["decide"]["256w/32768tok"]["p99_us"] if "256w/32768tok" in decide["decide"] else max(
        r["p99_us"] for r in decide["decide"].values())
    print(f"RESULT decide_p99_us={worst:.0f} http_overhead_p99_ms={http['overhead_p99_ms']:.2f} "
          f"http_overhead_p50_ms={http['overhead_p50_ms']:.2f}")
    return {"decide": decide, "http": http}
