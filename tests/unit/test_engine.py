"""Unit tests of the simulated engine (``data_plane.engines``): pure core, no mocks.

Builders take ``**overrides``; each test states the arithmetic it checks.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from common.hashing import hash_block_digests, hash_blocks
from data_plane.engines import (
    Admission,
    AsyncEngine,
    EngineCore,
    EngineRequest,
    MooncakeTrace,
    PolynomialTiming,
    ProfileError,
    RequestRejected,
    StepShape,
    TraceRecord,
    default_hash_config,
    load_profile,
    pseudo_token,
    read_mooncake,
    request_seed,
    simulate,
)
from common.log.sink import MemorySink
from schemas.events import AllBlocksCleared, BlockRemoved, BlockStored
from schemas.types import RequestPhase, Tier, WorkerRole


def _profile(**overrides):
    """A tiny vLLM-semantics profile: 8 blocks of 4 tokens, mocker polynomial timing."""
    base = dict(
        block_size=4,
        num_device_blocks=8,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        admission=Admission.CHUNK,
        reuse_uncached_first=False,
    )
    base.update(overrides)
    return load_profile("mocker").replace(name="tiny", **base)


def _core(role=WorkerRole.AGGREGATED, on_evict=None, **overrides) -> EngineCore:
    prof = _profile(**overrides)
    return EngineCore(
        prof, role=role, hash_config=default_hash_config(prof.block_size), on_evict=on_evict
    )


def _req(rid: str, prompt, max_tokens: int = 1, **kw) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt=list(prompt), max_tokens=max_tokens, **kw)


def _drain(core: EngineCore, max_steps: int = 10_000) -> list:
    """Step until idle; return the step results."""
    out = []
    while core.has_work() and len(out) < max_steps:
        res = core.step()
        if res.num_scheduled == 0:
            break
        out.append(res)
    return out


# --------------------------------------------------------------------------------------------
# Block pool: prefix cache hits, misses and LRU eviction
# --------------------------------------------------------------------------------------------


def test_prefix_cache_and_lru_eviction_worked_example():
    """8 blocks of 4 tokens; requests run one after the other, each with max_tokens=1.

    A = tokens 1..10 (3 blocks: 0, 1 full -> hashes a0, a1; 2 partial). Freed last block
    first, after the never-used blocks: free queue = 3 4 5 6 7 | 2 1 0.
    B = tokens 1..8, 20..24 (13 tokens). Hit limit (13-1)//4 = 3 blocks; a0, a1 hit (blocks 0,
    1 leave the free queue), b2 misses. B takes blocks 3 (b2, full) and 4 (partial): 8 cached
    tokens. Freed: queue = 5 6 7 2 | 4 3 1 0.
    C = 24 fresh tokens (6 blocks): pops 5 6 7 2 4 (no hash: nothing evicted) and 3, which
    evicts b2 (the least recently freed *cached* block): one BlockRemoved([b2]) and
    on_evict(b2, parent a1). a0 and a1 survive because they were freed later.
    B again: a0, a1 hit, b2 misses -> 8 cached tokens; its own b2 is recomputed and stored.
    """
    evicted = []
    core = _core(on_evict=lambda h, parent: evicted.append((h, parent)))
    a = list(range(1, 11))
    b = list(range(1, 9)) + [20, 21, 22, 23, 24]
    c = list(range(100, 124))
    cfg = default_hash_config(4)
    a0, a1 = hash_blocks(a, cfg)
    _, _, b2 = hash_blocks(b, cfg)

    core.add_request(_req("A", a))
    _drain(core)
    assert core.pool.free_order() == [3, 4, 5, 6, 7, 2, 1, 0]
    stored = core.take_kv_events()
    assert [e.block_hashes for e in stored] == [[a0, a1]]
    assert stored[0].parent_hash is None and stored[0].tier is Tier.DEVICE

    core.add_request(_req("B", b))
    (res,) = _drain(core)
    assert res.admitted == [("B", 8)]
    assert core.pool.free_order() == [5, 6, 7, 2, 4, 3, 1, 0]
    (ev,) = core.take_kv_events()
    assert ev.block_hashes == [b2] and ev.parent_hash == a1

    core.add_request(_req("C", c))
    (res,) = _drain(core)
    assert res.admitted == [("C", 0)]
    events = core.take_kv_events()
    assert [type(e) for e in events] == [BlockRemoved, BlockStored]
    assert events[0].block_hashes == [b2]
    assert evicted == [(b2, a1)]
    assert core.pool.get_cached_block(a0) is not None and core.pool.get_cached_block(b2) is None

    core.add_request(_req("B2", b))
    (res,) = _drain(core)
    assert res.admitted == [("B2", 8)]


def test_uncached_blocks_reused_first_like_dynamo_mocker():
    """With ``reuse_uncached_first`` A's partial block 2 goes to the head when freed:
    free queue = 2 3 4 5 6 7 | 1 0 (vLLM would put it after 7)."""
    core = _core(reuse_uncached_first=True)
    core.add_request(_req("A", range(1, 11)))
    _drain(core)
    assert core.pool.free_order() == [2, 3, 4, 5, 6, 7, 1, 0]


def test_fully_cached_prompt_recomputes_last_block():
    """A prompt of exactly 8 tokens (2 blocks) seen before hits only (8-1)//4 = 1 block: the last
    token must be computed, so block 1 is recomputed (a second copy of the same hash)."""
    core = _core()
    core.add_request(_req("A", range(8)))
    _drain(core)
    core.take_kv_events()
    core.add_request(_req("B", range(8)))
    (res,) = _drain(core)
    assert res.admitted == [("B", 4)]
    assert res.shape.prefill_tokens == 4
    (stored,) = core.take_kv_events()
    assert stored.block_hashes == hash_blocks(list(range(8)), default_hash_config(4))[1:]


def test_reset_prefix_cache_emits_all_blocks_cleared_only_when_idle():
    core = _core()
    core.add_request(_req("A", range(10), max_tokens=3))
    core.step()
    assert core.reset_prefix_cache() is False  # A holds blocks
    _drain(core)
    core.take_kv_events()
    assert core.reset_prefix_cache() is True
    assert core.take_kv_events() == [AllBlocksCleared(worker_id=core.worker_id, tier=Tier.DEVICE)]
    assert core.pool.num_cached_blocks == 0


def test_event_hashes_match_router_hashing_including_generated_blocks():
    """Blocks filled by generated tokens are hashed too, chained after the prompt, from the
    deterministic pseudo-tokens: the router can recompute every stored hash."""
    core = _core()
    prompt = list(range(50, 56))  # 6 tokens
    core.add_request(_req("A", prompt, max_tokens=9))
    _drain(core)
    seed = request_seed("A")
    out = [pseudo_token(seed, i) for i in range(9)]
    stored = [h for e in core.take_kv_events() if isinstance(e, BlockStored) for h in e.block_hashes]
    # The 15th token (out[8]) is sampled but never fed, so 14 computed tokens = 3 full blocks.
    assert stored == hash_blocks(prompt + out[:6], default_hash_config(4))


def test_one_block_stored_per_request_per_step():
    """Two requests chunked in the same step each get their own BlockStored."""
    core = _core(max_num_batched_tokens=12)
    core.add_request(_req("A", range(0, 8)))
    core.add_request(_req("B", range(100, 108)))
    core.step()  # A: 8 tokens (2 blocks full), B: 4 tokens (1 block full)
    events = core.take_kv_events()
    assert [len(e.block_hashes) for e in events] == [2, 1]


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def test_polynomial_timing_matches_formulas_exactly():
    t = PolynomialTiming()
    for n in (1, 100, 1434, 8192):
        assert t.prefill_ms(n) == 4.209989e-7 * n * n + 1.518344e-2 * n + 16.50142
    for u in (0.0, 0.25, 0.5, 1.0):
        assert t.decode_ms(u) == max(1.0, -25.74 * u * u + 54.01 * u + 5.74)
    assert t.decode_ms(-1.0) == 1.0  # floor
    cap = 16384 * 64
    shape = StepShape(
        prefill_tokens=5376, decode_seqs=1, decode_context_tokens=6759, kv_capacity_tokens=cap
    )
    assert t.step_ms(shape) == t.prefill_ms(5376) + t.decode_ms(6759 / cap)
    idle_decodes = StepShape(decode_seqs=3, decode_context_tokens=0, kv_capacity_tokens=cap)
    assert t.step_ms(idle_decodes) == t.decode_ms(0)  # no batch-size term
    assert t.step_ms(StepShape()) == 0.0


def test_mocker_profile_reproduces_dynamo_measured_ttfts():
    """First two lines of the Mooncake conversation trace on one worker, measured with
    ai-dynamo-runtime 1.6.1's mocker: TTFT 169.136918 ms and 285.519032 ms, 512 reused tokens.

    Step 1: A's 6,758 tokens + B's first 1,434 (B hits 8 blocks = 512 tokens of A's prefix,
    cached at scheduling time): prefill(8192) = 169.1369 ms, A's first token.
    Step 2: B's last 5,376 tokens + A's decode at sequence length 6,759:
    prefill(5376) + decode(6759 / 1,048,576) = 110.2951 + 6.0871 = 116.3821 ms.
    """
    records = [
        TraceRecord(0, 6758, 500, tuple(range(0, 14))),
        TraceRecord(0, 7322, 490, (0, *range(14, 28))),
    ]
    trace = MooncakeTrace(default_hash_config(64))
    res = simulate(list(trace.requests(records)), "mocker")
    a, b = res.requests
    assert a.ttft_ms == pytest.approx(169.136918, abs=1e-5)
    assert b.ttft_ms == pytest.approx(285.519032, abs=1e-5)
    assert (a.cached_tokens, b.cached_tokens) == (0, 512)
    assert b.itl_ms[0] == pytest.approx(6.460743, abs=1e-5)  # both decode: u = (6760+7323)/C


def test_roofline_decode_grows_with_batch_and_context():
    t = load_profile("h100_llama3_8b").timing

    def decode(batch, ctx):
        return t.step_ms(StepShape(decode_seqs=batch, decode_context_tokens=batch * ctx))

    assert decode(1, 1000) < decode(8, 1000) < decode(64, 1000) < decode(256, 1000)
    assert decode(32, 500) < decode(32, 2000) < decode(32, 8000)
    assert 6.0 < decode(1, 1000) < 9.0  # ~137 tok/s single stream (see the profile file)


def test_profile_errors():
    with pytest.raises(ProfileError):
        load_profile("no_such_profile")
    with pytest.raises(ProfileError):
        _profile(num_device_blocks=0)


# --------------------------------------------------------------------------------------------
# Scheduler
# --------------------------------------------------------------------------------------------


def test_chunked_prefill_respects_token_budget():
    """Budget 16: A (prompt 40) runs alone: chunks 16, 16, 8 -> first token after step 3.
    B (prompt 30) arrives then: step 4 = A's decode (1) + B's first 15 tokens = 16."""
    core = _core(max_num_batched_tokens=16, num_device_blocks=32)
    core.add_request(_req("A", range(40), max_tokens=4))
    shapes = [core.step().shape for _ in range(3)]
    assert [s.prefill_tokens for s in shapes] == [16, 16, 8]
    core.add_request(_req("B", range(100, 130), max_tokens=2))
    s4 = core.step().shape
    assert (s4.decode_seqs, s4.prefill_tokens) == (1, 15)
    for res in _drain(core):
        assert res.shape.prefill_tokens + res.shape.decode_seqs <= 16


def test_preemption_under_pressure_is_lifo_and_recomputes():
    """8 blocks of 4 = 32 tokens. A, B, C each have a 6-token prompt and want 14 tokens: 19
    computed tokens = 5 blocks each, 15 for all three. When decoding runs out of blocks the
    *last admitted* running request (C) is preempted, freed, and re-queued at the front; it
    recomputes later. Every request still gets exactly its 14 deterministic tokens."""
    core = _core()
    for rid, base in (("A", 0), ("B", 100), ("C", 200)):
        core.add_request(_req(rid, range(base, base + 6), max_tokens=14))
    results = _drain(core)
    preempted = [rid for r in results for rid in r.preempted]
    assert preempted and preempted[0] == "C"
    assert core.stats().preemptions == len(preempted)
    tokens = {}
    for r in results:
        for t in r.tokens:
            tokens.setdefault(t.request_id, []).append(t.token_id)
    for rid in "ABC":
        assert tokens[rid] == [pseudo_token(request_seed(rid), i) for i in range(14)]
    assert core.pool.num_free_blocks == 8


def test_max_num_seqs_limits_running():
    core = _core(max_num_seqs=2, num_device_blocks=64)
    for i in range(4):
        core.add_request(_req(f"r{i}", range(i * 10, i * 10 + 5), max_tokens=3))
    core.step()
    assert core.stats().running == 2 and core.stats().waiting == 2


def test_whole_prompt_admission_waits_for_free_blocks():
    """Budget 25, 8 blocks: A takes 24 tokens = 6 blocks, leaving 2 free and 1 budget token.
    vLLM (chunk admission) starts B's first chunk (1 token, 1 block); the mocker's rule wants
    B's whole 10 tokens (3 blocks) free, so B waits."""
    for admission, waiting in ((Admission.CHUNK, 0), (Admission.WHOLE_PROMPT, 1)):
        core = _core(admission=admission, max_num_batched_tokens=25)
        core.add_request(_req("A", range(24), max_tokens=3))
        core.add_request(_req("B", range(100, 110)))
        core.step()
        assert core.stats().waiting == waiting


def test_request_that_can_never_fit_is_rejected():
    core = _core()
    with pytest.raises(RequestRejected):
        core.add_request(_req("big", range(30), max_tokens=3))  # 33 tokens > 32
    with pytest.raises(RequestRejected):
        _req("empty", [])


# --------------------------------------------------------------------------------------------
# Roles
# --------------------------------------------------------------------------------------------


def test_prefill_role_holds_blocks_until_release():
    """Prefill worker: 10-token prompt -> 3 blocks, one token, then the blocks stay referenced
    (held for the NIXL transfer) until release(); no decode time is ever charged."""
    core = _core(role=WorkerRole.PREFILL)
    core.add_request(_req("A", range(10), max_tokens=50))
    (res,) = _drain(core)
    assert [(t.index, t.finished) for t in res.tokens] == [(0, True)]
    assert res.finished == ["A"] and res.shape.decode_seqs == 0
    assert core.is_held("A") and core.held_block_ids("A") == [0, 1, 2]
    assert core.pool.num_free_blocks == 5
    assert core.release("A") is True and core.release("A") is False
    assert core.pool.num_free_blocks == 8
    assert core.pool.num_cached_blocks == 2  # freed, still prefix hits


def test_held_blocks_delay_admission_until_release_in_simulation():
    """Prefill worker with 8 blocks: A (20 tokens = 5 blocks) is held after its token; B (16
    tokens = 4 blocks) cannot get its blocks until A is released 100 ms later."""
    prof = _profile()
    reqs = [_req("A", range(20), max_tokens=10, arrival_ms=0.0), _req("B", range(100, 116), arrival_ms=1.0)]
    cfg = default_hash_config(4)
    a, b = simulate(reqs, prof, role=WorkerRole.PREFILL, release_after_ms=100.0, hash_config=cfg).requests
    assert a.output_tokens == 1 and b.output_tokens == 1
    assert b.first_token_ms > a.first_token_ms + 100.0
    never = simulate(reqs, prof, role=WorkerRole.PREFILL, release_after_ms=None, hash_config=cfg)
    assert never.requests[1].output_tokens == 0 and not never.requests[1].finished


def test_decode_role_allocates_transferred_prompt_without_prefill():
    """Decode worker: prompt KV (10 tokens) already transferred, first token from the prefill
    worker in ``output_prefix``. Admission allocates ceil(11/4) = 3 blocks, stores the 2 full
    prompt blocks, and the first step is a decode (no prefill tokens): 4 more tokens follow."""
    core = _core(role=WorkerRole.DECODE)
    prompt = list(range(10))
    first = pseudo_token(request_seed("A"), 0)
    core.add_request(_req("A", prompt, max_tokens=5, output_prefix=(first,)))
    results = _drain(core)
    assert results[0].shape.prefill_tokens == 0 and results[0].shape.decode_seqs == 1
    assert results[0].shape.decode_context_tokens == 11
    assert [t.index for r in results for t in r.tokens] == [1, 2, 3, 4]
    stored = [e for e in core.take_kv_events() if isinstance(e, BlockStored)]
    assert stored[0].block_hashes == hash_blocks(prompt, default_hash_config(4))


def test_decode_role_without_first_token_generates_all_tokens():
    core = _core(role=WorkerRole.DECODE)
    core.add_request(_req("A", range(10), max_tokens=3))
    results = _drain(core)
    assert all(r.shape.prefill_tokens == 0 for r in results)
    assert [t.index for r in results for t in r.tokens] == [0, 1, 2]


def test_request_phase_overrides_the_role():
    """A decode worker recomputes a prompt whose transfer failed (phase AGGREGATED: 10 prefill
    tokens, then 2 more tokens); a prefill worker serves a plain request whole; an aggregated
    worker holds a PREFILL-phase request like a prefill worker would."""
    dec = _core(role=WorkerRole.DECODE)
    dec.add_request(_req("A", range(10), max_tokens=3, phase=RequestPhase.AGGREGATED))
    results = _drain(dec)
    assert results[0].shape.prefill_tokens == 10
    assert [t.index for r in results for t in r.tokens] == [0, 1, 2]

    pre = _core(role=WorkerRole.PREFILL)
    pre.add_request(_req("B", range(10), max_tokens=3, phase=RequestPhase.AGGREGATED))
    assert [t.index for r in _drain(pre) for t in r.tokens] == [0, 1, 2]
    assert not pre.is_held("B") and pre.pool.num_free_blocks == 8

    agg = _core()
    agg.add_request(_req("C", range(10), max_tokens=50, phase=RequestPhase.PREFILL))
    assert [t.index for r in _drain(agg) for t in r.tokens] == [0]
    assert agg.held_block_ids("C") == [0, 1, 2]


def test_prefill_phase_request_is_validated_for_one_token():
    """8 blocks of 4 tokens: a 30-token prompt fits for prefill (31 tokens, 8 blocks) but not
    with 10 output tokens (40 tokens, 10 blocks)."""
    core = _core()
    core.validate_request(_req("A", range(30), max_tokens=10, phase=RequestPhase.PREFILL))
    with pytest.raises(RequestRejected):
        core.validate_request(_req("A", range(30), max_tokens=10))


# --------------------------------------------------------------------------------------------
# Drivers
# --------------------------------------------------------------------------------------------


def _workload():
    """12 requests over 3 shared prefixes, arriving every 15 ms, on a pool small enough to
    preempt (48 blocks of 16 tokens)."""
    out = []
    for i in range(12):
        prompt = [(i % 3) * 1000 + j for j in range(40 + 17 * i)]
        out.append(_req(f"r{i}", prompt, max_tokens=20 + 3 * i, arrival_ms=15.0 * i))
    return out


def _driver_profile():
    return _profile(block_size=16, num_device_blocks=30, max_num_batched_tokens=128, max_num_seqs=6)


def test_simulation_and_real_time_runs_agree():
    """Same input -> same KV events, same tokens, same virtual token times, whether the core is
    driven by the discrete-event simulation or by the asyncio engine at 1000x real time."""
    prof = _driver_profile()
    sim_sink = MemorySink()
    res = simulate(_workload(), prof, sink=sim_sink, hash_config=default_hash_config(16))
    assert res.preemptions > 0 and any(r.cached_tokens for r in res.requests)

    async def run():
        sink = MemorySink()
        eng = AsyncEngine(EngineCore(prof, hash_config=default_hash_config(16)), speedup=1000.0, sink=sink)
        streams = [eng.submit(r) for r in _workload()]
        async with eng:
            outs = await asyncio.wait_for(asyncio.gather(*(s.collect() for s in streams)), 30)
        return sink, {s.request_id: [(t.token_id, t.time_ms) for t in o] for s, o in zip(streams, outs)}

    sink, streamed = asyncio.run(run())
    assert sink.events == sim_sink.events
    for rec in res.requests:
        seed = request_seed(rec.request_id)
        expected = [(pseudo_token(seed, i), t) for i, t in enumerate(rec.token_times)]
        assert streamed[rec.request_id] == expected


def test_async_engine_streams_live_requests_and_abort():
    async def run():
        eng = AsyncEngine(_core(num_device_blocks=64), speedup=100.0)
        async with eng:
            s1 = eng.submit(_req("A", range(10), max_tokens=5))
            s2 = eng.submit(_req("B", range(20, 30), max_tokens=200))
            toks = await s1.collect()
            assert eng.abort("B") is True and eng.abort("B") is False
            rest = await s2.collect()
        return toks, rest

    toks, rest = asyncio.run(run())
    with pytest.raises(RequestRejected):  # 210 + 500 tokens > 64 blocks * 4: refused at submit
        AsyncEngine(_core(num_device_blocks=64)).submit(_req("C", range(210), max_tokens=500))
    assert [t.index for t in toks] == [0, 1, 2, 3, 4] and toks[-1].finish_reason == "length"
    assert all(b.time_ms >= a.time_ms for a, b in zip(toks, toks[1:]))
    assert rest[-1].finish_reason == "abort"


def test_simulation_is_deterministic_and_counts_tokens():
    prof = _driver_profile()
    a = simulate(_workload(), prof, hash_config=default_hash_config(16)).summary()
    b = simulate(_workload(), prof, hash_config=default_hash_config(16)).summary()
    assert a == b
    assert a["completed"] == 12 and a["output_tokens"] == sum(20 + 3 * i for i in range(12))


# --------------------------------------------------------------------------------------------
# Trace tooling
# --------------------------------------------------------------------------------------------


def test_trace_prompts_share_exactly_the_hash_id_prefix(tmp_path):
    """Each trace hash id = 512 tokens = 8 engine blocks of 64. Prompts [7, 8, 9] and [7, 8, 5]
    share 2 hash ids -> 1,024 tokens -> 16 equal chained engine hashes, then differ. The
    memoised digests equal hashing the synthesized tokens directly."""
    path = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1500, "output_length": 3, "hash_ids": [7, 8, 9]},
        {"timestamp": 5, "input_length": 1300, "output_length": 2, "hash_ids": [7, 8, 5]},
        {"timestamp": 9, "input_length": 700, "output_length": 1, "hash_ids": [7, 8]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = default_hash_config(64)
    trace = MooncakeTrace(cfg)
    recs = read_mooncake(path)
    x, y, z = (list(trace.requests(recs)))
    assert x.prompt[:1024] == y.prompt[:1024] and x.prompt[1024:1100] != y.prompt[1024:1100]
    hx, hy = hash_blocks(x.prompt[:], cfg), hash_blocks(y.prompt[:], cfg)
    assert hx[:16] == hy[:16] and hx[16] != hy[16]
    for r in (x, y, z):
        assert list(r.prompt_digests) == hash_block_digests(r.prompt[:], cfg)
    assert len(z.prompt) == 700 and len(z.prompt_digests) == 10  # 512 + 188: 8 + 2 full blocks
    assert z.arrival_ms == 9.0 and x.max_tokens == 3


# --------------------------------------------------------------------------------------------
# Fast paths: coalesced decode runs, native hashing, vectorised timing. Each is checked against
# the plain implementation it replaces, on random inputs.
# --------------------------------------------------------------------------------------------


def _reference_simulate(requests, prof, *, num_workers=1, role=WorkerRole.AGGREGATED, router="round_robin",
                        sink=None, release_after_ms=0.0, emit_token_ids=False):
    """The simulation loop as it was before decode runs were coalesced, verbatim: one event
    heap, one ``EngineCore.step()`` per step. The oracle of the equivalence tests."""
    import heapq

    from data_plane.engines import RequestRecord, SimulationResult, round_robin

    ids = [f"worker-{i}" for i in range(num_workers)]
    cores = [EngineCore(prof, worker_id=w, role=role, hash_config=default_hash_config(prof.block_size),
                        emit_token_ids=emit_token_ids) for w in ids]
    route = round_robin() if router == "round_robin" else router
    _ARRIVAL, _RELEASE, _BOUNDARY = 0, 1, 2
    reqs = sorted(requests, key=lambda r: r.arrival_ms or 0.0)
    records, ordered, heap, seq = {}, [], [], 0
    for r in reqs:
        heap.append((r.arrival_ms or 0.0, _ARRIVAL, seq, -1, r))
        seq += 1
    heapq.heapify(heap)
    busy = [False] * num_workers
    steps, last_time = 0, 0.0
    first_arrival = (reqs[0].arrival_ms or 0.0) if reqs else 0.0
    while heap:
        t, kind, _, w, payload = heapq.heappop(heap)
        if kind == _ARRIVAL:
            w = route(payload, cores)
            rec = RequestRecord(payload.request_id, ids[w], t, len(payload.prompt), payload.max_tokens)
            records[payload.request_id] = rec
            ordered.append(rec)
            cores[w].add_request(payload)
            if not busy[w]:
                busy[w] = True
                heapq.heappush(heap, (t, _BOUNDARY, seq, w, None))
                seq += 1
            continue
        core = cores[w]
        if kind == _RELEASE:
            core.release(payload)
            if not busy[w] and core.has_work():
                busy[w] = True
                heapq.heappush(heap, (t, _BOUNDARY, seq, w, None))
                seq += 1
            continue
        if payload is not None:
            for tok in payload.tokens:
                rec = records[tok.request_id]
                rec.token_times.append(t)
                if tok.finished:
                    rec.finished = True
            for rid, cached in payload.admitted:
                records[rid].cached_tokens = cached
            if role is WorkerRole.PREFILL and release_after_ms is not None:
                for rid in payload.finished:
                    heapq.heappush(heap, (t + release_after_ms, _RELEASE, seq, w, rid))
                    seq += 1
            events = core.take_kv_events()
            if sink is not None:
                for ev in events:
                    sink.publish(ev)
            last_time = t
        res = core.step()
        if res.num_scheduled == 0:
            busy[w] = False
            continue
        steps += 1
        heapq.heappush(heap, (t + res.duration_ms, _BOUNDARY, seq, w, res))
        seq += 1
    return SimulationResult(ordered, last_time - first_arrival, steps,
                            sum(c.scheduler.num_preemptions for c in cores), prof.name, num_workers), cores


def _random_case(seed: int):
    """A random small workload and engine: shared prefixes, arrival ties, long outputs, small
    pools (preemption), every admission rule and role."""
    import random

    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 16])
    role = rng.choice([WorkerRole.AGGREGATED] * 3 + [WorkerRole.PREFILL, WorkerRole.DECODE])
    prof = _profile(
        block_size=bs,
        num_device_blocks=rng.choice([12, 24, 48, 200]) * (16 // bs if bs < 16 else 1),
        max_num_seqs=rng.choice([1, 2, 4, 8]),
        max_num_batched_tokens=rng.choice([16, 48, 256]),
        admission=rng.choice([Admission.CHUNK, Admission.WHOLE_PROMPT]),
        reuse_uncached_first=rng.random() < 0.5,
        enable_prefix_caching=rng.random() < 0.85,
        enable_chunked_prefill=rng.random() < 0.8,
    )
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(1, 40))] for _ in range(3)]
    reqs = []
    t = 0.0
    cap = prof.num_device_blocks * bs
    for i in range(rng.randrange(3, 14)):
        if rng.random() < 0.6:
            t += rng.choice([0.0, 1.0, 7.5, 30.0, 250.0])
        prompt = rng.choice(prefixes)[: rng.randrange(1, 40)] + [rng.randrange(1000) for _ in range(rng.randrange(0, 30))]
        max_tokens = rng.choice([1, 2, 5, 40, 150])
        prompt = prompt[: max(1, cap // 2 - max_tokens)] or [1]
        if len(prompt) + max_tokens > cap:
            max_tokens = max(1, cap - len(prompt))
        prefix = ()
        if role is WorkerRole.DECODE and max_tokens > 1 and rng.random() < 0.7:
            prefix = (rng.randrange(1000),)
        reqs.append(_req(f"q{seed}-{i}", prompt, max_tokens=max_tokens, arrival_ms=t, output_prefix=prefix))
    workers = rng.choice([1, 2, 3])
    return prof, role, workers, reqs, rng


def _same_run(a, b):
    assert [r.request_id for r in a.requests] == [r.request_id for r in b.requests]
    for x, y in zip(a.requests, b.requests):
        assert (x.worker_id, x.arrival_ms, x.cached_tokens, x.finished) == (y.worker_id, y.arrival_ms, y.cached_tokens, y.finished)
        assert list(x.token_times) == list(y.token_times), x.request_id
    assert (a.steps, a.preemptions, a.duration_ms) == (b.steps, b.preemptions, b.duration_ms)


@pytest.mark.parametrize("seed", range(60))
def test_coalesced_simulation_equals_step_by_step(seed):
    """Property: on random workloads, the simulation with coalesced decode runs produces the
    same records (every token time, bit for bit), step count, preemptions and KV event stream,
    in the same order, as the original one-step-at-a-time loop, and as ``coalesce=False``."""
    prof, role, workers, reqs, rng = _random_case(seed)
    release = rng.choice([0.0, 3.0, 100.0]) if role is WorkerRole.PREFILL else 0.0
    emit = rng.random() < 0.3
    ref_sink, sink, slow_sink = MemorySink(), MemorySink(), MemorySink()
    ref, _ = _reference_simulate(reqs, prof, num_workers=workers, role=role, sink=ref_sink,
                                 release_after_ms=release, emit_token_ids=emit)
    kw = dict(num_workers=workers, role=role, hash_config=default_hash_config(prof.block_size),
              release_after_ms=release, emit_token_ids=emit)
    fast = simulate(reqs, prof, sink=sink, **kw)
    slow = simulate(reqs, prof, sink=slow_sink, coalesce=False, **kw)
    _same_run(fast, ref)
    _same_run(slow, ref)
    assert sink.events == ref_sink.events
    assert slow_sink.events == ref_sink.events
    no_sink = simulate(reqs, prof, **kw)
    _same_run(no_sink, ref)


@pytest.mark.parametrize("seed", range(20))
def test_coalesced_simulation_with_a_stateful_router_and_exact_ties(seed):
    """A router that reads the engines' stats at each arrival sees them exactly as the
    step-by-step loop does; workers given identical work tie at every step boundary, and the
    KV events of tied boundaries still come out in the heap's order."""
    prof, _, _, reqs, rng = _random_case(1000 + seed)
    twins = []
    for r in reqs:  # same shapes under other ids: their steps end at the same instants
        twins.append(r)
        twins.append(_req(r.request_id + "-twin", list(r.prompt), max_tokens=r.max_tokens, arrival_ms=r.arrival_ms))

    def least_loaded(req, cores):
        load = [(c.stats().running + c.stats().waiting, -c.stats().free_blocks, i) for i, c in enumerate(cores)]
        return min(load)[2]

    cases = [("round_robin", WorkerRole.AGGREGATED, 0.0), (least_loaded, WorkerRole.AGGREGATED, 0.0),
             # Held blocks released at once, and later: releases that wake a worker at a tie.
             ("round_robin", WorkerRole.PREFILL, 0.0), (least_loaded, WorkerRole.PREFILL, 2.5)]
    for router, role, release in cases:
        ref_sink, sink = MemorySink(), MemorySink()
        ref, _ = _reference_simulate(twins, prof, num_workers=2, router=router, sink=ref_sink, role=role,
                                     release_after_ms=release)
        fast = simulate(twins, prof, num_workers=2, router=router, sink=sink, role=role,
                        release_after_ms=release, hash_config=default_hash_config(prof.block_size))
        _same_run(fast, ref)
        assert sink.events == ref_sink.events


def test_coalesced_runs_are_taken_and_long():
    """The equivalence above is not vacuous: decode runs happen, and a long decode is applied
    in few calls (one step each at the start and end, the rest in runs)."""
    prof = _profile(num_device_blocks=256)
    core = EngineCore(prof, hash_config=default_hash_config(4))
    core.add_request(_req("A", range(10), max_tokens=200))
    core.add_request(_req("B", range(50, 70), max_tokens=150))
    calls, steps = 0, 0
    t = 0.0
    while core.has_work():
        run = core.run_decode(t, float("inf"))
        calls += 1
        if run is None:
            res = core.step()
            steps += 1
            t += res.duration_ms
            continue
        steps += run.num_steps + (run.final is not None)
        t = float(run.starts[-1]) + (run.final.duration_ms if run.final else 0.0)
    assert steps == 200 and calls < 10


def test_native_block_hash_equals_pickle_sha256():
    """Property: ``block_digests`` (native for sha256) == ``hash_block_digests`` (pickle +
    hashlib) on random blocks, with every int size pickle distinguishes, and falls back for
    what the native path does not pickle the same way (bools, numpy ints, huge ints)."""
    import random

    import numpy as np

    from data_plane.engines.blockhash import block_digests, native_available, wire_hashes

    assert native_available()
    rng = random.Random(7)
    edges = [0, 1, 255, 256, 65535, 65536, 2**31 - 1, 2**31, -1, -(2**31), -(2**31) - 1, 2**63 - 1, -(2**63)]
    for case in range(300):
        bs = rng.choice([1, 2, 3, 4, 16, 64])
        n = rng.randrange(0, 5 * bs)
        toks = [rng.choice(edges) if rng.random() < 0.2 else rng.randrange(200_000) for _ in range(n)]
        cfg = default_hash_config(bs)
        parent = None if case % 3 else hash_block_digests([5] * bs, cfg)[0]
        want = hash_block_digests(toks, cfg, parent=parent)
        got, wire = block_digests(toks, cfg, parent=parent)
        assert got == want and wire == wire_hashes(want) == hash_blocks(toks, cfg, parent=parent)
    cfg = default_hash_config(2)
    for odd in ([True, 3], [np.int64(3), 4], [2**64, 1], [2**70, -(2**65)]):
        assert block_digests(odd, cfg)[0] == hash_block_digests(odd, cfg)
    from data_plane.engines.blockhash import generated_digests
    from data_plane.engines.request import pseudo_tokens

    for bs, head, start, stop in ((64, list(range(40)), 0, 24), (64, [], 24, 24 + 128), (4, [7, 8, 9], 5, 30)):
        cfg = default_hash_config(bs)
        seed = request_seed(f"g{bs}")
        toks = head + pseudo_tokens(seed, start, stop)
        parent = hash_block_digests([1] * bs, cfg)[0]
        assert generated_digests(head, seed, start, stop, 128_256, cfg, parent=parent) == (
            hash_block_digests(toks, cfg, parent=parent), hash_blocks(toks, cfg, parent=parent))
    assert generated_digests([True], 1, 0, 3, 128_256, default_hash_config(4)) is None


def test_native_trace_hashing_and_pseudo_tokens_equal_python(tmp_path):
    """The trace loader's native chain (tokens synthesized in Rust) gives the digests of the
    tokens ``SyntheticPrompt`` yields; native pseudo-tokens are ``pseudo_token``'s."""
    import random

    from data_plane.engines.request import pseudo_tokens

    rng = random.Random(3)
    rows = []
    for i in range(40):
        ids = [rng.randrange(12) for _ in range(rng.randrange(1, 6))]
        rows.append({"timestamp": i, "input_length": rng.randrange(1, 512 * len(ids) + 50),
                     "output_length": 1, "hash_ids": ids})
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    for bs, tbs in ((64, 512), (16, 64), (3, 12)):
        cfg = default_hash_config(bs)
        trace = MooncakeTrace(cfg, trace_block_size=tbs)
        for r in trace.requests(read_mooncake(path)):
            want = hash_block_digests(r.prompt[:], cfg)
            assert list(r.prompt_digests) == want
            assert list(r.prompt_hashes) == hash_blocks(r.prompt[:], cfg)
    for seed in (0, 1, 2**64 - 1, request_seed("x")):
        assert pseudo_tokens(seed, 3, 90) == [pseudo_token(seed, i) for i in range(3, 90)]
    from data_plane.engines.trace import SyntheticPrompt, trace_token

    p = SyntheticPrompt([3, 2**62, 0, 17], 4 * 512 - 5, 512, 128_256)
    want = [trace_token(p.hash_ids[j // 512], j % 512, 128_256, 512) for j in range(len(p))]
    for a, b in ((0, None), (500, 530), (511, 512), (1000, 1600), (2040, 2100), (7, 7)):
        assert p[a:b] == want[a:b]
    assert p[::7] == want[::7] and p[-3] == want[-3]


def test_decode_run_clock_equals_adding_step_ms():
    """``decode_run_starts`` gives, float for float, the times the step-by-step clock reaches
    by adding ``step_ms`` of each decode-only step (the coalesced runs deliver tokens at these
    times, so they must be the same numbers), for both shipped timing models and for a model
    that only has ``step_ms``."""
    from data_plane.engines.timing import decode_run_starts

    class OnlyStepMs:
        def step_ms(self, shape):
            return 0.5 + shape.decode_context_tokens / 3.0

    for name in ("mocker", "h100_llama3_8b", None):
        prof = load_profile(name or "mocker")
        model = prof.timing if name else OnlyStepMs()
        cap = prof.kv_capacity_tokens
        for seqs, ctx0, t0 in ((1, 7, 0.0), (3, 54_321, 1234.5678), (256, cap // 3, 1e6 + 0.1), (2, cap - 1, 3.0)):
            starts = decode_run_starts(model, t0, t0 + 500.0, seqs, ctx0, cap, 10_000)
            t, want = t0, [t0]
            while t < t0 + 500.0:
                t = t + model.step_ms(StepShape(decode_seqs=seqs, decode_context_tokens=ctx0 + seqs * (len(want) - 1),
                                                kv_capacity_tokens=cap))
                want.append(t)
            assert starts == want
            assert decode_run_starts(model, t0, float("inf"), seqs, ctx0, cap, 5) == \
                decode_run_starts(model, t0, float("inf"), seqs, ctx0, cap, 50)[:6]


def test_digest_chain_reads_like_a_list_and_copies_apart():
    from data_plane.engines.blockhash import DigestChain

    ds = [bytes([i]) * 32 for i in range(5)]
    c = DigestChain(b"".join(ds[:3]))
    assert list(c) == ds[:3] and len(c) == 3 and c[-1] == ds[2] and c[1:] == ds[1:3] and c == ds[:3]
    d = c.copy()
    d.extend(ds[3:])
    assert list(d) == ds and d[-1] == ds[4] and d[3] == ds[3] and list(c) == ds[:3]
    with pytest.raises(IndexError):
        c[3]


@pytest.mark.parametrize(("orders", "first"), [((None, None), "C"), ((2.0, 1.0), "B")])
def test_a_steps_arrivals_go_in_the_routers_order(orders, first):
    """A fills a step alone from t=0; C arrives at 1 ms and B at 2 ms, during it, and each needs a
    step of its own. In arrival order C goes first; sent by a router that decided B first
    (``router_order`` 1.0 against C's 2.0: the hop to the worker varied), B does."""
    async def run():
        eng = AsyncEngine(_core(num_device_blocks=64, max_num_batched_tokens=32), speedup=1000.0)
        streams = {"A": eng.submit(_req("A", range(32), arrival_ms=0.0)),
                   "C": eng.submit(_req("C", range(100, 132), arrival_ms=1.0, router_order=orders[0])),
                   "B": eng.submit(_req("B", range(200, 232), arrival_ms=2.0, router_order=orders[1]))}
        async with eng:
            return {rid: (await s.collect())[0].time_ms for rid, s in streams.items()}

    t = asyncio.run(run())
    assert t["A"] < t[first] < t[({"B", "C"} - {first}).pop()]
