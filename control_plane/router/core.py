"""The router's request path, independent of HTTP framing: admit, decide, record, proxy, retry.

One :class:`Router` per process. Its state is the :class:`RouterView` (folded from the log by
the Faust agent on the same event loop), the in-flight ledger and the round-robin cursor.
Every decision is a pure call to :func:`control_plane.routing.decide`; what it was decided on
(score table, config version, seed, view position and state) is recorded in
``RequestRouted`` so the decision can be re-executed from the log.

Failure handling: a worker that refuses the connection, answers 5xx, or drops the stream
before the first token sent to the client is recorded as ``RequestFailed(retried=True)`` and
the request is routed again without it (at most ``max_attempts``). After a token reached the
client, the stream ends with an error event and ``RequestFailed``; nothing ever hangs: every
read has a timeout.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import msgspec
import xxhash

from control_plane.bus.kafka import EventProducer
from control_plane.index.hashing import HashConfig, hash_blocks
from control_plane.router.view import RouterView, WorkerState
from control_plane.routing import (
    InflightLedger,
    NoEligibleWorker,
    RouterConfig,
    RoutingRequest,
    WorkerLoad,
    WorkerOverlap,
    decide,
)
from schemas.events import (
    PrefillCompleted,
    RequestAdmitted,
    RequestCompleted,
    RequestFailed,
    RequestRejected,
    RequestRouted,
)
from schemas.types import RequestPhase, WorkerRole

log = logging.getLogger(__name__)


class RouterRejected(Exception):
    """The request cannot be served (no eligible worker, bad input). ``status`` is HTTP."""

    def __init__(self, message: str, status: int = 503, code: str = "no_workers") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass
class Admission:
    request_id: str
    model: str
    tokens: list[int]
    hashes: list[int]
    max_tokens: int
    stream: bool
    endpoint: str
    received_at: float = field(default_factory=time.monotonic)


@dataclass
class Chunk:
    """One token (or a final usage record) coming back from the worker."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None
    error: str | None = None


class WorkerFailed(Exception):
    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code


@dataclass
class Outcome:
    worker_id: str
    ttft_ms: float
    itls_ms: list[float]
    e2e_ms: float
    output_tokens: int
    cached_tokens: int
    finish_reason: str


class Router:
    def __init__(
        self,
        *,
        router_id: str,
        view: RouterView,
        producer: EventProducer,
        config: RouterConfig,
        hash_config: HashConfig,
        health=None,  # () -> RouterHealth
        max_attempts: int = 3,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float = 60.0,
        metrics=None,
    ) -> None:
        self.router_id = router_id
        self.view = view
        self.producer = producer
        self.config = config
        self.hash_config = hash_config
        self.ledger = InflightLedger()
        #: Round-robin cursor per worker role: prefill and decode rotate independently.
        self.rr_cursor: dict[str, str] = {}
        self.max_attempts = max_attempts
        self._health = health
        self.metrics = metrics
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(read_timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=128),
        )

    async def close(self) -> None:
        await self.http.aclose()

    # -- admission --------------------------------------------------------------------------

    def admit(self, *, request_id: str | None, model: str, tokens: list[int], max_tokens: int,
              stream: bool, endpoint: str) -> Admission:
        rid = request_id or f"cmpl-{uuid.uuid4().hex}"
        hashes = hash_blocks(tokens, self.hash_config)
        adm = Admission(rid, model, tokens, hashes, max_tokens, stream, endpoint)
        self.producer.publish(RequestAdmitted(
            request_id=rid, model=model, prompt_tokens=len(tokens), max_tokens=max_tokens, stream=stream,
            block_hashes=hashes, block_size=self.hash_config.block_size, hash_algo=self.hash_config.hash_algo,
            endpoint=endpoint), correlation_id=rid)
        return adm

    def reject(self, request_id: str, reason: str, code: str, status: int) -> None:
        self.producer.publish(RequestRejected(request_id=request_id, reason=reason, code=code, http_status=status),
                              correlation_id=request_id)

    # -- decision ---------------------------------------------------------------------------

    def _serving_mode(self) -> str:
        roles = {w.role for w in self.view.routable()}
        if WorkerRole.AGGREGATED.value in roles or not roles:
            return "aggregated"
        if WorkerRole.PREFILL.value in roles and WorkerRole.DECODE.value in roles:
            return "disaggregated"
        return "aggregated"

    def decide(self, adm: Admission, phase: RequestPhase, excluded: set[str], attempt: int) -> tuple[RequestRouted, WorkerState]:
        role = {RequestPhase.PREFILL: "prefill", RequestPhase.DECODE: "decode"}.get(phase, "aggregated")
        workers = [w for w in self.view.routable(role) if w.worker_id not in excluded]
        if not workers:
            raise RouterRejected(f"no {role} worker available" + (f" (excluded after failures: {sorted(excluded)})" if excluded else ""))
        # Wall-clock seconds (recorded as ``decided_at_s``), so a replay can rebuild the ledger.
        now = time.time()
        self.ledger.expire(now)
        overlaps = {wid: WorkerOverlap.from_tiers(m.by_tier, stale=m.stale)
                    for wid, m in self.view.matches(adm.hashes).items()} if phase is not RequestPhase.DECODE else {}
        loads = [WorkerLoad(worker_id=w.worker_id, role=w.role, queued_prefill_tokens=w.queued_prefill_tokens,
                            active_decode_blocks=w.active_decode_blocks, inflight_requests=w.running + w.waiting,
                            kv_capacity_blocks=w.device_capacity_blocks) for w in workers]
        seed = xxhash.xxh64_intdigest(f"{adm.request_id}:{phase.value}:{attempt}".encode()) & 0x7FFF_FFFF_FFFF_FFFF
        req = RoutingRequest(request_id=adm.request_id, prompt_tokens=len(adm.tokens), block_size=self.hash_config.block_size,
                             block_hashes=tuple(adm.hashes), expected_output_tokens=adm.max_tokens, phase=phase)
        cursor = self.rr_cursor.get(role)
        t0 = time.perf_counter()
        try:
            d = decide(req, loads, self.config, rng_seed=seed, overlaps=overlaps, inflight=self.ledger, rr_cursor=cursor)
        except NoEligibleWorker as e:
            raise RouterRejected(str(e)) from None
        if self.metrics:
            self.metrics.decision_seconds.observe(time.perf_counter() - t0)
        if d.rr_cursor is not None:
            self.rr_cursor[role] = d.rr_cursor
        self.ledger.add(adm.request_id, d.worker_id, adm.hashes, d.prefill_tokens, d.decode_blocks, now,
                        self.config.inflight_ttl_s)
        health = self._health() if self._health else None
        ev = msgspec.structs.replace(
            d.to_event(index_position={f"{t}:{p}": o for (t, p), o in self.view.positions.items()},
                       router_id=self.router_id, attempt=attempt),
            rr_cursor=cursor, guards=list(d.guards), expected_output_tokens=adm.max_tokens,
            view_state=health.state if health else "", excluded_workers=sorted(excluded), decided_at_s=now)
        self.producer.publish(ev, correlation_id=adm.request_id)
        return ev, self.view.workers[d.worker_id]

    # -- serving ----------------------------------------------------------------------------

    async def serve(self, adm: Admission) -> AsyncIterator[Chunk]:
        """Tokens for the client. Retries on another worker until a token was yielded."""
        excluded: set[str] = set()
        sent = 0
        last_error = ""
        finished = False
        try:
            async for chunk in self._attempts(adm, excluded):
                if chunk.error:
                    finished = True
                yield chunk
            finished = True
        finally:
            if not finished:
                # The client went away mid-stream: the request ends here, and says so.
                self.ledger.complete(adm.request_id)
                self.producer.publish(RequestFailed(request_id=adm.request_id, reason="client disconnected",
                                                    code="client_cancelled"), correlation_id=adm.request_id)

    async def _attempts(self, adm: Admission, excluded: set[str]) -> AsyncIterator[Chunk]:
        sent = 0
        last_error = ""
        for attempt in range(self.max_attempts):
            worker = None
            try:
                disagg = self._serving_mode() == "disaggregated"
                if disagg:
                    stream, worker = await self._disaggregated(adm, excluded, attempt)
                else:
                    ev, worker = self.decide(adm, RequestPhase.AGGREGATED, excluded, attempt)
                    stream = self._stream_from(worker, adm, None)
                outcome = _Tracker(worker.worker_id, adm.received_at)
                async for chunk in stream:
                    if chunk.token_ids or chunk.text:
                        if outcome.first_token():
                            self._first_token(adm, worker.worker_id, record=not disagg)
                        sent += 1
                    outcome.observe(chunk)
                    yield chunk
                self._completed(adm, outcome)
                return
            except WorkerFailed as e:
                wid = worker.worker_id if worker else None
                self.ledger.complete(adm.request_id)
                retry = sent == 0 and attempt + 1 < self.max_attempts
                self.producer.publish(RequestFailed(request_id=adm.request_id, worker_id=wid, reason=str(e), code=e.code,
                                                    tokens_sent=sent, retried=retry), correlation_id=adm.request_id)
                if self.metrics:
                    self.metrics.failures.labels(code=e.code, retried=str(retry).lower()).inc()
                last_error = f"{wid}: {e}"
                if wid:
                    excluded.add(wid)
                if not retry:
                    yield Chunk(error=f"worker failed after {sent} tokens: {e}" if sent else f"all attempts failed: {e}")
                    return
                log.warning("request %s: %s failed before any token (%s); retrying elsewhere", adm.request_id, wid, e)
            except RouterRejected as e:
                self.ledger.complete(adm.request_id)
                if attempt == 0:
                    raise
                self.producer.publish(RequestFailed(request_id=adm.request_id, reason=f"{e}; last error: {last_error}",
                                                    code="no_workers_left", tokens_sent=sent), correlation_id=adm.request_id)
                yield Chunk(error=f"{e}; last error: {last_error}")
                return
        yield Chunk(error=f"all {self.max_attempts} attempts failed; last error: {last_error}")

    async def _disaggregated(self, adm: Admission, excluded: set[str], attempt: int):
        _, prefill = self.decide(adm, RequestPhase.PREFILL, excluded, attempt)
        body = {"model": adm.model, "prompt": adm.tokens, "max_tokens": 1, "stream": False,
                "request_id": adm.request_id, "kv_transfer_params": {"do_remote_decode": True}}
        try:
            r = await self.http.post(f"{prefill.endpoint}/v1/completions", json=body,
                                     headers={"X-Request-Id": adm.request_id})
        except httpx.HTTPError as e:
            self._drop(prefill)
            raise WorkerFailed("worker_unreachable", f"prefill {prefill.worker_id}: {type(e).__name__}: {e}") from None
        if r.status_code >= 500:
            raise WorkerFailed("worker_error", f"prefill {prefill.worker_id}: HTTP {r.status_code}: {r.text[:200]}")
        if r.status_code >= 400:
            raise RouterRejected(f"prefill worker refused the request: {r.text[:300]}", r.status_code, "bad_request")
        params = r.json().get("kv_transfer_params")
        self.ledger.complete(adm.request_id, prefill.worker_id)
        _, decode = self.decide(adm, RequestPhase.DECODE, excluded, attempt)
        return self._stream_from(decode, adm, params), decode

    async def _stream_from(self, worker: WorkerState, adm: Admission, kv_params: dict | None) -> AsyncIterator[Chunk]:
        body = {"model": adm.model, "prompt": adm.tokens, "max_tokens": adm.max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "request_id": adm.request_id}
        if kv_params is not None:
            body["kv_transfer_params"] = kv_params
        url = f"{worker.endpoint}/v1/completions"
        try:
            async with self.http.stream("POST", url, json=body, headers={"X-Request-Id": adm.request_id}) as r:
                if r.status_code >= 500:
                    raise WorkerFailed("worker_error", f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                if r.status_code >= 400:
                    raise RouterRejected(f"worker refused the request: {(await r.aread())[:300].decode(errors='replace')}",
                                         r.status_code, "bad_request")
                done = False
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        raise WorkerFailed("worker_error", str(obj["error"])[:300])
                    choices = obj.get("choices") or []
                    if choices:
                        c = choices[0]
                        yield Chunk(text=c.get("text", ""), token_ids=c.get("token_ids") or obj.get("token_ids") or [],
                                    finish_reason=c.get("finish_reason"), usage=obj.get("usage"))
                    elif obj.get("usage"):
                        yield Chunk(usage=obj["usage"])
                if not done:
                    raise WorkerFailed("worker_lost", "stream ended without [DONE]")
        except httpx.ConnectError as e:
            self._drop(worker)
            raise WorkerFailed("worker_unreachable", f"{type(e).__name__}: {e}") from None
        except (httpx.ReadError, httpx.RemoteProtocolError, httpx.ReadTimeout, httpx.WriteError) as e:
            raise WorkerFailed("worker_lost", f"{type(e).__name__}: {e}") from None

    def _first_token(self, adm: Admission, worker_id: str, record: bool) -> None:
        """The prompt's KV now exists on the worker: its queued prefill leaves the ledger. Recorded
        as PrefillCompleted (by the router, in aggregated serving) so replays see it too."""
        self.ledger.prefill_done(adm.request_id)
        if not record:  # disaggregated: the prefill worker recorded PrefillCompleted itself
            return
        self.producer.publish(PrefillCompleted(
            request_id=adm.request_id, worker_id=worker_id, prompt_tokens=len(adm.tokens),
            duration_ms=(time.monotonic() - adm.received_at) * 1000), correlation_id=adm.request_id)

    def _drop(self, worker: WorkerState) -> None:
        """A refused connection: stop considering this incarnation until it shows up again."""
        self.ledger.drop_worker(worker.worker_id)

    def _completed(self, adm: Admission, t: "_Tracker") -> None:
        self.ledger.complete(adm.request_id)
        itls = t.itls_ms
        itls_sorted = sorted(itls)
        self.producer.publish(RequestCompleted(
            request_id=adm.request_id, worker_id=t.worker_id, prompt_tokens=len(adm.tokens),
            output_tokens=t.tokens, cached_tokens=t.cached_tokens, ttft_ms=t.ttft_ms,
            itl_mean_ms=statistics.fmean(itls) if itls else 0.0,
            itl_p50_ms=itls_sorted[len(itls_sorted) // 2] if itls else 0.0,
            itl_p99_ms=itls_sorted[min(len(itls_sorted) - 1, int(0.99 * len(itls_sorted)))] if itls else 0.0,
            e2e_ms=(time.monotonic() - adm.received_at) * 1000, finish_reason=t.finish_reason or "length"),
            correlation_id=adm.request_id)
        if self.metrics:
            self.metrics.ttft_seconds.observe(t.ttft_ms / 1000)
            for x in itls:
                self.metrics.itl_seconds.observe(x / 1000)


class _Tracker:
    def __init__(self, worker_id: str, start: float) -> None:
        self.worker_id = worker_id
        self.start = start
        self.last: float | None = None
        self.ttft_ms = 0.0
        self.itls_ms: list[float] = []
        self.tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None

    def first_token(self) -> bool:
        return self.last is None

    def observe(self, c: Chunk) -> None:
        now = time.monotonic()
        if c.token_ids or c.text:
            if self.last is None:
                self.ttft_ms = (now - self.start) * 1000
            else:
                self.itls_ms.append((now - self.last) * 1000)
            self.last = now
            self.tokens += max(len(c.token_ids), 1)
        if c.finish_reason:
            self.finish_reason = c.finish_reason
        if c.usage:
            self.cached_tokens = int((c.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0)
            self.tokens = int(c.usage.get("completion_tokens", self.tokens))
