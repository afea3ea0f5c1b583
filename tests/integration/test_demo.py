"""The README's first command, on a short slice, against a private stack (own ports and data
dir, so stopping it does not disturb the shared stack other tests use)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid

import pytest

from control_plane.settings import repo_root
from control_plane.stack.process import processes_mentioning
from tests.support.ports import free_port

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def test_up_demo_runs_end_to_end_and_down_leaves_nothing() -> None:
    state = repo_root() / ".stack" / "tests" / f"demo-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "SWITCHYARD_STATE_DIR": str(state), "SWITCHYARD_KAFKA_PORT": str(free_port(pair=True)),
           "SWITCHYARD_POSTGRES_PORT": str(free_port()), "SWITCHYARD_REDIS_PORT": str(free_port()),
           "SWITCHYARD_PROMETHEUS_PORT": str(free_port()), "SWITCHYARD_TOPIC_PREFIX": "sy"}
    env.pop("SWITCHYARD_KAFKA_BOOTSTRAP", None)
    try:
        r = subprocess.run([sys.executable, "-m", "control_plane.cli", "up", "--limit", "24", "--rate", "40",
                            "--max-output", "16", "--prefill", "1", "--decode", "1", "--stop"],
                           env=env, capture_output=True, text=True, timeout=420)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        out = r.stdout
        assert "24/24 completed" in out, out
        for line in ("TTFT", "ITL", "prefix hits", "scaling", "router", "report", "everything stopped"):
            assert line in out
        assert (state / "demo" / "report.png").stat().st_size > 10_000
        assert processes_mentioning(str(state)) == []
    finally:
        subprocess.run([sys.executable, "-m", "control_plane.cli", "down"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(state, ignore_errors=True)
