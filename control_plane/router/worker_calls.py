"""The router's HTTP calls to workers: one port, its real adapter and an in-memory one.

:class:`WorkerCalls` is what :class:`control_plane.router.proxy.Router` needs from the network:
POST a JSON body to a worker and read the answer's status and body bytes, whole or as they
arrive. Every way a call can fail at the transport is a :class:`CallFailed` whose ``code`` is
the router's failure code (``connect_timeout``, ``worker_unreachable``, ``timeout``,
``worker_lost``); a request that cannot be put on the wire at all (an illegal header or URL) is
:class:`Unsendable`, the request's fault and not the worker's. Each adapter translates its
driver's errors into these, so the router classifies failures once, whatever the transport.

:class:`HttpWorkerCalls` is the real adapter: aiohttp (its C HTTP parser, keep-alive pool), the
each worker's own bearer on every call (:func:`common.settings.worker_token`: derived from the
cluster's worker secret, which never leaves the router), aiohttp rather than httpx: about 5x
less time per call (docs/benchmarks.md, "Measurements behind defaults").
A connection returns to the pool only once its answer was read to the end, so an answer the
router is done with before its end (the SSE stream after ``[DONE]``) is drained in the
background, for at most :data:`DRAIN_S`, instead of being closed (a new connection per request
costs a TCP handshake and a socket each way). An answer the router gives up on (a failure, a
client gone) closes its connection: the worker sees it and stops generating.

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

import aiohttp

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
    """A worker's answer: its status at once, its body read whole or piece by piece (either
    once). Reading raises :class:`CallFailed`."""

    status: int

    async def read(self) -> bytes: ...

    def chunks(self) -> AsyncIterator[bytes]: ...


class WorkerCalls(Protocol):
    def post(self, url: str, body: bytes, request_id: str, worker_id: str) -> AbstractAsyncContextManager[Reply]:
        """POST ``body`` (JSON) to worker ``worker_id`` at ``url`` with ``X-Request-Id`` (and the
        worker's bearer, :func:`common.settings.worker_token`); the answer, until the block
        ends. Raises :class:`CallFailed` or :class:`Unsendable`."""
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
    """Calls over HTTP/1.1 with aiohttp (module docstring). The session is made on first use, on
    the event loop that serves the router (aiohttp binds it to that loop). aiohttp is imported
    by the router process anyway (its HTTP client)."""

    def __init__(self, *, connect_timeout_s: float, read_timeout_s: float, credential: str | None = None,
                 max_connections: int = 2048) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_connections = max_connections
        self._headers = {"Content-Type": "application/json"}
        #: The cluster's worker secret; each call carries the bearer of the worker it calls.
        self._secret = credential
        self._tokens: dict[str, str] = {}
        self._session: aiohttp.ClientSession | None = None
        self._draining: set[asyncio.Task] = set()

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            reuse = aiohttp.TraceConfig()
            reuse.on_connection_reuseconn.append(_mark_reused)
            # ``connect`` bounds the wait for a pooled connection as well as the connect itself
            # (what httpx called the pool timeout): the read timeout's length.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0,
                                               keepalive_timeout=KEEP_ALIVE_S),
                timeout=aiohttp.ClientTimeout(total=None, connect=self.read_timeout_s + self.connect_timeout_s,
                                              sock_connect=self.connect_timeout_s, sock_read=self.read_timeout_s),
                headers=self._headers, skip_auto_headers=("Accept-Encoding",), trace_configs=[reuse],
                cookie_jar=aiohttp.DummyCookieJar())  # workers set none; no state between calls
        return self._session

    @asynccontextmanager
    async def post(self, url: str, body: bytes, request_id: str, worker_id: str) -> AsyncIterator[Reply]:
        _check_sendable(url, request_id)
        session = self._client()
        headers = {"X-Request-Id": request_id}
        if self._secret:
            headers["Authorization"] = f"Bearer {self._token(worker_id)}"
        for last in (False, True):
            call: dict = {}
            try:
                # Never follow a redirect: it would carry the body and the worker credential
                # elsewhere (a 3xx is answered as it is, an answer without [DONE]).
                response = await session.post(url, data=body, headers=headers, trace_request_ctx=call,
                                              allow_redirects=False)
                break
            except (aiohttp.InvalidURL, aiohttp.NonHttpUrlClientError) as e:
                raise Unsendable(f"{type(e).__name__}: {e}") from None
            except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as e:
                # A pooled connection the worker closed as it was taken (its keep-alive ran
                # out): the request never reached it; once more, on a new connection.
                if last or not call.get("reused"):
                    raise _translated(e) from None
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
                raise _translated(e) from None
        try:
            yield _AiohttpReply(response)
        except BaseException:
            # The router gave up on this answer (a failure, a client gone): closing the
            # connection tells the worker, which stops generating for it.
            response.close()
            raise
        if response.content.is_eof():
            response.release()
        else:
            self._drain(response)

    def _token(self, worker_id: str) -> str:
        token = self._tokens.get(worker_id)
        if token is None:
            if len(self._tokens) > 4096:  # workers come and go: keep the memo bounded
                self._tokens.clear()
            token = self._tokens[worker_id] = worker_token(self._secret, worker_id)  # type: ignore[arg-type]
        return token

    def _drain(self, response: aiohttp.ClientResponse) -> None:
        """Read the rest of an answer in the background, then pool its connection (closed if
        it does not end within :data:`DRAIN_S` or breaks)."""

        async def drain() -> None:
            try:
                async with asyncio.timeout(DRAIN_S):
                    while await response.content.readany():
                        pass
                response.release()
            except BaseException:
                response.close()
                raise

        task = asyncio.get_running_loop().create_task(drain())
        self._draining.add(task)
        task.add_done_callback(self._drained)

    def _drained(self, task: asyncio.Task) -> None:
        self._draining.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a broken drain only costs the connection

    async def drained(self) -> None:
        """Once every answer being drained has ended and its connection is back in the pool (or
        closed)."""
        while self._draining:
            await asyncio.gather(*self._draining, return_exceptions=True)

    async def close(self) -> None:
        for task in list(self._draining):
            task.cancel()
        await self.drained()
        if self._session is not None:
            await self._session.close()
            self._session = None


async def _mark_reused(session: aiohttp.ClientSession, trace: object, params: object) -> None:
    trace.trace_request_ctx["reused"] = True  # type: ignore[attr-defined]


def _translated(e: BaseException) -> CallFailed:
    if isinstance(e, aiohttp.ConnectionTimeoutError):
        code = "connect_timeout"
    elif isinstance(e, aiohttp.ClientConnectorError):
        code = "worker_unreachable"
    elif isinstance(e, (aiohttp.ServerTimeoutError, asyncio.TimeoutError)):
        code = "timeout"
    else:  # disconnected, reset, a malformed answer
        code = "worker_lost"
    return CallFailed(code, f"{type(e).__name__}: {e}".rstrip(": "))


@dataclass
class _AiohttpReply:
    response: aiohttp.ClientResponse

    @property
    def status(self) -> int:
        return self.response.status

    async def read(self) -> bytes:
        try:
            return await self.response.read()
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
            raise _translated(e) from None

    async def chunks(self) -> AsyncIterator[bytes]:
        content = self.response.content
        while True:
            try:
                data = await content.readany()
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
                raise _translated(e) from None
            if not data:
                return
            yield data


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


#: What a fake worker does with a call: answer it, or raise :class:`CallFailed`.
Answer = Callable[[WorkerCall], MemoryReply | Awaitable[MemoryReply]]


class MemoryWorkerCalls:
    """Workers in process: every call goes to ``answer`` (after the same sendability check as
    the real adapter)."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer

    @asynccontextmanager
    async def post(self, url: str, body: bytes, request_id: str, worker_id: str) -> AsyncIterator[Reply]:
        _check_sendable(url, request_id)
        reply = self.answer(WorkerCall(url, body, request_id, worker_id))
        if not isinstance(reply, MemoryReply):
            reply = await reply
        yield reply

    async def close(self) -> None:
        return None


async def lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The lines of a body arriving in pieces (split at LF, a CR before it dropped; a line is
    whole even when it spans pieces). A last line without LF is yielded at the end."""
    rest = b""
    async for piece in chunks:
        if rest:
            piece = rest + piece
        *whole, rest = piece.split(b"\n")
        for line in whole:
            yield line[:-1] if line.endswith(b"\r") else line
    if rest:
        yield rest

