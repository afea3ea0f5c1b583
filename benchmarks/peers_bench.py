"""``switchyard bench peers``: our router side by side with the routers users would pick instead,
in one run, in front of the same simulated workers, with the same string-prompt requests
(issue 37).

Sides (``SIDES``):

* ``direct``: straight to one worker (the baseline every overhead is measured against);
* ``ours``: a Switchyard router replica, kv mode, on the local broker;
* ``smg``: SGLang's model gateway 1.13.0, ``cache_aware``;
* ``sglang``: ``sglang-router`` 0.3.2, ``cache_aware``;
* ``vllmrouter``: ``vllm-router`` 0.1.17, ``consistent_hash``; ``vllmrouter_rr``: ``round_robin``.
  Its ``cache_aware`` is left out: it calls ``POST /v1/completions/render`` and ``/tokenize`` on
  every worker for every request, which our workers do not serve;
* ``dynamo``: Dynamo 1.6.1's frontend, ``--router-mode kv``, file discovery (no etcd, no NATS),
  on two of its own mocker workers (it cannot front external HTTP workers). Our workers' engine
  profile is the mocker's (``data_plane/engines/profiles.py``), but the processes differ: its
  overhead against ``direct`` includes the mocker's own cost against our worker's;
* ``nginx``: Debian's nginx, round robin, keep-alive: the floor;
* ``pyfloor``: the floor of any Python router here (``benchmarks.bare_proxy``: the router's HTTP
  server and worker port forwarding the body to one worker, nothing else); HTTP phase only.

The peers come from their own pinned environment (``scripts/peers-env.sh`` -> ``.venv-peers``),
never from the project's. Each runs in the mode its docs describe and the bench asserts that mode
from the side's own status after every run: ``smg_worker_selection_total{policy="cache_aware"}``
(smg, sglang-router), ``vllm_router_policy_decisions_total{policy=...}`` (vllm-router), the
frontend's ``KV Routing initialized`` and ``router_mode="kv"`` log lines (Dynamo), ``mode kv`` in
our router's start line; nginx's is its config (``nginx -T``).

Phases, each side at least ``rounds`` times, the order of the sides rotating between rounds:

1. HTTP (workers at ``--speedup`` 1000, so the engine time is ~0): ``n`` sequential non-streaming
   1-token completions of distinct 4,096-word prompts (after a warm-up), then ``concurrent``
   requests at 32 and at 128 clients. Per side: overhead p50/p99 against ``direct``; CPU ms per
   request of the side's own process(es), from /proc (ours: the router; nginx: master and
   worker; Dynamo: the frontend; the workers never count) and of the broker (every side's
   workers publish their KV events; ours also its decisions and ledger); req/s and p99 at 32
   and 128 clients.
2. Routing quality (fresh workers at engine speed 1 for every run): the first ``limit`` requests
   of the demo's trace slice, as string prompts, streaming, at the demo's arrival rate and 2x
   (``ops.demo.loadgen``): prefix hit rate from the ``cached_tokens`` the workers
   report, TTFT p50/p99.

A worker's idle ``GET /health`` p50 is measured first (goal < 2 ms). The load average is printed
beside the figures: on a shared box they move with it.

Last line: ``RESULT ours_overhead_p50_ms=... ours_overhead_p99_ms=... ours_cpu_ms_per_req=...
ours_rps_c128=... ours_hit_rate=... ours_ttft_p99_ms=...`` and the same keys for ``smg_``,
``sglang_``, ``vllmrouter_``, ``dynamo_``, ``nginx_`` (medians over the rounds; hit rate and
TTFT at the demo's rate), then ``vllmrouter_rr_``, ``pyfloor_`` and ``health_p50_ms``.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx

from benchmarks.router_bench import _nginx, _pct, _wait
from ops.demo.loadgen import run_trace, word_prompt
from ops.demo.settings import DEMO_DEFAULTS, DEMO_TRACE
from data_plane.engines.trace import DEFAULT_VOCAB_SIZE
from common.log.admin import apply_topics
from common.net import free_port
from common.processes import cpu_s as process_cpu_s
from common.settings import BusSettings, repo_root

SIDES = ("direct", "ours", "smg", "sglang", "vllmrouter", "vllmrouter_rr", "dynamo", "nginx", "pyfloor")
#: Sides in front of one worker only: no routing-quality runs.
ONE_WORKER = ("direct", "pyfloor")
#: Sides in the RESULT line, in this order (the issue's keys).
RESULT_SIDES = ("ours", "smg", "sglang", "vllmrouter", "dynamo", "nginx")
MODEL = "switchyard-sim"
PROMPT_WORDS = 4096
#: Engine time runs this much faster in the HTTP phase: a 4K-token prefill takes ~0.1 ms, so
#: the latencies are the HTTP path's.
FAST = 1000.0
PEERS_VENV = Path(os.environ.get("SWITCHYARD_PEERS_VENV", repo_root() / ".venv-peers"))


# -- processes --------------------------------------------------------------------------------

@dataclass
class Side:
    """One running side: its URL, its processes (the first ``cpu_procs`` count as the router's
    CPU), its log, and how to check the mode it runs in."""

    name: str
    url: str
    procs: list[subprocess.Popen] = field(default_factory=list)
    cpu_procs: int = 0
    log: Path | None = None
    #: Raises unless the side's own status/logs show the mode it is meant to run in; gets the
    #: number of routed requests since start.
    check: Callable[[int], str] = lambda n: "baseline"
    #: Removed when the side stops (nginx's config and temp dirs).
    scratch: Path | None = None

    def cpu_s(self) -> float:
        return sum(process_cpu_s(p.pid, children=True) for p in self.procs[:self.cpu_procs])

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in reversed(self.procs):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


def _spawn(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    with open(log, "ab") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _peer_bin(name: str) -> str:
    path = PEERS_VENV / "bin" / name
    if not path.exists():
        raise RuntimeError(f"{path} missing: install the peers with `bash scripts/peers-env.sh`")
    return str(path)


def _metric_sum(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``, from a Prometheus text
    page."""
    total = 0.0
    for line in httpx.get(url, timeout=5).text.splitlines():
        if not line.startswith(name + "{"):
            continue
        lab, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in lab for k, v in labels.items()):
            total += float(value)
    return total


def _wait_log(log: Path, pattern: str, proc: subprocess.Popen, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    rx = re.compile(pattern)
    while time.monotonic() < deadline:
        m = rx.search(log.read_text(errors="replace"))
        if m:
            return m.group(0)
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise RuntimeError(f"{log}: no line matching {pattern!r} (exit {proc.poll()}); tail: "
                       f"{log.read_text(errors='replace')[-800:]}")


@dataclass
class Workers:
    """Our two simulated workers (mocker profile) on a topic prefix of their own."""

    urls: list[str]
    procs: list[subprocess.Popen]
    env: dict
    prefix: str

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def start_workers(tmp: Path, speedup: float, n: int = 2) -> Workers:
    prefix = f"peers{uuid.uuid4().hex[:8]}"
    bus = BusSettings.from_env(topic_prefix=prefix)
    apply_topics(bus)
    env = {**os.environ, "SWITCHYARD_KAFKA_BOOTSTRAP": bus.bootstrap, "SWITCHYARD_TOPIC_PREFIX": prefix}
    ports = [free_port() for _ in range(n)]
    d = tmp / prefix
    d.mkdir(parents=True)
    procs = [_spawn([sys.executable, "-m", "switchyard.cli", "worker", "--worker-id", f"peers-{i}", "--port",
                     str(port), "--speedup", str(speedup), "--data-dir", str(d / f"w{i}"),
                     # the peers cannot send a per-worker bearer (ours does, and still must)
                     "--open-generation"], d / f"w{i}.log", env)
             for i, port in enumerate(ports)]
    w = Workers([f"http://127.0.0.1:{p}" for p in ports], procs, env, prefix)
    try:
        for u in w.urls:
            _wait(f"{u}/health", lambda r: r.status_code == 200, timeout=120)
    except BaseException:
        w.stop()
        raise
    return w


def _launch_ours(w: Workers, log: Path) -> Side:
    port = free_port()
    p = _spawn([sys.executable, "-m", "switchyard.cli", "router", "--port", str(port), "--router-id",
                f"peers-{uuid.uuid4().hex[:6]}", "--no-auth"], log, w.env)
    side = Side("ours", f"http://127.0.0.1:{port}", [p], 1, log)
    _wait(f"{side.url}/health", lambda r: r.status_code == 200 and r.json()["workers"] >= len(w.urls), timeout=120)
    started = _wait_log(log, r"serving on [0-9.:]+ \(mode [\w.]+", p)

    def check(n: int) -> str:
        if not started.lower().endswith("kv"):
            raise RuntimeError(f"ours is not in kv mode: {started!r}")
        return "kv (its start line)"

    side.check = check
    return side


def _launch_rust_peer(name: str, cmd: list[str], w: Workers, log: Path, metric: str, policy: str) -> Side:
    port, prom = free_port(), free_port()
    p = _spawn(cmd + ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *w.urls, "--policy", policy,
                      "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom)], log)
    side = Side(name, f"http://127.0.0.1:{port}", [p], 1, log)
    try:
        _wait(f"{side.url}/health", lambda r: r.status_code == 200, timeout=60)
        # Ready when it routes: its worker discovery (each worker's /v1/models) is asynchronous.
        _wait(f"{side.url}/v1/models", lambda r: r.status_code == 200 and (MODEL in r.text or "unknown" in r.text),
              timeout=60)
    except BaseException:
        side.stop()
        raise
    metrics = f"http://127.0.0.1:{prom}/metrics"
    base = [0.0]

    def check(n: int) -> str:
        seen = _metric_sum(metrics, metric, policy=policy) - base[0]
        base[0] += seen
        if seen < n:
            raise RuntimeError(f"{name}: {metric}{{policy={policy!r}}} counted {seen:.0f} of {n} requests")
        return f"{policy} ({metric}: {seen:.0f})"

    side.check = check
    return side


def _launch_smg(w: Workers, log: Path) -> Side:
    return _launch_rust_peer("smg", [_peer_bin("smg"), "launch", "--log-level", "warn"], w, log,
                             "smg_worker_selection_total", "cache_aware")


def _launch_sglang(w: Workers, log: Path) -> Side:
    return _launch_rust_peer("sglang", [_peer_bin("python"), "-m", "sglang_router.launch_router", "--log-level", "warn"],
                             w, log, "smg_worker_selection_total", "cache_aware")


def _launch_vllmrouter(w: Workers, log: Path, policy: str = "consistent_hash") -> Side:
    return _launch_rust_peer("vllmrouter" if policy == "consistent_hash" else "vllmrouter_rr",
                             [_peer_bin("vllm-router"), "--log-level", "warning"], w, log,
                             "vllm_router_policy_decisions_total", policy)


def _launch_nginx(w: Workers, log: Path) -> Side:
    port = free_port()
    ports = [int(u.rsplit(":", 1)[1]) for u in w.urls]
    p = _nginx(ports, port, name=f"peers-nginx-{port}")
    scratch = repo_root() / ".stack" / f"peers-nginx-{port}"
    side = Side("nginx", f"http://127.0.0.1:{port}", [p], 1, log, scratch=scratch)
    try:
        _wait(f"{side.url}/health", lambda r: r.status_code == 200, timeout=30)
    except BaseException:
        side.stop()
        raise
    conf = scratch / "nginx.conf"

    def check(n: int) -> str:
        text = conf.read_text()
        if not all(f"server 127.0.0.1:{q};" in text for q in ports):
            raise RuntimeError(f"nginx's config does not round-robin over {ports}")
        return "round robin (its config)"

    side.check = check
    return side


def dynamo_model_dir(d: Path, vocab: int = DEFAULT_VOCAB_SIZE) -> Path:
    """A local model dir for Dynamo's frontend and mocker: a WordLevel ``tokenizer.json`` whose
    vocabulary is ``w0 .. w<vocab-1>`` (the words :func:`word_prompt` writes, each back to its
    id), a Llama-shaped config.json and a tokenizer_config with a chat template. Nothing is
    downloaded."""
    d.mkdir(parents=True, exist_ok=True)
    specials = ["[UNK]", "<s>", "</s>"]
    words = {f"w{i}": i for i in range(vocab)}
    words.update({s: vocab + k for k, s in enumerate(specials)})
    tok = {"version": "1.0", "truncation": None, "padding": None,
           "added_tokens": [{"id": vocab + k, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True} for k, s in enumerate(specials)],
           "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
           "model": {"type": "WordLevel", "vocab": words, "unk_token": "[UNK]"}}
    (d / "tokenizer.json").write_text(json.dumps(tok))
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab + 3,
        "max_position_embeddings": 1 << 20, "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "bos_token_id": vocab + 1, "eos_token_id": vocab + 2}))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "[UNK]", "model_max_length": 1 << 20,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}))
    return d


def _launch_dynamo(tmp: Path, log: Path, speedup: float) -> Side:
    """Dynamo's mocker (two workers, its defaults: the mocker profile) and its frontend in kv mode,
    file discovery, every host variable on loopback. The frontend logs at warn except its kv
    router's start (its per-request decision lines would cost it CPU)."""
    run = tmp / f"dynamo-{uuid.uuid4().hex[:6]}"
    model = dynamo_model_dir(run / "model")
    env = {**os.environ, "DYN_FILE_KV": str(run / "kv"), "DYN_TCP_RPC_HOST": "127.0.0.1",
           "DYN_EVENT_PLANE_HOST": "127.0.0.1", "DYN_SYSTEM_HOST": "127.0.0.1",
           "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1", "DYN_LOG": "warn,dynamo_llm::kv_router=info",
           "HF_HUB_OFFLINE": "1", "TMPDIR": str(run / "tmp")}  # its runtime writes a logging config there
    (run / "tmp").mkdir(parents=True, exist_ok=True)
    port = free_port()
    py = _peer_bin("python")
    mocker = _spawn([py, "-m", "dynamo.mocker", "--model-path", str(model), "--model-name", MODEL,
                     "--discovery-backend", "file", "--num-workers", "2", "--speedup-ratio", str(speedup)],
                    run / "mocker.log", env)
    front = _spawn([py, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(port),
                    "--router-mode", "kv", "--discovery-backend", "file", "--model-path", str(model),
                    "--model-name", MODEL], log, env)
    side = Side("dynamo", f"http://127.0.0.1:{port}", [front, mocker], 1, log)
    try:
        _wait(f"{side.url}/health", lambda r: r.status_code == 200 and r.json().get("status") == "healthy"
              and sum(1 for i in r.json().get("instances", []) if i.get("endpoint") == "generate") >= 2, timeout=120)
        _wait(f"{side.url}/v1/models", lambda r: MODEL in r.text, timeout=60)
        _wait_log(log, r"KV Routing initialized", front, timeout=30)
    except BaseException:
        side.stop()
        raise

    def check(n: int) -> str:
        text = log.read_text(errors="replace")
        if "KV Routing initialized" not in text:
            raise RuntimeError("dynamo: its frontend did not log 'KV Routing initialized'")
        return "kv (KV Routing initialized)"

    side.check = check
    return side


def _launch_pyfloor(w: Workers, log: Path) -> Side:
    port = free_port()
    p = _spawn([sys.executable, "-m", "benchmarks.bare_proxy", "--port", str(port), "--worker", w.urls[0]], log, w.env)
    side = Side("pyfloor", f"http://127.0.0.1:{port}", [p], 1, log)
    _wait(f"{side.url}/health", lambda r: r.status_code == 200, timeout=60)
    side.check = lambda n: "forwarding to one worker"
    return side


def launch(name: str, w: Workers | None, tmp: Path, speedup: float) -> Side:
    log = tmp / f"{name}-{uuid.uuid4().hex[:6]}.log"
    log.touch()
    if name == "dynamo":
        return _launch_dynamo(tmp, log, speedup)
    assert w is not None
    if name == "direct":
        return Side("direct", w.urls[0])
    return {"ours": _launch_ours, "smg": _launch_smg, "sglang": _launch_sglang, "vllmrouter": _launch_vllmrouter,
            "vllmrouter_rr": lambda w_, l_: _launch_vllmrouter(w_, l_, "round_robin"),
            "nginx": _launch_nginx, "pyfloor": _launch_pyfloor}[name](w, log)


def broker_pids() -> list[int]:
    """The local broker's processes (from the stack's pid files): its CPU per request is part of
    what a side costs."""
    state = os.environ.get("SWITCHYARD_STATE_DIR") or str(repo_root() / ".stack")
    pids = []
    for f in glob.glob(f"{state}/kafka/**/kafka.pid", recursive=True):
        try:
            pid = int(Path(f).read_text().strip())
            if Path(f"/proc/{pid}").exists():
                pids.append(pid)
        except (OSError, ValueError):
            pass
    return pids


def broker_cpu_s(pids: Sequence[int]) -> float:
    return sum(process_cpu_s(p, children=True) for p in pids)


def broker_idle_rate(pids: Sequence[int], quiet_s: float = 3.0) -> float:
    """The brokers' background CPU seconds per second (other topics, other clients, their own
    housekeeping) over a quiet window: what a phase's broker CPU is net of."""
    q0, qt = broker_cpu_s(pids), time.monotonic()
    time.sleep(quiet_s)
    return (broker_cpu_s(pids) - q0) / (time.monotonic() - qt)


# -- load -------------------------------------------------------------------------------------

def prompts(n: int, words: int = PROMPT_WORDS, seed: int = 37) -> list[bytes]:
    """``n`` distinct non-streaming 1-token completion bodies of ``words``-word string prompts,
    the same for every side."""
    rng = random.Random(seed)
    return [json.dumps({"model": MODEL, "prompt": word_prompt(rng.randrange(DEFAULT_VOCAB_SIZE) for _ in range(words)),
                        "max_tokens": 1, "stream": False}).encode() for _ in range(n)]


async def _fire(url: str, bodies: Sequence[bytes], clients: int) -> tuple[list[float], float, int]:
    """Send ``bodies`` with ``clients`` concurrent connections; latencies (ms, sorted), wall
    seconds, errors."""
    lat: list[float] = []
    errors = 0
    it = iter(bodies)
    endpoint = f"{url}/v1/completions"
    headers = {"Content-Type": "application/json"}
    conn = aiohttp.TCPConnector(limit=clients, force_close=False)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
        async def client() -> None:
            nonlocal errors
            for body in it:
                t0 = time.perf_counter()
                try:
                    async with s.post(endpoint, data=body, headers=headers) as r:
                        await r.read()
                        ok = r.status == 200
                except aiohttp.ClientError:
                    ok = False
                if ok:
                    lat.append((time.perf_counter() - t0) * 1000)
                else:
                    errors += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        wall = time.perf_counter() - t0
    return sorted(lat), wall, errors


def http_run(side: Side, bodies: list[bytes], warmup: int, n: int, concurrent: int, brokers: list[int]) -> dict:
    out: dict = {}
    asyncio.run(_fire(side.url, bodies[:warmup], 1))
    seq = bodies[warmup:warmup + n]
    # CPU over the whole run (sequential and concurrent requests): /proc counts in clock ticks
    # (10 ms), so a few hundred requests of nginx's 0.1 ms would read as 0 or 1 tick.
    cpu0, b0 = side.cpu_s(), broker_cpu_s(brokers)
    lat, _, errors = asyncio.run(_fire(side.url, seq, 1))
    out["p50_ms"], out["p99_ms"], out["errors"] = _pct(lat, 0.5), _pct(lat, 0.99), errors
    sent = warmup + len(seq)
    for c in (32, 128):
        conc = [bodies[i % len(bodies)] for i in range(concurrent)]
        lat, wall, errors = asyncio.run(_fire(side.url, conc, c))
        out[f"rps_c{c}"] = len(lat) / wall
        out[f"p99_c{c}_ms"] = _pct(lat, 0.99) if lat else float("nan")
        out["errors"] += errors
        sent += concurrent
    measured = len(seq) + 2 * concurrent
    out["cpu_ms"] = (side.cpu_s() - cpu0) * 1000 / measured
    out["broker_cpu_ms"] = (broker_cpu_s(brokers) - b0) * 1000 / measured
    out["mode"] = side.check(sent - out["errors"])
    return out


def quality_run(side: Side, trace: Path, limit: int, rate: float, max_output: int) -> dict:
    s = asyncio.run(run_trace(side.url, trace, limit=limit, speedup=rate, max_output=max_output, model=MODEL,
                              progress=False, text=True))
    s.pop("results", None)
    s["mode"] = side.check(s["completed"])
    return s


def health_p50(url: str, n: int = 200) -> float:
    with httpx.Client(timeout=5) as c:
        for _ in range(20):
            c.get(f"{url}/health")
        xs = []
        for _ in range(n):
            t0 = time.perf_counter()
            c.get(f"{url}/health").raise_for_status()
            xs.append((time.perf_counter() - t0) * 1000)
    return _pct(sorted(xs), 0.5)


# -- the bench --------------------------------------------------------------------------------

def _med(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def _spread(xs: list[float], fmt: str = "{:.2f}") -> str:
    xs = [x for x in xs if x == x]
    if not xs:
        return "-"
    return f"{fmt.format(_med(xs))} [{fmt.format(min(xs))}-{fmt.format(max(xs))}]"


def trace_slice(trace: Path, offset: int, limit: int, out: Path) -> Path:
    """Lines ``offset .. offset+limit`` of ``trace`` as a trace of their own (timestamps as
    they are: the replay starts at the first one)."""
    with open(trace) as f:
        lines = [line for line in f if line.strip()][offset:offset + limit]
    if len(lines) < limit:
        raise ValueError(f"{trace} has fewer than {offset + limit} requests")
    out.write_text("".join(lines))
    return out


def run(sides: Sequence[str] = SIDES, rounds: int = 3, n: int = 200, warmup: int = 30, concurrent: int = 600,
        trace: Path = DEMO_TRACE, limit: int = 100, rates: Sequence[float] | None = None,
        max_output: int = DEMO_DEFAULTS.max_output, quality: bool = True, http: bool = True,
        offset: int = 0) -> dict:
    """``http=False``: only the routing-quality runs (``offset``: the slice starts at that request
    of ``trace``)."""
    sides = list(sides)
    if "direct" not in sides:
        sides.insert(0, "direct")
    rates = list(rates or (DEMO_DEFAULTS.rate, 2 * DEMO_DEFAULTS.rate))
    brokers = broker_pids()
    http_runs: dict[str, list[dict]] = {s: [] for s in sides}
    qual: dict[tuple[str, float], list[dict]] = {}
    bodies = prompts(warmup + max(n, concurrent))
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="sy-peers-") as t:
        tmp = Path(t)
        if offset:
            trace = trace_slice(trace, offset, limit, tmp / "slice.jsonl")
        w = start_workers(tmp, FAST)
        try:
            health = health_p50(w.urls[0])
            print(f"worker GET /health p50 {health:.2f} ms (idle, {os.cpu_count()} cores, load "
                  f"{load0[0]:.2f})", flush=True)
            for r in range(rounds if http else 0):
                order = sides[r % len(sides):] + sides[:r % len(sides)]
                for name in order:
                    side = launch(name, w, tmp, FAST)
                    try:
                        res = http_run(side, bodies, warmup, n, concurrent, brokers)
                    finally:
                        side.stop()
                    http_runs[name].append(res)
                    print(f"  round {r + 1} {name:<14} p50 {res['p50_ms']:.2f} p99 {res['p99_ms']:.2f} ms, "
                          f"cpu {res['cpu_ms']:.2f} ms/req, c128 {res['rps_c128']:.0f} req/s, "
                          f"errors {res['errors']}, mode {res['mode']}", flush=True)
        finally:
            w.stop()
        if quality:
            qsides = [s for s in sides if s not in ONE_WORKER]
            for r in range(rounds):
                order = qsides[r % len(qsides):] + qsides[:r % len(qsides)]
                for name in order:
                    for rate in rates:
                        w = None if name == "dynamo" else start_workers(tmp, 1.0)
                        try:
                            side = launch(name, w, tmp, 1.0)
                            try:
                                q = quality_run(side, trace, limit, rate, max_output)
                            finally:
                                side.stop()
                        finally:
                            if w is not None:
                                w.stop()
                        qual.setdefault((name, rate), []).append(q)
                        print(f"  round {r + 1} {name:<14} {rate}x: {q['completed']}/{q['requests']} ok, hit rate "
                              f"{q['hit_rate']:.3f}, TTFT p50 {q['ttft_p50_ms']:.0f} p99 {q['ttft_p99_ms']:.0f} ms, "
                              f"mode {q['mode']}", flush=True)
                        if q["errors"]:
                            print(f"    {name} errors: {q['errors'][:2]}", flush=True)
    load1 = os.getloadavg()
    return report(sides, http_runs, qual, rates, health, (load0, load1), n=n, concurrent=concurrent, limit=limit,
                  trace=f"{trace.name}" + (f" (requests {offset}-{offset + limit - 1})" if offset else ""))


def report(sides: list[str], http: dict, qual: dict, rates: list[float], health: float, load, *, n: int,
           concurrent: int, limit: int, trace: str = DEMO_TRACE.name) -> dict:
    direct = http["direct"]
    summary: dict[str, dict] = {}
    if not direct:  # routing quality only
        sides = [s for s in sides if s not in ONE_WORKER]
    print(f"\nHTTP: {PROMPT_WORDS}-word string prompts, 1 output token, {n} sequential requests and {concurrent} at "
          f"32 and 128 clients per run; {len(direct)} runs per side, median [min-max]; load average "
          f"{load[0][0]:.2f} at start, {load[1][0]:.2f} at end")
    print(f"{'side':<14}{'overhead p50':>22}{'overhead p99':>22}{'CPU ms/req':>22}{'broker ms/req':>22}"
          f"{'req/s c32':>18}{'req/s c128':>18}{'p99 c128 ms':>22}")
    for s in sides if direct else []:
        runs = http[s]
        # Each run's overhead against the direct run of the same round.
        ov50 = [r["p50_ms"] - d["p50_ms"] for r, d in zip(runs, direct)]
        ov99 = [r["p99_ms"] - d["p99_ms"] for r, d in zip(runs, direct)]
        row = {"overhead_p50_ms": ov50, "overhead_p99_ms": ov99, "cpu_ms_per_req": [r["cpu_ms"] for r in runs],
               "broker_cpu_ms_per_req": [r["broker_cpu_ms"] for r in runs],
               "rps_c32": [r["rps_c32"] for r in runs], "rps_c128": [r["rps_c128"] for r in runs],
               "p99_c128_ms": [r["p99_c128_ms"] for r in runs], "p50_ms": [r["p50_ms"] for r in runs]}
        summary[s] = row
        label = f"{s} (abs)" if s == "direct" else s
        first = _spread(row["p50_ms"]) if s == "direct" else _spread(ov50)
        second = _spread([r["p99_ms"] for r in runs]) if s == "direct" else _spread(ov99)
        cpu = "-" if s == "direct" else _spread(row["cpu_ms_per_req"])
        print(f"{label:<14}{first:>22}{second:>22}{cpu:>22}{_spread(row['broker_cpu_ms_per_req']):>22}"
              f"{_spread(row['rps_c32'], '{:.0f}'):>18}{_spread(row['rps_c128'], '{:.0f}'):>18}"
              f"{_spread(row['p99_c128_ms'], '{:.0f}'):>22}")
    if qual:
        ideal = next(iter(qual.values()))[0]["ideal_hit_rate"]
        print(f"\nrouting quality: {limit} requests of {trace} as string prompts, streaming, fresh workers each run; "
              f"hit rate from the workers' cached_tokens (ideal, one infinite cache: {ideal:.3f}); median [min-max]")
        print(f"{'side':<14}{'rate':>6}{'hit rate':>24}{'TTFT p50 ms':>22}{'TTFT p99 ms':>24}{'failed':>8}")
        for s in sides:
            for rate in rates:
                runs = qual.get((s, rate))
                if not runs:
                    continue
                row = summary.setdefault(s, {})
                row[f"hit_rate_{rate}"] = [q["hit_rate"] for q in runs]
                row[f"ttft_p50_ms_{rate}"] = [q["ttft_p50_ms"] for q in runs]
                row[f"ttft_p99_ms_{rate}"] = [q["ttft_p99_ms"] for q in runs]
                failed = sum(q["failed"] + q["rejected"] for q in runs)
                print(f"{s:<14}{rate:>5}x{_spread(row[f'hit_rate_{rate}'], '{:.3f}'):>24}"
                      f"{_spread(row[f'ttft_p50_ms_{rate}'], '{:.0f}'):>22}"
                      f"{_spread(row[f'ttft_p99_ms_{rate}'], '{:.0f}'):>24}{failed:>8}")
    demo_rate = rates[0]
    keys = []
    for s in [x for x in RESULT_SIDES if x in summary] + [x for x in ("vllmrouter_rr", "pyfloor") if x in summary]:
        row = summary[s]
        keys += [f"{s}_overhead_p50_ms={_med(row.get('overhead_p50_ms', [])):.2f}",
                 f"{s}_overhead_p99_ms={_med(row.get('overhead_p99_ms', [])):.2f}",
                 f"{s}_cpu_ms_per_req={_med(row.get('cpu_ms_per_req', [])):.2f}",
                 f"{s}_rps_c128={_med(row.get('rps_c128', [])):.0f}",
                 f"{s}_hit_rate={_med(row.get(f'hit_rate_{demo_rate}', [])):.3f}",
                 f"{s}_ttft_p99_ms={_med(row.get(f'ttft_p99_ms_{demo_rate}', [])):.0f}"]
    print("RESULT " + " ".join(keys) + f" health_p50_ms={health:.2f}")
    return {"summary": summary, "health_p50_ms": health, "load": load}


def main(sides: Sequence[str] = SIDES, rounds: int = 3, n: int = 200, concurrent: int = 600, limit: int = 100,
         quality: bool = True, http: bool = True, offset: int = 0, rates: Sequence[float] | None = None) -> dict:
    if any(s not in SIDES for s in sides):
        raise ValueError(f"sides must be among {SIDES}")
    if shutil.which("nginx") is None and not os.path.exists("/usr/sbin/nginx") and "nginx" in sides:
        raise RuntimeError("nginx not found: scripts/install-deps.sh installs it")
    return run(sides, rounds=rounds, n=n, concurrent=concurrent, limit=limit, quality=quality, http=http,
               offset=offset, rates=rates)
