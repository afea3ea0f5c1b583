"""Settings every process shares: where the checkout is and how to reach the event log.

Built once per process from the environment.

Every field is described; ``from_env`` is the only place that reads ``os.environ``. Nothing here
is built at import time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def repo_root() -> Path:
    """The checkout this package runs from (where pyproject.toml lives)."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "pyproject.toml").exists():
            return parent
    return Path.cwd()


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
    #: When set, every EventProducer of the process keeps an ack ledger (kernel/log/ledger.py)
    #: in this directory, one JSON-lines file per producer incarnation, for ``check_acks``.
    ack_ledger_dir: str | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides) -> BusSettings:
        env = dict(os.environ if env is None else env)
        kwargs: dict = {}
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
        kwargs.update(overrides)
        return cls(**kwargs)
