"""Process liveness, shared by both planes. Linux only (reads /proc)."""

from __future__ import annotations

import os
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
