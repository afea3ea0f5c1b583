"""Small helpers for running daemons from pid files. Linux only (reads /proc)."""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from common.processes import alive


class StackError(RuntimeError):
    """A service could not be installed, started or stopped. The message says what to do."""


def read_pid(pid_file: Path) -> int | None:
    try:
        text = pid_file.read_text().split()
    except (FileNotFoundError, PermissionError):
        return None
    if not text:
        return None
    try:
        return int(text[0])
    except ValueError:
        return None


def live_pid(pid_file: Path) -> int | None:
    """The pid in ``pid_file`` when that process is alive, else None."""
    pid = read_pid(pid_file)
    return pid if alive(pid) else None


def log_tail(path: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of a log, for an error message ("" when it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except (FileNotFoundError, PermissionError):
        return ""


def processes_mentioning(needle: str) -> list[int]:
    """Pids whose command line contains ``needle`` (e.g. a data directory)."""
    found = []
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (FileNotFoundError, PermissionError, ProcessLookupError):
            continue
        if needle in cmd and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def terminate(pid: int, timeout: float = 20.0, sig: int = signal.SIGTERM) -> bool:
    """Send ``sig``, wait up to ``timeout``, then SIGKILL. True if it is gone."""
    if not alive(pid):
        return True
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            _reap(pid)
            return True
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return True
    for _ in range(50):
        if not alive(pid):
            _reap(pid)
            return True
        time.sleep(0.1)
    return False


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def wait_until(predicate, timeout: float, interval: float = 0.2, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except Exception as e:  # readiness probes fail in many ways while a service starts
            last_exc = e
        time.sleep(interval)
    detail = f" (last error: {last_exc})" if last_exc else ""
    raise StackError(f"timed out after {timeout:.0f}s waiting for {what}{detail}")


def start_daemon(what: str, argv: list[str], *, log_file: Path, pid_file: Path, ready: Callable[[], bool],
                 stop: Callable[[], None], timeout: float, cwd: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
    """Run ``argv`` in a session of its own (its output appended to ``log_file``, its pid in
    ``pid_file``) and wait until ``ready()``. If it exits first or is not ready in ``timeout``,
    ``stop()`` it and raise a StackError with the tail of its log."""
    with open(log_file, "ab") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    pid_file.write_text(str(proc.pid))

    def up() -> bool:
        if proc.poll() is not None:
            raise StackError(f"{what} exited with code {proc.returncode}:\n{log_tail(log_file)}")
        return ready()

    try:
        wait_until(up, timeout, 0.2, what)
    except StackError as e:
        stop()
        raise StackError(f"{what} did not become ready: {e}\n{log_tail(log_file)}") from None


def port_in_use(host: str, port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def require_free_port(service: str, host: str, port: int, env_var: str) -> None:
    """Refuse to start on a port someone else holds: we would silently talk to a stranger."""
    if port_in_use(host, port):
        raise StackError(
            f"{service}: port {host}:{port} is already in use by a process this stack did not "
            f"start; stop it or choose another port with {env_var}"
        )


# ----------------------------------------------------------------------------------------------
# Listening sockets (the "loopback by default" check)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Listener:
    """A socket a process listens on (TCP) or receives on unconnected (UDP)."""

    pid: int
    command: str
    proto: str
    address: str
    port: int

    @property
    def loopback(self) -> bool:
        ip = ipaddress.ip_address(self.address)
        mapped = getattr(ip, "ipv4_mapped", None)  # Java binds ::ffff:127.0.0.1 for 127.0.0.1
        return (mapped or ip).is_loopback


def descendants(pids: list[int]) -> list[int]:
    """``pids`` and every live process below them (children of children too)."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                continue
    found = {p for p in pids if alive(p)}
    grew = True
    while grew:
        more = {c for c, p in parent.items() if p in found and c not in found and alive(c)}
        found |= more
        grew = bool(more)
    return sorted(found)


def _proc_net(kind: str) -> dict[int, tuple[str, int]]:
    """inode -> (address, port) of the listening (TCP) or unconnected (UDP) sockets in
    /proc/net/<kind> (tcp, tcp6, udp, udp6)."""
    want = "0A" if kind.startswith("tcp") else "07"
    out: dict[int, tuple[str, int]] = {}
    try:
        lines = Path(f"/proc/net/{kind}").read_text().splitlines()[1:]
    except FileNotFoundError:
        return out
    for line in lines:
        f = line.split()
        if len(f) < 10 or f[3] != want:
            continue
        host, port = f[1].split(":")
        raw = bytes.fromhex(host)
        # The kernel prints each 32-bit word in host (little-endian) order.
        addr = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
        out[int(f[9])] = (str(ipaddress.ip_address(addr)), int(port, 16))
    return out


def listening_sockets(pids: list[int]) -> list[Listener]:
    """Every TCP listener and unconnected UDP socket held by ``pids``."""
    socks = {kind: _proc_net(kind) for kind in ("tcp", "tcp6", "udp", "udp6")}
    found: list[Listener] = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except (FileNotFoundError, PermissionError, ProcessLookupError):
            continue
        inodes = {int(link[8:-1]) for link in links if link.startswith("socket:[")}
        for kind, table in socks.items():
            for inode in inodes & table.keys():
                addr, port = table[inode]
                found.append(Listener(pid, cmd[:200], kind, addr, port))
    return sorted(set(found), key=lambda x: (x.pid, x.proto, x.port))
