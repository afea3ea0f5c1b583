"""A project-local Redis (Debian's redis-server, our dir and port). Used for the planner lease.

Commands need the ACL user ``switchyard`` and its password (``StackSettings.secret("redis")``,
part of ``StackSettings.redis_url``); the default user is off. It is passed in a config file readable by us only, never on the
command line, where every user of the box could read it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess

from common.stack_settings import StackSettings
from ops.stack.process import (
    StackError,
    live_pid,
    require_free_port,
    terminate,
    wait_until,
)

#: The ACL user of the stack's clients (``StackSettings.redis_url``).
REDIS_USER = "switchyard"


class RedisService:
    name = "redis"

    def __init__(self, settings: StackSettings) -> None:
        self.s = settings
        self.dir = settings.state_dir / "redis"
        self.pid_file = self.dir / "redis.pid"

    def ensure_installed(self) -> None:
        if not shutil.which("redis-server"):
            raise StackError("redis-server not found: apt-get install -y redis-server")

    def pid(self) -> int | None:
        return live_pid(self.pid_file)

    def start(self, timeout: float = 20.0) -> bool:
        if self.pid():
            return False
        require_free_port(self.name, self.s.host, self.s.redis_port, "SWITCHYARD_REDIS_PORT")
        self.ensure_installed()
        self.dir.mkdir(parents=True, exist_ok=True)
        conf = self.dir / "redis.conf"
        conf.unlink(missing_ok=True)
        with os.fdopen(os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            # The default (unauthenticated) user is off; the stack's ACL user may do everything
            # on every key and channel (the planner's lease is the one client).
            f.write(f"user default off\nuser {REDIS_USER} on >{self.s.secret('redis')} ~* &* +@all\n")
        r = subprocess.run(
            ["redis-server", str(conf), "--port", str(self.s.redis_port), "--bind", self.s.host,
             "--dir", str(self.dir), "--daemonize", "yes", "--pidfile", str(self.pid_file),
             "--logfile", str(self.dir / "redis.log"), "--save", "", "--appendonly", "no",
             "--protected-mode", "yes"],
            capture_output=True, text=True, stdin=subprocess.DEVNULL,
        )
        if r.returncode != 0:
            raise StackError(f"redis-server failed: {r.stderr or r.stdout}")
        wait_until(self.ready, timeout, 0.1, "Redis PING")
        return True

    def ready(self) -> bool:
        with socket.create_connection((self.s.host, self.s.redis_port), timeout=1) as s:
            s.sendall(f"AUTH {REDIS_USER} {self.s.secret('redis')}\r\nPING\r\n".encode())
            got = b""
            while got.count(b"\r\n") < 2:
                chunk = s.recv(64)
                if not chunk:
                    break
                got += chunk
            return got.startswith(b"+OK\r\n+PONG")

    def stop(self, timeout: float = 10.0) -> None:
        pid = self.pid()
        if pid:
            terminate(pid, timeout)
        self.pid_file.unlink(missing_ok=True)

    def status(self) -> dict:
        pid = self.pid()
        return {"service": self.name, "running": bool(pid), "pid": pid, "address": self.s.redis_address,
                "data": str(self.dir)}
