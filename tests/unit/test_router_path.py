"""The router's request path (admit, decide, record, proxy, retry) over in-memory ports: a
``MemorySink`` for the log and ``MemoryWorkerCalls`` for the workers. No broker, no sockets.

Every scenario also checks the design property of :mod:`control_plane.router.ledger`: the
router's live state is exactly the fold of the events it published. A fresh ``RouterLedger``
folded from ``sink.envelopes`` must equal ``router.ledger`` (load per worker, the in-flight view
of the prompt, the round-robin cursors, open requests, entries) at every point the router
waits on a worker, after every chunk the client receives, and at the end.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx
import msgspec
import pytest

from control_plane.replay.verify import check_rejection
from control_plane.router import RouterConfig
from control_plane.router.server import create_app
from control_plane.router.serving import RouterApp, RouterMetrics
from control_plane.router.health import RouterHealth
from control_plane.router.ledger import NO_INFLIGHT, RouterLedger
from control_plane.router.loop_lag import LoopLag
from control_plane.router.proxy import Admission, Chunk, Router, RouterRejected
from control_plane.router.ttft import PRIOR, predict_ttft_ms
from control_plane.router.view import RouterView, WorkerState
from control_plane.router.worker_calls import CallFailed, MemoryReply, MemoryWorkerCalls, WorkerCall
from common.hashing import HashAlgo, HashConfig, hash_blocks
from common.log.sink import MemorySink
from schemas.events import (
    PrefillCompleted,
    RequestAdmitted,
    RequestCompleted,
    RequestFailed,
    RequestRejected,
    RequestRouted,
)
from schemas.types import RequestPhase, RoutingMode
from tests.support.waits import until

BLOCK = 16
PROMPT = list(range(40))  # two full blocks (hashed) and a partial one
KV_PARAMS = {"do_remote_prefill": True, "remote_block_ids": [3, 4, 5], "remote_engine_id": "engine-p",
             "remote_host": "10.0.0.7", "remote_port": 5600}

Answer = Callable[[dict], MemoryReply]


# ----------------------------------------------------------------------------------------------
# Fake workers: scripted answers, in call order
# ----------------------------------------------------------------------------------------------


def _sse(*objs: dict, done: bool = True) -> bytes:
    return b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in objs) + (b"data: [DONE]\n\n" if done else b"")


def _token(text: str, token_id: int, finish: str | None = None) -> dict:
    return {"choices": [{"text": text, "token_ids": [token_id], "finish_reason": finish}]}


USAGE = {"usage": {"prompt_tokens": len(PROMPT), "completion_tokens": 3,
                   "prompt_tokens_details": {"cached_tokens": 16}}}


def tokens(*texts: str) -> Answer:
    """A stream of one token per text, the last one finishing, then usage and [DONE]."""
    chunks = [_token(t, 100 + i, "length" if i == len(texts) - 1 else None) for i, t in enumerate(texts)]
    return lambda body: MemoryReply(200, _sse(*chunks, USAGE))


def status(code: int) -> Answer:
    return lambda body: MemoryReply(code, json.dumps({"error": f"HTTP {code} from the engine"}).encode())


def unreachable() -> Answer:
    """A worker whose port refuses the connection: the request never reached it."""

    def answer(body: dict) -> MemoryReply:
        raise CallFailed("worker_unreachable", "[Errno 111] Connection refused")

    return answer


def prefilled(params: dict) -> Answer:
    """A prefill worker's (non-streamed) answer, carrying the KV handoff parameters."""
    return lambda body: MemoryReply(200, json.dumps({"choices": [{"text": "x", "finish_reason": "length"}],
                                                     "kv_transfer_params": params}).encode())


def token_then_error(text: str) -> Answer:
    return lambda body: MemoryReply(200, _sse(_token(text, 100), {"error": "engine core died"}, done=False))


def token_then_cut(text: str) -> Answer:
    return lambda body: MemoryReply(200, _sse(_token(text, 100), done=False))


def token_then_hold(text: str, release: asyncio.Event) -> Answer:
    """One token, then nothing until ``release`` (a worker still decoding), then the rest."""

    async def stream() -> AsyncIterator[bytes]:
        yield _sse(_token(text, 100), done=False)
        await release.wait()
        yield _sse(_token("!", 101, "length"), USAGE)

    return lambda body: MemoryReply(200, stream())


@dataclass
class Call:
    worker: str  # the endpoint's host, which is the worker id
    path: str
    body: dict


@dataclass
class FakeWorkers:
    """``MemoryWorkerCalls``'s answer: the n-th call to any worker gets ``script[n]``. Before
    answering it runs ``on_call`` (the router is waiting on the worker: every fact it decided so
    far is recorded)."""

    script: list[Answer]
    calls: list[Call] = field(default_factory=list)
    on_call: Callable[[Call], None] = lambda call: None

    def __call__(self, request: WorkerCall) -> MemoryReply:
        call = Call(request.host, request.path, json.loads(request.body))
        self.calls.append(call)
        self.on_call(call)
        assert len(self.calls) <= len(self.script), f"unscripted call {len(self.calls)}: {call}"
        return self.script[len(self.calls) - 1](call.body)


# ----------------------------------------------------------------------------------------------
# Builders
# ----------------------------------------------------------------------------------------------


def _worker(worker_id: str, role: str = "aggregated", **overrides) -> WorkerState:
    fields = dict(worker_id=worker_id, epoch=1, role=role, pool="p", endpoint=f"http://{worker_id}:8000",
                  capacity={"device": 1000})
    fields.update(overrides)
    return WorkerState(**fields)


def _router(workers: list[WorkerState], fake: FakeWorkers, **config) -> tuple[Router, MemorySink]:
    view = RouterView("sha256", BLOCK)
    for w in workers:
        view.workers[w.worker_id] = w
    sink = MemorySink()
    router = Router(router_id="r-path", view=view, producer=sink, config=RouterConfig(**config),
                    hash_config=HashConfig(HashAlgo.SHA256, BLOCK), max_attempts=3,
                    workers=MemoryWorkerCalls(fake))
    return router, sink


async def _admit(router: Router, rid: str, prompt: list[int] = PROMPT) -> Admission:
    adm = router.admit(request_id=rid, model="m", tokens=prompt, max_tokens=3, stream=True, endpoint="completions")
    await router.queue(adm)
    return adm


# ----------------------------------------------------------------------------------------------
# The design property
# ----------------------------------------------------------------------------------------------


def ledger_state(ledger: RouterLedger, workers, hashes) -> dict:
    """Everything a decision or the admission test reads from the ledger."""
    return {"load_for": {w: ledger.load_for(w) for w in workers}, "view": ledger.view(hashes),
            "view of no prompt": ledger.view(()), "rr_cursor": dict(ledger.rr_cursor),
            "open_requests": ledger.open_requests(), "len": len(ledger),
            "ttft_models": {w: ledger.ttft_fit.model(w) for w in workers},
            "pending_prefills": {w: ledger.inflight.pending_prefills(w) for w in workers}}


def folded(router: Router, sink: MemorySink) -> RouterLedger:
    fold = RouterLedger(router.config.inflight_ttl_s)
    for env in sink.envelopes:
        fold.apply(env)
    return fold


class FoldCheck:
    """Compares the live ledger with the fold of the sink, wherever it is called from (a check
    inside the transport cannot raise through the router: it records, ``verify`` asserts)."""

    def __init__(self, router: Router, sink: MemorySink, hashes) -> None:
        self.router, self.sink, self.hashes = router, sink, list(hashes)
        self.points = 0
        self.mismatches: list[tuple[int, dict, dict]] = []

    def __call__(self, *_: object) -> None:
        live = ledger_state(self.router.ledger, self.router.view.workers, self.hashes)
        fold = ledger_state(folded(self.router, self.sink), self.router.view.workers, self.hashes)
        self.points += 1
        if live != fold:
            self.mismatches.append((len(self.sink.envelopes), live, fold))

    def verify(self) -> None:
        self()
        assert self.mismatches == [], self.mismatches[0]


def _scenario(workers: list[WorkerState], script: list[Answer], **config):
    fake = FakeWorkers(script)
    router, sink = _router(workers, fake, **config)
    check = FoldCheck(router, sink, _hashes(router))
    fake.on_call = check
    return router, sink, fake, check


def _hashes(router: Router) -> list[int]:
    return hash_blocks(PROMPT, router.hash_config)


async def _collect(router: Router, adm: Admission, check: FoldCheck) -> list[Chunk]:
    out = []
    async for chunk in router.serve(adm):
        out.append(chunk)
        check()
    return out


def _types(sink: MemorySink) -> list[str]:
    return [type(e).__name__ for e in sink.events]


# ----------------------------------------------------------------------------------------------
# Scenarios
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [RoutingMode.KV, RoutingMode.ROUND_ROBIN])
async def test_an_aggregated_stream_is_recorded_in_order_and_its_tokens_relayed(mode: RoutingMode) -> None:
    router, sink, fake, check = _scenario([_worker("w-a")], [tokens("Hel", "lo", ".")], mode=mode)
    adm = await _admit(router, "agg-1")
    chunks = await _collect(router, adm, check)

    assert [c.text for c in chunks if c.text] == ["Hel", "lo", "."]
    assert [c.token_ids for c in chunks if c.token_ids] == [[100], [101], [102]]
    assert chunks[-1].usage == USAGE["usage"] and not any(c.error for c in chunks)
    assert _types(sink) == ["RequestAdmitted", "RequestRouted", "PrefillCompleted", "RequestCompleted"]
    assert set(sink.correlation) == {"agg-1"}
    [admitted], [routed], [done] = sink.of_type(RequestAdmitted), sink.of_type(RequestRouted), sink.of_type(RequestCompleted)
    assert admitted.block_hashes == _hashes(router) and admitted.prompt_tokens == 40
    assert routed.worker_id == "w-a" and routed.phase is RequestPhase.AGGREGATED and routed.mode is mode
    assert (done.worker_id, done.output_tokens, done.cached_tokens, done.finish_reason) == ("w-a", 3, 16, "length")
    [call] = fake.calls
    assert (call.worker, call.path) == ("w-a", "/v1/completions")
    assert call.body["prompt"] == PROMPT and call.body["stream"] is True and "kv_transfer_params" not in call.body
    # While the worker streamed, the request held its blocks on w-a.
    assert check.points == 5 and check.mismatches == []
    check.verify()
    assert len(router.ledger) == 0 and router.ledger.open_requests() == 0
    assert router.ledger.rr_cursor == ({"aggregated": "w-a"} if mode is RoutingMode.ROUND_ROBIN else {})
    await router.close()


async def test_a_completed_request_teaches_the_next_decisions_ttft_model() -> None:
    """The first decision predicts under the prior; its completion (the TTFT the client got)
    is an observation of the ledger's fit, so the second decision records the worker's fitted
    model (1 sample) and predicts under it; the fold of the log holds the same model."""
    router, sink, fake, check = _scenario([_worker("w-a")], [tokens("a", "b"), tokens("c", "d")])
    await _collect(router, await _admit(router, "fit-1"), check)
    await _collect(router, await _admit(router, "fit-2"), check)
    first, second = sink.of_type(RequestRouted)
    # the prior, bound to the decision with nothing of a queue done
    assert first.ttft_model == msgspec.structs.replace(PRIOR, queue_done_tokens=0, busy_steps=0)
    assert first.ttft_model.samples == 0
    assert second.ttft_model.samples == 1 and second.ttft_model.pool_samples == 1
    assert second.ttft_model != PRIOR
    [row] = [r for r in second.scores if r.worker_id == "w-a"]
    assert second.predicted_ttft_ms == predict_ttft_ms(row, 40, router.view.block_size, RequestPhase.AGGREGATED,
                                                       second.ttft_model)
    check.verify()
    await router.close()


async def test_a_disaggregated_request_hands_the_prefills_kv_to_the_decode_worker() -> None:
    seen: dict[str, object] = {}
    router, sink, fake, check = _scenario([_worker("p-1", "prefill"), _worker("d-1", "decode")],
                                          [prefilled(KV_PARAMS), tokens("a", "b", "c")])

    def at_call(call: Call) -> None:
        check()
        seen[call.worker] = (router.ledger.load_for("p-1"), router.ledger.load_for("d-1"))

    fake.on_call = at_call
    adm = await _admit(router, "dis-1")
    chunks = await _collect(router, adm, check)

    assert [c.text for c in chunks if c.text] == ["a", "b", "c"]
    prefill, decode = fake.calls
    assert prefill.worker == "p-1" and prefill.body["max_tokens"] == 1 and prefill.body["stream"] is False
    assert prefill.body["kv_transfer_params"] == {"do_remote_decode": True}
    # The prefill worker's engine takes a step's arrivals in the router's order: its decision time.
    assert prefill.body["routed_at_s"] == sink.of_type(RequestRouted)[0].decided_at_s
    assert decode.worker == "d-1" and decode.body["stream"] is True and "routed_at_s" not in decode.body
    assert decode.body["kv_transfer_params"] == KV_PARAMS  # forwarded as the prefill answered it
    assert _types(sink) == ["RequestAdmitted", "RequestRouted", "RequestRouted", "FirstToken",
                            "RequestCompleted"]
    assert [(r.phase, r.worker_id) for r in sink.of_type(RequestRouted)] == [
        (RequestPhase.PREFILL, "p-1"), (RequestPhase.DECODE, "d-1")]
    assert sink.of_type(RequestCompleted)[0].worker_id == "d-1"
    # While prefilling, the request is on p-1 with its prompt to compute; the decode decision
    # released that entry (the KV was handed off) before d-1 was called.
    p_load, d_load = seen["p-1"]
    assert p_load.requests == 1 and p_load.prefill_tokens > 0 and d_load == NO_INFLIGHT
    p_load, d_load = seen["d-1"]
    assert p_load == NO_INFLIGHT and d_load.requests == 1 and d_load.prefill_tokens == 0
    check.verify()
    assert len(router.ledger) == 0 and router.ledger.open_requests() == 0
    await router.close()


async def test_a_decode_failure_before_the_first_token_routes_both_phases_again() -> None:
    router, sink, fake, check = _scenario(
        [_worker("p-1", "prefill"), _worker("d-1", "decode"), _worker("d-2", "decode")],
        [prefilled(KV_PARAMS), status(503), prefilled({**KV_PARAMS, "remote_block_ids": [9]}), tokens("z")])
    adm = await _admit(router, "dis-retry")
    chunks = await _collect(router, adm, check)

    assert [c.text for c in chunks if c.text] == ["z"]
    assert _types(sink) == ["RequestAdmitted", "RequestRouted", "RequestRouted", "RequestFailed",
                            "RequestRouted", "RequestRouted", "FirstToken", "RequestCompleted"]
    [failed] = sink.of_type(RequestFailed)
    first_decode = fake.calls[1].worker
    assert failed.retried and failed.code == "worker_error" and failed.worker_id == first_decode
    routed = sink.of_type(RequestRouted)
    assert [(r.phase, r.attempt) for r in routed] == [(RequestPhase.PREFILL, 0), (RequestPhase.DECODE, 0),
                                                      (RequestPhase.PREFILL, 1), (RequestPhase.DECODE, 1)]
    assert routed[3].worker_id != first_decode and routed[3].excluded_workers == [first_decode]
    assert fake.calls[3].body["kv_transfer_params"]["remote_block_ids"] == [9]  # this attempt's handoff
    check.verify()
    await router.close()


async def test_a_decode_worker_never_reached_takes_the_same_handoff_to_another_decode_worker() -> None:
    # The prefill worker still holds the KV under this request id (and would refuse a second
    # prefill of it): only the decode phase is decided again, with the first handoff.
    router, sink, fake, check = _scenario(
        [_worker("p-1", "prefill"), _worker("d-1", "decode"), _worker("d-2", "decode")],
        [prefilled(KV_PARAMS), unreachable(), tokens("z")])
    adm = await _admit(router, "dis-unreached")
    chunks = await _collect(router, adm, check)

    assert [c.text for c in chunks if c.text] == ["z"]
    [failed] = sink.of_type(RequestFailed)
    first_decode = fake.calls[1].worker
    assert failed.retried and failed.code == "worker_unreachable" and failed.worker_id == first_decode
    routed = sink.of_type(RequestRouted)
    assert [(r.phase, r.attempt) for r in routed] == [(RequestPhase.PREFILL, 0), (RequestPhase.DECODE, 0),
                                                      (RequestPhase.DECODE, 1)]
    assert routed[2].worker_id != first_decode and routed[2].excluded_workers == [first_decode]
    assert [c.worker for c in fake.calls] == ["p-1", first_decode, routed[2].worker_id]
    assert fake.calls[2].body["kv_transfer_params"] == KV_PARAMS  # the first attempt's handoff
    check.verify()
    await router.close()


@pytest.mark.parametrize("mode", [RoutingMode.KV, RoutingMode.ROUND_ROBIN])
async def test_a_5xx_before_the_first_token_is_retried_on_the_other_worker(mode: RoutingMode) -> None:
    router, sink, fake, check = _scenario([_worker("w-a"), _worker("w-b")], [status(500), tokens("ok")], mode=mode)
    adm = await _admit(router, "retry-1")
    chunks = await _collect(router, adm, check)

    assert [c.text for c in chunks if c.text] == ["ok"]
    assert _types(sink) == ["RequestAdmitted", "RequestRouted", "RequestFailed", "RequestRouted",
                            "PrefillCompleted", "RequestCompleted"]
    first, second = (c.worker for c in fake.calls)
    assert {first, second} == {"w-a", "w-b"}
    [failed] = sink.of_type(RequestFailed)
    assert failed.retried is True and failed.code == "worker_error" and failed.worker_id == first
    assert failed.tokens_sent == 0
    r0, r1 = sink.of_type(RequestRouted)
    assert (r0.worker_id, r0.attempt, r0.excluded_workers) == (first, 0, [])
    assert (r1.worker_id, r1.attempt, r1.excluded_workers) == (second, 1, [first])
    assert sink.of_type(RequestCompleted)[0].worker_id == second
    check.verify()
    if mode is RoutingMode.ROUND_ROBIN:
        assert router.ledger.rr_cursor == {"aggregated": second}
    await router.close()


def garbled() -> Answer:
    """An answer that is not a worker's stream: a data line whose JSON is cut."""
    return lambda body: MemoryReply(200, b'data: {"choices": [{"text": "x"\n\ndata: [DONE]\n\n')


async def test_an_answer_that_is_not_a_workers_stream_is_bad_response_and_retried() -> None:
    """The worker's stream is read by the crate (``sse_events``); data it cannot read is the
    worker's fault, ``bad_response``, retried elsewhere before the first token."""
    router, sink, fake, check = _scenario([_worker("w-a"), _worker("w-b")], [garbled(), tokens("ok")])
    adm = await _admit(router, "garbled-1")
    chunks = await _collect(router, adm, check)

    assert [c.text for c in chunks if c.text] == ["ok"]
    [failed] = sink.of_type(RequestFailed)
    assert (failed.code, failed.retried, failed.worker_id) == ("bad_response", True, fake.calls[0].worker)
    assert "JSON is malformed" in failed.reason
    check.verify()
    await router.close()


@pytest.mark.parametrize(("answer", "code"), [(token_then_error, "worker_error"), (token_then_cut, "worker_lost")])
async def test_a_failure_after_the_first_token_ends_the_stream_with_an_error_and_no_retry(answer, code: str) -> None:
    router, sink, fake, check = _scenario([_worker("w-a"), _worker("w-b")], [answer("Hel"), tokens("never")])
    adm = await _admit(router, "late-1")
    chunks = await _collect(router, adm, check)

    assert [c.text for c in chunks] == ["Hel", ""]
    assert chunks[-1].error and "after 1 tokens" in chunks[-1].error
    assert len(fake.calls) == 1  # no retry: the client already has a token
    assert _types(sink) == ["RequestAdmitted", "RequestRouted", "PrefillCompleted", "RequestFailed"]
    [failed] = sink.of_type(RequestFailed)
    assert (failed.code, failed.retried, failed.tokens_sent, failed.worker_id) == (code, False, 1, fake.calls[0].worker)
    check.verify()
    assert len(router.ledger) == 0 and router.ledger.open_requests() == 0
    await router.close()


async def test_a_failure_after_the_first_token_is_an_sse_error_event_then_done() -> None:
    """The same failure through the HTTP front: the client reads its token, an OpenAI-style error
    event and the end of the stream (never a hang, never a bare 500)."""
    router, sink, fake, check = _scenario([_worker("w-a")], [token_then_error("Hel")])
    app = create_app(RouterApp(router=router, tokenizer=None, metrics=RouterMetrics(), served_model="m",
                               health=lambda: None))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
        r = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "stream": True,
                                                       "request_id": "sse-1"})
    # The request id is the router's; the client's own id is metadata, echoed apart.
    rid = r.headers["x-request-id"]
    assert r.status_code == 200 and rid.startswith("cmpl-") and r.headers["x-client-request-id"] == "sse-1"
    assert sink.of_type(RequestAdmitted)[0].client_request_id == "sse-1" and set(sink.correlation) == {rid}
    events = [line[len("data: "):] for line in r.text.split("\n\n") if line]
    assert json.loads(events[0])["choices"][0]["text"] == "Hel"
    error = json.loads(events[1])["error"]
    assert error["code"] == "worker_failed" and error["type"] == "upstream_error" and "after 1 tokens" in error["message"]
    assert events[2:] == ["[DONE]"]
    assert _types(sink) == ["RequestAdmitted", "RequestRouted", "PrefillCompleted", "RequestFailed"]
    check.verify()
    await router.close()


def token_then_raise(text: str) -> Answer:
    """One token, then an exception no worker failure explains (a bug inside the router)."""

    async def stream() -> AsyncIterator[bytes]:
        yield _sse(_token(text, 100), done=False)
        raise RuntimeError("a bug")

    return lambda body: MemoryReply(200, stream())


def _ends(sink: MemorySink) -> list[str]:
    """The events that end a request (a retried failure does not)."""
    return [type(e).__name__ for e in sink.events if isinstance(e, (RequestCompleted, RequestRejected))
            or (isinstance(e, RequestFailed) and not e.retried)]


async def _post(router: Router, stream: bool) -> tuple[httpx.Response, RouterMetrics]:
    metrics = RouterMetrics()
    app = create_app(RouterApp(router=router, tokenizer=None, metrics=metrics, served_model="m", health=lambda: None))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
        return await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "stream": stream}), metrics


async def test_a_non_streaming_answer_is_read_whole_by_the_crate_and_recorded_as_a_stream_is() -> None:
    """Not streamed, the worker's answer is read to its end by the crate (``Reply.relay``): the
    router is woken at its first token (``PrefillCompleted``) and at its end, with the same
    record a streamed answer gets (tokens from usage, cached tokens, finish reason, times)."""
    router, sink, fake, check = _scenario([_worker("w-a")], [tokens("Hel", "lo", ".")])
    r, metrics = await _post(router, stream=False)

    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"] == [{"index": 0, "text": "Hello.", "finish_reason": "length", "logprobs": None}]
    assert body["usage"] == USAGE["usage"] and body["id"] == r.headers["x-request-id"]
    assert _types(sink) == ["RequestAdmitted", "RequestRouted", "PrefillCompleted", "RequestCompleted"]
    [prefilled], [done] = sink.of_type(PrefillCompleted), sink.of_type(RequestCompleted)
    assert (done.worker_id, done.output_tokens, done.cached_tokens, done.finish_reason) == ("w-a", 3, 16, "length")
    assert 0 < done.ttft_ms == prefilled.duration_ms <= done.e2e_ms and done.itl_p50_ms >= 0
    assert fake.calls[0].body["stream"] is True  # the worker always streams; the crate reads it
    check.verify()
    assert len(router.ledger) == 0 and router.ledger.open_requests() == 0
    await router.close()


@pytest.mark.parametrize(("answer", "code"), [(token_then_error, "worker_error"), (token_then_cut, "worker_lost")])
async def test_a_non_streaming_answer_failing_after_its_first_token_is_a_502_and_no_retry(answer, code: str) -> None:
    router, sink, fake, check = _scenario([_worker("w-a"), _worker("w-b")], [answer("Hel"), tokens("never")])
    r, metrics = await _post(router, stream=False)

    assert r.status_code == 502 and r.json()["error"]["code"] == "worker_failed"
    assert "after 1 tokens" in r.json()["error"]["message"] and len(fake.calls) == 1
    assert _types(sink) == ["RequestAdmitted", "RequestRouted", "PrefillCompleted", "RequestFailed"]
    [failed] = sink.of_type(RequestFailed)
    assert (failed.code, failed.retried, failed.tokens_sent, failed.worker_id) == (code, False, 1, fake.calls[0].worker)
    check.verify()
    await router.close()


async def test_a_non_streaming_answer_that_is_not_a_workers_stream_is_retried_before_its_first_token() -> None:
    router, sink, fake, check = _scenario([_worker("w-a"), _worker("w-b")], [garbled(), tokens("ok")])
    r, _ = await _post(router, stream=False)

    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"
    [failed] = sink.of_type(RequestFailed)
    assert (failed.code, failed.retried, failed.tokens_sent) == ("bad_response", True, 0)
    assert "JSON is malformed" in failed.reason
    check.verify()
    await router.close()


async def test_a_request_whose_last_attempt_failed_ends_once_as_failed_not_also_rejected() -> None:
    """Its only worker fails before the first token and no other is left: the client gets 503,
    and the request's one end is ``RequestFailed(no_workers_left)``, never a ``RequestRejected`` too."""
    router, sink, fake, check = _scenario([_worker("w-a")], [status(500)])
    r, metrics = await _post(router, stream=False)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_workers_left"
    assert _ends(sink) == ["RequestFailed"] and sink.of_type(RequestFailed)[-1].code == "no_workers_left"
    assert metrics.registry.get_sample_value(
        "switchyard_router_requests_total", {"endpoint": "completions", "outcome": "failed"}) == 1
    check.verify()
    await router.close()


async def test_the_budget_tests_terms_are_recorded_and_a_refusal_re_executes_from_them() -> None:
    """Budget 1,000 ms: the first request (prior prediction, far below it) is admitted and its
    RequestRouted carries the test's terms (the chosen worker's prediction, margin 1); the
    second asks for 0.001 ms of its own (header): refused 429 ``ttft_budget``, its
    RequestRejected carries the terms, which re-execute to the recorded reason."""
    router, sink, fake, check = _scenario([_worker("w-a")], [tokens("Hi")], ttft_slo_ms=1000.0)
    app = create_app(RouterApp(router=router, tokenizer=None, metrics=RouterMetrics(), served_model="m",
                               health=lambda: RouterHealth("EXACT", 0, 0.0)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
        body = {"prompt": PROMPT, "max_tokens": 3, "stream": False}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        r = await client.post("/v1/completions", json=body, headers={"x-ttft-budget-ms": "0.001"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "ttft_budget"
    [routed] = sink.of_type(RequestRouted)
    t = routed.admission
    assert (t.budget_ms, t.predicted_ttft_ms, t.worker_id, t.margin, t.idle) == \
        (1000.0, routed.predicted_ttft_ms, "w-a", 1.0, False)
    assert t.at_s == routed.decided_at_s and t.spent_ms >= 0
    [rejected] = sink.of_type(RequestRejected)
    assert rejected.admission.budget_ms == 0.001 and rejected.admission.predicted_ttft_ms is not None
    assert check_rejection(rejected, None) == "match"
    check.verify()
    await router.close()


async def test_a_router_whose_loop_lags_sheds_at_once_with_its_reason_and_exports_it() -> None:
    """Smoothed lag 300 ms over the 100 ms limit: 503 ``router_overloaded`` with Retry-After,
    the worker never called, one end (``RequestRejected``) counted by reason; /metrics shows the
    lag and the (empty) admission queue. The lag back at 5 ms: the next request is served."""
    router, sink, fake, check = _scenario([_worker("w-a")], [tokens("Hi")], max_loop_lag_ms=100)
    lag = {"now": LoopLag(0.3, 0.4, 1.0, 20)}
    router.loop_lag = lambda: lag["now"]
    metrics = RouterMetrics()
    app = create_app(RouterApp(router=router, tokenizer=None, metrics=metrics, served_model="m",
                               health=lambda: RouterHealth("EXACT", 0, 0.0)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
        body = {"prompt": PROMPT, "max_tokens": 3, "stream": False}
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "router_overloaded" and "300 ms late" in r.json()["error"]["message"]
        assert _ends(sink) == ["RequestRejected"] and sink.of_type(RequestRejected)[0].http_status == 503
        assert fake.calls == [] and metrics.registry.get_sample_value(
            "switchyard_router_rejections_total", {"code": "router_overloaded"}) == 1
        exported = (await client.get("/metrics")).text
        assert "switchyard_router_event_loop_lag_seconds 0.3" in exported
        assert "switchyard_router_admission_queue_requests 0.0" in exported
        assert 'switchyard_router_worker_calls{state="in_flight"} 0.0' in exported
        assert 'switchyard_router_worker_calls{state="ready"} 0.0' in exported
        lag["now"] = LoopLag(0.005, 0.004, 2.0, 40)
        assert (await client.post("/v1/completions", json=body)).status_code == 200
    check.verify()
    await router.close()


async def test_a_bug_mid_stream_ends_the_request_once_as_a_router_error() -> None:
    """An exception inside the router after the first token: an SSE error event, and one end,
    ``RequestFailed(router_error)`` (not also ``client_cancelled``)."""
    router, sink, fake, check = _scenario([_worker("w-a")], [token_then_raise("Hel")])
    r, _ = await _post(router, stream=True)
    events = [line[len("data: "):] for line in r.text.split("\n\n") if line]
    assert json.loads(events[1])["error"]["message"] == "router error: RuntimeError" and events[2:] == ["[DONE]"]
    assert _ends(sink) == ["RequestFailed"] and sink.of_type(RequestFailed)[-1].code == "router_error"
    check.verify()
    await router.close()


async def _close_between_tokens(stream: AsyncIterator[Chunk], first: list[Chunk], check: FoldCheck) -> None:
    first.append(await stream.__anext__())
    check()
    await stream.aclose()  # what the HTTP front does when the client is gone (its finally)


async def _cancel_while_waiting(stream: AsyncIterator[Chunk], first: list[Chunk], check: FoldCheck) -> None:
    got_one = asyncio.Event()

    async def client() -> None:
        async for chunk in stream:
            first.append(chunk)
            check()
            got_one.set()

    task = asyncio.ensure_future(client())
    # The client task sets the event and asks for the next token at once (no await between):
    # when this task resumes, the router is waiting on the worker's next line.
    await got_one.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize("leave", [_close_between_tokens, _cancel_while_waiting],
                         ids=["closed between tokens", "cancelled while waiting for a token"])
async def test_a_client_going_away_mid_stream_ends_the_request_as_client_cancelled(leave) -> None:
    release = asyncio.Event()
    router, sink, fake, check = _scenario([_worker("w-a")], [token_then_hold("Hel", release)])
    try:
        adm = await _admit(router, "gone-1")
        first: list[Chunk] = []
        await leave(router.serve(adm), first, check)

        assert [c.text for c in first] == ["Hel"]
        assert _types(sink) == ["RequestAdmitted", "RequestRouted", "PrefillCompleted", "RequestFailed"]
        [failed] = sink.of_type(RequestFailed)
        assert (failed.code, failed.retried, failed.request_id) == ("client_cancelled", False, "gone-1")
        assert len(fake.calls) == 1
        check.verify()
        assert len(router.ledger) == 0 and router.ledger.open_requests() == 0
    finally:
        release.set()
        await router.close()


async def test_the_ledger_is_the_fold_while_requests_are_in_flight() -> None:
    """Two requests with one prompt on one worker: while the first still decodes, the second is
    routed, served and completed. The fold equals the live ledger with one request open (its
    blocks held on w-a, shared with the second while both run), and again once it ends."""
    release = asyncio.Event()
    router, sink, fake, check = _scenario([_worker("w-a")], [token_then_hold("A", release), tokens("B")])
    adm_a = await _admit(router, "inflight-a")
    stream_a = router.serve(adm_a)
    assert (await stream_a.__anext__()).text == "A"
    held = router.ledger.load_for("w-a")
    assert held.requests == 1 and held.prefill_tokens == 0 and held.decode_blocks >= 2
    assert router.ledger.view(_hashes(router))["w-a"].shared_blocks == 2  # the speculative overlap

    adm_b = await _admit(router, "inflight-b")
    assert [c.text for c in await _collect(router, adm_b, check) if c.text] == ["B"]
    check.verify()
    assert router.ledger.open_requests() == 1 and len(router.ledger) == 1
    assert router.ledger.load_for("w-a") == held

    release.set()
    rest = [c async for c in stream_a]
    assert [c.text for c in rest if c.text] == ["!"]
    check.verify()
    assert len(router.ledger) == 0 and router.ledger.open_requests() == 0
    assert [type(e).__name__ for e in sink.events if e.request_id == "inflight-a"] == [
        "RequestAdmitted", "RequestRouted", "PrefillCompleted", "RequestCompleted"]
    await router.close()


async def test_a_decision_that_finds_no_worker_leaves_the_ledger_the_fold_of_the_log() -> None:
    """A's entry outlives its lifetime (``inflight_ttl_s``) while A still streams; then B finds
    no routable worker. The live ledger expired A's entry when B's decision prepared it; the log
    holds nothing that says so."""
    release = asyncio.Event()
    ttl = 0.05
    router, sink, fake, check = _scenario([_worker("w-a")], [token_then_hold("A", release)], inflight_ttl_s=ttl)
    try:
        stream_a = router.serve(await _admit(router, "ttl-a"))
        assert (await stream_a.__anext__()).text == "A"
        [routed] = sink.of_type(RequestRouted)
        # The ledger's expiry runs on the wall clock the router stamps decisions with.
        await until(lambda: time.time() > routed.decided_at_s + ttl, timeout=5, what="A's entry past its lifetime")
        router.view.workers["w-a"] = _worker("w-a", state="draining")
        adm_b = await _admit(router, "ttl-b")
        with pytest.raises(RouterRejected) as refused:
            [c async for c in router.serve(adm_b)]
        # As serving does: the rejection is the request's end, recorded once.
        assert router.reject(adm_b, str(refused.value), refused.value.code, refused.value.status)
        assert not router.reject(adm_b, str(refused.value), refused.value.code, refused.value.status)
        assert _types(sink)[-2:] == ["RequestAdmitted", "RequestRejected"]
        check.verify()
    finally:
        release.set()
        await router.close()


def test_the_fold_check_sees_a_ledger_that_drifts_from_the_log() -> None:
    """The property is not vacuous: a ledger change that was not published is a mismatch."""
    router, sink, fake, check = _scenario([_worker("w-a")], [])
    adm = router.admit(request_id="drift", model="m", tokens=PROMPT, max_tokens=3, stream=True, endpoint="completions")
    router.decide(adm, RequestPhase.AGGREGATED, set(), 0)
    check()
    assert check.mismatches == []
    router.ledger.inflight.prefill_done("drift")  # by hand, not from an event
    check()
    assert check.mismatches and check.mismatches[0][1]["load_for"]["w-a"].prefill_tokens == 0
    assert check.mismatches[0][2]["load_for"]["w-a"].prefill_tokens > 0
    assert check.mismatches[0][2]["load_for"]["w-a"].requests == 1
