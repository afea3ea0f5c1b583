"""Serving an ASGI app with bounds on connections: how many at once, and how long one may take
to send its request.

uvicorn (0.54) closes a keep-alive connection that stays idle after a response, but nothing
bounds a connection that sends its request slowly: every byte resets the idle timer, and a
connection that never sends a request has no timer at all. A few hundred such connections
(slowloris) hold the process's sockets and memory. :class:`GuardedProtocol` gives each
request ``request_timeout_s`` from the connection's start (or the end of the previous response)
until its headers are complete, then closes the connection if they are not. Bodies have their
own bound, in the app (the router's ``RequestLimits.body_timeout_s``: a 408).

The protocol is uvicorn's httptools one (llhttp's C parser), not its pure-Python h11 one: in a
profile of the router serving 4K-token requests, h11's parsing and framing took about 8% of the
main thread, and with httptools the router's CPU per request fell from 2.6-3.0 ms to 1.8-2.2 ms
(no-broker harness, alternated).

``max_connections`` is uvicorn's ``limit_concurrency``: past it, a request is answered 503 and
the connection closed, so the process keeps its sockets for the clients it serves.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

if TYPE_CHECKING:
    import uvicorn


@dataclass(frozen=True)
class ConnectionLimits:
    #: Connections (and requests in flight) served at once; beyond: 503, connection closed.
    max_connections: int = 1024
    #: Seconds a connection has to send a request's headers, from its start or the end of the
    #: previous response on it; beyond: closed.
    request_timeout_s: float = 10.0
    #: Seconds an idle keep-alive connection stays open after a response.
    keep_alive_s: float = 5.0

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"max_connections={self.max_connections}: at least 1")
        for name in ("request_timeout_s", "keep_alive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0")


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline for each request's headers (module
    docstring)."""

    request_timeout_s = ConnectionLimits.request_timeout_s
    closed_stalled = 0  # class-wide count, for the process's metrics and tests
    _header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._header_deadline = self.loop.call_later(self.request_timeout_s, self._stalled)

    def _disarm(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._disarm()  # a request is being served: its headers came in time

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _stalled(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return
        type(self).closed_stalled += 1
        self.transport.close()


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedProtocol]:
    """A protocol class with these limits' header deadline (uvicorn takes a class)."""
    return type("GuardedProtocol", (GuardedProtocol,), {"request_timeout_s": limits.request_timeout_s})


def server_config(app, host: str, port: int, limits: ConnectionLimits = ConnectionLimits(),
                  **uvicorn_options) -> uvicorn.Config:
    """uvicorn's config with the limits (httptools, asyncio loop, no access log unless asked)."""
    import uvicorn

    options = {"loop": "asyncio", "log_level": "warning", "access_log": False, **uvicorn_options}
    return uvicorn.Config(app, host=host, port=port, http=guarded_protocol(limits),
                          limit_concurrency=limits.max_connections, timeout_keep_alive=limits.keep_alive_s, **options)


def serve(app, host: str, port: int, limits: ConnectionLimits = ConnectionLimits(), **uvicorn_options) -> None:
    """Serve ``app`` with the limits until the process is told to stop."""
    import uvicorn

    uvicorn.Server(server_config(app, host, port, limits, **uvicorn_options)).run()
