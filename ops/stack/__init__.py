"""The local stack: real Kafka (KRaft), PostgreSQL, Redis, Prometheus and SeaweedFS (S3) as
project-local processes.

``Stack.up()`` is idempotent: a service already running is left alone. ``down()`` stops every
service and verifies that no process holding the stack's data dir survives.
"""

from __future__ import annotations

from common.stack_settings import StackSettings
from ops.stack.kafka import KafkaService
from ops.stack.postgres import PostgresService
from ops.stack.process import StackError, processes_mentioning
from ops.stack.prometheus import PrometheusService
from ops.stack.redis import RedisService
from ops.stack.seaweedfs import SeaweedService

SERVICE_NAMES = ("kafka", "postgres", "redis", "prometheus", "seaweedfs")


class Stack:
    def __init__(self, settings: StackSettings) -> None:
        self.settings = settings
        self.services = {
            "kafka": KafkaService(settings),
            "postgres": PostgresService(settings),
            "redis": RedisService(settings),
            "prometheus": PrometheusService(settings),
            "seaweedfs": SeaweedService(settings),
        }

    def _select(self, only: list[str] | None):
        names = only or list(SERVICE_NAMES)
        unknown = [n for n in names if n not in self.services]
        if unknown:
            raise StackError(f"unknown service(s) {unknown}; known: {list(self.services)}")
        return [(n, self.services[n]) for n in names]

    def up(self, only: list[str] | None = None) -> dict[str, bool]:
        """Start what is not running; returns {service: started_now}."""
        return {name: svc.start() for name, svc in self._select(only)}

    def down(self, only: list[str] | None = None) -> list[int]:
        """Stop services (reverse order); returns pids still alive afterwards (should be [])."""
        for _name, svc in reversed(self._select(only)):
            svc.stop()
        if only:
            return []
        return processes_mentioning(str(self.settings.state_dir))

    def status(self) -> list[dict]:
        return [svc.status() for svc in self.services.values()]


__all__ = ["Stack", "StackError", "SERVICE_NAMES"]
