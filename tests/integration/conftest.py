"""Fixtures of the integration tests that run Switchyard processes (the shared ones, e.g. the
stack's, are in tests/conftest.py)."""

from __future__ import annotations

import pytest

from common.settings import BusSettings
from tests.integration.test_router import Procs


@pytest.fixture
def procs(bus: BusSettings, tmp_path):
    """Routers and mini workers on this test's topics, their output in its tmp dir; all stopped
    after it."""
    p = Procs(bus, tmp_path)
    yield p
    p.close()
