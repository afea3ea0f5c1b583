"""A real full disk for a KV disk tier: a small tmpfs mounted over the tier's directory, filled
with a ballast file until the kernel answers ENOSPC, freed by deleting it.

Mounting needs root (or CAP_SYS_ADMIN). Where the mount is refused, :meth:`SmallDisk.mount`
raises :class:`DiskFaultUnavailable` with the command's own error, and the chaos run reports the
fault as not injected instead of pretending: a quota or a fake store would not be the kernel's
ENOSPC on the write path the worker really takes.
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

from ops.chaos.errors import ChaosError

#: The ballast's name: not a block file (``<16 hex>.kvb``) nor a temporary (``*.tmp``), so the
#: disk store neither scans it as a block nor deletes it as a crashed write's leftover.
BALLAST = ".chaos-ballast"
_CHUNK = 64 * 1024


class DiskFaultUnavailable(ChaosError):
    """This machine will not mount the small filesystem (not root, no tmpfs)."""


class SmallDisk:
    """A tmpfs of ``size_bytes`` at ``path``: mount it before the worker opens the directory
    (the mount hides what was there), unmount it after the worker has stopped."""

    def __init__(self, path: Path, size_bytes: int) -> None:
        self.path = Path(path)
        self.size_bytes = size_bytes
        self.mounted = False

    def mount(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={self.size_bytes},mode=0700", "switchyard-chaos", str(self.path)]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise DiskFaultUnavailable(f"`{' '.join(cmd)}`: {e}") from e
        if r.returncode != 0:
            raise DiskFaultUnavailable(f"`{' '.join(cmd)}` exited {r.returncode}: {(r.stderr or r.stdout).strip()}")
        self.mounted = True

    def fill(self) -> int:
        """Write the ballast until the filesystem is full; the bytes it took."""
        written = 0
        chunk = b"\0" * _CHUNK
        with open(self.path / BALLAST, "ab", buffering=0) as f:
            while True:
                try:
                    n = f.write(chunk)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise ChaosError(f"filling {self.path}: {e}") from e
                    break
                if not n:
                    break
                written += n
        # Whatever a write of less than a chunk could still squeeze in.
        with open(self.path / BALLAST, "ab", buffering=0) as f:
            for size in (4096, 512, 1):
                while True:
                    try:
                        if not f.write(b"\0" * size):
                            break
                        written += size
                    except OSError as e:
                        if e.errno != errno.ENOSPC:
                            raise ChaosError(f"filling {self.path}: {e}") from e
                        break
        return written

    def free_bytes(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def free(self) -> None:
        try:
            os.unlink(self.path / BALLAST)
        except FileNotFoundError:
            pass

    def unmount(self) -> None:
        """Lazily (a process still holding a file there does not keep the mount alive)."""
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True, timeout=30)
            self.mounted = False
