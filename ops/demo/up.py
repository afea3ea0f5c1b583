"""``switchyard up --demo`` / ``switchyard down``: the whole system on one box.

Starts the stack (Kafka, PostgreSQL, Redis, Prometheus, SeaweedFS), then Switchyard's processes, each a
real ``switchyard ...`` subprocess with its own log under ``.stack/demo/``: the event-derived
metrics processor, the router, the admin API, the planner, and simulated prefill/decode workers.
Their pids go to ``.stack/demo/procs.json`` so ``switchyard down`` (another process) can stop
them: SIGTERM first (workers drain), SIGKILL after a grace period, then the stack.

The router runs with API keys on: once the admin API answers, the demo makes itself an admin
token (``switchyard admin create-token``, the bootstrap way), issues a router key through the
API (``POST /router-keys``) and its load generator sends that key. Both secrets go to 0600
files, ``.stack/demo/admin-token`` and ``.stack/demo/router-key``, for ``switchyard
security-check``. Without the admin API (``with_admin`` off) the router runs ``--no-auth``, and
the demo says so.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from control_plane.admin.client import AdminClient
from ops.demo.settings import DEMO_DEFAULTS, DEMO_TRACE, WHOLE_TRACE, DemoSettings  # noqa: F401 (re-exported)
from common.stack_settings import StackSettings
from ops.stack import Stack
from ops.stack.process import descendants, port_in_use, processes_mentioning, read_pid, terminate
from common.log.catalog import Catalog
from common.log.reader import KafkaLogReader
from common.net import free_port
from common.processes import alive
from common.settings import BusSettings, write_private


#: The object tier of the demo's simulated workers: the bucket in the stack's SeaweedFS (made by
#: the first worker) and each worker's quota in blocks (above the disk tier's 8,192, as each tier
#: should be larger than the one above it).
DEMO_BUCKET = "switchyard-demo"
DEMO_OBJECT_BLOCKS = 32768


@dataclass
class Proc:
    name: str
    pid: int
    url: str = ""
    log: str = ""


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

    def start(self, name: str, args: list[str], url: str = "", env: dict[str, str] | None = None,
              python: str | None = None) -> Proc:
        log = self.dir / f"{name}.log"
        with open(log, "ab") as out:
            p = subprocess.Popen([python or sys.executable, "-m", "switchyard.cli", *args], stdout=out,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                 env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"})
        proc = Proc(name, p.pid, url, str(log))
        self.procs.append(proc)
        self.save()
        return proc

    def running(self) -> list[Proc]:
        return [p for p in self.procs if alive(p.pid)]

    def stop_all(self, grace: float = 30.0) -> list[str]:
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


def wait_http(url: str, pred=lambda r: r.status_code == 200, timeout: float = 90.0, what: str = "",
              method: str = "GET", headers: dict[str, str] | None = None) -> dict:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            r = httpx.request(method, url, timeout=2, headers=headers)
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


# -- the demo ------------------------------------------------------------------------------------


def workload_trace(family: str, seed: int, limit: int, state_dir: Path) -> Path:
    """A generated workload for ``up --demo --workload``: ``family`` with ``seed`` at its default
    rate, long enough to hold ``limit`` requests, written to ``<state dir>/demo/``."""
    # lazy: start-up time: loads numpy only when called
    from workloads.generator import Spec, default_rate, generate, write

    rate = default_rate(family)
    duration = 1.5 * max(limit, 1) / rate + 60.0  # Poisson counts and session warm-up leave room
    records = generate(Spec(family, seed, duration_s=duration))
    if len(records) < limit:
        raise RuntimeError(f"workload {family}:{seed} gave {len(records)} requests in {duration:.0f} s, "
                           f"fewer than --limit {limit}")
    path = state_dir / "demo" / f"workload-{family}-{seed}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    write(records, path)
    return path



def run_demo(d: DemoSettings, stack_settings: StackSettings, echo=print) -> dict:
    # lazy: start-up time: loads confluent_kafka only when called
    from common.log.admin import apply_topics

    t0 = time.monotonic()
    stack = Stack(stack_settings)
    echo("starting the stack: Kafka (KRaft), PostgreSQL, Redis, Prometheus, SeaweedFS ...")
    stack.up()
    bus = BusSettings.from_env()
    apply_topics(bus)
    sup = Supervisor(stack_settings)
    if sup.running():
        raise RuntimeError(f"a demo is already running ({[p.name for p in sup.running()]}); run `switchyard down` first")
    targets = stack_settings.state_dir / "prometheus" / "targets"

    def port(p: int) -> int:
        return p if not port_in_use("127.0.0.1", p) else free_port()

    metrics_port = port(d.metrics_port)
    sup.start("metrics", ["metrics", "run", "--port", str(metrics_port), "--processor-id", "demo",
                          "--targets-dir", str(targets)], f"http://127.0.0.1:{metrics_port}")
    workers = []
    vllm = d.engine == "vllm"
    # G4 in the stack's SeaweedFS: one bucket, each worker under its own prefix, requests signed
    # with the stack's key (read from its 0600 credentials file, never on a command line).
    object_tier = ["--object-blocks", str(DEMO_OBJECT_BLOCKS), "--s3-endpoint", stack_settings.s3_endpoint,
                   "--s3-bucket", DEMO_BUCKET, "--s3-credentials-file", str(stack_settings.s3_credentials_file)]
    if vllm:
        # lazy: start-up time: loads numpy only when called
        from ops.demo import vllm as vllm_demo
    for role, n in (("prefill", d.prefill_workers), ("decode", d.decode_workers)):
        for i in range(n):
            wid, wport = f"{role}-{i}", free_port()
            args = ["worker", "--worker-id", wid, "--role", role, "--pool", role, "--port", str(wport),
                    "--data-dir", str(sup.dir / "workers" / wid)]
            if vllm:
                sup.start(f"worker-{wid}", args + vllm_demo.WORKER_ARGS, f"http://127.0.0.1:{wport}",
                          env=vllm_demo.WORKER_ENV, python=vllm_demo.vllm_python())
            else:
                sup.start(f"worker-{wid}", args + ["--speedup", str(d.speedup), "--host-blocks", "4096",
                                                   "--disk-blocks", "8192", *object_tier, "--lease-s", "10"],
                          f"http://127.0.0.1:{wport}")
            workers.append(f"127.0.0.1:{wport}")
    router_port = port(d.router_port)
    router_url = f"http://127.0.0.1:{router_port}"
    if not d.with_admin:
        echo("API keys OFF: this demo runs without the admin API, so the router runs --no-auth (nothing can "
             "issue keys); anyone on this box can send it prompts")
    sup.start("router", ["router", "--port", str(router_port), "--router-id", "demo-router",
                         *(vllm_demo.ROUTER_ARGS if vllm else []), *([] if d.with_admin else ["--no-auth"])],
              router_url)
    write_prometheus_targets(targets, {"routers": [f"127.0.0.1:{router_port}"], "workers": workers})
    admin_url = ""
    if d.with_admin:
        admin_port = port(d.admin_port)
        admin_url = f"http://127.0.0.1:{admin_port}"
        sup.start("admin", ["admin", "serve", "--port", str(admin_port), "--db-url", stack_settings.postgres_url],
                  admin_url)
    if d.with_planner:
        # Virtual scaler: decisions are recorded on the log but the demo keeps its fixed workers
        # (the local-process scaler, which starts and drains real workers, is tested separately).
        sup.start("planner", ["planner", "run", "--scaler", "virtual", "--planner-id", "demo-planner"])
    n_workers = d.prefill_workers + d.decode_workers
    echo(f"waiting for {n_workers} workers to register with the router ...")
    wait_http(f"{router_url}/health", lambda r: r.status_code == 200 and r.json().get("workers") == n_workers,
              timeout=vllm_demo.READY_TIMEOUT_S if vllm else 120, what="router")
    api_key = None
    if admin_url:
        wait_http(f"{admin_url}/health", timeout=90, what="admin API")
        api_key = issue_demo_key(sup, stack_settings, admin_url, router_url)
        echo(f"API keys on: the load generator uses router key {api_key.split('_')[1]} "
             f"(issued through the admin API; {sup.dir / 'router-key'})")
    startup_s = time.monotonic() - t0

    import asyncio

    # lazy: start-up time: loads numpy only when called
    from ops.demo.loadgen import format_summary, plot, run_trace

    if d.limit <= 0:
        echo(f"up in {startup_s:.0f} s: router {router_url}/v1, admin {admin_url or '-'}; `switchyard down` stops it")
        return {"router": router_url, "admin": admin_url, "startup_s": startup_s}
    # lazy: start-up time: loads numpy only when called
    from ops.demo.runcheck import CpuSampler, breakdown, explain, now_ms, predict

    echo(f"replaying {d.limit} requests of {d.trace.name} at {d.rate}x arrivals"
         + ("" if vllm else f", engines at {d.speedup}x the mocker profile") + f", through {router_url} ...")
    since = now_ms() - 1000
    cpu = CpuSampler().start()
    if vllm:
        summary = vllm_demo.replay(router_url, d, echo, api_key=api_key)
    else:
        summary = asyncio.run(run_trace(router_url, d.trace, limit=d.limit, speedup=d.rate, max_output=d.max_output,
                                        api_key=api_key))
    load = cpu.stop()
    # The simulator models the mocker-profile engine; a vLLM engine has no prediction.
    pred = None if vllm else predict(d.trace, limit=d.limit, rate=d.rate, speedup=d.speedup,
                                     max_output=d.max_output, prefill=d.prefill_workers, decode=d.decode_workers)
    bd = breakdown(bus, summary["id_prefix"], since) if summary.get("id_prefix") else {
        "handoffs": 0, "disaggregated": 0, "recomputed": 0, "handoff_ratio": float("nan"), "fallback_reasons": {}}
    png = plot(summary, sup.dir / "report.png", "Switchyard demo")
    scaling = _count_scaling(bus)
    out = {k: v for k, v in summary.items() if k != "results"}
    out.update(startup_s=startup_s, report_png=str(png), router=router_url, admin=admin_url,
               prometheus=f"http://127.0.0.1:{stack_settings.prometheus_port}", metrics=f"http://127.0.0.1:{metrics_port}/metrics",
               scaling_decisions=scaling, predicted=pred, breakdown=bd, **load,
               ttft_p50_predicted_ms=pred["ttft_p50_ms"] if pred else float("nan"),
               handoff_ratio=bd["handoff_ratio"])
    echo("")
    echo(format_summary(summary))
    if pred:
        echo(f"predicted     TTFT p50 {pred['ttft_p50_ms']:.0f} ms  p99 {pred['ttft_p99_ms']:.0f} ms  ITL p50 "
             f"{pred['itl_p50_ms']:.1f} ms (the cluster simulator, same requests, same profile)")
        for line in explain(summary["ttft_p50_ms"], pred["ttft_p50_ms"], bd):
            echo(f"              {line}")
    echo(f"handoffs      {bd['handoffs']}/{bd['disaggregated']} disaggregated requests moved their KV over NIXL"
         + (f"; recomputed: {bd['fallback_reasons']}" if bd["recomputed"] else ""))
    echo(f"CPU           {load['cpu_busy'] * 100:.0f}% busy on average, {load['cpu_busy_peak'] * 100:.0f}% peak "
         f"({load['cpu_headroom'] * 100:.0f}% headroom, {os.cpu_count()} CPUs)")
    echo(f"scaling       {scaling} scaling decisions recorded")
    echo(f"router        {router_url}/v1 (OpenAI API), {router_url}/health")
    if admin_url:
        echo(f"admin API     {admin_url}/docs")
    echo(f"Prometheus    {out['prometheus']} (dashboards: dashboards/*.json, provisioning in dashboards/provisioning)")
    echo(f"report        {png}")
    echo(f"logs          {sup.dir}/*.log")
    if d.stop_after:
        stop_demo(stack_settings, echo)
    else:
        echo("still running: `switchyard down` stops everything")
    echo(result_line(out))
    return out


def issue_demo_key(sup: Supervisor, stack_settings: StackSettings, admin_url: str, router_url: str) -> str:
    """An admin token (straight into the database, as an operator bootstraps the first one), then
    a router key through the admin API with it; both kept in 0600 files of the demo's directory.
    Returns the key once the router has folded it."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    made = subprocess.run([sys.executable, "-m", "switchyard.cli", "admin", "create-token", "--name",
                           f"demo-{stamp}", "--role", "admin", "--db-url", stack_settings.postgres_url],
                          capture_output=True, text=True, timeout=120, env={**os.environ})
    if made.returncode != 0:
        raise RuntimeError(f"could not make the demo's admin token: {made.stderr.strip()[-300:]}")
    token = made.stdout.strip().splitlines()[-1]
    client = AdminClient(admin_url, token)
    try:
        key = client.issue_router_key(f"demo-loadgen-{stamp}")["key"]
    finally:
        client.close()
    for name, secret in (("admin-token", token), ("router-key", key)):
        (sup.dir / name).unlink(missing_ok=True)
        write_private(sup.dir / name, secret + "\n")
    # The key is checked before the body: an empty body is a 400 (nothing admitted) once the
    # router knows the key, a 401 until then.
    wait_http(f"{router_url}/v1/chat/completions", lambda r: r.status_code != 401, timeout=30,
              what="the router to fold the demo's key", method="POST", headers={"Authorization": f"Bearer {key}"})
    return key


def demo_secret(stack_settings: StackSettings, name: str) -> str | None:
    """The demo's admin token or router key (``admin-token``, ``router-key``), if it made one."""
    try:
        return (stack_settings.state_dir / "demo" / name).read_text().strip() or None
    except FileNotFoundError:
        return None


def result_line(out: dict) -> str:
    return (f"RESULT completed={out['completed']} failed={out['failed']} rejected={out.get('rejected', 0)} "
            f"ttft_p50_ms={out['ttft_p50_ms']:.0f} ttft_p50_predicted_ms={out['ttft_p50_predicted_ms']:.0f} "
            f"handoff_ratio={out['handoff_ratio']:.3f} cpu_headroom={out['cpu_headroom']:.2f}")


def _count_scaling(bus) -> int:
    topic = Catalog(bus.topic_prefix).topic("planner")
    with KafkaLogReader(bus) as reader:
        return sum(hi - lo for lo, hi in (reader.bounds(topic, p) for p in reader.partitions(topic)))


def system_pids(stack_settings: StackSettings) -> list[int]:
    """Every process of the system ``switchyard up`` started: the demo's (its ``procs.json``),
    the stack's (their data directories and pid files), and all their children."""
    state = stack_settings.state_dir
    pids = [p.pid for p in Supervisor(stack_settings).procs] + processes_mentioning(str(state))
    pids += [pid for f in state.glob("*/*.pid") if (pid := read_pid(f))]
    return descendants(pids)


def stop_demo(stack_settings: StackSettings, echo=print, stack: bool = True) -> None:
    sup = Supervisor(stack_settings)
    killed = sup.stop_all()
    if killed:
        echo(f"needed SIGKILL: {', '.join(killed)}")
    if stack:
        left = Stack(stack_settings).down()
        if left:
            raise RuntimeError(f"processes still running after stop: {left}")
    echo("everything stopped")
