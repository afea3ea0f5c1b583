"""The router's HTTP calls to workers: one port, its real adapter and an in-memory one.

:class:`WorkerCalls` is what :class:`control_plane.router.proxy.Router` needs from the network:
POST a JSON body to a worker and read the answer's status and body bytes, whole or as they
arrive. Every way a call can fail at the transport is a :class:`CallFailed` whose ``code`` is
the router's failure code (``connect_timeout``, ``worker_unreachable``, ``timeout``,
``worker_lost``); a request that cannot be put on the wire at all (an illegal header or URL) is
:class:`Unsendable`, the request's fault and not the worker's. Each adapter translates its
driver's errors into these, so the router classifies failures once, whatever the transport.

:class:`HttpWorkerCalls` is the real adapter: the native client (``native/src/calls.rs``: hyper
on a tokio thread of its own, keep-alive pool, TCP_NODELAY), each worker's own bearer on every
call (:func:`common.settings.worker_token`: derived from the cluster's worker secret, which never
leaves the router). It replaced aiohttp, which had replaced httpx (about 5x less time per call,
docs/benchmarks.md "Measurements behind defaults"); what the native hop cost and saved is in
docs/benchmarks-native.md ("The worker hop in the crate").
A connection returns to the pool only once its answer was read to the end, so an answer the
router is done with before its end (the SSE stream after ``[DONE]``) is drained in the
background, for at most :data:`DRAIN_S`, instead of being closed (a new connection per request
costs a TCP handshake and a socket each way). An answer the router gives up on (a failure, a
client gone) closes its connection: the worker sees it and stops generating.
A non-streamed request's answer is relayed (``post(relay=True)``, :meth:`Reply.relay`): the
crate reads it to its end and folds it (``native/src/sse.rs`` ``Relay``), waking the event loop
at its first token and at its end only.

:class:`MemoryWorkerCalls` answers from a function, in process (unit tests of the request path:
no sockets), with the same contract.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import urlsplit

import switchyard_native

from common.native_wake import Waiters
from common.settings import worker_token

#: Seconds a worker has to end an answer the router stopped reading (after ``[DONE]``) before
#: its connection is closed instead of reused.
DRAIN_S = 5.0
#: Seconds an idle pooled connection is kept: less than the workers' own keep-alive (uvicorn's
#: and vLLM's 5 s), so the router seldom picks a connection the worker is closing.
KEEP_ALIVE_S = 4.0
#: What may not be in a header value (CR, LF, NUL: header injection).
_ILLEGAL_HEADER = re.compile(r"[\r\n\x00]")


class CallFailed(Exception):
    """A call to a worker failed at the transport; ``code`` says how: ``connect_timeout`` or
    ``worker_unreachable`` (the request never reached the worker), ``timeout`` (the worker
    stopped answering for longer than the read timeout), ``worker_lost`` (the connection broke,
    or the answer was not HTTP the client could read)."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code


class Unsendable(Exception):
    """The request itself cannot be put on the wire (an illegal header value or URL)."""


class Reply(Protocol):
    """A worker's answer: its status at once, its body read whole or piece by piece, or (a call
    posted with ``relay``, a 2xx answer) relayed: read to its end by the crate (one of the
    three, once). Reading raises :class:`CallFailed`."""

    status: int

    async def read(self) -> bytes: ...

    def chunks(self) -> AsyncIterator[bytes]: ...

    def relay(self) -> "Relay": ...


class Relay(Protocol):
    """A worker's SSE answer read to its end and folded by the crate (``native/src/sse.rs``
    ``Relay``), as it arrives: the router is woken at its first token and at its end, never per
    token. A transport failure is part of the answer (its ``end``), not raised."""

    async def first_token(self) -> float | None:
        """When the first token came (``time.monotonic()``'s clock), once it did; None: the answer
        ended without one."""
        ...

    async def end(self) -> switchyard_native.RelayedAnswer:
        """The whole answer (``switchyard_native.RelayedAnswer``: text, token counts and times,
        finish reason, usage JSON, how it ended)."""
        ...


@dataclass(frozen=True, slots=True)
class CallLoad:
    """The worker calls' own queue at one instant (the router's saturation, issue 38 item 4)."""

    #: Calls begun and not over: waiting for a connection or an answer, being read or drained.
    in_flight: int = 0
    #: Calls with news (a head, body bytes, an end) the router's event loop has not taken yet:
    #: above 0 for long, the loop is what is slow, not the workers.
    ready: int = 0
    #: Connections carrying a call, and kept open idle for the next one.
    busy_connections: int = 0
    idle_connections: int = 0


class WorkerCalls(Protocol):
    def load(self) -> CallLoad:
        """The calls' queue now (:class:`CallLoad`)."""
        ...

    def post(self, url: str, body: bytes, request_id: str, worker_id: str,
             relay: bool = False) -> AbstractAsyncContextManager[Reply]:
        """POST ``body`` (JSON) to worker ``worker_id`` at ``url`` with ``X-Request-Id`` (and the
        worker's bearer, :func:`common.settings.worker_token`); the answer, until the block
        ends; ``relay``: a 2xx answer is to be relayed (:meth:`Reply.relay`). Raises
        :class:`CallFailed` or :class:`Unsendable`."""
        ...

    async def close(self) -> None: ...


def _check_sendable(url: str, request_id: str) -> None:
    if _ILLEGAL_HEADER.search(request_id):
        raise Unsendable(f"illegal header value X-Request-Id={request_id!r}")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise Unsendable(f"not an http(s) URL: {url!r}")


# -- the real adapter -------------------------------------------------------------------------


class HttpWorkerCalls:
    """Calls over HTTP/1.1 with the native client (module docstring): hyper on a tokio thread of
    its own (``native/src/calls.rs``). It never holds the GIL and Python never blocks on it: a
    call that is not ready marks itself waited on, and the client wakes this event loop through
    a descriptor (``loop.add_reader``) once per batch of calls that changed, whose waiters then
    take what arrived, all of it at once. Made on first use, on the event loop that serves the
    router."""

    def __init__(self, *, connect_timeout_s: float, read_timeout_s: float, credential: str | None = None,
                 max_connections: int = 2048) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_connections = max_connections
        #: The cluster's worker secret; each call carries the bearer of the worker it calls.
        self._secret = credential
        self._tokens: dict[str, str] = {}
        self._native: switchyard_native.WorkerClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Call id -> what its waiter awaits (done when the client says it changed).
        self._waiters: Waiters | None = None
        #: Call id -> the call being drained (finished before its end); the wake-up sees each end.
        self._draining: dict[int, switchyard_native.WorkerCall] = {}
        #: Set while nothing is being drained (made on first use, on the loop).
        self._none_draining: asyncio.Event | None = None

    def _client(self) -> switchyard_native.WorkerClient:
        if self._native is None:
            self._loop = asyncio.get_running_loop()
            self._waiters = Waiters(self._loop)
            self._native = switchyard_native.WorkerClient(self.connect_timeout_s, self.read_timeout_s, KEEP_ALIVE_S,
                                                          DRAIN_S, self.max_connections)
            self._loop.add_reader(self._native.fileno(), self._ready)
        return self._native

    def load(self) -> CallLoad:
        if self._native is None:
            return CallLoad()
        return CallLoad(*self._native.load())

    def _ready(self) -> None:
        """The client's wake-up: every call that changed since its waiter found it pending, and
        the drains that ended (no task per drain: they are looked at only when woken)."""
        ids = self._native.take_ready()  # type: ignore[union-attr]
        draining = self._draining
        if draining:
            for i in ids:
                call = draining.get(i)
                # Nothing but its end (or failure) comes out of a draining call; None: not yet.
                if call is not None and call.take() is not None:
                    del draining[i]
            if not draining and self._none_draining is not None:
                self._none_draining.set()
        self._waiters.wake(ids)  # type: ignore[union-attr]

    async def _changed(self, call: switchyard_native.WorkerCall) -> None:
        try:
            await self._waiters.changed(call.id)  # type: ignore[union-attr]
        finally:
            self._waiters.forget(call.id)  # type: ignore[union-attr]

    @asynccontextmanager
    async def post(self, url: str, body: bytes, request_id: str, worker_id: str,
                   relay: bool = False) -> AsyncIterator[Reply]:
        _check_sendable(url, request_id)
        headers = [("X-Request-Id", request_id)]
        if self._secret:
            headers.append(("Authorization", f"Bearer {self._token(worker_id)}"))
        try:
            # Never follows a redirect: it would carry the body and the worker credential
            # elsewhere (a 3xx is answered as it is, an answer without [DONE]).
            call = self._client().post(url, body, headers, relay)
        except ValueError as e:
            raise Unsendable(str(e)) from None
        try:
            while (head := call.head()) is None:
                await self._changed(call)
        except BaseException:
            call.abort()
            raise
        if isinstance(head, tuple):
            raise CallFailed(*head)
        try:
            yield _NativeReply(self, call, head)
        except BaseException:
            # The router gave up on this answer (a failure, a client gone): closing the
            # connection tells the worker, which stops generating for it.
            call.abort()
            raise
        if call.finish():  # not read to its end: drained by the crate, then pooled; woken at its end
            self._draining[call.id] = call
            if self._none_draining is not None:
                self._none_draining.clear()

    def _token(self, worker_id: str) -> str:
        token = self._tokens.get(worker_id)
        if token is None:
            if len(self._tokens) > 4096:  # workers come and go: keep the memo bounded
                self._tokens.clear()
            token = self._tokens[worker_id] = worker_token(self._secret, worker_id)  # type: ignore[arg-type]
        return token

    async def drained(self) -> None:
        """Once every answer being drained has ended and its connection is back in the pool (or
        closed)."""
        while self._draining:
            if self._none_draining is None:
                self._none_draining = asyncio.Event()
            self._none_draining.clear()
            await self._none_draining.wait()

    async def close(self) -> None:
        for call in self._draining.values():
            call.abort()
        self._draining.clear()
        if self._none_draining is not None:
            self._none_draining.set()
        if self._native is not None:
            self._loop.remove_reader(self._native.fileno())  # type: ignore[union-attr]
            self._native.close()
            self._native = None
        if self._waiters is not None:
            self._waiters.fail(CallFailed("worker_lost", "the router closed its worker calls"))


@dataclass
class _NativeReply:
    calls: HttpWorkerCalls
    call: switchyard_native.WorkerCall
    status: int

    async def read(self) -> bytes:
        return b"".join([c async for c in self.chunks()])

    async def chunks(self) -> AsyncIterator[bytes]:
        call = self.call
        while True:
            data = call.take()
            if data is None:
                await self.calls._changed(call)
            elif isinstance(data, tuple):
                raise CallFailed(*data)
            elif data:
                yield data
            else:
                return

    def relay(self) -> "_NativeRelay":
        return _NativeRelay(self.calls, self.call)


class _NativeRelay:
    """A call the crate reads to its end (``native/src/calls.rs``): this loop is woken at the
    first token and at the end."""

    __slots__ = ("calls", "call", "_whole")

    def __init__(self, calls: HttpWorkerCalls, call: switchyard_native.WorkerCall) -> None:
        self.calls = calls
        self.call = call
        self._whole: switchyard_native.RelayedAnswer | None = None

    async def first_token(self) -> float | None:
        call = self.call
        while (r := call.relayed(False)) is None:
            await self.calls._changed(call)
        if isinstance(r, float):
            return r
        self._whole = r
        return r.first_at

    async def end(self) -> switchyard_native.RelayedAnswer:
        call = self.call
        while self._whole is None:
            if (r := call.relayed(True)) is None:
                await self.calls._changed(call)
            elif not isinstance(r, float):
                self._whole = r
        return self._whole


# -- the in-memory adapter --------------------------------------------------------------------


@dataclass
class WorkerCall:
    """One call as a worker received it."""

    url: str
    body: bytes
    request_id: str
    worker_id: str = ""

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    @property
    def path(self) -> str:
        return urlsplit(self.url).path


@dataclass
class MemoryReply:
    """An answer: ``body`` whole, or pieces as they come (an async iterator of bytes, which may
    raise :class:`CallFailed` mid-way: a worker that dies mid-answer)."""

    status: int = 200
    body: bytes | AsyncIterator[bytes] = b""
    _read: bool = field(default=False, repr=False)

    async def read(self) -> bytes:
        return b"".join([c async for c in self.chunks()])

    async def chunks(self) -> AsyncIterator[bytes]:
        assert not self._read, "a reply's body is read once"
        self._read = True
        if isinstance(self.body, bytes):
            if self.body:
                yield self.body
            return
        async for piece in self.body:
            yield piece

    def relay(self) -> "PiecesRelay":
        return PiecesRelay(self.chunks())


class PiecesRelay:
    """A :class:`Relay` of an answer's pieces as some adapter reads them, folded by the same
    crate code as a native call's (``switchyard_native.SseRelay``)."""

    __slots__ = ("_pieces", "_fold")

    def __init__(self, pieces: AsyncIterator[bytes]) -> None:
        self._pieces = pieces
        self._fold = switchyard_native.SseRelay()

    async def _read(self, until_first: bool) -> None:
        fold = self._fold
        while not fold.over:
            try:
                piece = await anext(self._pieces)
            except StopAsyncIteration:
                fold.body_end()
                return
            except CallFailed as e:
                fold.fail(e.code, str(e))
                return
            if fold.feed(piece) and until_first:
                return

    async def first_token(self) -> float | None:
        await self._read(True)
        return self._fold.first_at

    async def end(self) -> switchyard_native.RelayedAnswer:
        await self._read(False)
        return self._fold.take()


#: What a fake worker does with a call: answer it, or raise :class:`CallFailed`.
Answer = Callable[[WorkerCall], MemoryReply | Awaitable[MemoryReply]]


class MemoryWorkerCalls:
    """Workers in process: every call goes to ``answer`` (after the same sendability check as
    the real adapter)."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self._in_flight = 0

    def load(self) -> CallLoad:
        """Calls in flight; nothing is ever ready untaken (no loop between the answer and its
        caller) and there are no connections."""
        return CallLoad(in_flight=self._in_flight)

    @asynccontextmanager
    async def post(self, url: str, body: bytes, request_id: str, worker_id: str,
                   relay: bool = False) -> AsyncIterator[Reply]:
        _check_sendable(url, request_id)
        self._in_flight += 1
        try:
            reply = self.answer(WorkerCall(url, body, request_id, worker_id))
            if not isinstance(reply, MemoryReply):
                reply = await reply
            yield reply
        finally:
            self._in_flight -= 1

    async def close(self) -> None:
        return None


#: The kinds of :func:`sse_events`' events (their first item).
SSE_CHUNK, SSE_USAGE, SSE_DONE, SSE_ERROR, SSE_BAD = range(5)


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[tuple]:
    """A worker's streamed answer, arriving in pieces, read by the crate
    (``switchyard_native.SseReader``, ``native/src/sse.rs``: lines split at LF and spanning
    pieces, only ``data:`` lines, each chunk's JSON read there): ``(SSE_CHUNK, text, token_ids,
    finish_reason, usage JSON or None)``, ``(SSE_USAGE, usage JSON)``, ``(SSE_DONE,)``,
    ``(SSE_ERROR, the worker's error JSON)``, ``(SSE_BAD, why)``; nothing after the last three."""
    reader = switchyard_native.SseReader()
    async for piece in chunks:
        for ev in reader.feed(piece):
            yield ev
    for ev in reader.end():
        yield ev
