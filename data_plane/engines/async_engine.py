"""Real-time driver: runs an ``EngineCore`` in wall-clock time and streams tokens per request.

This is what backs a worker's OpenAI-compatible HTTP API::

    engine = AsyncEngine(EngineCore("mocker", worker_id=wid), speedup=1.0, sink=producer)
    await engine.start()
    stream = engine.submit(EngineRequest(request_id=rid, prompt=ids, max_tokens=64))
    async for tok in stream:          # StreamedToken(request_id, index, token_id, finished, time_ms)
        ...
    await engine.stop()

Time: the engine keeps a *virtual* clock in ms, exactly like :func:`simulate`. A step that starts
at virtual ``t`` and lasts ``d`` delivers its tokens and publishes its KV events when the wall
clock reaches ``t + d`` (divided by ``speedup``), and the next step starts at ``t + d``: virtual
time never drifts with scheduling jitter, so a run with explicit ``arrival_ms`` is reproducible
and produces the same tokens, times and event sequence as the simulation. A request without
``arrival_ms`` arrives "now" (wall clock mapped to virtual time) and joins the next step
boundary; a request with ``arrival_ms`` joins the first boundary at or after it (an idle engine
wakes at exactly that virtual time).

Single event loop, no threads: the core is only touched from the loop, between steps.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from data_plane.engines.core import EngineCore, EngineStats
from data_plane.engines.errors import EngineError, RequestRejected
from data_plane.engines.request import EngineRequest
from data_plane.engines.scheduler import OnboardStats
from common.log.sink import EventSink
from common.tasks import cancel_and_wait
from schemas.types import RequestId

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StreamedToken:
    request_id: RequestId
    #: 0 for the first generated token.
    index: int
    token_id: int
    #: Last token of the request (prefill role: the KV is now held for transfer).
    finished: bool
    #: Virtual time the token was delivered, in ms since the engine started.
    time_ms: float
    #: "length" on the last token, "abort" when the request was dropped, else None.
    finish_reason: str | None = None


class TokenStream:
    """Async iterator over one request's tokens; ends after the last one (or on abort)."""

    def __init__(self, request_id: RequestId, arrival_ms: float) -> None:
        self.request_id = request_id
        self.arrival_ms = arrival_ms
        #: Prompt tokens served from the prefix cache, once admitted.
        self.cached_tokens: int | None = None
        self._queue: asyncio.Queue[StreamedToken | None] = asyncio.Queue()
        self._done = False

    def _put(self, tok: StreamedToken) -> None:
        self._queue.put_nowait(tok)
        if tok.finished:
            self._close()

    def _close(self) -> None:
        if not self._done:
            self._done = True
            self._queue.put_nowait(None)

    def __aiter__(self) -> AsyncIterator[StreamedToken]:
        return self

    async def __anext__(self) -> StreamedToken:
        item = await self._queue.get()
        if item is None:
            raise StopAsyncIteration
        return item

    async def collect(self) -> list[StreamedToken]:
        return [t async for t in self]


class AsyncEngine:
    """Real-time driver of one ``EngineCore`` (see the module docstring)."""

    def __init__(
        self,
        core: EngineCore,
        *,
        speedup: float = 1.0,
        sink: EventSink | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if speedup <= 0:
            raise ValueError("speedup must be > 0")
        self.core = core
        self.speedup = speedup
        self.sink = sink
        self._clock = clock
        self._t0 = 0.0
        #: Virtual time of the current (or last) step boundary, ms.
        self._t = 0.0
        self._pending: list[tuple[float, int, EngineRequest]] = []
        self._seq = 0
        self._streams: dict[RequestId, TokenStream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    # ------------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._task is not None:
            raise EngineError("engine already started")
        self._t0 = self._clock()
        self._t = 0.0
        self._stopping = False
        self._task = asyncio.create_task(self._run(), name=f"engine-{self.core.worker_id}")

    async def stop(self) -> None:
        """Stop stepping; open streams end (their last item is an ``abort``)."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        for rid, stream in list(self._streams.items()):
            stream._put(StreamedToken(rid, -1, -1, True, self._t, "abort"))
        self._streams.clear()

    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------------------------- commands

    @property
    def now_ms(self) -> float:
        """Virtual time now (wall clock since start, times the speed-up)."""
        return (self._clock() - self._t0) * 1e3 * self.speedup

    def submit(self, request: EngineRequest) -> TokenStream:
        """Queue a request; returns its token stream. Raises :class:`RequestRejected` at once if
        the request can never fit or its id is in use."""
        rid = request.request_id
        if rid in self._streams:
            raise RequestRejected(f"request {rid} is already in the engine")
        self.core.validate_request(request)
        arrival = request.arrival_ms if request.arrival_ms is not None else max(self.now_ms, self._t)
        stream = TokenStream(rid, arrival)
        heapq.heappush(self._pending, (arrival, self._seq, request))
        self._seq += 1
        self._streams[rid] = stream
        self._wake.set()
        return stream

    def release(self, request_id: RequestId) -> bool:
        """Prefill role: free a held request's blocks (the transfer is done)."""
        ok = self.core.release(request_id)
        if ok:
            self._wake.set()
        return ok

    def abort(self, request_id: RequestId) -> bool:
        """Drop a request; its stream ends with an ``abort`` item. False if it is unknown
        (already finished, or never submitted)."""
        stream = self._streams.pop(request_id, None)
        for i, (_, _, req) in enumerate(self._pending):
            if req.request_id == request_id:
                self._pending.pop(i)
                heapq.heapify(self._pending)
                break
        found = self.core.abort(request_id) or stream is not None
        if stream is not None:
            stream._put(StreamedToken(request_id, -1, -1, True, self._t, "abort"))
        if found:
            self._wake.set()
        return found

    def validate(self, request: EngineRequest) -> None:
        """Raise :class:`RequestRejected` if ``request`` can never run here."""
        self.core.validate_request(request)

    def cached_hashes(self) -> set[int]:
        """Block hashes in the device prefix cache."""
        return {int(h) for h in self.core.pool.cached_hashes()}

    def model_info(self) -> dict:
        prof = self.core.profile
        return {"root": prof.name, "max_model_len": prof.num_device_blocks * prof.block_size}

    #: The engine does not move KV between workers itself: the worker's NIXL handoff does.
    moves_kv = False

    def held_block_ids(self, request_id: RequestId) -> list[int]:
        return self.core.held_block_ids(request_id)

    def stats(self) -> EngineStats:
        return self.core.stats()

    def onboard_stats(self) -> OnboardStats:
        return self.core.onboard_stats()

    # ------------------------------------------------------------------------------ the loop

    def _admit_due(self, t: float) -> None:
        pending = self._pending
        due = []
        while pending and pending[0][0] <= t:
            due.append(heapq.heappop(pending)[2])
        if len(due) > 1 and all(r.router_order is not None for r in due):
            # The router's order, not the arrival's: see ``EngineRequest.router_order``.
            due.sort(key=lambda r: r.router_order)
        for req in due:
            stream = self._streams.get(req.request_id)
            try:
                self.core.add_request(req)
            except RequestRejected:
                logger.warning("request %s rejected by the engine core", req.request_id)
                if stream is not None:
                    self._streams.pop(req.request_id, None)
                    stream._put(StreamedToken(req.request_id, -1, -1, True, t, "abort"))

    async def _sleep_until(self, t_virtual: float) -> None:
        delay = self._t0 + t_virtual / 1e3 / self.speedup - self._clock()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            await asyncio.sleep(0)  # stay fair to the rest of the event loop

    async def _run(self) -> None:
        core = self.core
        while not self._stopping:
            self._admit_due(self._t)
            res = core.step() if core.has_work() else None
            if res is not None and res.num_scheduled:
                t_end = self._t + res.duration_ms
                await self._sleep_until(t_end)
                self._t = t_end
                self._deliver(res, t_end)
                continue
            self._publish()
            # Idle: wait for a submission/release, or for the next timed arrival.
            self._wake.clear()
            if self._pending:
                nxt = self._pending[0][0]
                delay = self._t0 + nxt / 1e3 / self.speedup - self._clock()
                if delay > 0:
                    try:
                        await asyncio.wait_for(self._wake.wait(), delay)
                    except TimeoutError:
                        pass
                if self._pending and self._pending[0][0] <= max(self.now_ms, self._t):
                    self._t = max(self._t, self._pending[0][0])
                    continue
            else:
                await self._wake.wait()
            self._t = max(self._t, self.now_ms)

    def _deliver(self, res, t_end: float) -> None:  # noqa: ANN001 - StepResult
        streams = self._streams
        for rid, cached in res.admitted:
            s = streams.get(rid)
            if s is not None:
                s.cached_tokens = cached
        for tok in res.tokens:
            s = streams.get(tok.request_id)
            if s is None:
                continue
            s._put(
                StreamedToken(
                    tok.request_id, tok.index, tok.token_id, tok.finished, t_end,
                    "length" if tok.finished else None,
                )
            )
            if tok.finished:
                del streams[tok.request_id]
        self._publish()

    def _publish(self) -> None:
        events = self.core.take_kv_events()
        if self.sink is not None:
            for ev in events:
                self.sink.publish(ev)
