"""Typed settings, built once per process from the environment.

Every field is described; ``from_env`` is the only place that reads ``os.environ``. Nothing here
is built at import time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path


def repo_root() -> Path:
    """The checkout this package runs from (where pyproject.toml lives)."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "pyproject.toml").exists():
            return parent
    return Path.cwd()


@dataclass(frozen=True)
class StackSettings:
    """Where the local stack's services run and keep their data."""

    #: Directory holding every service's data, logs and pid files (ignored by git).
    state_dir: Path = field(default_factory=lambda: repo_root() / ".stack")
    #: Cache for downloaded artifacts (Kafka jars); survives ``stack down``.
    cache_dir: Path = field(default_factory=lambda: repo_root() / ".cache")
    #: Host every service binds to. Loopback only: the stack is for one box.
    host: str = "127.0.0.1"
    #: Kafka client (PLAINTEXT) port; the KRaft controller listens on this + 1.
    kafka_port: int = 19092
    #: PostgreSQL port of the project-local cluster.
    postgres_port: int = 55432
    #: Redis port of the project-local instance.
    redis_port: int = 56379
    #: Prometheus port of the project-local instance.
    prometheus_port: int = 59090
    #: Maximum heap for the Kafka JVM.
    kafka_heap: str = "1g"

    @property
    def kafka_bootstrap(self) -> str:
        return f"{self.host}:{self.kafka_port}"

    @property
    def postgres_url(self) -> str:
        return f"postgresql+psycopg://switchyard@{self.host}:{self.postgres_port}/switchyard"

    @property
    def redis_url(self) -> str:
        return f"redis://{self.host}:{self.redis_port}/0"

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
            elif f.name.endswith("_port"):
                kwargs[f.name] = int(raw)
            else:
                kwargs[f.name] = raw
        kwargs.update(overrides)
        return cls(**kwargs)


@dataclass(frozen=True)
class BusSettings:
    """How a process talks to the event log."""

    #: Kafka bootstrap servers, host:port[,host:port].
    bootstrap: str = "127.0.0.1:19092"
    #: Prefix of every topic name; tests use a unique prefix for isolation.
    topic_prefix: str = "sy"
    #: Producer batching delay. Small: control-plane events are latency-sensitive.
    linger_ms: int = 2

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides) -> BusSettings:
        env = dict(os.environ if env is None else env)
        kwargs: dict = {}
        if "SWITCHYARD_KAFKA_BOOTSTRAP" in env:
            kwargs["bootstrap"] = env["SWITCHYARD_KAFKA_BOOTSTRAP"]
        elif "SWITCHYARD_KAFKA_PORT" in env:
            kwargs["bootstrap"] = f"127.0.0.1:{int(env['SWITCHYARD_KAFKA_PORT'])}"
        if "SWITCHYARD_TOPIC_PREFIX" in env:
            kwargs["topic_prefix"] = env["SWITCHYARD_TOPIC_PREFIX"]
        if "SWITCHYARD_LINGER_MS" in env:
            kwargs["linger_ms"] = int(env["SWITCHYARD_LINGER_MS"])
        kwargs.update(overrides)
        return cls(**kwargs)
