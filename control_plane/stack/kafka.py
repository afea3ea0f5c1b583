"""A real Apache Kafka 4.x broker, single node, KRaft mode (broker + controller in one JVM).

The jars come from Maven Central through ``scripts/kafka-pom.xml`` and are cached under
``<cache_dir>/kafka/libs``. Storage is formatted once; the data directory persists across
restarts so the log survives ``stack down``/``up`` (delete ``.stack/kafka`` to start empty).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path

from control_plane.settings import StackSettings
from control_plane.stack.process import (
    StackError,
    alive,
    port_in_use,
    processes_mentioning,
    read_pid,
    require_free_port,
    terminate,
    wait_until,
)
from kernel.settings import repo_root

log = logging.getLogger(__name__)

KAFKA_MAIN = "kafka.Kafka"
STORAGE_TOOL = "kafka.tools.StorageTool"

_LOG4J2 = """\
status = warn
appender.file.type = File
appender.file.name = FILE
appender.file.fileName = {log_file}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = FILE
logger.kafka.name = kafka
logger.kafka.level = WARN
logger.apache.name = org.apache.kafka
logger.apache.level = WARN
logger.state.name = state.change.logger
logger.state.level = WARN
"""


def java_version() -> int | None:
    java = shutil.which("java")
    if not java:
        return None
    out = subprocess.run([java, "-version"], capture_output=True, text=True).stderr
    m = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    if not m:
        return None
    major = int(m.group(1))
    return int(m.group(2)) if major == 1 and m.group(2) else major


class KafkaService:
    name = "kafka"

    def __init__(self, settings: StackSettings) -> None:
        self.s = settings
        self.dir = settings.state_dir / "kafka"
        self.data_dir = self.dir / "data"
        self.libs = settings.cache_dir / "kafka" / "libs"
        self.pid_file = self.dir / "kafka.pid"
        self.log_file = self.dir / "server.log"

    # -- install ----------------------------------------------------------------------------

    def ensure_installed(self) -> None:
        v = java_version()
        if v is None:
            raise StackError(
                "Java is not installed. Kafka 4.x needs Java 17 or newer: "
                "apt-get install -y openjdk-17-jre-headless"
            )
        if v < 17:
            raise StackError(f"Java {v} found; Kafka 4.x needs Java 17 or newer")
        if self._jars_present():
            return
        mvn = shutil.which("mvn")
        if not mvn:
            raise StackError(
                "Kafka jars are not cached and Maven is missing to fetch them: "
                "apt-get install -y maven (then run `switchyard stack up` again)"
            )
        self.libs.mkdir(parents=True, exist_ok=True)
        pom = repo_root() / "scripts" / "kafka-pom.xml"
        log.info("fetching Kafka jars from Maven Central into %s", self.libs)
        proc = subprocess.run(
            [mvn, "-q", "-B", "-f", str(pom), "dependency:copy-dependencies",
             f"-DoutputDirectory={self.libs}", "-DincludeScope=runtime"],
            capture_output=True, text=True,
        )
        if proc.returncode != 0 or not self._jars_present():
            raise StackError(f"mvn failed to fetch the Kafka jars:\n{proc.stdout}\n{proc.stderr}")

    def _jars_present(self) -> bool:
        return any(self.libs.glob("kafka_2.13-*.jar")) and any(self.libs.glob("kafka-storage-*.jar"))

    def version(self) -> str:
        jars = sorted(self.libs.glob("kafka_2.13-*.jar"))
        return jars[0].stem.removeprefix("kafka_2.13-") if jars else "not installed"

    # -- config -------------------------------------------------------------------------------

    def _write_config(self) -> Path:
        h, p = self.s.host, self.s.kafka_port
        cfg = self.dir / "server.properties"
        cfg.write_text(
            "\n".join(
                [
                    "process.roles=broker,controller",
                    "node.id=1",
                    f"controller.quorum.voters=1@{h}:{p + 1}",
                    f"listeners=PLAINTEXT://{h}:{p},CONTROLLER://{h}:{p + 1}",
                    f"advertised.listeners=PLAINTEXT://{h}:{p}",
                    "controller.listener.names=CONTROLLER",
                    "inter.broker.listener.name=PLAINTEXT",
                    "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
                    f"log.dirs={self.data_dir}",
                    "num.partitions=3",
                    # Topics are created explicitly from the catalog, never by accident.
                    "auto.create.topics.enable=false",
                    "offsets.topic.replication.factor=1",
                    "offsets.topic.num.partitions=8",
                    "transaction.state.log.replication.factor=1",
                    "transaction.state.log.min.isr=1",
                    "share.coordinator.state.topic.replication.factor=1",
                    "share.coordinator.state.topic.min.isr=1",
                    "group.initial.rebalance.delay.ms=0",
                    "log.segment.bytes=67108864",
                    # fsync is left to the OS page cache as in every production Kafka; durability
                    # across a broker kill -9 comes from the OS (the machine keeps running).
                    "",
                ]
            )
        )
        (self.dir / "log4j2.properties").write_text(_LOG4J2.format(log_file=self.log_file))
        return cfg

    def _java(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["java", "-cp", f"{self.libs}/*", *args], capture_output=True, text=True, **kw
        )

    def _format_once(self, cfg: Path) -> None:
        if (self.data_dir / "meta.properties").exists():
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cluster_id = self._java(STORAGE_TOOL, "random-uuid").stdout.strip().splitlines()[-1:]
        cid = cluster_id[0] if cluster_id else uuid.uuid4().hex[:22]
        proc = self._java(STORAGE_TOOL, "format", "-t", cid, "-c", str(cfg), "--ignore-formatted")
        if proc.returncode != 0:
            raise StackError(f"kafka storage format failed: {proc.stderr or proc.stdout}")

    # -- lifecycle --------------------------------------------------------------------------

    def pid(self) -> int | None:
        pid = read_pid(self.pid_file)
        return pid if alive(pid) else None

    def start(self, timeout: float = 90.0) -> bool:
        """Start unless running. Returns True if it started a new process."""
        if self.pid():
            return False
        require_free_port(self.name, self.s.host, self.s.kafka_port, "SWITCHYARD_KAFKA_PORT")
        self.ensure_installed()
        self.dir.mkdir(parents=True, exist_ok=True)
        cfg = self._write_config()
        self._format_once(cfg)
        env = dict(os.environ)
        env.pop("KAFKA_OPTS", None)
        cmd = [
            "java",
            f"-Xmx{self.s.kafka_heap}",
            "-Xms256m",
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.dir / 'log4j2.properties'}",
            f"-Dswitchyard.stack={self.dir}",
            "-cp",
            f"{self.libs}/*",
            KAFKA_MAIN,
            str(cfg),
        ]
        out = open(self.dir / "stdout.log", "ab")
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, env=env,
        )
        self.pid_file.write_text(str(proc.pid))
        try:
            wait_until(lambda: self._ready(proc), timeout, 0.5, "Kafka to accept a produce/consume round trip")
        except StackError:
            tail = _tail(self.log_file) + _tail(self.dir / "stdout.log")
            raise StackError(f"Kafka did not become ready; last log lines:\n{tail}") from None
        return True

    def _ready(self, proc: subprocess.Popen) -> bool:
        if proc.poll() is not None:
            raise StackError(f"Kafka exited with code {proc.returncode}:\n{_tail(self.dir / 'stdout.log')}")
        return self.round_trip()

    def round_trip(self, timeout: float = 10.0) -> bool:
        """Produce one record to a health topic and read it back."""
        import socket

        from confluent_kafka import Consumer, KafkaException, Producer
        from confluent_kafka.admin import AdminClient, NewTopic

        # A plain TCP probe first: librdkafka retries (and logs) forever on a closed port.
        with socket.create_connection((self.s.host, self.s.kafka_port), timeout=1):
            pass
        conf = {"bootstrap.servers": self.s.kafka_bootstrap, "socket.timeout.ms": 3000,
                "logger": logging.getLogger("switchyard.stack.rdkafka")}
        topic = "__switchyard_health"
        admin = AdminClient(conf)
        md = admin.list_topics(timeout=3)
        if topic not in md.topics:
            fut = admin.create_topics([NewTopic(topic, 1, 1)])[topic]
            try:
                fut.result(timeout=10)
            except KafkaException as e:
                if "TOPIC_ALREADY_EXISTS" not in str(e):
                    raise
        token = uuid.uuid4().hex.encode()
        p = Producer({**conf, "acks": "all"})
        p.produce(topic, token)
        if p.flush(timeout) != 0:
            return False
        c = Consumer({**conf, "group.id": f"health-{uuid.uuid4().hex}", "auto.offset.reset": "latest",
                      "enable.auto.commit": False})
        try:
            from confluent_kafka import TopicPartition

            lo, hi = c.get_watermark_offsets(TopicPartition(topic, 0), timeout=5)
            c.assign([TopicPartition(topic, 0, max(lo, hi - 1))])
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                m = c.poll(0.5)
                if m is not None and not m.error() and m.value() == token:
                    return True
            return False
        finally:
            c.close()

    def stop(self, timeout: float = 30.0) -> None:
        pid = read_pid(self.pid_file)
        if pid and alive(pid):
            terminate(pid, timeout)
        # Anything else still holding our data dir (e.g. a crashed start) goes too.
        for stray in processes_mentioning(f"-Dswitchyard.stack={self.dir}"):
            terminate(stray, 10)
        self.pid_file.unlink(missing_ok=True)

    def kill9(self) -> None:
        """SIGKILL the broker (fault injection)."""
        pid = self.pid()
        if pid:
            os.kill(pid, 9)
            wait_until(lambda: not alive(pid), 10, 0.05, "Kafka to die")
            try:
                os.waitpid(pid, os.WNOHANG)  # reap it if it is our child
            except ChildProcessError:
                pass
            self.pid_file.unlink(missing_ok=True)
            # The kernel may still be tearing the listener down; a restart must not see it.
            wait_until(lambda: not port_in_use(self.s.host, self.s.kafka_port), 15, 0.1,
                       "the killed broker's port to close")

    def status(self) -> dict:
        pid = self.pid()
        return {
            "service": self.name,
            "running": bool(pid),
            "pid": pid,
            "address": self.s.kafka_bootstrap,
            "version": self.version(),
            "data": str(self.data_dir),
        }


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) + "\n"
    except FileNotFoundError:
        return ""
