"""``switchyard bench router``: decision latency and the router's HTTP overhead, each beside an
anchor measured in the same run (issue 12: machines differ 2-4x, so the goals are ratios).

1. Decision latency (pure, in process): ``benchmarks.router_decide`` — kv mode at 8, 64 and 256
   workers for 4K- and 32K-token prompts, every worker with requests in flight. Anchor: Dynamo's
   ``RadixTree.find_matches`` (ai-dynamo-runtime, the ``bench`` group) for the same 32K-token
   prompt at 64 workers, each worker holding the prefix its overlap in the decision says
   (``dynamo_find_p99_us``): the whole decision against their lookup alone.
2. HTTP overhead (needs the local broker): an instant worker (``tests/support/mini_worker.py``
   with no token delay) is called directly, through a router replica and through nginx
   (Debian's, a project-local config under ``.stack/bench-nginx/``, 127.0.0.1 only, keep-alive
   to the worker), with the same non-streaming 1-token completions of a 4K-token prompt, one at
   a time; each overhead is the difference of the percentiles from the direct calls. The
   router's path includes decoding the body, tokenizer-free hashing of the prompt (token ids are
   sent), the decision, four events published, and the proxy hop. Beside the latencies, the CPU
   each side's process spent per request (``routed_cpu_ms``: the router; ``proxied_cpu_ms``:
   nginx's master and workers; ``direct_cpu_ms``: the worker), read from /proc over its own
   phase: on a shared box it moves far less than the percentiles do. A fourth side is the floor
   of any Python router here (``benchmarks.bare_proxy``: the router's HTTP server and worker
   port forwarding the body, nothing else; ``floor_*``).
3. Restart (needs the local broker): ``benchmarks.router_restart`` — 1M indexed blocks, kill -9,
   spawn to EXACT (``restart_exact_s``); ``--no-restart`` skips it.

Last line: ``RESULT decide_p99_us=<256 workers, 32K tokens> decide_p99_us_64=<64 workers, 32K>
dynamo_find_p99_us=... http_overhead_p99_ms=... proxy_overhead_p99_ms=... restart_exact_s=...
floor_overhead_p99_ms=...``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid

import httpx

from benchmarks import router_decide, router_restart
from benchmarks.index_bench import dynamo_stored, load_dynamo
from common.log.admin import apply_topics
from common.net import free_port
from common.processes import cpu_s
from common.settings import BusSettings, repo_root

#: The decision point the Dynamo anchor is measured on (issue 12's goal: decide p99 there at most
#: one find_matches p99).
ANCHOR_POINT = "64w/32768tok"
FIND_SAMPLES = 1500
FIND_WARMUP = 100


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


def dynamo_find(request, overlaps, samples: int = FIND_SAMPLES) -> dict:
    """Dynamo's ``find_matches`` p50/p99 (us) for ``request``'s blocks, each worker of
    ``overlaps`` having stored the prompt's first ``depth`` blocks (Dynamo's tree has no tiers:
    every matched block counts, whatever its tier in our view)."""
    radix_tree, why = load_dynamo()
    if radix_tree is None:
        raise RuntimeError(f"Dynamo's RadixTree is not importable ({why}): run with `uv run --group bench`")
    hashes = [int(h) for h in request.block_hashes]
    tree = radix_tree()
    for i, (wid, overlap) in enumerate(sorted(overlaps.items())):
        if overlap.depth:
            # Our chained hashes stand for both of Dynamo's hashes: its tree keys on the
            # sequence from the root, so any distinct values make the same tree shape.
            tree.apply_event(i, dynamo_stored(0, hashes[:overlap.depth], hashes[:overlap.depth]))
    tree.find_matches([])  # barrier: the tree's thread has applied every event
    for _ in range(FIND_WARMUP):
        tree.find_matches(hashes)
    timings = []
    for _ in range(samples):
        t0 = time.perf_counter_ns()
        tree.find_matches(hashes)
        timings.append((time.perf_counter_ns() - t0) / 1000.0)
    timings.sort()
    matched = sum(1 for d in tree.find_matches(hashes).scores.values() if d)
    return {"p50_us": _pct(timings, 0.5), "p99_us": _pct(timings, 0.99), "workers_matched": matched,
            "blocks": len(hashes)}


_NGINX_CONF = """daemon off;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    client_max_body_size 8m;
    client_body_buffer_size 8m;
    upstream worker {{ {servers} keepalive 16; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://worker;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


def _nginx(worker_port: int | list[int], port: int, name: str = "bench-nginx") -> subprocess.Popen:
    """Debian's nginx (``scripts/install-deps.sh`` installs it) in front of the worker (or,
    round robin, the workers), with a project-local config and temp dirs under
    ``.stack/<name>``, on 127.0.0.1 only, in the foreground."""
    binary = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if binary is None:
        raise RuntimeError("nginx not found: install it (apt-get install nginx; scripts/install-deps.sh does)")
    d = repo_root() / ".stack" / name
    d.mkdir(parents=True, exist_ok=True)
    conf = d / "nginx.conf"
    ports = worker_port if isinstance(worker_port, list) else [worker_port]
    servers = " ".join(f"server 127.0.0.1:{p};" for p in ports)
    conf.write_text(_NGINX_CONF.format(dir=d, servers=servers, port=port))
    return subprocess.Popen([binary, "-p", str(d), "-c", str(conf), "-e", str(d / "error.log")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def http_overhead(n: int = 400) -> dict:
    bus = BusSettings.from_env(topic_prefix=f"benchr{uuid.uuid4().hex[:6]}")
    apply_topics(bus)
    env = {**os.environ, "SWITCHYARD_KAFKA_BOOTSTRAP": bus.bootstrap, "SWITCHYARD_TOPIC_PREFIX": bus.topic_prefix}
    wport, rport, nport, fport = free_port(), free_port(), free_port(), free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.support.mini_worker", "--worker-id", "instant",
                               "--port", str(wport), "--token-delay", "0"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        _wait(f"http://127.0.0.1:{wport}/health", lambda r: r.status_code == 200)
        procs.append(subprocess.Popen([sys.executable, "-m", "switchyard.cli", "router", "--port", str(rport),
                                       "--router-id", "bench", "--no-auth"], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        procs.append(_nginx(wport, nport))
        procs.append(subprocess.Popen([sys.executable, "-m", "benchmarks.bare_proxy", "--port", str(fport),
                                       "--worker", f"http://127.0.0.1:{wport}"], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _wait(f"http://127.0.0.1:{rport}/health", lambda r: r.status_code == 200 and r.json()["workers"] >= 1)
        for port in (nport, fport):
            _wait(f"http://127.0.0.1:{port}/health", lambda r: r.status_code == 200)
        body = {"model": "switchyard-sim", "prompt": list(range(5000, 5000 + 4096)), "max_tokens": 1}
        urls = {side: f"http://127.0.0.1:{port}/v1/completions"
                for side, port in (("direct", wport), ("routed", rport), ("proxied", nport), ("floor", fport))}
        # CPU per request of what sits in front of the worker (the router process; nginx's master
        # and workers): unlike the latencies, it hardly moves with the load of a shared box.
        serving = {"direct": procs[0].pid, "routed": procs[1].pid, "proxied": procs[2].pid, "floor": procs[3].pid}
        out = {}
        with httpx.Client(timeout=30) as client:
            for url in urls.values():
                _latencies(client, url, body, 50)
            lat = {}
            for side, url in urls.items():
                cpu0 = cpu_s(serving[side], children=True)
                lat[side] = _latencies(client, url, body, n)
                out[f"{side}_cpu_ms"] = (cpu_s(serving[side], children=True) - cpu0) * 1000 / n
        for side, xs in lat.items():
            out[f"{side}_p50_ms"], out[f"{side}_p99_ms"] = _pct(xs, 0.5), _pct(xs, 0.99)
        for side, name in (("routed", "overhead"), ("proxied", "proxy_overhead"), ("floor", "floor_overhead")):
            for q in ("p50", "p99"):
                out[f"{name}_{q}_ms"] = out[f"{side}_{q}_ms"] - out[f"direct_{q}_ms"]
        return out
    finally:
        for p in procs:
            # nginx's master stops its worker on SIGTERM; killed, it would leave it listening.
            p.terminate() if p.args[0].endswith("nginx") else p.kill()
            p.wait(10)


def main(n: int = 400, restart: bool = True) -> dict:
    decide = router_decide.run()
    print(f"{'kv decide':<22}{'p50 us':>10}{'p99 us':>10}{'p99 idle':>10}")
    for name, r in decide["decide"].items():
        print(f"{name:<22}{r['p50_us']:>10.1f}{r['p99_us']:>10.1f}{r['no_inflight_p99_us']:>10.1f}")
    find = dynamo_find(*decide["inputs"][ANCHOR_POINT])
    print(f"Dynamo find_matches, {ANCHOR_POINT} (same prompt, {find['workers_matched']} workers matched): "
          f"p50 {find['p50_us']:.1f} us  p99 {find['p99_us']:.1f} us")
    http = http_overhead(n)
    print(f"\nHTTP, 4K-token prompt, 1 output token, {n} sequential requests per side")
    print(f"  direct to worker   p50 {http['direct_p50_ms']:.2f} ms  p99 {http['direct_p99_ms']:.2f} ms")
    print(f"  through the router p50 {http['routed_p50_ms']:.2f} ms  p99 {http['routed_p99_ms']:.2f} ms")
    print(f"  through nginx      p50 {http['proxied_p50_ms']:.2f} ms  p99 {http['proxied_p99_ms']:.2f} ms")
    print(f"  through the floor  p50 {http['floor_p50_ms']:.2f} ms  p99 {http['floor_p99_ms']:.2f} ms "
          f"(a bare Python proxy: the router's HTTP server and worker port, nothing else)")
    print(f"  overhead: router p50 {http['overhead_p50_ms']:.2f} / p99 {http['overhead_p99_ms']:.2f} ms, "
          f"nginx p50 {http['proxy_overhead_p50_ms']:.2f} / p99 {http['proxy_overhead_p99_ms']:.2f} ms, "
          f"floor p50 {http['floor_overhead_p50_ms']:.2f} / p99 {http['floor_overhead_p99_ms']:.2f} ms")
    print(f"  CPU per request: router {http['routed_cpu_ms']:.2f} ms, nginx {http['proxied_cpu_ms']:.2f} ms, "
          f"floor {http['floor_cpu_ms']:.2f} ms, worker {http['direct_cpu_ms']:.2f} ms")
    rs = router_restart.run() if restart else None
    if rs is not None:
        print(f"\nrouter restart, {rs['blocks']:,} blocks: EXACT after {rs['restart_exact_s']:.2f} s")
    worst = decide["decide"]["256w/32768tok"]["p99_us"]
    at64 = decide["decide"][ANCHOR_POINT]["p99_us"]
    restart_s = f"{rs['restart_exact_s']:.2f}" if rs is not None else "skipped"
    print(f"RESULT decide_p99_us={worst:.0f} decide_p99_us_64={at64:.0f} dynamo_find_p99_us={find['p99_us']:.0f} "
          f"http_overhead_p99_ms={http['overhead_p99_ms']:.2f} proxy_overhead_p99_ms={http['proxy_overhead_p99_ms']:.2f} "
          f"restart_exact_s={restart_s} floor_overhead_p99_ms={http['floor_overhead_p99_ms']:.2f}")
    return {"decide": decide, "dynamo_find": find, "http": http, "restart": rs}
