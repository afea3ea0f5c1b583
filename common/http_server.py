"""Serving an ASGI app with bounds on connections: how many at once, and how long one may take
to send its request.

uvicorn (0.54) closes a keep-alive connection that stays idle after a response, but nothing
bounds a connection that sends its request slowly: every byte resets the idle timer, and a
connection that never sends a request has no timer at all. A few hundred such connections
(slowloris) hold the process's sockets and memory. :class:`GuardedProtocol` gives each
request at most ``request_timeout_s`` (at least half of it) from the connection's start (or the
end of the previous response) until its headers are complete, then closes the connection if
they are not. Bodies have their
own bound, in the app (the router's ``RequestLimits.body_timeout_s``: a 408).

The protocol is uvicorn's httptools one (llhttp's C parser), not its pure-Python h11 one: in a
profile of the router serving 4K-token requests, h11's parsing and framing took about 8% of the
main thread, and with httptools the router's CPU per request fell from 2.6-3.0 ms to 1.8-2.2 ms
(no-broker harness, alternated).

Connections are bounded without letting idle ones crowd out served ones (:class:`Connections`):
``max_connections`` bounds the requests being *served* at once (503 past it), and idle
connections (waiting for their headers, or kept alive between requests) do not count. Open
connections, idle included, are bounded by ``max_open`` (and ``max_per_ip`` from one address):
past it, a new connection closes the oldest idle one, and only when none is idle is it refused.
So a flood of silent connections holds no slot a client's request needs, each of its sockets
lasts at most ``request_timeout_s``, and past ``max_open`` it closes its own oldest sockets.
(uvicorn's own ``limit_concurrency`` counted idle connections: 1,030 silent sockets made every
client a 503.)
"""

from __future__ import annotations

import asyncio
import random
from collections import OrderedDict
from typing import TYPE_CHECKING

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from common.connection_limits import ConnectionLimits

if TYPE_CHECKING:
    import uvicorn


class Connections:
    """The open connections of one server: how many serve a request, and which are idle, oldest
    first (what :meth:`add` closes to make room for a new one). Idle means no request is being
    served on it (its headers are not complete yet, or its last response is sent), so closing
    it costs a client at most a reconnect, never an answer."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.open: dict[str, int] = {}  # client address -> open connections
        self.total = 0
        self.busy = 0
        self.idle: OrderedDict[GuardedProtocol, str] = OrderedDict()
        self.idle_by_ip: dict[str, OrderedDict[GuardedProtocol, None]] = {}
        self.evicted = 0
        self.refused = 0

    def add(self, conn: GuardedProtocol, ip: str) -> bool:
        """Count ``conn`` (idle), closing the oldest idle connection of its address, then of the
        server, while either is over its cap. False: nothing idle was left to close (every
        connection serves a request): ``conn`` must be refused."""
        self.total += 1
        self.open[ip] = self.open.get(ip, 0) + 1
        self.idle[conn] = ip
        self.idle_by_ip.setdefault(ip, OrderedDict())[conn] = None
        ok = True
        while ok and self.open.get(ip, 0) > self.limits.max_per_ip:
            ok = self._evict(self.idle_by_ip.get(ip), conn)
        while ok and self.total > self.limits.max_open:
            ok = self._evict(self.idle, conn)
        if not ok:
            self.refused += 1
        return ok

    def _evict(self, idle, new: GuardedProtocol) -> bool:
        victim = next((c for c in (idle or ()) if c is not new), None)
        if victim is None:
            return False
        self.evicted += 1
        victim.evict()
        return True

    def start_request(self, conn: GuardedProtocol) -> bool:
        """``conn`` serves a request now; False when ``max_connections`` already do (refuse it)."""
        self._not_idle(conn)
        self.busy += 1
        if self.busy > self.limits.max_connections:
            self.refused += 1
            return False
        return True

    def end_request(self, conn: GuardedProtocol, ip: str) -> None:
        """Its response is sent and the connection kept alive: idle again, the newest."""
        self.busy -= 1
        self.idle[conn] = ip
        self.idle_by_ip.setdefault(ip, OrderedDict())[conn] = None

    def _not_idle(self, conn: GuardedProtocol) -> bool:
        ip = self.idle.pop(conn, None)
        if ip is None:
            return False
        mine = self.idle_by_ip[ip]
        del mine[conn]
        if not mine:
            del self.idle_by_ip[ip]
        return True

    def remove(self, conn: GuardedProtocol, ip: str) -> None:
        if not self._not_idle(conn):
            self.busy -= 1  # it was serving a request
        self.total -= 1
        left = self.open[ip] - 1
        if left:
            self.open[ip] = left
        else:
            del self.open[ip]


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline for each request's headers and connection
    limits that idle connections cannot fill (module docstring)."""

    request_timeout_s = ConnectionLimits.request_timeout_s
    #: The server's connections (one instance per server: :func:`guarded_protocol`).
    connections_of: Connections | None = None
    closed_stalled = 0  # class-wide count, for the process's metrics and tests
    _header_deadline: asyncio.TimerHandle | None = None
    _ip: str | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()
        if self.connections_of is not None:
            self._ip = self.client[0] if self.client else "-"
            if not self.connections_of.add(self, self._ip):
                # Every connection is serving a request: this one's request is answered 503
                # (uvicorn's own answer past its concurrency limit) and the connection closed.
                self.limit_concurrency = 0

    def evict(self) -> None:
        """Closed to make room for a new connection (it was idle: no request is lost)."""
        self._forget()
        self.transport.close()

    def _forget(self) -> None:
        if self._ip is not None and self.connections_of is not None:
            self.connections_of.remove(self, self._ip)
            self._ip = None
        self._disarm()

    def _arm(self) -> None:
        self._disarm()
        # Drawn in [1/2, 1] x request_timeout_s: connections opened together (a flood) are not
        # all closed together, and do not all come back in one burst of accepts.
        self._header_deadline = self.loop.call_later(self.request_timeout_s * (0.5 + random.random() / 2),
                                                     self._stalled)

    def _disarm(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def on_headers_complete(self) -> None:
        if self._ip is not None and not self.connections_of.start_request(self):  # type: ignore[union-attr]
            self.limit_concurrency = 0  # uvicorn answers 503; the connection is closed after it
        super().on_headers_complete()
        self._disarm()  # a request is being served: its headers came in time

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.limit_concurrency == 0:  # refused (every slot was serving a request)
            self._forget()
            self.transport.close()
        elif not self.transport.is_closing():
            if self._ip is not None:
                self.connections_of.end_request(self, self._ip)  # type: ignore[union-attr]
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._forget()
        super().connection_lost(exc)

    def _stalled(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return
        type(self).closed_stalled += 1
        self._forget()
        self.transport.close()


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedProtocol]:
    """A protocol class for one server, with these limits (uvicorn takes a class)."""
    return type("GuardedProtocol", (GuardedProtocol,), {
        "request_timeout_s": limits.request_timeout_s,
        "connections_of": Connections(limits)})


def server_config(app, host: str, port: int, limits: ConnectionLimits = ConnectionLimits(),
                  **uvicorn_options) -> uvicorn.Config:
    """uvicorn's config with the limits (httptools, asyncio loop, no access log unless asked).
    ``X-Forwarded-For`` is not trusted (uvicorn trusts it from 127.0.0.1 by default, which on one
    box is every client): an app that sits behind a proxy reads it itself, from the proxies it
    was configured with (the admin API: ``trusted_proxies``)."""
    import uvicorn

    options = {"loop": "asyncio", "log_level": "warning", "access_log": False, "proxy_headers": False,
               **uvicorn_options}
    return uvicorn.Config(app, host=host, port=port, http=guarded_protocol(limits),
                          timeout_keep_alive=limits.keep_alive_s, **options)


def serve(app, host: str, port: int, limits: ConnectionLimits = ConnectionLimits(), **uvicorn_options) -> None:
    """Serve ``app`` with the limits until the process is told to stop."""
    import uvicorn

    uvicorn.Server(server_config(app, host, port, limits, **uvicorn_options)).run()
