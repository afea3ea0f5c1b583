"""``planner backtest`` over load recorded in the real broker: a 2 -> 12 req/s step served by one
worker is replayed under a candidate config; the report has the candidate's scale-up after the
step, predicted vs actual load, SLO attainment and replica-seconds, and a PNG chart."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from typer.testing import CliRunner

from control_plane.planner.cli import planner_app
from control_plane.planner.load_view import NS
from common.log.kafka import EventProducer
from common.settings import BusSettings
from schemas.events import WorkerLoadReported
from tests.support.traffic import Clock, register_worker, serve_request

pytestmark = pytest.mark.kafka

CONFIG = """
version = 7
gpu_budget = 8
tick_s = 10.0
cooldown_up_s = 0.0
cooldown_down_s = 30.0

[[pools]]
name = "agg"
role = "aggregated"
min_replicas = 1
max_replicas = 8
ttft_slo_ms = 1500.0
itl_slo_ms = 30.0
profile = "mocker"
"""


def _record(bus: BusSettings, start: int, seconds: int) -> None:
    """One worker; Poisson arrivals at 2 req/s, then 12 req/s from half-way; ISL 4,000, OSL 200;
    the recorded TTFT degrades to 3 s in the busy half (one worker is not enough)."""
    clock = Clock(start)
    router, worker = EventProducer(bus, "router", clock_ns=clock), EventProducer(bus, "a1", epoch=1, clock_ns=clock)
    register_worker(worker, "a1", block_size=64)
    rng = np.random.default_rng(3)
    now, i, next_report = 0.0, 0, 0.0
    while now < seconds:
        busy = now >= seconds / 2
        now += rng.exponential(1 / (12.0 if busy else 2.0))
        while next_report <= now:
            clock.t = start + int(next_report * NS)
            worker.publish(WorkerLoadReported(worker_id="a1", running=8, waiting=0))
            next_report += 1.0
        serve_request(router, clock, f"r{i}", "a1", at_ns=start + int(now * NS), served_s=2, prompt_tokens=4000,
                      output_tokens=200, block_size=64, ttft_ms=3000.0 if busy else 150.0, itl_mean_ms=12.0,
                      e2e_ms=4000.0)
        i += 1
    assert router.flush(30) == 0 and worker.flush(30) == 0


def test_backtest_cli_replays_recorded_load_under_another_config(bus: BusSettings, tmp_path, monkeypatch) -> None:
    seconds = 240
    start = (time.time_ns() // (10 * NS) - seconds // 10 - 3) * 10 * NS
    _record(bus, start, seconds)
    cfg = tmp_path / "planner.toml"
    cfg.write_text(CONFIG)
    png = tmp_path / "bt.png"
    monkeypatch.setenv("SWITCHYARD_KAFKA_BOOTSTRAP", bus.bootstrap)
    monkeypatch.setenv("SWITCHYARD_TOPIC_PREFIX", bus.topic_prefix)
    args = ["backtest", "--from", str(start / NS), "--to", str(start / NS + seconds), "--config", str(cfg),
            "--predictor", "kalman", "--startup-s", "20"]
    res = CliRunner().invoke(planner_app, args + ["--png", str(png)])
    assert res.exit_code == 0, res.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    out = res.output
    assert "config v7, predictor kalman" in out and "RESULT " in out

    res = CliRunner().invoke(planner_app, args + ["--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    s = rep["summary"]
    ups = [d for d in rep["decisions"] if d["to"] > d["from"]]
    assert ups and all(d["t"] - start / NS >= seconds / 2 for d in ups), rep["decisions"]
    assert max(d["to"] for d in ups) >= 3
    # recorded: one worker all along; the busy half (12 of every 14 requests) missed the TTFT target
    assert s["recorded_replica_seconds"] == pytest.approx(seconds - 10, abs=10)
    assert s["recorded_slo_attainment"] == pytest.approx(2 / 14, abs=0.05)
    assert s["estimated_slo_attainment_candidate"] > s["estimated_slo_attainment_recorded"]
    assert s["candidate_replica_seconds"] > s["recorded_replica_seconds"]
    windows = rep["windows"]
    assert len(windows) == seconds // 10 and all(w["predicted_rate"] is not None for w in windows[2:])
    assert s["forecast_error"] < 0.5
