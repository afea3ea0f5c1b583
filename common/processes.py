"""Process liveness and CPU time, shared by both planes and the benches. Linux only (reads /proc)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def alive(pid: int | None) -> bool:
    """Whether process ``pid`` exists and is not a zombie (one we may not signal counts as alive)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is not alive for our purposes.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (FileNotFoundError, IndexError):
        return False


def cpu_s(pid: int, children: bool = False) -> float:
    """CPU seconds (user + system) process ``pid`` has used, from /proc; with ``children``, plus
    those of its live child processes (nginx's workers)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    kids = Path(f"/proc/{pid}/task/{pid}/children")
    if not children or not kids.exists():
        return own
    return own + sum(cpu_s(int(k)) for k in kids.read_text().split())


def remove_dead_owned(base: Path, prefix: str) -> None:
    """Remove the directories ``<base>/<prefix><pid>[-...]`` whose process is gone: a process
    that names its scratch directory so lets the next one clean up after a kill -9."""
    for d in base.glob(prefix + "*"):
        pid = d.name.removeprefix(prefix).split("-", 1)[0]
        if pid.isdigit() and not alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)
