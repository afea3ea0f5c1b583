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
