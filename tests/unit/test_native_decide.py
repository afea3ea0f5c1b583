"""The native kv decision (``native/src/decide.rs``) against its differential oracle
(``tests/oracles/scoring.py``: ``score`` and ``pick``, the executable specification).

``decide`` scores every candidate, applies the guards and finds the kv argmin in Rust; within
``oracle_steps()`` the same ``decide`` runs the oracle's pure-Python steps instead. For random
decision inputs (1..300 candidates with random loads, roles, drains and capacities; overlaps per
tier, some stale, some with a peer reach; in-flight loads with speculative overlap; configs with
every mode, tier and peer weights, load combine, guards, temperature, cost; seeds and cursors)
the two must give the same ``Decision``: equal as values and byte-identical when encoded (so
every float is the same double).
"""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from control_plane.router import decision
from control_plane.router.config import RouterConfig, TierWeights
from control_plane.router.decision import RoutingRequest, WorkerLoad, WorkerOverlap, decide
from control_plane.router.errors import InvalidRoutingInput, NoEligibleWorker
from control_plane.router.ledger import InflightLedger, InflightLoad
from schemas.events import TtftModel
from schemas.types import BlockHash, RequestId, RequestPhase, RoutingMode, WorkerId, WorkerRole
from tests.oracles.ledger import Accounts
from tests.oracles.scoring import oracle_steps


class _Recorded:
    def __init__(self, loads: dict[WorkerId, InflightLoad]) -> None:
        self.loads = loads

    def view(self, hashes):
        return self.loads


def _weights(draw) -> TierWeights:
    # Non-increasing in [0, 1], from a small palette (exact ties) or any float.
    palette = st.one_of(st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.75, 1.0]), st.floats(0.0, 1.0))
    values = sorted((draw(palette) for _ in range(4)), reverse=True)
    return TierWeights(device=values[0], host=values[1], disk=values[2], object=values[3], peer=draw(palette))


@st.composite
def _configs(draw) -> RouterConfig:
    return RouterConfig(
        version=draw(st.integers(0, 5)),
        mode=draw(st.sampled_from(list(RoutingMode))),
        tier_weights=TierWeights() if draw(st.booleans()) else _weights(draw),
        prefill_load_scale=draw(st.one_of(st.sampled_from([0.0, 1.0, 5.0]), st.floats(0.0, 20.0))),
        temperature=draw(st.one_of(st.just(0.0), st.floats(0.01, 5.0))),
        stale_overlap_factor=draw(st.one_of(st.sampled_from([0.0, 0.5, 1.0]), st.floats(0.0, 1.0))),
        load_combine=draw(st.sampled_from(["max", "sum"])),
        imbalance_guard=draw(st.booleans()),
        imbalance_abs_threshold=draw(st.integers(0, 70)),
        imbalance_rel_threshold=draw(st.floats(1.0, 3.0)),
        capacity_guard=draw(st.booleans()),
        least_loaded_metric=draw(st.sampled_from(["blocks", "requests"])),
        cost=draw(st.sampled_from(["blocks", "ttft"])),
    )


def _models(seed: int, workers: list[WorkerLoad]) -> dict[WorkerId, TtftModel] | None:
    """Fitted TTFT models for some candidates (the rest under the prior), or none at all."""
    rng = random.Random(seed)
    if rng.random() < 0.2:
        return None
    return {w.worker_id: TtftModel(base_ms=rng.uniform(0, 80), step_ms=rng.uniform(0, 5),
                                   ms_per_token=rng.uniform(0, 0.2), ms_per_token_ctx=rng.uniform(0, 1e-5),
                                   chunk_tokens=rng.choice([256, 2048, 8192]), samples=rng.randrange(0, 50))
            for w in workers if rng.random() < 0.7}


def _inputs(seed: int, n: int, phase: RequestPhase):
    """A decision's inputs from one seed: loads from a small palette half the time (ties)."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 3, 16, 64])
    n_hash = rng.randrange(0, 300)
    prompt_tokens = n_hash * block_size + rng.randrange(0, block_size)
    request = RoutingRequest(
        request_id=RequestId(f"r{seed}"), prompt_tokens=prompt_tokens, block_size=block_size,
        block_hashes=tuple(BlockHash(rng.getrandbits(64)) for _ in range(n_hash)),
        expected_output_tokens=rng.randrange(0, 2000), phase=phase)
    small = rng.random() < 0.5

    def load(hi: int) -> int:
        return rng.choice([0, 1, 16, 64]) if small else rng.randrange(0, hi)

    role = WorkerRole.AGGREGATED if phase is RequestPhase.AGGREGATED else WorkerRole(phase.value)
    workers = [
        WorkerLoad(
            worker_id=WorkerId(f"w{i:03d}"),
            role=role if rng.random() < 0.9 else rng.choice(list(WorkerRole)),
            registered=rng.random() < 0.95, draining=rng.random() < 0.05,
            queued_prefill_tokens=load(50_000), active_decode_blocks=load(20_000),
            inflight_requests=load(100), kv_capacity_blocks=rng.choice([0, 0, 500, 5_000, 40_000]))
        for i in rng.sample(range(1000), n)
    ]
    overlaps: dict[WorkerId, WorkerOverlap] = {}
    inflight: dict[WorkerId, InflightLoad] = {}
    for w in workers:
        if rng.random() < 0.6:
            k = rng.randrange(0, 5)
            peer = rng.randrange(1, n_hash + 2) if rng.random() < 0.2 else 0
            overlaps[w.worker_id] = WorkerOverlap(
                tiers=tuple(rng.randrange(0, n_hash // 2 + 2) for _ in range(k)), stale=rng.random() < 0.2,
                peer=peer, peer_from=WorkerId("w999") if peer else "")
        if rng.random() < 0.4:
            inflight[w.worker_id] = InflightLoad(
                prefill_tokens=load(40_000), decode_blocks=load(10_000), requests=rng.choice([0, 1, 2, 7]),
                shared_blocks=rng.randrange(0, n_hash + 1))
    rng.shuffle(workers)
    cursor = rng.choice([None, workers[0].worker_id, WorkerId("w500")])
    return request, workers, overlaps, inflight, cursor


def _ledgers(seed: int, request: RoutingRequest, workers: list[WorkerLoad]) -> tuple[InflightLedger, InflightLedger]:
    """The same random in-flight history in the product's ledger and one over the oracle's
    accounts: entries on candidates and on other workers, their prompts sharing a random
    prefix of the request's, some prefilled, some completed."""
    rng = random.Random(seed)
    native, reference = InflightLedger(), InflightLedger(accounts=Accounts())
    hashes = request.block_hashes
    names = [w.worker_id for w in workers] + [WorkerId(f"gone{i}") for i in range(3)]
    k = 0
    for wid in names:
        for _ in range(rng.choice([0, 0, 1, 2, 3])):
            k += 1
            shared = hashes[: rng.randrange(0, len(hashes) + 1)]
            chain = shared + tuple(BlockHash(rng.getrandbits(64)) for _ in range(rng.randrange(0, 8)))
            args = (RequestId(f"q{k}"), wid, chain, rng.randrange(0, 40_000), len(chain) + rng.randrange(0, 64),
                    0.0, 600.0)
            for ledger in (native, reference):
                ledger.add(*args)
            if rng.random() < 0.3:
                for ledger in (native, reference):
                    ledger.prefill_done(RequestId(f"q{k}"))
            if rng.random() < 0.2:
                for ledger in (native, reference):
                    ledger.complete(RequestId(f"q{k}"))
    return native, reference


def _both(request, workers, config, seed, overlaps, inflight, cursor, native_inflight=None, models=None):
    """``decide`` with the oracle's steps over ``inflight`` (a recorded view, or a ledger) and
    with the native core over ``native_inflight`` (the same view by default)."""
    def run(native: bool):
        source = native_inflight if native and native_inflight is not None else inflight
        try:
            return decide(request, workers, config, rng_seed=seed, overlaps=overlaps,
                          inflight=source if hasattr(source, "view") else _Recorded(source),
                          rr_cursor=cursor, ttft_models=models)
        except (NoEligibleWorker, InvalidRoutingInput) as e:
            return type(e), str(e)

    with oracle_steps():
        reference = run(False)
    native = run(True)
    return reference, native


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    input_seed=st.integers(0, 2**32), n=st.integers(1, 300), phase=st.sampled_from(list(RequestPhase)),
    config=_configs(), rng_seed=st.integers(0, 2**63 - 1),
)
def test_native_scoring_gives_the_oracle_decision(input_seed, n, phase, config, rng_seed):
    request, workers, overlaps, inflight, cursor = _inputs(input_seed, n, phase)
    reference, native = _both(request, workers, config, rng_seed, overlaps, inflight, cursor,
                              models=_models(input_seed, workers))
    assert native == reference
    if isinstance(reference, decision.Decision):
        assert msgspec.msgpack.encode(native) == msgspec.msgpack.encode(reference)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    input_seed=st.integers(0, 2**32), n=st.integers(1, 120), phase=st.sampled_from(list(RequestPhase)),
    config=_configs(), rng_seed=st.integers(0, 2**63 - 1), ledger_seed=st.integers(0, 2**32),
)
def test_native_decision_over_a_native_ledger(input_seed, n, phase, config, rng_seed, ledger_seed):
    """The live router's path: the ledger's own view (native accounts: an ``InflightView`` the
    core reads directly) against the oracle's ledger (a dict), over random histories."""
    request, workers, overlaps, _, cursor = _inputs(input_seed, n, phase)
    native_ledger, reference_ledger = _ledgers(ledger_seed, request, workers)
    view = native_ledger.view(request.block_hashes)
    assert type(view) is not dict and view == reference_ledger.view(request.block_hashes)
    reference, native = _both(request, workers, config, rng_seed, overlaps, reference_ledger, cursor,
                              native_inflight=native_ledger, models=_models(ledger_seed, workers))
    assert native == reference
    if isinstance(reference, decision.Decision):
        assert msgspec.msgpack.encode(native) == msgspec.msgpack.encode(reference)


def test_burst_example_natively():
    """docs/routing-cost.md's burst: 4 empty workers, 128-block prompt, 16 output blocks, scale 1;
    A holds r1 in flight (2,048 queued tokens, 144 blocks, the 128 hashes): A costs
    (2,048 + 2,048)/16 - 128 + (144 + 144 - 128) = 288, the others 128 + 144 = 272."""
    hashes = tuple(BlockHash(h) for h in range(1, 129))
    request = RoutingRequest(request_id=RequestId("r2"), prompt_tokens=2048, block_size=16,
                             block_hashes=hashes, expected_output_tokens=256)
    workers = [WorkerLoad(worker_id=WorkerId(w)) for w in "ABCD"]
    inflight = {WorkerId("A"): InflightLoad(prefill_tokens=2048, decode_blocks=144, requests=1, shared_blocks=128)}
    config = RouterConfig(prefill_load_scale=1.0)
    reference, native = _both(request, workers, config, 7, {}, inflight, None)
    assert native == reference
    assert [r.cost for r in native.scores] == [288.0, 272.0, 272.0, 272.0]
    assert native.worker_id != "A"


def test_out_of_range_inputs_are_refused():
    """Beyond 2^53 a Python int divides with one rounding and an f64 with two: the core refuses
    rather than round where exact arithmetic would not (the oracle, in Python ints, decides)."""
    request = RoutingRequest(request_id=RequestId("big"), prompt_tokens=17, block_size=16)
    workers = [WorkerLoad(worker_id=WorkerId("a"), queued_prefill_tokens=2**60 + 1),
               WorkerLoad(worker_id=WorkerId("b"), queued_prefill_tokens=2**70)]
    with pytest.raises(InvalidRoutingInput, match="beyond 2\\^53"):
        decide(request, workers, RouterConfig(), rng_seed=1)
    with oracle_steps():
        assert decide(request, workers, RouterConfig(), rng_seed=1).worker_id == "a"


def test_duplicate_worker_is_refused():
    request = RoutingRequest(request_id=RequestId("dup"), prompt_tokens=16, block_size=16)
    workers = [WorkerLoad(worker_id=WorkerId("a")), WorkerLoad(worker_id=WorkerId("a"))]
    with pytest.raises(InvalidRoutingInput, match="'a' is listed twice"):
        decide(request, workers, RouterConfig(), rng_seed=1)
    with oracle_steps(), pytest.raises(InvalidRoutingInput, match="'a' is listed twice"):
        decide(request, workers, RouterConfig(), rng_seed=1)
