"""``switchyard chaos``, short: a private 3-broker KRaft cluster, two routers, disaggregated
workers (one prefill, two decode), the metrics processor and two planner replicas, under open-loop load; the broker
leading the probe partition killed -9 and later SIGSTOPped past its session timeout, a router,
a decode worker and the planner leader killed -9, each restarted; then an overload phase.

The command's own checks are the assertions: nothing acknowledged lost or duplicated, no
unexplained sequence gap, every router's view equal to the oracle fold, every admitted request
ended with a reason, no client-visible failure the log does not explain, every fault recovered;
and no process it started outlives it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from ops.chaos.diskfill import DiskFaultUnavailable, SmallDisk
from ops.stack.process import processes_mentioning
from common.settings import repo_root

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(480)]

FAULTS = "broker_kill,router_kill,decode_kill,planner_kill,broker_hang,disk_full"


def _faults(tmp_path) -> str:
    """Every fault above; disk_full only where a small filesystem can be mounted (root)."""
    disk = SmallDisk(tmp_path / "mount-probe", 1024 * 1024)
    try:
        disk.mount()
    except DiskFaultUnavailable as e:
        print(f"disk_full left out: {e}")
        return FAULTS.replace(",disk_full", "")
    disk.unmount()
    return FAULTS


def test_chaos_command_short_run_loses_nothing_and_recovers(tmp_path) -> None:
    report_dir = tmp_path / "chaos"
    faults = _faults(tmp_path)
    cmd = [sys.executable, "-m", "switchyard.cli", "chaos", "--report", str(report_dir), "--seed", "3",
           "--duration", "45", "--faults", faults, "--rate", "3", "--overload-s", "8", "--gap", "5",
           "--prefill", "1"]  # no prefill fault here: one prefill worker spares the 2-core box
    proc = subprocess.Popen(cmd, cwd=repo_root(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=420)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the command stops what it started, then exits
        stdout, stderr = proc.communicate(timeout=60)
    out = stdout + stderr[-3000:]
    print(out[-6000:])
    report_file = report_dir / "report.json"
    assert report_file.exists(), out[-4000:]
    report = json.loads(report_file.read_text())
    system = report["system"]
    try:
        assert proc.returncode == 0, out[-4000:]
        lines = stdout.strip().splitlines()
        n = len(faults.split(","))
        assert lines[-1].startswith(f"RESULT faults={n} ") and lines[-1] == report["result"]
        checks = report["checks"]
        zero = ("acked_lost", "duplicates", "gaps", "unended", "silent_failures", "unrecovered",
                "rejections_without_reason")
        assert {k: checks[k] for k in zero} == dict.fromkeys(zero, 0)
        assert (report_dir / "requests.jsonl").stat().st_size > 0
        assert checks["views_equal_oracle"] == 1 and len(report["views"]) == 2
        assert sorted(f["kind"] for f in report["faults"]) == sorted(faults.split(","))
        assert all(f["recovered"] for f in report["faults"])
        assert all(f["refused_writes"] > 0 for f in report["faults"] if f["kind"] == "disk_full")
        assert checks["broker_failover_s"] is not None and checks["acked"] > 0
        assert report["requests"]["ok"] > 0 and report["overload"]["sent"] > 0
        assert (report_dir / "timeline.png").stat().st_size > 0
    finally:
        # Every process it started is gone: brokers and workers (the state dir is on their
        # command lines), routers, metrics and planners (the run's prefix is in their ids).
        assert processes_mentioning(system["state_dir"]) == [], "a process outlived the chaos run"
        assert processes_mentioning(system["topic_prefix"]) == [], "a process outlived the chaos run"
        with open("/proc/mounts") as mounts:
            assert [m for m in mounts if system["state_dir"] in m] == [], "a small disk outlived the chaos run"
