"""Where the local stack runs (`StackSettings`): the one description of its services that
`ops/stack` starts and the runtime connects to, built once per process from the environment.

Every field is described; ``from_env`` is the only place that reads ``os.environ``. Nothing here
is built at import time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from common.settings import broker_addresses, default_secrets_dir, repo_root, stack_secret, write_private


#: The flags of ``weed mini``'s listeners, in the order of their ports from
#: ``StackSettings.seaweedfs_port`` on (the S3 endpoint first).
SEAWEEDFS_PORT_FLAGS = ("s3.port", "s3.port.grpc", "master.port", "master.port.grpc", "volume.port",
                        "volume.port.grpc", "filer.port", "filer.port.grpc", "admin.port")
#: Consecutive ports SeaweedFS takes from ``seaweedfs_port`` on.
SEAWEEDFS_PORTS = len(SEAWEEDFS_PORT_FLAGS)
#: Its admin server's gRPC port is its HTTP port + this: mini's maintenance workers dial the admin
#: there whatever ``-admin.port.grpc`` says (SeaweedFS 4.48), so that is where it must listen.
SEAWEEDFS_GRPC_OFFSET = 10000
#: The components with a Redis ACL user of their own (``sy-<role>``, its password the stack
#: secret ``redis-<role>``: :meth:`StackSettings.redis_role_url`); what each may touch is
#: ``ops/stack/redis.py``'s ``ROLE_KEYS``. The super user ``switchyard`` is the operator's.
REDIS_ROLES = ("router", "planner")
#: The access key id of the stack's one S3 identity (its secret key: ``StackSettings.s3_secret_key``).
S3_ACCESS_KEY = "switchyard"


@dataclass(frozen=True)
class StackSettings:
    """Where the local stack's services run and keep their data."""

    #: Directory holding every service's data, logs and pid files (ignored by git).
    state_dir: Path = field(default_factory=lambda: repo_root() / ".stack")
    #: The stack's passwords (Kafka's SCRAM user, PostgreSQL, Redis, SeaweedFS's S3 key), one 0600
    #: file each. Shared by every stack of the checkout (tests' private stacks too), so any client
    #: finds them.
    secrets_dir: Path = field(default_factory=default_secrets_dir)
    #: Cache for downloaded artifacts (Kafka jars); survives ``stack down``.
    cache_dir: Path = field(default_factory=lambda: repo_root() / ".cache")
    #: Host every service binds to. Loopback only: the stack is for one box.
    host: str = "127.0.0.1"
    #: Kafka client port of the first broker; its KRaft controller listens on this + 1. In a
    #: cluster, broker ``i`` (0-based) uses ``kafka_port + 2 i`` and controller ``i`` the port after it.
    kafka_port: int = 19092
    #: Kafka brokers to run (``stack up --brokers``). 1: one JVM, broker and controller, data in
    #: ``<state_dir>/kafka``. More: that many broker JVMs beside min(3, brokers) dedicated
    #: KRaft controllers, data in ``<state_dir>/kafka-cluster/broker-<id>`` and
    #: ``controller-<j>``; topics then get min(3, brokers) replicas.
    kafka_brokers: int = 1
    #: PostgreSQL port of the project-local cluster.
    postgres_port: int = 55432
    #: Redis port of the project-local instance.
    redis_port: int = 56379
    #: Prometheus port of the project-local instance.
    prometheus_port: int = 59090
    #: SeaweedFS (``weed mini``, the object store of the KVBM's G4 tier): its S3 endpoint's port.
    #: Its other listeners take the next :data:`SEAWEEDFS_PORTS` - 1 ports, in the order of
    #: :attr:`seaweedfs_ports` (S3's gRPC, then master, volume and filer, each an HTTP and a gRPC
    #: port, then the admin server's HTTP port), and the admin server's gRPC port is its HTTP port
    #: + 10,000: a private stack moves them all with this one setting.
    seaweedfs_port: int = 48333
    #: Maximum heap of each Kafka JVM (give a cluster's three a small one, e.g. 384m).
    kafka_heap: str = "1g"
    #: Extra JVM options of each Kafka node, space-separated. The default, C1 only
    #: (``-XX:TieredStopAtLevel=1``), is for this project-local stack on a small box: measured
    #: over one demo run on 2 cores, the broker used 18 s of CPU instead of 32 s (C2's compiling
    #: competes with the first requests), at the same TTFT. A broker serving a large fleet wants
    #: C2 back: set ``SWITCHYARD_KAFKA_JVM_OPTS=""``.
    kafka_jvm_opts: str = "-XX:TieredStopAtLevel=1"
    #: TLS on the client and inter-broker listener (``SASL_SSL``, certificates made by
    #: ``ops/stack/tls.py``); off: ``SASL_PLAINTEXT``. Clients must agree
    #: (``BusSettings.security_protocol``, ``SWITCHYARD_KAFKA_SECURITY_PROTOCOL``).
    kafka_tls: bool = True

    def __post_init__(self) -> None:
        if self.seaweedfs_port + SEAWEEDFS_PORTS - 1 + SEAWEEDFS_GRPC_OFFSET > 65535:
            raise ValueError(f"seaweedfs_port={self.seaweedfs_port}: at most {65535 - SEAWEEDFS_GRPC_OFFSET - SEAWEEDFS_PORTS + 1} "
                             "(the admin server's gRPC port is its HTTP port + 10,000)")
        if not 1 <= self.kafka_brokers <= 9:
            raise ValueError(f"kafka_brokers={self.kafka_brokers}: run 1 broker, or a cluster of 2 to 9 "
                             "(3 is the one that survives a broker loss with min.insync.replicas=2)")

    @property
    def kafka_bootstrap(self) -> str:
        """Every broker's client address, comma-separated."""
        return ",".join(broker_addresses(self.host, self.kafka_port, self.kafka_brokers))

    @property
    def postgres_url(self) -> str:
        return f"postgresql+psycopg://switchyard@{self.host}:{self.postgres_port}/switchyard"

    @property
    def redis_url(self) -> str:
        """With the stack's Redis password (:meth:`secret`): keep it out of logs, use
        :attr:`redis_address` to show where Redis is."""
        return f"redis://switchyard:{self.secret('redis')}@{self.host}:{self.redis_port}/0"

    def redis_role_url(self, role: str) -> str:
        """The Redis URL of component ``role`` (one of :data:`REDIS_ROLES`): its own ACL user,
        confined to its own keys, so that no other credential holder writes what it reads."""
        if role not in REDIS_ROLES:
            raise ValueError(f"no Redis user for role {role!r}: one of {', '.join(REDIS_ROLES)}")
        return f"redis://sy-{role}:{self.secret(f'redis-{role}')}@{self.host}:{self.redis_port}/0"

    @property
    def redis_address(self) -> str:
        return f"redis://{self.host}:{self.redis_port}/0"

    @property
    def seaweedfs_ports(self) -> dict[str, int]:
        """Every port ``weed mini`` listens on, by its flag (``-s3.port`` ...): all explicit, so
        it never moves to another port when one is taken (it does for a port left at its default)."""
        ports = {flag: self.seaweedfs_port + i for i, flag in enumerate(SEAWEEDFS_PORT_FLAGS)}
        return {**ports, "admin.port.grpc": ports["admin.port"] + SEAWEEDFS_GRPC_OFFSET}

    @property
    def s3_endpoint(self) -> str:
        """The stack's S3 endpoint (SeaweedFS)."""
        return f"http://{self.host}:{self.seaweedfs_port}"

    @property
    def s3_secret_key(self) -> str:
        """The secret key of the stack's S3 identity :data:`S3_ACCESS_KEY` (the stack secret
        ``seaweedfs``): keep it out of logs and command lines."""
        return self.secret("seaweedfs")

    @property
    def s3_credentials_file(self) -> Path:
        """An AWS shared credentials file (mode 0600) with the stack's S3 identity as the
        ``default`` profile: a process given ``AWS_SHARED_CREDENTIALS_FILE`` finds it through
        boto3's usual chain, and the secret stays out of command lines and environments."""
        path = self.secrets_dir / "s3-credentials"
        if not path.exists():
            write_private(path, f"[default]\naws_access_key_id = {S3_ACCESS_KEY}\n"
                                f"aws_secret_access_key = {self.s3_secret_key}\n")
        return path

    @property
    def pgpass_file(self) -> Path:
        """A libpq password file (mode 0600) for the stack's PostgreSQL user. The password stays
        out of URLs, command lines and logs: clients of :attr:`postgres_url` find it here
        (``control_plane.admin.db.session.make_engine``, ``PGPASSFILE`` for the CLI tools)."""
        path = self.secrets_dir / f"pgpass.{self.postgres_port}"
        if not path.exists():
            write_private(path, f"{self.host}:{self.postgres_port}:*:switchyard:{self.secret('postgres')}\n")
        return path

    def secret(self, name: str) -> str:
        """The stack's password for ``name`` (kafka, postgres, redis, seaweedfs): :func:`common.settings.stack_secret`."""
        return stack_secret(self.secrets_dir, name)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides) -> StackSettings:
        """Read ``SWITCHYARD_<FIELD>`` variables (e.g. ``SWITCHYARD_KAFKA_PORT``)."""
        env = dict(os.environ if env is None else env)
        kwargs: dict = {}
        for f in fields(cls):
            raw = env.get(f"SWITCHYARD_{f.name.upper()}")
            if raw is None:
                continue
            if f.name.endswith("_dir"):
                kwargs[f.name] = Path(raw)
            elif f.name.endswith("_port") or f.type == "int":
                kwargs[f.name] = int(raw)
            elif f.type == "bool":
                kwargs[f.name] = raw.strip().lower() in ("1", "true", "yes", "on")
            else:
                kwargs[f.name] = raw
        kwargs.update(overrides)
        return cls(**kwargs)

