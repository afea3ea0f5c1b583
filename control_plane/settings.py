"""Typed settings, built once per process from the environment.

Every field is described; ``from_env`` is the only place that reads ``os.environ``. Nothing here
is built at import time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from kernel.settings import repo_root


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
