"""One request in flight on a worker: its input, its tokens, the errors it may end in.

:class:`Run` is what :meth:`data_plane.workers.service.Worker.open` returns and the HTTP layer
iterates; :func:`engine_tokens` turns an engine stream into its :class:`Token` s (both the
simulated path and the real-KV path read the engine through it).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from data_plane.engines import AsyncEngine
from data_plane.workers.metrics import WorkerMetrics


class WorkerError(Exception):
    """Base of the errors the HTTP layer turns into responses."""

    status = 500
    kind = "server_error"


class BadRequest(WorkerError):
    status = 400
    kind = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class Unavailable(WorkerError):
    status = 503
    kind = "service_unavailable"


class Aborted(Unavailable):
    """The engine dropped the request (worker stopping): answered as any unavailability."""


@dataclass(frozen=True, slots=True)
class CompletionInput:
    request_id: str
    prompt: list[int]
    max_tokens: int
    kv_transfer_params: dict[str, Any] | None = None
    #: When the router routed it (s, its clock): the engine's order among a step's arrivals.
    routed_at_s: float | None = None


@dataclass(frozen=True, slots=True)
class Token:
    index: int
    token_id: int
    #: "length" on the last token, else None.
    finish_reason: str | None = None


class RunHost(Protocol):
    """What a :class:`Run` uses of its worker: the engine (to abort), the metrics, and the
    in-flight table it leaves when closed."""

    engine: AsyncEngine
    metrics: WorkerMetrics
    _inflight: dict[str, Run]


class Run:
    """One request in flight. Iterate it once for its tokens; ``kv_transfer_params`` and
    ``cached_tokens`` are final once iteration ended. Closing it early aborts the request."""

    def __init__(self, worker: RunHost, inp: CompletionInput) -> None:
        self.worker = worker
        self.request_id = inp.request_id
        self.prompt_tokens = len(inp.prompt)
        self.arrival = time.monotonic()
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.kv_transfer_params: dict[str, Any] | None = None
        #: The engine still runs (or holds) this request on our behalf: abort it on close.
        self.in_engine = False
        self._gen: AsyncIterator[Token] | None = None
        self._closed = False

    def __aiter__(self) -> AsyncIterator[Token]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Token]:
        assert self._gen is not None
        m = self.worker.metrics
        last: float | None = None
        try:
            async for tok in self._gen:
                now = time.monotonic()
                if last is None:
                    m.labels(m.ttft).observe(now - self.arrival)
                    m.labels(m.prompt_tokens).inc(self.prompt_tokens)
                else:
                    m.labels(m.itl).observe(now - last)
                last = now
                self.completion_tokens += 1
                m.labels(m.generation_tokens).inc()
                if tok.finish_reason:
                    self.finish_reason = tok.finish_reason
                yield tok
            m.labels(m.e2e).observe(time.monotonic() - self.arrival)
        finally:
            await self._gen.aclose()  # type: ignore[attr-defined]
            self.close()

    def close(self) -> None:
        """Idempotent: abort what the engine still runs for us, leave the in-flight set."""
        if self._closed:
            return
        self._closed = True
        if self.in_engine:
            self.in_engine = False
            self.worker.engine.abort(self.request_id)
        self.worker._inflight.pop(self.request_id, None)


async def engine_tokens(run: Run, stream, metrics: WorkerMetrics) -> AsyncIterator[Token]:  # noqa: ANN001
    """The engine's tokens for ``run``, as :class:`Token`; raises :class:`Aborted`."""
    m = metrics
    first = True
    async for tok in stream:
        if tok.finish_reason == "abort":
            run.in_engine = False
            raise Aborted(f"request {run.request_id} was aborted by the engine")
        if first:
            first = False
            run.cached_tokens = stream.cached_tokens or 0
            m.labels(m.prefix_queries).inc(run.prompt_tokens)
            m.labels(m.prefix_hits).inc(run.cached_tokens)
        if tok.finished:
            run.in_engine = False
        yield Token(tok.index, tok.token_id, tok.finish_reason)
