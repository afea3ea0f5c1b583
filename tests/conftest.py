"""Shared fixtures. Integration tests use the real local stack (`switchyard stack up`): a test
that needs a service fails loudly when it is missing, it never skips silently."""

from __future__ import annotations

import logging
import socket
import uuid

import pytest

from common.stack_settings import StackSettings
from common.settings import BusSettings

logging.getLogger("switchyard.rdkafka").setLevel(logging.CRITICAL)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):  # noqa: ANN001, ANN201 - pytest's hook signature
    """A failed test's report carries the tail of every worker log written while it ran."""
    outcome = yield
    rep = outcome.get_result()
    if not rep.failed or call.when == "collect":
        return
    from tests.integration.workerproc import WorkerProc

    for w in WorkerProc.launched:
        path = w.log_path
        if path.exists() and path.stat().st_mtime >= call.start:
            rep.sections.append((f"worker {w.worker_id} log (tail of {path.name})", w.log(4000)))


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def stack_settings() -> StackSettings:
    return StackSettings.from_env()


@pytest.fixture(scope="session")
def kafka_bootstrap(stack_settings: StackSettings) -> str:
    if not _reachable(stack_settings.host, stack_settings.kafka_port):
        pytest.fail(f"Kafka is not running on {stack_settings.kafka_bootstrap}: run `uv run switchyard stack up`")
    return stack_settings.kafka_bootstrap


@pytest.fixture(scope="session")
def seaweedfs(stack_settings: StackSettings):
    """The stack's SeaweedFS (its S3 endpoint); tests share it, each with buckets of its own."""
    from ops.stack.seaweedfs import SeaweedService

    if not _reachable(stack_settings.host, stack_settings.seaweedfs_port):
        pytest.fail(f"SeaweedFS is not running on {stack_settings.s3_endpoint}: run `uv run switchyard stack up`")
    return SeaweedService(stack_settings)


@pytest.fixture
def bus(kafka_bootstrap: str) -> BusSettings:
    """Bus settings with a topic prefix unique to this test, topics created from the catalog."""
    from common.log.admin import apply_topics

    settings = BusSettings(bootstrap=kafka_bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:10]}")
    apply_topics(settings)
    return settings
