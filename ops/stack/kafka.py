"""Real Apache Kafka 4.x in KRaft mode: one node, or a replicated cluster on one box.

* One broker (the default): one JVM that is both the KRaft controller and the broker
  (``process.roles=broker,controller``), data in ``<state_dir>/kafka``; client port
  ``kafka_port``, controller ``kafka_port + 1``. Topics have one replica.
* ``kafka_brokers`` = N > 1: N brokers (``process.roles=broker``, node ids 1..N) beside a
  quorum of min(N, 3) dedicated controllers (``process.roles=controller``, node ids 101..),
  data in ``<state_dir>/kafka-cluster/broker-<id>`` and ``controller-<j>``. Broker ``i``
  listens on ``kafka_port + 2 (i - 1)``, controller ``j`` on ``kafka_port + 2 (j - 1) + 1``.
  Controllers apart from brokers, as Kafka recommends for production: a broker that dies is
  only a broker. With combined nodes, killing the partition leader killed the active
  controller in one case of three, and the new controller fenced the dead broker only a full
  session after its own election (measured under a CPU hog, 6 kills of the leader: 3.6-4.4 s
  to the first acknowledged produce when it was also the active controller, 2.7-3.0 s when it
  was not). Every topic, the internal ones included, gets min(3, N) replicas and
  ``min.insync.replicas`` 2 when that is 3 (:func:`common.log.catalog.replication_for`): an
  ``acks=all`` write is on two brokers before it is acknowledged, so losing any one broker
  loses no acknowledged write. A dead broker is fenced, and its partitions led elsewhere,
  within ``broker.session.timeout.ms`` (:data:`BROKER_SESSION_TIMEOUT_MS`, 1.5 s here rather
  than 9 s: the nodes share one machine, so a missed heartbeat is a dead or stopped JVM, not a
  slow network).

The jars come from Maven Central through ``scripts/kafka-pom.xml`` and are cached under
``<cache_dir>/kafka/libs``. Storage is formatted once (a cluster's nodes with one cluster id,
kept in ``kafka-cluster/cluster.id``); the data directories persist across restarts so the log
survives ``stack down``/``up`` (delete ``.stack/kafka`` or ``.stack/kafka-cluster`` to start
empty). ``stop`` and ``status`` cover whichever layout is running, whatever the settings say.
"""

from __future__ import annotations

import base64
import logging
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

from common.stack_settings import StackSettings
from ops.stack.process import (
    StackError,
    alive,
    live_pid,
    log_tail,
    port_in_use,
    processes_mentioning,
    require_free_port,
    terminate,
    wait_until,
)
from ops.stack.tls import ensure_kafka_tls
from common.log.catalog import replication_for
from common.settings import BusSettings, repo_root

log = logging.getLogger(__name__)

KAFKA_MAIN = "kafka.Kafka"
#: The SCRAM user every client of the stack authenticates as (common.settings.BusSettings).
KAFKA_USER = "switchyard"
#: Written into a node's data dir once it is formatted with that user's credential.
AUTH_MARKER = "switchyard-auth"
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


#: How long a broker may miss heartbeats before the controller fences it (clusters only).
BROKER_SESSION_TIMEOUT_MS = 1500


#: Node id of a cluster's first dedicated controller (the next ones follow): far from the
#: brokers' 1..N, so a node id in the metadata says which kind of JVM it is.
CONTROLLER_ID_BASE = 101


def controller_count(brokers: int) -> int:
    """Dedicated controllers of an N-broker cluster: a quorum of three survives the loss of one."""
    return min(brokers, 3)


class KafkaNode:
    """One Kafka JVM: the combined controller and broker of a one-node stack (``role``
    ``combined``), or one broker or one dedicated controller of a cluster of ``cluster_size``
    brokers."""

    def __init__(self, settings: StackSettings, libs: Path, node_dir: Path, node_id: int, cluster_size: int,
                 role: str = "combined") -> None:
        self.s = settings
        self.libs = libs
        self.node_id = node_id
        self.cluster_size = cluster_size
        self.role = role
        self.dir = node_dir
        self.data_dir = node_dir / "data"
        self.pid_file = node_dir / "kafka.pid"
        self.log_file = node_dir / "server.log"
        if role == "controller":
            self.port = self.controller_port = settings.kafka_port + 2 * (node_id - CONTROLLER_ID_BASE) + 1
        else:
            self.port = settings.kafka_port + 2 * (node_id - 1)
            self.controller_port = self.port + 1

    @property
    def address(self) -> str:
        return f"{self.s.host}:{self.port}"

    def voters(self) -> str:
        """``controller.quorum.voters``: the combined node itself, or the cluster's controllers."""
        h, p = self.s.host, self.s.kafka_port
        if self.role == "combined":
            return f"{self.node_id}@{h}:{self.controller_port}"
        return ",".join(f"{CONTROLLER_ID_BASE + j}@{h}:{p + 2 * j + 1}" for j in range(controller_count(self.cluster_size)))

    def config_lines(self) -> list[str]:
        h, n = self.s.host, self.cluster_size
        rf, min_isr = replication_for(n)
        serves = self.role != "controller"
        lines = [
            f"process.roles={'broker,controller' if self.role == 'combined' else self.role}",
            f"node.id={self.node_id}",
            f"controller.quorum.voters={self.voters()}",
            "controller.listener.names=CONTROLLER",
        ]
        if self.role == "combined":
            lines.append(f"listeners={self.listener}://{h}:{self.port},CONTROLLER://{h}:{self.controller_port}")
        elif self.role == "broker":
            lines.append(f"listeners={self.listener}://{h}:{self.port}")
        else:
            lines.append(f"listeners=CONTROLLER://{h}:{self.controller_port}")
        if serves:
            lines += [
                f"advertised.listeners={self.listener}://{h}:{self.port}",
                f"inter.broker.listener.name={self.listener}",
                f"listener.security.protocol.map=CONTROLLER:SASL_PLAINTEXT,{self.listener}:{self.listener}",
            ]
        else:
            lines.append("listener.security.protocol.map=CONTROLLER:SASL_PLAINTEXT")
        lines += [
            *self.auth_lines(),
            *(self.tls_lines() if serves else []),
            f"log.dirs={self.data_dir}",
            # Topic defaults on every kind of node: a controller applies them when it creates a
            # topic, a broker when it creates an internal one.
            "num.partitions=3",
            # Topics are created explicitly from the catalog, never by accident.
            "auto.create.topics.enable=false",
            # Internal topics (consumer offsets, transactions, share groups) as replicated as
            # the catalog's: a group's committed position must survive the broker loss too.
            f"default.replication.factor={rf}",
            f"min.insync.replicas={min_isr}",
            f"offsets.topic.replication.factor={rf}",
            "offsets.topic.num.partitions=8",
            f"transaction.state.log.replication.factor={rf}",
            f"transaction.state.log.min.isr={min_isr}",
            f"share.coordinator.state.topic.replication.factor={rf}",
            f"share.coordinator.state.topic.min.isr={min_isr}",
            "group.initial.rebalance.delay.ms=0",
            "log.segment.bytes=67108864",
            # fsync is left to the OS page cache as in every production Kafka; durability
            # across a broker kill -9 comes from the OS (the machine keeps running) and, in a
            # cluster, from the other replicas.
        ]
        if n > 1:
            lines += [
                # A kill -9 of a broker stops its partitions' writes until the controller fences
                # it, after its session timeout; a dead controller costs an election (the fetch
                # timeout, then the election timeout) but fences nobody. Defaults 9 s + 2 s + 1 s;
                # here 1.5 s + 0.75 s + 0.5 s, with heartbeats every 250 ms (six chances for a
                # busy JVM before a false fence, which only moves leaders: clients ride it out).
                # Measured with a producer's socket timeout of 2 s (common/log/kafka.py) on
                # combined nodes: the first acknowledged produce after a leader's kill -9 came
                # 2.4-3.3 s later, after a SIGSTOP 3.1-4.8 s later (4 runs each; 2 s + 1 s:
                # 2.3-3.8 and 3.2-5.4 s).
                "broker.heartbeat.interval.ms=250",
                f"broker.session.timeout.ms={BROKER_SESSION_TIMEOUT_MS}",
                "controller.quorum.fetch.timeout.ms=750",
                "controller.quorum.election.timeout.ms=500",
                # A leader killed before its followers caught up is never re-elected over them.
                "unclean.leader.election.enable=false",
            ]
        return lines

    def auth_lines(self) -> list[str]:
        """Every connection authenticates. Clients and brokers: SCRAM-SHA-256 as the stack's
        user, whose credential is in the cluster metadata from the format on. Controllers:
        PLAIN with the same password held in this file (a controller has to authenticate its
        peers before it has read any metadata, so it cannot look SCRAM credentials up)."""
        user, pw = KAFKA_USER, self.s.secret("kafka")
        scram = [] if self.role == "controller" else [
            "sasl.enabled.mechanisms=SCRAM-SHA-256",
            "sasl.mechanism.inter.broker.protocol=SCRAM-SHA-256",
            f"listener.name.{self.listener.lower()}.scram-sha-256.sasl.jaas.config="
            f'org.apache.kafka.common.security.scram.ScramLoginModule required username="{user}" password="{pw}";',
        ]
        return [
            # Each component is its own principal, confined by ACLs (common/log/principals.py);
            # the stack's user is the super user: brokers, controllers, operator tools.
            "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            f"super.users=User:{user}",
            *scram,
            "listener.name.controller.sasl.enabled.mechanisms=PLAIN",
            "sasl.mechanism.controller.protocol=PLAIN",
            "listener.name.controller.plain.sasl.jaas.config="
            f'org.apache.kafka.common.security.plain.PlainLoginModule required username="{user}" password="{pw}" '
            f'user_{user}="{pw}";',
        ]

    @property
    def listener(self) -> str:
        """The client and inter-broker listener's protocol (and name)."""
        return "SASL_SSL" if self.s.kafka_tls else "SASL_PLAINTEXT"

    def tls_lines(self) -> list[str]:
        """TLS on the client and inter-broker listener: the stack CA's broker certificate; the
        brokers verify each other against the same CA (hostname checked: 127.0.0.1 is in the
        certificate). The controller listener stays SASL_PLAINTEXT on loopback."""
        if not self.s.kafka_tls:
            return []

        tls = ensure_kafka_tls(self.s.secrets_dir, self.s.host)
        return [
            "ssl.keystore.type=PKCS12",
            f"ssl.keystore.location={tls.keystore}",
            f"ssl.keystore.password={tls.keystore_password}",
            f"ssl.key.password={tls.keystore_password}",
            "ssl.truststore.type=PEM",
            f"ssl.truststore.location={tls.ca_file}",
            "ssl.endpoint.identification.algorithm=https",
            "ssl.client.auth=none",
            *self.cipher_lines(),
        ]

    def cipher_lines(self) -> list[str]:
        """A JVM without C2 (``-XX:TieredStopAtLevel=1``, the stack's default) has no AES-GCM
        intrinsics: its TLS 1.3 AES-GCM runs as plain Java at about 33 MB/s, and the broker's
        network thread becomes the log's bound. ChaCha20-Poly1305 (a TLS 1.3 suite as strong)
        costs such a JVM 3.7 times less. Measured on 2 cores, reading `bench replay`'s 1.3M
        records (242 MB) over TLS, the broker's network thread: AES-GCM 7.05 s (C1), ChaCha20
        1.86-2.06 s (C1), AES-GCM 0.39-0.41 s (C2), no TLS 0.15 s. With C2 the JVM's AES-GCM
        intrinsics are the faster, so its choice is left to the client then."""
        if "-XX:TieredStopAtLevel=1" not in self.s.kafka_jvm_opts.split():
            return []
        return ["ssl.cipher.suites=TLS_CHACHA20_POLY1305_SHA256"]

    def write_config(self) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        cfg = self.dir / "server.properties"
        cfg.unlink(missing_ok=True)  # it holds the password: made readable by us only
        with os.fdopen(os.open(cfg, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write("\n".join([*self.config_lines(), ""]))
        (self.dir / "log4j2.properties").write_text(_LOG4J2.format(log_file=self.log_file))
        return cfg

    def format_storage(self, cluster_id: str) -> subprocess.Popen | None:
        """Write the config and start formatting the storage unless it is formatted already
        (the caller waits: a cluster's nodes format in parallel, each is a JVM start)."""
        cfg = self.write_config()
        marker = self.data_dir / AUTH_MARKER
        if (self.data_dir / "meta.properties").exists():
            if not marker.exists():
                raise StackError(
                    f"{self.data_dir} was formatted before the stack's Kafka required authentication, so "
                    f"its metadata holds no SCRAM credential for {KAFKA_USER!r}. Stop the stack and delete "
                    f"{self.dir} to start an empty, authenticated log (its events are not carried over).")
            return None
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # The SCRAM credential goes into the bootstrap metadata; the tool reads its arguments
        # from a private file (a command line is readable by every user of the box).
        args = self.dir / "format.args"
        args.unlink(missing_ok=True)
        with os.fdopen(os.open(args, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write("\n".join([STORAGE_TOOL, "format", "-t", cluster_id,
                               "-c", f'"{cfg}"', "--ignore-formatted", "--add-scram",
                               f'"SCRAM-SHA-256=[name={KAFKA_USER},password={self.s.secret("kafka")}]"', ""]))
        # A short-lived tool: C1 only and the serial GC start it in about half the CPU.
        return subprocess.Popen(["java", "-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC", "-cp", f"{self.libs}/*",
                                 f"@{args}"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def formatted(self) -> None:
        """Record that the storage was formatted with the stack's credential."""
        (self.data_dir / AUTH_MARKER).write_text("SCRAM-SHA-256\n")
        (self.dir / "format.args").unlink(missing_ok=True)

    def pid(self) -> int | None:
        return live_pid(self.pid_file)

    def send_signal(self, sig: int) -> None:
        """``sig`` to the node's JVM, if it runs (one that exits meanwhile is no error)."""
        pid = self.pid()
        if pid:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def check_ports(self) -> None:
        for port in sorted({self.port, self.controller_port}) if self.role == "combined" else (self.port,):
            require_free_port(f"kafka node {self.node_id}", self.s.host, port, "SWITCHYARD_KAFKA_PORT")

    def launch(self) -> subprocess.Popen:
        """Start the JVM on the formatted storage (not waiting for it to serve)."""
        cfg = self.dir / "server.properties"
        env = dict(os.environ)
        env.pop("KAFKA_OPTS", None)
        # The JVM's temporary files (the compression codecs' native libraries, extracted at each
        # start and never deleted) go in the node's own directory, not the machine's /tmp.
        tmp = self.dir / "tmp"
        tmp.mkdir(exist_ok=True)
        cmd = [
            "java",
            f"-Xmx{self.s.kafka_heap}",
            f"-Xms{_min_heap(self.s.kafka_heap)}",
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            *self.s.kafka_jvm_opts.split(),
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.dir / 'log4j2.properties'}",
            f"-Dswitchyard.stack={self.dir}",
            f"-Djava.io.tmpdir={tmp}",
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
        return proc

    def stop(self, timeout: float = 30.0) -> None:
        pid = self.pid()
        if pid:
            terminate(pid, timeout)
        # Anything else still holding our data dir (e.g. a crashed start) goes too.
        for stray in processes_mentioning(f"-Dswitchyard.stack={self.dir}"):
            terminate(stray, 10)
        self.pid_file.unlink(missing_ok=True)

    def kill9(self) -> None:
        """SIGKILL the JVM (fault injection) and wait until its ports are closed."""
        pid = self.pid()
        if pid:
            os.kill(pid, 9)
            wait_until(lambda: not alive(pid), 10, 0.05, f"Kafka node {self.node_id} to die")
            try:
                os.waitpid(pid, os.WNOHANG)  # reap it if it is our child
            except ChildProcessError:
                pass
            self.pid_file.unlink(missing_ok=True)
            # The kernel may still be tearing the listener down; a restart must not see it.
            wait_until(lambda: not port_in_use(self.s.host, self.port), 15, 0.1,
                       f"the killed Kafka node {self.node_id}'s port to close")

    def status(self) -> dict:
        pid = self.pid()
        return {"node": self.node_id, "role": self.role, "running": bool(pid), "pid": pid, "address": self.address,
                "controller": f"{self.s.host}:{self.controller_port}", "data": str(self.data_dir)}


class KafkaService:
    """The Kafka of the stack: ``settings.kafka_brokers`` nodes (see the module docstring)."""

    name = "kafka"

    def __init__(self, settings: StackSettings) -> None:
        self.s = settings
        self.libs = settings.cache_dir / "kafka" / "libs"
        self.brokers = settings.kafka_brokers
        self.dir = self._layout_dir(self.brokers)
        self.nodes = self._nodes(self.brokers)

    def _layout_dir(self, brokers: int) -> Path:
        return self.s.state_dir / ("kafka" if brokers == 1 else "kafka-cluster")

    def _nodes(self, brokers: int) -> list[KafkaNode]:
        """The layout's JVMs: brokers first (node ids 1..N), then a cluster's controllers."""
        if brokers == 1:
            return [KafkaNode(self.s, self.libs, self.s.state_dir / "kafka", 1, 1)]
        base = self._layout_dir(brokers)
        return [*(KafkaNode(self.s, self.libs, base / f"broker-{i}", i, brokers, "broker")
                  for i in range(1, brokers + 1)),
                *(KafkaNode(self.s, self.libs, base / f"controller-{j + 1}", CONTROLLER_ID_BASE + j, brokers,
                            "controller") for j in range(controller_count(brokers)))]

    def node(self, node_id: int) -> KafkaNode:
        """The JVM of a node id (a broker's id is what partition metadata names as leader)."""
        for n in self.nodes:
            if n.node_id == node_id:
                return n
        raise KeyError(f"no Kafka node {node_id} in this layout")

    # Kept for callers of the one-broker layout (its data dir, pid file and log).
    @property
    def data_dir(self) -> Path:
        return self.nodes[0].data_dir

    @property
    def log_file(self) -> Path:
        return self.nodes[0].log_file

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

    # -- cluster identity -------------------------------------------------------------------

    def _cluster_id(self) -> str:
        """The id every node is formatted with: one per layout dir, made on first start. A
        cluster formatted for another number of nodes is refused (its quorum is fixed)."""
        id_file, size_file = self.dir / "cluster.id", self.dir / "brokers"
        if id_file.exists():
            formatted = int(size_file.read_text()) if size_file.exists() else 1
            if formatted != self.brokers:
                raise StackError(f"{self.dir} holds a {formatted}-broker cluster; start it with --brokers "
                                 f"{formatted}, or delete {self.dir} to start a {self.brokers}-broker one empty")
            if self.brokers > 1 and not (self.dir / "controllers").exists():
                raise StackError(f"{self.dir} holds a cluster of combined controller+broker nodes, formatted "
                                 "before clusters had dedicated controllers; delete it to start one empty")
            return id_file.read_text().strip()
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.brokers == 1 and (self.data_dir / "meta.properties").exists():
            return ""  # formatted before cluster ids were kept; the format step is skipped anyway
        # What `kafka-storage random-uuid` prints (Kafka's Uuid: 16 bytes, URL-safe base64),
        # without starting a JVM for it; never one starting with "-" (read as an option).
        cid = "-"
        while cid.startswith("-"):
            cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        id_file.write_text(cid)
        size_file.write_text(str(self.brokers))
        if self.brokers > 1:
            (self.dir / "controllers").write_text(str(controller_count(self.brokers)))
        return cid

    def _other_layout(self) -> list[KafkaNode]:
        """The nodes of the layout the settings do not name (the one-broker one, or the cluster
        last formatted in ``kafka-cluster``), if it exists."""
        other = 1 if self.brokers > 1 else self._formatted_cluster_size()
        return [] if other is None or other == self.brokers else self._nodes(other)

    def _other_layout_running(self) -> list[KafkaNode]:
        return [n for n in self._other_layout() if n.pid()]

    def _formatted_cluster_size(self) -> int | None:
        f = self._layout_dir(2) / "brokers"
        return int(f.read_text()) if f.exists() else None

    # -- lifecycle --------------------------------------------------------------------------

    def pid(self) -> int | None:
        """Node 1's pid when every node runs, else None (the service as a whole is not up)."""
        pids = [n.pid() for n in self.nodes]
        return pids[0] if all(pids) else None

    def start(self, timeout: float = 120.0) -> bool:
        """Start every node that is not running, then wait until the cluster serves a replicated
        produce/consume round trip. Returns True if it started any process."""
        down = [n for n in self.nodes if not n.pid()]
        if not down:
            return False
        running_other = self._other_layout_running()
        if running_other:
            size = running_other[0].cluster_size
            raise StackError(f"a Kafka of {size} broker(s) is running from {self._layout_dir(size)}; "
                             "`switchyard stack down -s kafka` first")
        for n in down:
            n.check_ports()
        self.ensure_installed()
        cluster_id = self._cluster_id()
        formats = [(n, n.format_storage(cluster_id)) for n in down]
        for n, fmt in formats:
            if fmt is not None:
                if fmt.wait() != 0:
                    raise StackError(f"kafka storage format of node {n.node_id} failed: {fmt.stdout.read()}")
                n.formatted()
        procs = [(n, n.launch()) for n in down]
        try:
            wait_until(lambda: self._ready(procs), timeout, 0.5,
                       f"Kafka ({self.brokers} broker(s)) to accept a produce/consume round trip")
        except StackError as e:
            tail = "".join(f"{log_tail(log, 20)}\n" for n in down for log in (n.log_file, n.dir / "stdout.log"))
            raise StackError(f"Kafka did not become ready ({e}); last log lines:\n{tail}") from None
        return True

    def _ready(self, procs: list[tuple[KafkaNode, subprocess.Popen]]) -> bool:
        for node, proc in procs:
            if proc.poll() is not None:
                raise StackError(f"Kafka node {node.node_id} exited with code {proc.returncode}:\n"
                                 f"{log_tail(node.dir / 'stdout.log', 20)}\n")
        return len(self.live_brokers()) == self.brokers and self.round_trip()

    def _client_conf(self) -> dict:
        bus = BusSettings(bootstrap=self.s.kafka_bootstrap, secrets_dir=self.s.secrets_dir,
                          security_protocol="SASL_SSL" if self.s.kafka_tls else "SASL_PLAINTEXT")
        return {**bus.client_conf(), "socket.timeout.ms": 3000,
                "logger": logging.getLogger("switchyard.stack.rdkafka")}

    def live_brokers(self) -> list[int]:
        """Node ids the cluster's metadata lists as brokers (registered and not fenced)."""
        import socket

        from confluent_kafka.admin import AdminClient

        # A plain TCP probe first: librdkafka retries (and logs) forever on a closed port.
        for n in self.nodes:
            if n.role != "controller" and n.pid():
                with socket.create_connection((self.s.host, n.port), timeout=1):
                    break
        else:
            return []
        return sorted(AdminClient(self._client_conf()).list_topics(timeout=3).brokers)

    def round_trip(self, timeout: float = 10.0) -> bool:
        """Produce one record (acks=all) to a health topic as replicated as the catalog's topics
        and read it back."""
        from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
        from confluent_kafka.admin import AdminClient, NewTopic

        conf = self._client_conf()
        topic = "__switchyard_health"
        admin = AdminClient(conf)
        md = admin.list_topics(timeout=3)
        if topic not in md.topics:
            fut = admin.create_topics([NewTopic(topic, 1, replication_for(self.brokers)[0])])[topic]
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
        """Stop every node of either layout (a cluster started with ``--brokers`` is stopped
        by a plain ``stack down`` too)."""
        nodes = [*self.nodes, *self._other_layout()]
        # Brokers first, all at once (their controlled shutdowns overlap), then the controllers:
        # a broker's controlled shutdown asks the active controller, so with the controllers
        # stopping beside it each broker hung until SIGKILL at ``timeout`` (the three-broker
        # test cluster's teardown took 91 s).
        for group in ([n for n in nodes if n.role != "controller"], [n for n in nodes if n.role == "controller"]):
            for n in group:
                n.send_signal(signal.SIGTERM)
            for n in group:
                n.stop(timeout)

    def kill9(self, node_id: int = 1) -> None:
        """SIGKILL one node (fault injection); ``start`` brings it back."""
        self.node(node_id).kill9()

    def status(self) -> dict:
        """The configured layout's status, or the other layout's when only that one runs."""
        nodes = self.nodes
        if not any(n.pid() for n in nodes) and self._other_layout_running():
            nodes = self._other_layout()
        brokers = [n.status() for n in nodes if n.role != "controller"]
        controllers = [n.status() for n in nodes if n.role == "controller"]
        running = all(b["running"] for b in [*brokers, *controllers])
        return {
            "service": self.name,
            "running": running,
            "pid": brokers[0]["pid"] if running else None,
            "address": ",".join(b["address"] for b in brokers),
            "version": self.version(),
            "data": str(nodes[0].data_dir if len(nodes) == 1 else nodes[0].dir.parent),
            "brokers": brokers,
            "controllers": controllers,
        }


def _min_heap(max_heap: str) -> str:
    """-Xms: 256m, or the maximum heap when that is smaller (a JVM refuses Xms > Xmx)."""
    m = re.fullmatch(r"(\d+)([mMgG])", max_heap)
    if m and (int(m.group(1)) * (1024 if m.group(2) in "gG" else 1)) < 256:
        return max_heap
    return "256m"
