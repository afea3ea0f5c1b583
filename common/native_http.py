"""Serving an ASGI app from the native HTTP/1.1 server (``native/src/front.rs``): the router's
server.

The crate's server (hyper on tokio threads of its own, never holding the GIL) accepts, parses
and bounds the connections with :class:`ConnectionLimits`' values and rules (the header deadline,
the idle keep-alive, ``max_connections`` served at once answered 503, idle connections evicted
oldest first past ``max_open`` and ``max_per_ip``, TCP_NODELAY): the same as
:mod:`common.http_server`'s guarded uvicorn protocol, which the other processes keep. It hands
complete requests (head and body; a slow body follows as it arrives) to this event loop in
batches: one byte on a socket pair wakes the loop, which takes every request that is ready and
runs the app on each, as its own task. The app's answer goes back through the request's handle
(no thread hop): the head with the first body piece, and the pieces sent in one turn of the loop
together, one call into the crate each; past the crate's buffer the app waits for the client.

The ASGI adapter is uvicorn's contract, message for message (spec 2.3): ``receive`` gives the
body, then waits until the answer is over or the client gone and says ``http.disconnect``;
``send`` after the client is gone is ignored; an app that fails before its answer's head is a
500, after it the connection is cut. Lifespan events run as uvicorn's "auto" mode does.

**Direct routes.** An app may name routes this server runs without the ASGI machinery
(``app.state.direct_routes``: path -> ``async handler(request: Direct)``, for POST): the handler
reads the headers and body from the crate's request and writes its answer to it itself, with
the same flow control and the same watch on the client as above (a stream whose client goes
away is cancelled where it waits, as Starlette's ``StreamingResponse`` is). The router's
generation routes are served so (``control_plane/router/server.py``): no scope, no middleware,
no routing, no Starlette request or response per request. Another method on those paths still
goes to the app (its 405).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import unquote

import switchyard_native

from common.connection_limits import ConnectionLimits
from common.native_wake import Waiters

log = logging.getLogger(__name__)

_ASGI = {"version": "3.0", "spec_version": "2.3"}
_ERROR_HEADERS = [(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close")]
#: Seconds the in-flight requests have to end once the server is told to stop.
GRACE_S = 10.0


class Server:
    """``app`` served on ``host:port`` with ``limits`` (uvicorn.Server's shape: :meth:`run`,
    ``started``, ``should_exit``)."""

    def __init__(self, app: Any, host: str, port: int, limits: ConnectionLimits = ConnectionLimits(),
                 threads: int = 1) -> None:
        self.app = app
        self.host, self.port = host, port
        self.limits = limits
        self.threads = threads
        self.started = False
        self.should_exit = False
        self._native: switchyard_native.FrontServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Request id -> what its waiters await (done when the crate says it changed).
        self._waiters: Waiters | None = None
        self._tasks: set[asyncio.Task] = set()
        self._state: dict = {}
        #: Path -> handler of the app's direct routes (POST).
        self._direct: dict = dict(getattr(getattr(app, "state", None), "direct_routes", None) or {})

    def run(self) -> None:
        asyncio.run(self.serve())

    def stats(self) -> dict:
        return self._native.stats() if self._native is not None else {}

    async def serve(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self._waiters = Waiters(loop)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self._exit)
        lifespan = _Lifespan(self.app, self._state)
        if not await lifespan.startup():
            return
        lim = self.limits
        self._native = switchyard_native.FrontServer(self.host, self.port, lim.max_connections, lim.max_open,
                                                     lim.max_per_ip, lim.request_timeout_s, lim.keep_alive_s,
                                                     self.threads)
        self.port = self._native.port
        loop.add_reader(self._native.fileno(), self._ready)
        self.started = True
        try:
            # uvicorn's main loop: ``should_exit`` may be set from another thread (tests).
            while not self.should_exit:
                await asyncio.sleep(0.1)
            if self._tasks:
                await asyncio.wait(list(self._tasks), timeout=GRACE_S)
        finally:
            loop.remove_reader(self._native.fileno())
            for task in list(self._tasks):
                task.cancel()
            if self._tasks:
                await asyncio.wait(list(self._tasks))
            self._native.close()
            await lifespan.shutdown()

    def _exit(self) -> None:
        self.should_exit = True

    # -- the crate's wake-up -------------------------------------------------------------------

    def _ready(self) -> None:
        """New requests, each run as a task, and the requests that changed: their waiters go on."""
        new, changed = self._native.take_ready()  # type: ignore[union-attr]
        self._waiters.wake(changed)  # type: ignore[union-attr]
        loop = self._loop
        for req in new:
            task = loop.create_task(self._handle(req))  # type: ignore[union-attr]
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _changed(self, rid: int) -> asyncio.Future:
        """Done when request ``rid`` changes (every waiter on it shares one future)."""
        return self._waiters.changed(rid)  # type: ignore[union-attr]

    async def _handle(self, req: switchyard_native.FrontRequest) -> None:
        direct = self._direct.get(req.path) if self._direct and req.method == "POST" else None
        if direct is not None and not self.should_exit:
            await self._handle_direct(req, direct)
            return
        exchange = _Exchange(self, req)
        if self.should_exit:
            await exchange.send({"type": "http.response.start", "status": 503, "headers": _ERROR_HEADERS})
            await exchange.send({"type": "http.response.body", "body": b"Service Unavailable"})
            return
        try:
            await self.app(exchange.scope(self._state), exchange.receive, exchange.send)
        except BaseException as e:
            if not isinstance(e, asyncio.CancelledError):
                log.exception("the app failed on %s %s", exchange.method, exchange.path)
            if not exchange.started or exchange.head is not None:
                await exchange.error()
            elif not exchange.complete:
                req.abort()
            if isinstance(e, (asyncio.CancelledError, KeyboardInterrupt, SystemExit)):
                raise
        else:
            if not exchange.started or exchange.head is not None:
                log.error("the app answered nothing to %s %s", exchange.method, exchange.path)
                await exchange.error()
            elif not exchange.complete:
                log.error("the app did not end its answer to %s %s", exchange.method, exchange.path)
                req.abort()
        finally:
            self._waiters.forget(req.id)  # type: ignore[union-attr]


    async def _handle_direct(self, req: switchyard_native.FrontRequest, handler) -> None:
        d = Direct(self, req)
        try:
            await handler(d)
        except ClientGone:
            pass
        except BaseException as e:
            if not isinstance(e, asyncio.CancelledError):
                log.exception("the app failed on %s %s", req.method, req.path)
            if not d.started:
                req.start(500, _ERROR_HEADERS, b"Internal Server Error", True)
            elif not d.complete:
                req.abort()
            if isinstance(e, (asyncio.CancelledError, KeyboardInterrupt, SystemExit)):
                raise
        else:
            if not d.complete:
                log.error("the app did not end its answer to %s %s", req.method, req.path)
                if d.started:
                    req.abort()
                else:
                    req.start(500, _ERROR_HEADERS, b"Internal Server Error", True)
        finally:
            self._waiters.forget(req.id)  # type: ignore[union-attr]


class ClientGone(Exception):
    """The client went away before its request's body ended."""


class Direct:
    """One request of a direct route: its headers and body, and its answer, written to the crate
    (a stream through :class:`_Exchange`'s ``send``: the same coalescing and flow control)."""

    __slots__ = ("server", "req", "arrived_at", "_ex", "_task", "_cancelled", "_done")

    def __init__(self, server: Server, req: switchyard_native.FrontRequest) -> None:
        self.server = server
        self.req = req
        #: When the server handed the request over (monotonic).
        self.arrived_at = time.monotonic()
        self._ex: _Exchange | None = None
        self._task: asyncio.Task | None = None
        self._cancelled = self._done = False

    @property
    def started(self) -> bool:
        return self._done or (self._ex is not None and self._ex.started)

    @property
    def complete(self) -> bool:
        return self._done or (self._ex is not None and self._ex.complete)

    def header(self, name: str) -> str | None:
        """Header ``name`` (lowercase; latin-1, as Starlette's ``Headers``), or None."""
        return self.req.header(name)

    async def body(self) -> AsyncIterator[bytes]:
        """The body's pieces as they arrive (:class:`ClientGone` if the client leaves first)."""
        req = self.req
        while True:
            got = req.take_body()
            if got is None:
                await self.server._changed(req.id)
            elif got is False:
                raise ClientGone()
            else:
                data, end = got
                if data:
                    yield data
                if end:
                    return

    def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """The whole answer at once."""
        self._done = True
        self.req.start(status, headers, body, True)

    async def stream(self, status: int, headers: list[tuple[bytes, bytes]], pieces: AsyncIterator[bytes]) -> None:
        """The answer's head, then ``pieces`` as they come. If the client goes away meanwhile,
        ``pieces`` is cancelled where it waits, and closed."""
        ex = self._ex = _Exchange(self.server, self.req)
        ex.body_done = True
        self._task = asyncio.current_task()
        await ex.send({"type": "http.response.start", "status": status, "headers": headers})
        self._watch()
        try:
            async for piece in pieces:
                if ex.gone:
                    break
                await ex.send({"type": "http.response.body", "body": piece, "more_body": True})
            await ex.send({"type": "http.response.body", "body": b""})
        except asyncio.CancelledError:
            if not self._cancelled:
                raise
            self._task.uncancel()  # type: ignore[union-attr]
        finally:
            self._done = True
            await pieces.aclose()  # type: ignore[attr-defined]

    def _watch(self, _: object = None) -> None:
        """Cancels the stream once the client is gone (a callback on the request's changes: no task)."""
        if self._done or self._cancelled:
            return
        if self.req.over():
            if not self._ex.complete:  # type: ignore[union-attr]
                self._cancelled = True
                self._task.cancel()  # type: ignore[union-attr]
            return
        self.server._changed(self.req.id).add_done_callback(self._watch)


class _Exchange:
    """One request: its scope, ``receive`` and ``send``."""

    __slots__ = ("server", "req", "method", "path", "head", "pending", "flush_soon", "full", "body_done", "started",
                 "complete", "gone")

    def __init__(self, server: Server, req: switchyard_native.FrontRequest) -> None:
        self.server = server
        self.req = req
        self.method = self.path = ""
        self.head: tuple | None = None
        self.pending: list[bytes] = []
        self.flush_soon = self.full = False
        self.body_done = self.started = self.complete = self.gone = False

    def scope(self, state: dict) -> dict:
        method, raw_path, query, version, headers, client, server = self.req.head()
        self.method, self.path = method, unquote(raw_path)
        return {"type": "http", "asgi": _ASGI, "http_version": version, "server": server, "client": client,
                "scheme": "http", "method": method, "root_path": "", "path": self.path,
                "raw_path": raw_path.encode("ascii", "replace"), "query_string": query, "headers": headers,
                "state": state.copy()}

    async def receive(self) -> dict:
        req = self.req
        while not self.body_done and not self.gone:
            got = req.take_body()
            if got is None:
                await self.server._changed(req.id)
            elif got is False:
                self.gone = True
            else:
                data, end = got
                self.body_done = end
                return {"type": "http.request", "body": data, "more_body": not end}
        # The body is read: what comes next is the answer's end (``send`` wakes this waiter) or
        # the client's going away (the crate does).
        while not self.complete and not req.over():
            await self.server._changed(req.id)
        self.gone = True
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        kind = message["type"]
        req = self.req
        if kind == "http.response.start":
            if self.started:
                raise RuntimeError("http.response.start sent twice")
            self.started = True
            # Held until the first body piece: both go in one call, and a whole body its length.
            self.head = (message["status"], message.get("headers") or ())
        elif kind == "http.response.body":
            if not self.started:
                raise RuntimeError("http.response.body before http.response.start")
            if self.complete:
                raise RuntimeError("http.response.body after the answer's end")
            more = message.get("more_body", False)
            if not more:
                self.complete = True
                self.server._waiters.wake((req.id,))  # type: ignore[union-attr]  # a receive waiting for the answer's end
            if self.gone:
                return  # uvicorn ignores what is sent to a client that went away
            if self.full:  # the crate's buffer was full at the last flush: room first
                while not req.has_room():
                    await self.server._changed(req.id)
                self.full = False
            self.pending.append(message.get("body", b""))
            if not more:
                self._flush(True)
            elif not self.flush_soon:
                # The pieces sent in this turn of the loop go to the crate together: one
                # wake-up of its thread, one write.
                self.flush_soon = True
                self.server._loop.call_soon(self._flush)  # type: ignore[union-attr]
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r}")

    def _flush(self, end: bool = False) -> None:
        self.flush_soon = False
        pending, self.pending = self.pending, []
        if self.gone or not (pending or end):
            return
        data = pending[0] if len(pending) == 1 else b"".join(pending)
        if self.head is not None:
            status, headers = self.head
            self.head = None
            if not self.req.start(status, headers, data, end):
                self.gone = True
            return
        sent = self.req.send(data, end)
        if sent < 0:
            self.gone = True
        elif sent == 1:
            self.full = True

    async def error(self) -> None:
        """uvicorn's answer to an app that failed before its answer: 500, the connection closed."""
        self.req.start(500, _ERROR_HEADERS, b"Internal Server Error", True)
        self.started = self.complete = True


class _Lifespan:
    """The app's lifespan events (uvicorn's "auto": an app that does not take them is served anyway)."""

    def __init__(self, app: Any, state: dict) -> None:
        self.app = app
        self.state = state
        self._events: asyncio.Queue = asyncio.Queue()
        self._answers: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._supported = True

    async def _run(self) -> None:
        try:
            await self.app({"type": "lifespan", "asgi": _ASGI, "state": self.state}, self._events.get,
                           self._answers.put)
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError):
                raise
            log.info("the app takes no lifespan events (%s)", e)
            self._supported = False
        finally:
            await self._answers.put({"type": "_ended"})

    async def startup(self) -> bool:
        self._task = asyncio.get_running_loop().create_task(self._run())
        await self._events.put({"type": "lifespan.startup"})
        answer = await self._answers.get()
        if answer["type"] == "lifespan.startup.failed":
            log.error("the app's start-up failed: %s", answer.get("message", ""))
            return False
        return True

    async def shutdown(self) -> None:
        if not self._supported or self._task is None or self._task.done():
            return
        await self._events.put({"type": "lifespan.shutdown"})
        answer = await self._answers.get()
        if answer["type"] == "lifespan.shutdown.failed":
            log.error("the app's shutdown failed: %s", answer.get("message", ""))
        await asyncio.wait([self._task], timeout=GRACE_S)


def serve(app: Any, host: str, port: int, limits: ConnectionLimits = ConnectionLimits()) -> None:
    """Serve ``app`` with the limits until the process is told to stop (SIGINT, SIGTERM)."""
    Server(app, host, port, limits).run()
