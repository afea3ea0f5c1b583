"""The bounds on a server's connections: how many at once, and how long one may take to send
its request (why each exists: :mod:`common.http_server`). The router's native server
(:mod:`common.native_http`, ``native/src/front.rs``) and the other processes' guarded uvicorn
(:mod:`common.http_server`) take the same values."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConnectionLimits:
    #: Requests served at once (one per connection: HTTP/1.1). A request past it is answered
    #: 503 and its connection closed. Idle connections do not count.
    max_connections: int = 1024
    #: Connections open at once, idle ones included (sockets, memory). A new one past it closes
    #: the oldest idle connection; only when none is idle is the new one refused (503).
    max_open: int = 8192
    #: Connections open at once from one client address, enforced the same way (that address's
    #: own oldest idle connection goes first). On one box every client is 127.0.0.1, so this is a
    #: second total cap there; it separates clients only where they reach the server from their
    #: own addresses (docs/security.md).
    max_per_ip: int = 4096
    #: Seconds a connection has at most to send a request's headers, from its start or the end
    #: of the previous response on it; beyond: closed. Each deadline is drawn between half of it
    #: and all of it, so that connections opened together do not all close together.
    request_timeout_s: float = 10.0
    #: Seconds an idle keep-alive connection stays open after a response.
    keep_alive_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_open", "max_per_ip"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: at least 1")
        if self.max_connections > self.max_open or self.max_per_ip > self.max_open:
            raise ValueError(f"max_connections={self.max_connections} and max_per_ip={self.max_per_ip} must not "
                             f"exceed max_open={self.max_open}: connections serving requests are open connections")
        for name in ("request_timeout_s", "keep_alive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0")
