"""common.processes: liveness, and the sweep of scratch directories of processes that are gone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from common.processes import alive, remove_dead_owned


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)


def test_alive():
    assert alive(os.getpid())
    assert not alive(_dead_pid())
    assert not alive(None) and not alive(0)


def test_only_the_directories_of_dead_owners_go(tmp_path: Path):
    dead, live = _dead_pid(), os.getpid()
    gone = [tmp_path / f"pid-{dead}", tmp_path / f"pid-{dead}-abc"]
    kept = [tmp_path / f"pid-{live}", tmp_path / f"pid-{live}-x", tmp_path / "pid-notanumber", tmp_path / f"other-{dead}"]
    for d in gone + kept:
        (d / "inner").mkdir(parents=True)
    remove_dead_owned(tmp_path, "pid-")
    assert [d for d in gone if d.exists()] == []
    assert all(d.exists() for d in kept)
