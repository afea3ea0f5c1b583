"""A project-local Redis (Debian's redis-server, our dir and port): the planners' leader lease,
the routers' shared key limits and waiting counts.

Commands need an ACL user and its password; the default user is off. The super user
``switchyard`` (``StackSettings.secret("redis")``, part of ``StackSettings.redis_url``) is the
operator's and the tests'; it is passed in a config file readable by us only, never on the
command line, where every user of the box could read it. Each component of
``common.stack_settings.REDIS_ROLES`` has a user of its own (``sy-<role>``,
``StackSettings.redis_role_url``) that may touch only its own keys (:data:`ROLE_KEYS`): a
planner's credential cannot write the routers' waiting counts (admission rule 4) or key limits,
a router's cannot take the planners' lease. :meth:`RedisService.apply_users` sets them (``ACL
SETUSER``, idempotent) at every ``stack up``, a Redis already running included.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess

from common.stack_settings import REDIS_ROLES, StackSettings
from ops.stack.process import (
    StackError,
    live_pid,
    require_free_port,
    terminate,
    wait_until,
)

#: The super user (``StackSettings.redis_url``): the operator's tools and the tests.
REDIS_USER = "switchyard"

#: The keys each component's ACL user may touch (Redis glob patterns), and nothing else: the
#: routers' key limits (``SharedKeyGate``'s ``prefix``) and waiting counts (``SharedWaiting``,
#: one hash per topic prefix), the planners' lease and its fencing counter (``LeaderLease``).
ROLE_KEYS: dict[str, tuple[str, ...]] = {
    "router": ("switchyard:router-key:*", "switchyard:*:router-waiting"),
    "planner": ("switchyard:planner:*",),
}
#: The commands of every component user: data and scripts (the Lua scripts run their commands
#: under the same user and key patterns), not the server's administration (``CONFIG``,
#: ``ACL``, ``FLUSHALL``, ``KEYS`` ...: ``@dangerous``), no pub/sub channels.
ROLE_COMMANDS = ("-@all", "+@read", "+@write", "+@scripting", "+@connection", "+time", "-@dangerous")


def role_rules(role: str, password: str) -> list[str]:
    """The ``ACL SETUSER sy-<role>`` rules of ``role`` (pure): a full reset, so applying them
    again replaces whatever the user had."""
    return ["reset", "on", f">{password}", *(f"~{k}" for k in ROLE_KEYS[role]), "resetchannels", *ROLE_COMMANDS]


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
            self.apply_users()  # a stack started before a user was added gets it now
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
        self.apply_users()
        return True

    def apply_users(self) -> None:
        """Create or reset every component's ACL user (:func:`role_rules`), as the super user."""
        import redis

        client = redis.Redis(host=self.s.host, port=self.s.redis_port, username=REDIS_USER,
                             password=self.s.secret("redis"), socket_timeout=10)
        try:
            for role in REDIS_ROLES:
                client.execute_command("ACL", "SETUSER", f"sy-{role}", *role_rules(role, self.s.secret(f"redis-{role}")))
        finally:
            client.close()

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
