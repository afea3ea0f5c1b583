"""Settings every process shares: where the checkout is and how to reach the event log.

Built once per process from the environment.

Every field is described; ``from_env`` is the only place that reads ``os.environ``. Nothing here
is built at import time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from common.roles import role as find_role
from schemas.signing import ADMIN, MASTER_SECRET, ROUTER, Signer, Verifier, owner_key, worker_owner


def repo_root() -> Path:
    """The checkout this package runs from (where pyproject.toml lives)."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "pyproject.toml").exists():
            return parent
    return Path.cwd()


def default_secrets_dir() -> Path:
    """Where this checkout's stack keeps its passwords (``SWITCHYARD_SECRETS_DIR`` overrides)."""
    return Path(os.environ.get("SWITCHYARD_SECRETS_DIR") or repo_root() / ".stack" / "secrets")


def stack_secret(secrets_dir: Path, name: str) -> str:
    """The password called ``name`` (kafka, postgres, redis), made on first use: 24 random bytes
    in ``secrets_dir/name``, mode 0600 in a 0700 directory. Every process of the checkout reads
    the same one; of two processes making it at once, the second keeps the first's."""
    path = secrets_dir / name
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    import secrets

    write_private(path, secrets.token_urlsafe(24) + "\n")
    return path.read_text().strip()


#: The stack secret shared by every router and worker of a cluster. It is never sent: each
#: worker's endpoints take a bearer derived from it and that worker's id (:func:`worker_token`).
WORKER_CREDENTIAL = "worker-endpoint"


def worker_credential(secrets_dir: Path | None = None) -> str:
    """The cluster's worker secret (made on first use, like every stack secret)."""
    return stack_secret(secrets_dir or default_secrets_dir(), WORKER_CREDENTIAL)


def worker_token(secret: str, worker_id: str) -> str:
    """The bearer worker ``worker_id``'s endpoints require: HMAC-SHA256 of the cluster's worker
    secret with the worker id. The routers and the worker's peers, which hold the secret, send
    it; whoever only sees one call (a process that took over a stopped worker's port) learns a
    token good for that worker id alone."""
    import hashlib
    import hmac

    return hmac.new(secret.encode(), b"worker-endpoint\0" + worker_id.encode(), hashlib.sha256).hexdigest()


def signing_master(secrets_dir: Path) -> bytes:
    """The secret every event owner's signing key derives from (schemas/signing.py)."""
    return stack_secret(secrets_dir, MASTER_SECRET).encode()


def write_private(path: Path, text: str) -> bool:
    """Create ``path`` readable by its owner only, unless it exists (then keep it; False)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return True


def kafka_ca_file(secrets_dir: Path) -> Path:
    """The stack CA's certificate, which every Kafka client verifies the brokers with (made by
    ``ops.stack.tls`` when the stack starts)."""
    return secrets_dir / "kafka-ca.pem"


def broker_addresses(host: str, port: int, brokers: int = 1) -> list[str]:
    """Client addresses of a local cluster: broker ``i`` (0-based) listens on ``port + 2 i``
    (its KRaft controller on the port after it), so broker 0 is where a one-broker stack is."""
    return [f"{host}:{port + 2 * i}" for i in range(brokers)]


@dataclass(frozen=True)
class BusSettings:
    """How a process talks to the event log."""

    #: Kafka bootstrap servers, host:port[,host:port]: every broker of the cluster, so that a
    #: client starting while one broker is down still finds the others.
    bootstrap: str = "127.0.0.1:19092"
    #: Prefix of every topic name; tests use a unique prefix for isolation.
    topic_prefix: str = "sy"
    #: Producer batching delay. Small: control-plane events are latency-sensitive.
    linger_ms: int = 2
    #: When set, every EventProducer of the process keeps an ack ledger (common/log/acks.py)
    #: in this directory, one JSON-lines file per producer incarnation, for ``check_acks``.
    ack_ledger_dir: str | None = None
    #: ``SASL_SSL`` (the local stack: TLS to the brokers, verified against the stack's CA, and
    #: SCRAM-SHA-256 inside it), ``SASL_PLAINTEXT`` (a cluster with authentication but no TLS) or
    #: ``PLAINTEXT`` (a development cluster without either: logged loudly).
    security_protocol: str = "SASL_SSL"
    #: The SCRAM user this process authenticates as: the stack's super user, or a component's
    #: own (``sy-<role>``, see common/roles.py and :meth:`from_env`'s ``role``).
    username: str = "switchyard"
    #: Its password; None: the checkout's stack secret ``secrets_dir/<secret_name>``, read when a
    #: client is made, so it is never in the environment or on a command line.
    password: str | None = field(default=None, repr=False)
    secret_name: str = "kafka"
    #: Where the stack's secrets are (see :func:`default_secrets_dir`).
    secrets_dir: Path = field(default_factory=default_secrets_dir)
    #: This process's one event-signing identity and key (``<owner>`` and the hex key on two
    #: lines, from ``switchyard stack signing-key OWNER``), for a process on a host that does not
    #: hold the stack's secrets; None: derived from the master secret in ``secrets_dir``.
    signing_key_file: Path | None = None

    def signer(self, producer_id: str):
        """What this process may sign (schemas/signing.py): the key file's one identity; else,
        by the principal it authenticates as, a worker only its own events (``producer_id`` is
        its worker id), the admin API the admin stream, a router its config record; the stack's
        super user (the operator's tools) any owner."""
        if self.signing_key_file is not None:
            owner, key = self.signing_key_file.read_text().split()
            return Signer.identity(owner, bytes.fromhex(key))
        master = signing_master(self.secrets_dir)
        identity = {"sy-worker": worker_owner(producer_id), "sy-admin": ADMIN, "sy-router": ROUTER,
                    "sy-planner": "role:planner", "sy-processor": "role:processor"}.get(self.username)
        if identity is None:
            return Signer.master(master)
        return Signer.identity(identity, owner_key(master, identity))

    def verifier(self):
        """Checks every guarded event's owner signed it, from the stack's master secret; None
        (logged) for a process given only its own key (``signing_key_file``) on a host without
        that secret: it cannot tell a forged event from a signed one."""
        if self.signing_key_file is not None and not (self.secrets_dir / MASTER_SECRET).exists():
            import logging

            logging.getLogger("switchyard.security").warning(
                "no %s secret in %s: events read by this process are not checked for their owner's "
                "signature", MASTER_SECRET, self.secrets_dir)
            return None
        return Verifier(signing_master(self.secrets_dir))

    def client_conf(self) -> dict[str, str]:
        """The librdkafka settings that reach and authenticate to the log: the base of every
        producer, consumer and admin client of the process."""
        conf = {"bootstrap.servers": self.bootstrap}
        proto = self.security_protocol.upper()
        if proto in ("SASL_SSL", "SASL_PLAINTEXT"):
            conf.update({"security.protocol": proto, "sasl.mechanisms": "SCRAM-SHA-256",
                         "sasl.username": self.username, "sasl.password": self.secret()})
            if proto == "SASL_SSL":
                conf.update({"ssl.ca.location": str(self.ca_file()), "ssl.endpoint.identification.algorithm": "https"})
        elif proto == "PLAINTEXT":
            _warn_insecure(self.bootstrap)
        else:
            raise ValueError(f"security_protocol {self.security_protocol!r}: SASL_SSL, SASL_PLAINTEXT or PLAINTEXT")
        return conf

    def ca_file(self) -> Path:
        """The CA the brokers' certificate must chain to (``SASL_SSL``)."""
        ca = kafka_ca_file(self.secrets_dir)
        if not ca.exists():
            raise FileNotFoundError(f"no Kafka CA certificate at {ca}: the stack makes it when Kafka starts "
                                    "(`switchyard stack up`)")
        return ca

    def ssl_context(self):
        """For Python clients (Faust/aiokafka): verifies the brokers against :meth:`ca_file`."""
        import ssl

        return ssl.create_default_context(cafile=str(self.ca_file()))

    def secret(self) -> str:
        return self.password if self.password is not None else stack_secret(self.secrets_dir, self.secret_name)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, *, role: str | None = None, **overrides) -> BusSettings:
        """Settings from ``SWITCHYARD_*`` variables. ``role``: the component this process is
        (router, worker, planner, admin, processor): it authenticates as that role's principal,
        whose ACLs confine it to its topics, unless ``SWITCHYARD_KAFKA_USERNAME`` names a user."""
        env = dict(os.environ if env is None else env)
        kwargs: dict = {}
        if role is not None and not env.get("SWITCHYARD_KAFKA_USERNAME"):
            r = find_role(role)
            kwargs.update(username=r.user, secret_name=r.secret_name)
        if "SWITCHYARD_KAFKA_BOOTSTRAP" in env:
            kwargs["bootstrap"] = env["SWITCHYARD_KAFKA_BOOTSTRAP"]
        elif "SWITCHYARD_KAFKA_PORT" in env or "SWITCHYARD_KAFKA_BROKERS" in env:
            port = int(env.get("SWITCHYARD_KAFKA_PORT", 19092))
            brokers = int(env.get("SWITCHYARD_KAFKA_BROKERS", 1))
            kwargs["bootstrap"] = ",".join(broker_addresses("127.0.0.1", port, brokers))
        if "SWITCHYARD_TOPIC_PREFIX" in env:
            kwargs["topic_prefix"] = env["SWITCHYARD_TOPIC_PREFIX"]
        if "SWITCHYARD_LINGER_MS" in env:
            kwargs["linger_ms"] = int(env["SWITCHYARD_LINGER_MS"])
        if env.get("SWITCHYARD_ACK_LEDGER_DIR"):
            kwargs["ack_ledger_dir"] = env["SWITCHYARD_ACK_LEDGER_DIR"]
        if env.get("SWITCHYARD_KAFKA_SECURITY_PROTOCOL"):
            kwargs["security_protocol"] = env["SWITCHYARD_KAFKA_SECURITY_PROTOCOL"]
        elif env.get("SWITCHYARD_KAFKA_TLS", "").strip().lower() in ("0", "false", "no", "off"):
            kwargs["security_protocol"] = "SASL_PLAINTEXT"  # a stack started without TLS
        if env.get("SWITCHYARD_KAFKA_USERNAME"):
            kwargs["username"] = env["SWITCHYARD_KAFKA_USERNAME"]
        if env.get("SWITCHYARD_SECRETS_DIR"):
            kwargs["secrets_dir"] = Path(env["SWITCHYARD_SECRETS_DIR"])
        if env.get("SWITCHYARD_SIGNING_KEY_FILE"):
            kwargs["signing_key_file"] = Path(env["SWITCHYARD_SIGNING_KEY_FILE"])
        kwargs.update(overrides)
        return cls(**kwargs)


_insecure_warned: set[str] = set()


def _warn_insecure(bootstrap: str) -> None:
    """Say it loudly, once per process and cluster: PLAINTEXT is for development only."""
    if bootstrap in _insecure_warned:
        return
    _insecure_warned.add(bootstrap)
    import logging

    logging.getLogger("switchyard.security").warning(
        "INSECURE: talking to Kafka at %s without authentication (SWITCHYARD_KAFKA_SECURITY_PROTOCOL="
        "PLAINTEXT): anyone who reaches it can read the log and write events as any component", bootstrap)


def kafka_conf(bootstrap: str) -> dict[str, str]:
    """:meth:`BusSettings.client_conf` for a client given only the bootstrap servers (a log
    reader, a tool): this process's credentials from the environment."""
    return BusSettings.from_env(bootstrap=bootstrap).client_conf()
