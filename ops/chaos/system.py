"""The whole system on private ports under one state dir, for a chaos run (adapter).

* a KRaft cluster of ``brokers`` nodes (ops/stack/kafka.py), topics from the catalog
  with 3 replicas and ``min.insync.replicas`` 2 (``apply_topics``);
* a private Redis for the planner's leader lease;
* ``routers`` router replicas, each with a stable id and port (a restart closes the requests its
  dead incarnation left open: control_plane/router/orphans.py);
* simulated workers in disaggregated mode: ``prefill`` prefill and ``decode`` decode workers,
  each restarted with its id, port and data dir;
* the metrics processor, and ``planners`` planner replicas sharing one lease (one leads).

Every process is ``python -m switchyard.cli ...`` in its own session (a kill -9 takes its
children along), with ``SWITCHYARD_ACK_LEDGER_DIR`` set so that every producer keeps an ack
ledger for the checks, and writes its log into ``<report>/logs``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ops.chaos.diskfill import DiskFaultUnavailable, SmallDisk
from ops.chaos.errors import ChaosError
from ops.chaos.plan import Topology
from control_plane.router.admission import AdmissionConfig
from common.stack_settings import StackSettings
from ops.stack.kafka import KafkaNode, KafkaService
from ops.stack.redis import RedisService
from common.log.admin import apply_topics
from common.log.catalog import Catalog
from common.net import free_port
from common.settings import BusSettings, repo_root

log = logging.getLogger(__name__)

#: The topic the probe producer writes (one partition: its leader is the broker hit) and reads
#: nothing else from; ``AdminAction`` events there are audit records no fold acts on.
PROBE_STREAM = "admin"


@dataclass(frozen=True)
class SystemSettings:
    """What the chaos system runs."""

    #: Every process's data (Kafka, Redis, workers' disks, planner state).
    state_dir: Path
    #: Logs and ack ledgers go here (with the report).
    report_dir: Path
    topology: Topology = Topology()
    #: Topic prefix of the run (unique: the log holds this run only).
    topic_prefix: str = "chaos"
    block_size: int = 64
    #: Engine speed-up of the simulated workers.
    worker_speedup: float = 20.0
    #: Router admission: a short queue (32 requests may wait before 429, 5 s at most before 503),
    #: so that the overload phase sheds load with reasons instead of queueing it; a worker is busy
    #: at 2048 pending prefill tokens (the router's default, 65536, is 128 of this load's
    #: 512-token prompts per worker: the overload phase would never queue).
    admission: AdmissionConfig = AdmissionConfig(busy_prefill_tokens=2048, queue_max=32, queue_timeout_s=5.0)
    #: The routers' config fields besides the defaults (``RouterConfig``: say ``ttft_slo_ms``,
    #: ``max_loop_lag_ms``), given to every replica as a ``--config`` file; empty: none.
    router_config: tuple[tuple[str, float], ...] = ()
    #: Planner lease time-to-live: a dead leader is replaced within about this.
    lease_ttl_ms: int = 2000
    kafka_heap: str = "384m"
    secrets_dir: Path | None = None
    #: Mount a small filesystem under every worker's KV disk tier, so that the disk_full fault
    #: can fill it (root only; see ops/chaos/diskfill.py).
    small_disks: bool = False
    #: Size of each. The tier's capacity is then ``small_disk_blocks`` (half of it): a run never
    #: fills it, so no write has to evict a block first, and every write the ballast's ENOSPC
    #: refuses is a write that would have landed. (Without small disks: 64 blocks, which the
    #: load fills, so the tier's removals are exercised.)
    small_disk_bytes: int = 256 * 1024 * 1024
    small_disk_blocks: int = 8192

    @property
    def ledger_dir(self) -> Path:
        return self.report_dir / "ledgers"

    @property
    def log_dir(self) -> Path:
        return self.report_dir / "logs"


@dataclass
class Proc:
    """One ``switchyard`` process that can be killed and started again the same way."""

    name: str
    args: list[str]
    env: dict[str, str]
    log_dir: Path
    port: int = 0
    health_path: str = "/health"
    popen: subprocess.Popen | None = None
    starts: int = 0
    #: Exits nobody asked for ("<name> start N exited -11"): found when the process is next
    #: killed, launched or stopped, or by :meth:`note_crash`.
    crashes: list[str] = field(default_factory=list)
    #: Set by kill9/stop: this incarnation's exit is ours, not a crash.
    _ended_by_us: bool = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def note_crash(self) -> None:
        """Record this incarnation's exit if it ended on its own (once)."""
        if self.popen is not None and not self._ended_by_us and self.popen.poll() is not None:
            self.crashes.append(f"{self.name} start {self.starts} exited {self.popen.poll()}")
            self._ended_by_us = True  # recorded: not again

    def mark_stopping(self) -> None:
        """From here on this incarnation's exit is ours (a crash before now is recorded first)."""
        self.note_crash()
        self._ended_by_us = True

    def launch(self) -> Proc:
        self.note_crash()
        self._ended_by_us = False
        self.starts += 1
        with open(self.log_dir / f"{self.name}.{self.starts}.log", "wb") as out:
            self.popen = subprocess.Popen([sys.executable, "-m", "switchyard.cli", *self.args], cwd=repo_root(),
                                          env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None and self.popen.poll() is None else None

    def exited(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def kill9(self) -> None:
        """SIGKILL to the process and its session: no drain, no flush."""
        if self.popen is None:
            return
        self.mark_stopping()
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.popen.wait(10)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM, then SIGKILL to whatever is left of its session."""
        if self.popen is None:
            return
        self.mark_stopping()
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill9()

    def health(self) -> tuple[int, dict]:
        """(status, JSON body) of its health endpoint; (0, {}) while it does not answer."""
        try:
            r = httpx.get(f"{self.url}{self.health_path}", timeout=2)
        except httpx.HTTPError:
            return 0, {}
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, {}

    def tail(self, chars: int = 3000) -> str:
        path = self.log_dir / f"{self.name}.{self.starts}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def wait(pred: Callable[[], object], timeout: float, what: str | Callable[[], str], interval: float = 0.2):
    """Poll ``pred`` until it returns something truthy (returned); ``ChaosError`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise ChaosError(f"timed out after {timeout:.0f} s waiting for {what() if callable(what) else what}")
        time.sleep(interval)


@dataclass
class ChaosSystem:
    s: SystemSettings
    stack: StackSettings = field(init=False)
    kafka: KafkaService = field(init=False)
    redis: RedisService | None = field(init=False, default=None)
    bus: BusSettings = field(init=False)
    routers: list[Proc] = field(default_factory=list)
    prefill: list[Proc] = field(default_factory=list)
    decode: list[Proc] = field(default_factory=list)
    planners: list[Proc] = field(default_factory=list)
    metrics: Proc | None = None
    #: Each worker's small filesystem under its disk tier (``small_disks``), by worker name.
    disks: dict[str, SmallDisk] = field(default_factory=dict)
    #: Why no small filesystem could be mounted (the disk_full fault is then not injected).
    disk_error: str | None = None

    def __post_init__(self) -> None:
        s = self.s
        kw = {"secrets_dir": s.secrets_dir} if s.secrets_dir else {}
        # Three brokers and three controllers on a small shared box: small heaps, C1 only (half
        # the start-up CPU). The port span covers both (each controller's port follows a broker's).
        self.stack = StackSettings(state_dir=s.state_dir / "stack", kafka_port=free_port(span=2 * s.topology.brokers),
                                   kafka_brokers=s.topology.brokers, kafka_heap=s.kafka_heap,
                                   kafka_jvm_opts="-XX:TieredStopAtLevel=1", redis_port=free_port(),
                                   cache_dir=StackSettings.from_env().cache_dir, **kw)  # the shared downloads
        self.kafka = KafkaService(self.stack)
        self.bus = BusSettings(bootstrap=self.stack.kafka_bootstrap, topic_prefix=s.topic_prefix,
                               ack_ledger_dir=str(s.ledger_dir), **kw)

    # -- layout -----------------------------------------------------------------------------

    def _kv_blocks(self, small_disk: bool) -> list[str]:
        """The workers' KV capacities. With a small disk, an eighth of the device blocks (the
        load's prompts are 8 blocks, one of them unique): the device evicts to disk after about
        120 requests, so the disk_full fault has writes to refuse."""
        if small_disk:
            return ["--device-blocks", "128", "--disk-blocks", str(self.s.small_disk_blocks)]
        return ["--device-blocks", "1024", "--disk-blocks", "64"]

    def disk_counts(self, w: Proc) -> tuple[int, int]:
        """(block writes its disk tier refused as full, blocks written to its disk tier) so
        far, from the worker's /metrics; (-1, -1) while it does not answer."""
        from prometheus_client.parser import text_string_to_metric_families

        try:
            text = httpx.get(f"{w.url}/metrics", timeout=5).text
        except httpx.HTTPError:
            return -1, -1
        refused = written = 0.0
        for fam in text_string_to_metric_families(text):
            for smp in fam.samples:
                if smp.name == "switchyard_worker_kvbm_write_errors_total" and smp.labels.get("tier") == "disk" \
                        and smp.labels.get("reason") == "full":
                    refused += smp.value
                elif smp.name == "switchyard_worker_kvbm_offload_blocks_total" and smp.labels.get("to_tier") == "disk":
                    written += smp.value
        return int(refused), int(written)

    @property
    def workers(self) -> list[Proc]:
        return [*self.prefill, *self.decode]

    @property
    def procs(self) -> list[Proc]:
        return [*self.workers, *self.routers, *self.planners, *([self.metrics] if self.metrics else [])]

    @property
    def router_urls(self) -> list[str]:
        return [r.url for r in self.routers]

    def env(self) -> dict[str, str]:
        # The private system's settings only: none of the caller's SWITCHYARD_* (another stack's
        # ports, user or protocol) leaks into it; the secrets are the checkout's.
        env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_") or k == "SWITCHYARD_SECRETS_DIR"}
        env.update({"SWITCHYARD_KAFKA_BOOTSTRAP": self.bus.bootstrap, "SWITCHYARD_TOPIC_PREFIX": self.bus.topic_prefix,
                    "SWITCHYARD_KAFKA_SECURITY_PROTOCOL": self.bus.security_protocol,
                    "SWITCHYARD_ACK_LEDGER_DIR": str(self.s.ledger_dir), "PYTHONUNBUFFERED": "1"})
        if self.s.secrets_dir:
            env["SWITCHYARD_SECRETS_DIR"] = str(self.s.secrets_dir)
        return env

    def _redis_env(self, env: dict[str, str], role: str) -> dict[str, str]:
        """``env`` with the private Redis as ``role``'s own ACL user (``redis_role_url``)."""
        return {**env, "SWITCHYARD_REDIS_URL": self.stack.redis_role_url(role)} if self.redis is not None else env

    def _build(self) -> None:
        s, env = self.s, self.env()
        for role, n, into in (("prefill", s.topology.prefill, self.prefill), ("decode", s.topology.decode, self.decode)):
            for i in range(n):
                wid = f"{role}-{i}"
                port = free_port()
                data_dir = s.state_dir / "workers" / wid
                if s.small_disks and self.disk_error is None:
                    disk = SmallDisk(data_dir / "kvbm" / "g3", s.small_disk_bytes)  # KvbmSettings.disk_root
                    try:
                        disk.mount()
                        self.disks[wid] = disk
                    except DiskFaultUnavailable as e:
                        self.disk_error = str(e)
                        log.warning("the disk_full fault cannot be injected here: %s", e)
                into.append(Proc(wid, ["worker", "--worker-id", wid, "--role", role, "--pool", role, "--port",
                                       str(port), "--data-dir", str(data_dir),
                                       "--speedup", str(s.worker_speedup), "--block-size", str(s.block_size),
                                       *self._kv_blocks(wid in self.disks)],
                                 env, s.log_dir, port))
        # Every id carries the run's prefix, so ``processes_mentioning(prefix)`` finds them all.
        config: list[str] = []
        if s.router_config:
            path = s.state_dir / "router-config.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(dict(s.router_config)))
            config = ["--config", str(path)]
        for i in range(s.topology.routers):
            port = free_port()  # below the ephemeral range: restarted on the same port
            self.routers.append(Proc(f"router-{i}", [
                "router", "--port", str(port), "--router-id", f"{s.topic_prefix}-router-{i}", "--snapshot-every", "1",
                "--block-size", str(s.block_size), "--queue-max", str(s.admission.queue_max),
                "--queue-timeout", str(s.admission.queue_timeout_s),
                "--busy-prefill-tokens", str(s.admission.busy_prefill_tokens),
                *config, "--no-auth"],
                self._redis_env(env, "router"), s.log_dir, port))
        port = free_port()
        self.metrics = Proc("metrics", ["metrics", "run", "--port", str(port), "--processor-id",
                                        f"{s.topic_prefix}-metrics", "--block-size", str(s.block_size)],
                            env, s.log_dir, port)
        for i in range(s.topology.planners):
            port = free_port()
            self.planners.append(Proc(f"planner-{i}", [
                "planner", "run", "--scaler", "virtual", "--planner-id", f"{s.topic_prefix}-planner-{i}",
                "--lease", f"chaos-{s.topic_prefix}", "--lease-ttl-ms", str(s.lease_ttl_ms),
                "--state-dir", str(s.state_dir / "planner"), "--health-port", str(port)],
                self._redis_env(env, "planner"), s.log_dir, port))

    # -- start / stop -----------------------------------------------------------------------

    def start(self, timeout: float = 180.0) -> None:
        s = self.s
        for d in (s.state_dir, s.ledger_dir, s.log_dir):
            d.mkdir(parents=True, exist_ok=True)
        log.info("starting a %d-broker Kafka cluster on %s", s.topology.brokers, self.stack.kafka_bootstrap)
        self.kafka.start(timeout)
        apply_topics(self.bus)
        if s.topology.planners:
            self.redis = RedisService(self.stack)
            self.redis.start()
        self._build()
        for w in self.workers:
            w.launch()
        self.metrics.launch()
        for p in self.planners:
            p.launch()
        for w in self.workers:
            self.wait_ready(w, timeout)
        for r in self.routers:
            r.launch()
        self.wait_ready(self.metrics, timeout)
        for r in self.routers:
            self.wait_router_exact(r, timeout)
        if self.planners:
            self.wait_planners(timeout)

    def crashes(self) -> list[str]:
        """Every exit of a Switchyard process that no fault and no stop caused, so far."""
        for p in self.procs:
            p.note_crash()
        return [c for p in self.procs for c in p.crashes]

    def close_procs(self) -> None:
        """Stop every Switchyard process (workers first: they drain); SIGKILL what lingers."""
        for group in (self.workers, [*self.routers, *self.planners, *([self.metrics] if self.metrics else [])]):
            for p in group:
                p.mark_stopping()
                if p.pid:
                    try:
                        p.popen.send_signal(signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            for p in group:
                p.stop(20)

    def close(self) -> None:
        """Stop everything it started: the processes, then Redis and Kafka (a hung broker is
        continued first: a stopped JVM would ignore the SIGTERM)."""
        self.close_procs()
        for n in self.kafka.nodes:
            n.send_signal(signal.SIGCONT)
        for disk in self.disks.values():
            disk.unmount()
        if self.redis is not None:
            self.redis.stop()
        self.kafka.stop()

    # -- readiness --------------------------------------------------------------------------

    def wait_ready(self, p: Proc, timeout: float) -> None:
        def up() -> bool:
            if p.exited() is not None:
                raise ChaosError(f"{p.name} exited with {p.exited()}:\n{p.tail()}")
            return p.health()[0] == 200

        wait(up, timeout, f"{p.name} /health 200")

    def router_exact(self, r: Proc) -> bool:
        """200, view EXACT and every worker routable."""
        status, body = r.health()
        return status == 200 and body.get("state") == "EXACT" and body.get("workers") == len(self.workers)

    def wait_router_exact(self, r: Proc, timeout: float) -> None:
        def ok() -> bool:
            if r.exited() is not None:
                raise ChaosError(f"{r.name} exited with {r.exited()}:\n{r.tail()}")
            return self.router_exact(r)

        wait(ok, timeout, lambda: f"{r.name} /health EXACT with {len(self.workers)} workers: {r.health()}")

    def planner_leader(self) -> Proc | None:
        for p in self.planners:
            if p.pid and p.health()[1].get("leader") is True:
                return p
        return None

    def planners_settled(self) -> bool:
        """One leader, every other replica caught up on standby (holding no token)."""
        states = [p.health() for p in self.planners]
        leaders = [b for _, b in states if b.get("leader") is True]
        standby = [b for st, b in states if st == 200 and b.get("caught_up") and b.get("leader") is False]
        return len(leaders) == 1 and len(standby) == len(self.planners) - 1

    def wait_planners(self, timeout: float) -> None:
        wait(self.planners_settled, timeout,
             lambda: f"one planner leader, the others on standby: {[p.health() for p in self.planners]}")

    # -- brokers ----------------------------------------------------------------------------

    def probe_topic(self) -> str:
        return Catalog(self.bus.topic_prefix).topic(PROBE_STREAM)

    def partition_state(self, topic: str, partition: int = 0) -> tuple[int, list[int]] | None:
        """(leader, in-sync replicas) fresh from the metadata; None when it cannot be read."""
        from confluent_kafka import KafkaException
        from confluent_kafka.admin import AdminClient

        conf = {**self.bus.client_conf(), "socket.timeout.ms": 3000,
                "logger": logging.getLogger("switchyard.chaos.rdkafka")}
        try:
            p = AdminClient(conf).list_topics(topic, timeout=5).topics[topic].partitions[partition]
        except (KafkaException, KeyError):
            return None
        return p.leader, sorted(p.isrs)

    def node(self, node_id: int) -> KafkaNode:
        return self.kafka.node(node_id)

    def live_brokers(self) -> list[int]:
        try:
            return self.kafka.live_brokers()
        except Exception:  # noqa: BLE001 - a broker mid-restart refuses or resets: "not yet"
            return []

    def cluster_whole(self, topic: str, partition: int = 0) -> bool:
        """Every broker registered and unfenced, and the partition's ISR full again."""
        if len(self.live_brokers()) != self.s.topology.brokers:
            return False
        st = self.partition_state(topic, partition)
        return st is not None and len(st[1]) == self.s.topology.brokers
