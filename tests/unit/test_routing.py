"""Routing decision core: worked examples, determinism, guards and in-flight accounting.

Core-only, no mocks: every test builds plain inputs with the ``_make_*`` builders and calls
``decide`` or the ledger directly. Unless a test says otherwise: block size 16, a 2,048-token
prompt (P = 128 hashed blocks), 256 output tokens (16 blocks), so request_blocks = 144 and an
empty worker costs 1 x (0 + 2048)/16 + (0 + 144) = 128 + 144 = 272.
"""

from __future__ import annotations

import collections
import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.router import (
    Decision,
    InflightLedger,
    InflightLoad,
    InvalidRoutingInput,
    NoEligibleWorker,
    RouterConfig,
    RouterConfigError,
    RoutingRequest,
    TierWeights,
    WorkerLoad,
    WorkerOverlap,
    decide,
)
from schemas.events import RequestRouted
from schemas.types import TIER_ORDER, BlockHash, RequestId, RequestPhase, RoutingMode, WorkerId, WorkerRole

# ----------------------------------------------------------------------------------------------
# Builders
# ----------------------------------------------------------------------------------------------


def _hashes(n: int, root: int = 0) -> tuple[BlockHash, ...]:
    """A stand-in hash chain: distinct per (root, position), like chained hashes."""
    return tuple(BlockHash(root * 1_000_003 + i + 1) for i in range(n))


def _make_request(**overrides) -> RoutingRequest:
    fields = {
        "request_id": RequestId("r1"),
        "prompt_tokens": 2048,
        "block_size": 16,
        "block_hashes": _hashes(128),
        "expected_output_tokens": 256,
        "phase": RequestPhase.AGGREGATED,
    }
    fields.update(overrides)
    return RoutingRequest(**fields)


def _make_worker(worker_id: str, **overrides) -> WorkerLoad:
    fields = {"worker_id": WorkerId(worker_id), "role": WorkerRole.AGGREGATED}
    fields.update(overrides)
    return WorkerLoad(**fields)


def _make_workers(n: int, **overrides) -> list[WorkerLoad]:
    return [_make_worker(f"w{i}", **overrides) for i in range(n)]


def _make_config(**overrides) -> RouterConfig:
    """The worked examples below use Dynamo's weighting (prefill_load_scale 1) unless they say
    otherwise, so their arithmetic stays readable; the product default is 5 (see RouterConfig)."""
    return RouterConfig(**{"prefill_load_scale": 1.0, **overrides})


def _costs(decision: Decision) -> dict[str, float | None]:
    return {row.worker_id: row.cost for row in decision.scores}


def _route(ledger: InflightLedger, request: RoutingRequest, workers, config, seed: int,
           now: float = 0.0, **kwargs) -> Decision:
    """Decide, then record the decision in the ledger, as the router does."""
    decision = decide(request, workers, config, rng_seed=seed, inflight=ledger, **kwargs)
    ledger.add(request.request_id, decision.worker_id, request.block_hashes,
               decision.prefill_tokens, decision.decode_blocks, now, config.inflight_ttl_s)
    return decision


# ----------------------------------------------------------------------------------------------
# kv mode: worked examples
# ----------------------------------------------------------------------------------------------


def test_device_overlap_beats_empty_worker():
    """w1 holds 100 of the 128 prompt blocks on device.

    w0: 1 x max(2048/16 - 0, 0) + 144 = 272
    w1: 1 x max(2048/16 - 100 x 1.0, 0) + 144 = 28 + 144 = 172  -> w1
    """
    decision = decide(_make_request(), _make_workers(2), _make_config(), rng_seed=0,
                      overlaps={WorkerId("w1"): WorkerOverlap.of(device=100)})

    assert decision.worker_id == "w1"
    assert _costs(decision) == {"w0": 272.0, "w1": 172.0}
    w1 = decision.scores[1]
    assert (w1.overlap_blocks, w1.overlap_by_tier, w1.prefill_blocks, w1.decode_blocks) == (
        100, {"device": 100}, 28.0, 144.0)
    assert "cost 172 = 1 x max((queued 0 + prompt 2048) tok / 16 - overlap 100 [device 100x1]" \
        in decision.reason
    assert "runner-up w0 at 272 (+100)" in decision.reason


@pytest.mark.parametrize(("overlaps", "chosen", "costs"), [
    # 100 blocks each, w0 in host DRAM, w1 on disk.
    # w0: 128 - 100 x 0.75 = 53;  53 + 144 = 197  -> w0
    # w1: 128 - 100 x 0.25 = 103; 103 + 144 = 247
    pytest.param({"w0": {"host": 100}, "w1": {"disk": 100}}, "w0", {"w0": 197.0, "w1": 247.0},
                 id="host_hit_beats_disk_hit_of_equal_depth"),
    # w0: 128 - 100 x 1.0 = 28 -> 172 (chosen); w1: 128 - 100 x 0.75 = 53 -> 197.
    pytest.param({"w0": {"device": 100}, "w1": {"host": 100}}, "w0", {"w0": 172.0, "w1": 197.0},
                 id="device_hit_beats_host_hit_of_equal_depth"),
    # w0 nothing: 272; w1 100 object blocks: 128 - 10 = 118 -> 262 (chosen).
    pytest.param({"w1": {"object": 100}}, "w1", {"w0": 272.0, "w1": pytest.approx(262.0)},
                 id="object_hit_is_worth_least_but_more_than_nothing"),
])
def test_a_hit_is_worth_its_tier_weight(overlaps, chosen, costs):
    """Two workers, a 128-block prompt, 144 decode blocks each: cost = 128 - sum(blocks x tier
    weight) + 144 (weights device 1, host 0.75, disk 0.25, object 0.1)."""
    decision = decide(_make_request(), _make_workers(2), _make_config(), rng_seed=0,
                      overlaps={WorkerId(w): WorkerOverlap.of(**tiers) for w, tiers in overlaps.items()})

    assert decision.worker_id == chosen
    assert _costs(decision) == costs


def test_tier_weights_change_the_choice():
    """w0 has 60 device blocks, w1 100 host blocks.

    Default weights: w0 128 - 60 = 68; w1 128 - 75 = 53 -> w1 (a deeper host hit wins).
    Host weight 0.5: w1 128 - 50 = 78 > 68 -> w0 (onboarding from host now judged too slow).
    """
    overlaps = {WorkerId("w0"): WorkerOverlap.of(device=60), WorkerId("w1"): WorkerOverlap.of(host=100)}
    default = decide(_make_request(), _make_workers(2), _make_config(), rng_seed=0,
                     overlaps=overlaps)
    slow_host = decide(_make_request(), _make_workers(2),
                       _make_config(tier_weights=TierWeights(host=0.5)), rng_seed=0,
                       overlaps=overlaps)

    assert (default.worker_id, _costs(default)) == ("w1", {"w0": 212.0, "w1": 197.0})
    assert (slow_host.worker_id, _costs(slow_host)) == ("w0", {"w0": 212.0, "w1": 222.0})


def test_mixed_tiers_sum_their_weights():
    """w0: 40 device + 40 host + 40 disk = 120 matched blocks.

    overlap = 40 x 1 + 40 x 0.75 + 40 x 0.25 = 80; prefill 128 - 80 = 48; cost 48 + 144 = 192.
    """
    decision = decide(_make_request(), _make_workers(1), _make_config(), rng_seed=0,
                      overlaps={WorkerId("w0"): WorkerOverlap.of(device=40, host=40, disk=40)})

    row = decision.scores[0]
    assert (row.overlap_blocks, row.prefill_blocks, row.cost) == (120, 48.0, 192.0)
    assert "[device 40x1 + host 40x0.75 + disk 40x0.25]" in decision.reason


def test_load_outweighs_a_small_cache_hit():
    """w0 holds 20 device blocks but has 1,024 tokens (64 blocks) queued for prefill.

    w0: max((1024 + 2048)/16 - 20, 0) + 144 = 172 + 144 = 316
    w1: 128 + 144 = 272 -> w1
    """
    workers = [_make_worker("w0", queued_prefill_tokens=1024), _make_worker("w1")]
    decision = decide(_make_request(), workers, _make_config(), rng_seed=0,
                      overlaps={WorkerId("w0"): WorkerOverlap.of(device=20)})

    assert decision.worker_id == "w1"
    assert _costs(decision) == {"w0": 316.0, "w1": 272.0}


def test_prefill_load_scale_trades_prefill_against_decode():
    """w0 has 64 blocks cached but 200 active decode blocks; w1 is empty.

    scale 1: w0 64 + 344 = 408, w1 128 + 144 = 272 -> w1
    scale 4: w0 256 + 344 = 600, w1 512 + 144 = 656 -> w0
    """
    workers = [_make_worker("w0", active_decode_blocks=200), _make_worker("w1")]
    overlaps = {WorkerId("w0"): WorkerOverlap.of(device=64)}

    low = decide(_make_request(), workers, _make_config(), rng_seed=0, overlaps=overlaps)
    high = decide(_make_request(), workers, _make_config(prefill_load_scale=4.0), rng_seed=0,
                  overlaps=overlaps)

    assert (low.worker_id, _costs(low)) == ("w1", {"w0": 408.0, "w1": 272.0})
    assert (high.worker_id, _costs(high)) == ("w0", {"w0": 600.0, "w1": 656.0})


def test_decode_phase_has_no_prefill_term():
    """Decode workers get their KV by transfer: cost = active + request blocks.

    d0: 50 + 144 = 194; d1: 10 + 144 = 154 -> d1, even though d0 'has' the prefix.
    """
    workers = [
        _make_worker("d0", role=WorkerRole.DECODE, active_decode_blocks=50),
        _make_worker("d1", role=WorkerRole.DECODE, active_decode_blocks=10),
    ]
    decision = decide(_make_request(phase=RequestPhase.DECODE), workers, _make_config(),
                      rng_seed=0, overlaps={WorkerId("d0"): WorkerOverlap.of(device=128)})

    assert decision.worker_id == "d1"
    assert _costs(decision) == {"d0": 194.0, "d1": 154.0}
    assert decision.prefill_tokens == 0
    assert "decode phase: no prefill term" in decision.reason


# ----------------------------------------------------------------------------------------------
# Stale views and eligibility
# ----------------------------------------------------------------------------------------------


def test_stale_overlap_is_ignored_by_default():
    """w0's index view is stale: its 100 device blocks count x 0 by default.

    w0 queued 160 tokens (10 blocks). Default: w0 (10 + 128) - 0 + 144 = 282; w1 272 -> w1.
    Factor 0.5: w0 138 - 50 = 88 -> 232 -> w0. Factor 1: 138 - 100 = 38 -> 182 -> w0.
    """
    workers = [_make_worker("w0", queued_prefill_tokens=160), _make_worker("w1")]
    overlaps = {WorkerId("w0"): WorkerOverlap.of(device=100, stale=True)}

    ignored = decide(_make_request(), workers, _make_config(), rng_seed=0, overlaps=overlaps)
    half = decide(_make_request(), workers, _make_config(stale_overlap_factor=0.5), rng_seed=0,
                  overlaps=overlaps)
    trusted = decide(_make_request(), workers, _make_config(stale_overlap_factor=1.0),
                     rng_seed=0, overlaps=overlaps)

    assert (ignored.worker_id, _costs(ignored)) == ("w1", {"w0": 282.0, "w1": 272.0})
    assert ignored.scores[0].stale and ignored.scores[0].overlap_blocks == 100
    assert (half.worker_id, _costs(half)["w0"]) == ("w0", 232.0)
    assert (trusted.worker_id, _costs(trusted)["w0"]) == ("w0", 182.0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_ineligible_workers_are_never_chosen(temperature):
    """Draining, unregistered and wrong-role workers hold the whole prefix and no load, and still
    never win; they appear in the table with eligible=False and are named in the reason."""
    workers = [
        _make_worker("a-draining", draining=True),
        _make_worker("b-unregistered", registered=False),
        _make_worker("c-decode", role=WorkerRole.DECODE),
        _make_worker("d-ok", queued_prefill_tokens=50_000, active_decode_blocks=5_000),
    ]
    full = WorkerOverlap.of(device=128)
    overlaps = {w.worker_id: full for w in workers[:3]}
    config = _make_config(temperature=temperature)

    chosen = {decide(_make_request(), workers, config, rng_seed=s, overlaps=overlaps).worker_id
              for s in range(50)}
    decision = decide(_make_request(), workers, config, rng_seed=0, overlaps=overlaps)

    assert chosen == {"d-ok"}
    assert [r.eligible for r in decision.scores] == [False, False, False, True]
    assert "a-draining (draining)" in decision.reason
    assert "b-unregistered (not registered)" in decision.reason
    assert "c-decode (role decode does not serve phase aggregated)" in decision.reason


def test_no_eligible_worker_raises_with_reasons():
    workers = [_make_worker("w0", draining=True), _make_worker("w1", role=WorkerRole.PREFILL)]

    with pytest.raises(NoEligibleWorker, match=r"w0 \(draining\), w1 \(role prefill"):
        decide(_make_request(), workers, _make_config(), rng_seed=0)


def test_capacity_guard_excludes_a_worker_that_cannot_hold_the_request():
    """w0 has the prefix but 1,000 of its 1,100 blocks are active: 1000 + 144 > 1100.

    Without the guard w0 would win (28 + 1144 = 1172 < 128 + 1144 = 1272 for w1 with the same
    active blocks but no capacity limit reported).
    """
    workers = [
        _make_worker("w0", active_decode_blocks=1000, kv_capacity_blocks=1100),
        _make_worker("w1", active_decode_blocks=1000),
    ]
    overlaps = {WorkerId("w0"): WorkerOverlap.of(device=100)}

    guarded = decide(_make_request(), workers, _make_config(), rng_seed=0, overlaps=overlaps)
    unguarded = decide(_make_request(), workers, _make_config(capacity_guard=False), rng_seed=0,
                       overlaps=overlaps)

    assert (guarded.worker_id, guarded.guards) == ("w1", ("capacity",))
    assert not guarded.scores[0].eligible
    assert "w0 (over KV capacity: 1144 > 1100 blocks)" in guarded.reason
    assert unguarded.worker_id == "w0"


def test_imbalance_guard_sends_to_the_least_busy():
    """w0 has the whole prefix but 100 requests in flight; w1 has 10, w2 has 30.

    Spread 100 - 10 = 90 > 64 and 100 > 1.5 x 10: only w1 competes, although w0's cost is
    lowest (queues are not reported here, only in-flight counts).
    """
    workers = [_make_worker("w0", inflight_requests=100), _make_worker("w1", inflight_requests=10),
               _make_worker("w2", inflight_requests=30)]
    overlaps = {WorkerId("w0"): WorkerOverlap.of(device=128)}

    guarded = decide(_make_request(), workers, _make_config(), rng_seed=0, overlaps=overlaps)
    unguarded = decide(_make_request(), workers, _make_config(imbalance_guard=False), rng_seed=0,
                       overlaps=overlaps)

    assert (guarded.worker_id, guarded.guards) == ("w1", ("imbalance",))
    assert "in-flight spread 100 - 10 > 64 and 100 > 1.5 x 10" in guarded.reason
    assert unguarded.worker_id == "w0"


# ----------------------------------------------------------------------------------------------
# Determinism and sampling
# ----------------------------------------------------------------------------------------------


def _busy_inputs():
    workers = [
        _make_worker(f"w{i}", queued_prefill_tokens=(i * 37) % 500,
                     active_decode_blocks=(i * 53) % 300, inflight_requests=i % 7)
        for i in range(16)
    ]
    overlaps = {WorkerId(f"w{i}"): WorkerOverlap.of(device=i * 3 % 40, host=i % 9, disk=i % 5)
                for i in range(0, 16, 2)}
    return workers, overlaps


@pytest.mark.parametrize("mode", list(RoutingMode))
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_same_inputs_and_seed_give_a_bit_identical_decision(mode, temperature):
    workers, overlaps = _busy_inputs()
    config = _make_config(mode=mode, temperature=temperature)

    first = decide(_make_request(), workers, config, rng_seed=1234, overlaps=overlaps,
                   rr_cursor=WorkerId("w3"))
    again = decide(_make_request(), list(reversed(workers)), config, rng_seed=1234,
                   overlaps=dict(reversed(list(overlaps.items()))), rr_cursor=WorkerId("w3"))

    assert msgspec.msgpack.encode(first) == msgspec.msgpack.encode(again)


def test_ties_are_broken_by_the_seed_not_by_input_order():
    """Four empty workers tie at 272; the seed alone picks, and every worker gets picked by some
    seed (a lowest-id rule would always pick w0)."""
    workers = _make_workers(4)
    picks = {s: decide(_make_request(), workers, _make_config(), rng_seed=s).worker_id
             for s in range(64)}

    assert set(picks.values()) == {"w0", "w1", "w2", "w3"}
    for s in (0, 7, 63):
        shuffled = [workers[i] for i in (2, 0, 3, 1)]
        assert decide(_make_request(), shuffled, _make_config(), rng_seed=s).worker_id == picks[s]
    assert "4 tied, broken by rng_seed 7" in decide(_make_request(), workers, _make_config(),
                                                     rng_seed=7).reason


def test_temperature_samples_differ_across_seeds_and_repeat_per_seed():
    workers, overlaps = _busy_inputs()
    config = _make_config(temperature=1.0)

    runs = [decide(_make_request(), workers, config, rng_seed=s, overlaps=overlaps).worker_id
            for s in range(300)]
    reruns = [decide(_make_request(), workers, config, rng_seed=s, overlaps=overlaps).worker_id
              for s in range(300)]

    assert runs == reruns
    assert len(set(runs)) > 3


def test_softmax_probabilities_follow_normalised_costs():
    """Costs 272 (w0) and 172 (w1) normalise to 1 and 0. With temperature 1 the logits are -1
    and 0: p(w1) = 1 / (1 + e^-1) = 0.7311, p(w0) = 0.2689."""
    decision = decide(_make_request(), _make_workers(2), _make_config(temperature=1.0),
                      rng_seed=5, overlaps={WorkerId("w1"): WorkerOverlap.of(device=100)})

    p = {row.worker_id: row.probability for row in decision.scores}
    assert p["w1"] == pytest.approx(0.7310586)
    assert p["w0"] == pytest.approx(0.2689414)
    picks = collections.Counter(
        decide(_make_request(), _make_workers(2), _make_config(temperature=1.0), rng_seed=s,
               overlaps={WorkerId("w1"): WorkerOverlap.of(device=100)}).worker_id
        for s in range(2000))
    assert 0.69 < picks["w1"] / 2000 < 0.77


# ----------------------------------------------------------------------------------------------
# In-flight accounting
# ----------------------------------------------------------------------------------------------


def test_burst_of_identical_prompts_spreads_over_empty_workers():
    """8 identical prompts, 4 empty workers, nothing reported back in between.

    r1: all 272, seeded tie -> some worker A; ledger A: 2048 queued tokens, 144 blocks, 128 hashes.
    r2 on A: max((2048 + 2048)/16 - 128 in-flight, 0) + (144 + 144 - 128) = 128 + 160 = 288;
       elsewhere 272 -> an empty worker. r3, r4 likewise.
    r5..r8: 288 on every worker (r5's own prefill is 0 tokens: the in-flight hit covers it, so
       A's queue stays 2048) -> one more per worker.
    """
    ledger = InflightLedger()
    workers = _make_workers(4)
    placed = [
        _route(ledger, _make_request(request_id=RequestId(f"r{k}")), workers, _make_config(),
               seed=k).worker_id
        for k in range(8)
    ]

    assert sorted(collections.Counter(placed).values()) == [2, 2, 2, 2]
    assert ledger.load_for(WorkerId(placed[0])) == InflightLoad(
        prefill_tokens=2048, decode_blocks=128 + 16 + 16, requests=2)


def test_burst_goes_to_the_warm_worker_once_its_prefill_is_done():
    """r1 goes to A and finishes prefill (its KV events have not arrived yet).

    r2 on A: max((0 + 2048)/16 - 128 in-flight, 0) + (144 + 144 - 128) = 0 + 160 = 160;
    elsewhere 272 -> A: the cached prefix is now cheaper than a fresh prefill.
    """
    ledger = InflightLedger()
    workers = _make_workers(4)
    first = _route(ledger, _make_request(request_id=RequestId("r1")), workers, _make_config(), 0)
    ledger.prefill_done(RequestId("r1"))

    second = _route(ledger, _make_request(request_id=RequestId("r2")), workers, _make_config(), 1)

    assert second.worker_id == first.worker_id
    assert _costs(second)[first.worker_id] == 160.0
    assert second.speculative_overlap == {first.worker_id: 128}
    assert "in-flight 128x1" in second.reason and "shared in-flight 128" in second.reason


def test_speculative_overlap_without_load_would_pile_up():
    """The trap the ledger avoids: a view that reports the in-flight prefix but not the load.

    No output tokens here, so request_blocks = 128. After r1 on A, r2 sees A at
    max((0 + 2048)/16 - 128, 0) + (0 + 128 - 128) = 0 against 128 + 128 = 256 elsewhere, and
    every later one follows. This is why ``add`` records load and overlap together.
    """

    class OverlapOnly:
        """The ledger's view with the prefill tokens and the decode blocks left out."""

        def __init__(self, ledger: InflightLedger) -> None:
            self.ledger = ledger

        def view(self, hashes):
            return {w: InflightLoad(requests=m.requests, shared_blocks=m.shared_blocks)
                    for w, m in self.ledger.view(hashes).items()}

    ledger = InflightLedger()
    view = OverlapOnly(ledger)
    workers = _make_workers(4)
    placed = []
    for k in range(4):
        request = _make_request(request_id=RequestId(f"r{k}"), expected_output_tokens=0)
        d = decide(request, workers, _make_config(), rng_seed=k, inflight=view)
        ledger.add(request.request_id, d.worker_id, request.block_hashes, d.prefill_tokens,
                   d.decode_blocks, 0.0, 60.0)
        placed.append(d.worker_id)

    assert len(set(placed)) == 1


def test_inflight_load_combines_with_reports_by_max_or_sum():
    """w0 reports 1,024 queued tokens; the ledger holds r0's 2,048 on w0.

    max: queued max(1024, 2048) = 2048 -> prefill (2048 + 2048)/16 - 128 in-flight = 128.
    sum: queued 1024 + 2048 = 3072 -> prefill (3072 + 2048)/16 - 128 = 192.
    """
    ledger = InflightLedger()
    ledger.add(RequestId("r0"), WorkerId("w0"), _hashes(128), 2048, 144, 0.0, 60.0)
    workers = [_make_worker("w0", queued_prefill_tokens=1024)]

    by_max = decide(_make_request(), workers, _make_config(), rng_seed=0, inflight=ledger)
    by_sum = decide(_make_request(), workers, _make_config(load_combine="sum"), rng_seed=0,
                    inflight=ledger)

    row_max, row_sum = by_max.scores[0], by_sum.scores[0]
    assert (row_max.queued_prefill_tokens, row_max.prefill_blocks) == (2048, 128.0)
    assert (row_sum.queued_prefill_tokens, row_sum.prefill_blocks) == (3072, 192.0)


def test_ledger_counts_shared_prompt_blocks_once_and_releases_in_steps():
    """Two requests share the first 100 of 128 prompt blocks on w0 (each 144 blocks in all).

    unique hashed blocks = 128 + 28 = 156, plus 16 unhashed per request = 188.
    """
    ledger = InflightLedger()
    w0 = WorkerId("w0")
    a = _hashes(128)
    b = a[:100] + _hashes(28, root=7)
    ledger.add(RequestId("a"), w0, a, 2048, 144, now=0.0, ttl=10.0)
    ledger.add(RequestId("b"), w0, b, 448, 144, now=1.0, ttl=10.0)

    assert ledger.load_for(w0) == InflightLoad(2048 + 448, 188, 2)
    assert ledger.speculative_overlap(w0, a) == 128
    assert ledger.speculative_overlap(w0, a[:100] + _hashes(28, root=9)) == 100
    assert ledger.speculative_overlap(WorkerId("w1"), a) == 0

    ledger.prefill_done(RequestId("a"))
    assert ledger.load_for(w0) == InflightLoad(448, 188, 2)

    ledger.complete(RequestId("a"))
    ledger.complete(RequestId("a"))  # at-least-once delivery: a repeat is a no-op
    assert ledger.load_for(w0) == InflightLoad(448, 144, 1)
    assert ledger.speculative_overlap(w0, a) == 100

    assert ledger.expire(now=10.5) == ()
    assert ledger.expire(now=11.0) == ((RequestId("b"), w0),)
    assert ledger.load_for(w0) == InflightLoad() and len(ledger) == 0


def test_ledger_keeps_one_entry_per_request_and_worker():
    """Disaggregated: r1 on prefill p0 and decode d0. Handing off frees only p0; a retried
    add on d0 replaces the old entry; dropping a worker forgets its entries."""
    ledger = InflightLedger()
    r1, p0, d0 = RequestId("r1"), WorkerId("p0"), WorkerId("d0")
    ledger.add(r1, p0, _hashes(128), 2048, 128, now=0.0, ttl=60.0)
    ledger.add(r1, d0, _hashes(128), 0, 144, now=0.0, ttl=60.0)

    ledger.complete(r1, p0)
    assert ledger.load_for(p0) == InflightLoad() and r1 in ledger

    ledger.add(r1, d0, _hashes(128), 0, 150, now=5.0, ttl=60.0)
    assert ledger.load_for(d0) == InflightLoad(0, 150, 1)
    assert ledger.expire(now=60.0) == ()  # the replaced entry's expiry no longer applies

    ledger.drop_worker(d0)
    assert r1 not in ledger and len(ledger) == 0


def test_ledger_rejects_decode_blocks_smaller_than_the_prompt():
    with pytest.raises(InvalidRoutingInput, match="counts every block the request holds"):
        InflightLedger().add(RequestId("r"), WorkerId("w"), _hashes(10), 0, 5, 0.0, 1.0)


def test_view_is_load_for_plus_speculative_overlap():
    ledger = InflightLedger()
    ledger.add(RequestId("a"), WorkerId("w0"), _hashes(40), 640, 50, 0.0, 60.0)
    diverging = _hashes(10) + _hashes(30, root=3)
    ledger.add(RequestId("b"), WorkerId("w1"), diverging, 100, 45, 0.0, 60.0)
    ledger.add(RequestId("c"), WorkerId("w2"), _hashes(20, root=5), 320, 20, 0.0, 60.0)
    query = _hashes(64)

    view = ledger.view(query)

    assert view == {
        w: msgspec.structs.replace(ledger.load_for(w),
                                   shared_blocks=ledger.speculative_overlap(w, query))
        for w in (WorkerId("w0"), WorkerId("w1"), WorkerId("w2"))
    }
    assert [view[WorkerId(w)].shared_blocks for w in ("w0", "w1", "w2")] == [40, 10, 0]


_TIER_WEIGHT = {"device": 1.0, "host": 0.75, "disk": 0.25, "object": 0.1}


def _reference_kv_cost(request, worker, overlap, shared, stale_factor, scale):
    """The module docstring's formula, block by block (independent of decide's arithmetic)."""
    layout = [t.value for t, c in zip(TIER_ORDER, overlap.tiers) for _ in range(c)]
    factor = stale_factor if overlap.stale else 1.0
    saved = 0.0
    for position in range(len(request.block_hashes)):
        if position < shared:
            saved += 1.0
        elif position < len(layout):
            saved += factor * _TIER_WEIGHT[layout[position]]
    prefill = max((worker.queued_prefill_tokens + request.prompt_tokens) / request.block_size
                  - saved, 0.0)
    decode = worker.active_decode_blocks + request.request_blocks - shared
    return scale * prefill + decode


@settings(max_examples=300, derandomize=True, deadline=None)
@given(
    tiers=st.lists(st.integers(0, 40), min_size=4, max_size=4),
    shared=st.integers(0, 128),
    stale=st.booleans(),
    stale_factor=st.sampled_from([0.0, 0.5, 1.0]),
    queued=st.integers(0, 5000),
    active=st.integers(0, 500),
    scale=st.sampled_from([0.5, 1.0, 3.0]),
)
def test_kv_cost_matches_the_documented_formula(tiers, shared, stale, stale_factor, queued,
                                                active, scale):
    """In-flight blocks first at device weight, then the index's blocks fastest tier first,
    discounted when stale; loads combined by max with the ledger (which reports nothing for
    queue and decode here beyond what the worker reports)."""
    request = _make_request()
    worker = _make_worker("w0", queued_prefill_tokens=queued, active_decode_blocks=active)
    overlap = WorkerOverlap.of(device=tiers[0], host=tiers[1], disk=tiers[2], object=tiers[3],
                            stale=stale)
    ledger = InflightLedger()
    if shared:
        ledger.add(RequestId("other"), WorkerId("w0"), request.block_hashes[:shared], 0, shared,
                   0.0, 60.0)
    config = _make_config(stale_overlap_factor=stale_factor, prefill_load_scale=scale)

    decision = decide(request, [worker], config, rng_seed=0, overlaps={WorkerId("w0"): overlap},
                      inflight=ledger)

    expected = _reference_kv_cost(request, worker, overlap, shared, stale_factor, scale)
    # The ledger's own decode blocks (shared) count only when above the reported ones (max).
    if shared > active:
        expected += shared - active
    assert decision.scores[0].cost == pytest.approx(expected, rel=1e-12, abs=1e-9)


# ----------------------------------------------------------------------------------------------
# Other modes
# ----------------------------------------------------------------------------------------------


def test_round_robin_cycles_and_skips_ineligible_workers():
    workers = _make_workers(3) + [_make_worker("w3", draining=True)]
    config = _make_config(mode=RoutingMode.ROUND_ROBIN)
    cursor = None
    picks = []
    for k in range(7):
        d = decide(_make_request(), workers, config, rng_seed=k, rr_cursor=cursor)
        picks.append(d.worker_id)
        cursor = d.rr_cursor

    assert picks == ["w0", "w1", "w2", "w0", "w1", "w2", "w0"]
    assert all(row.cost is None for row in d.scores)


def test_round_robin_cursor_survives_membership_changes():
    """The cursor is the last worker chosen, not a position: w1 leaving after w0 was chosen
    makes the next pick w2 (not a skip), and a new w0b joins its place in the rotation."""
    config = _make_config(mode=RoutingMode.ROUND_ROBIN)
    workers = [_make_worker("w0"), _make_worker("w0b"), _make_worker("w2")]

    d = decide(_make_request(), workers, config, rng_seed=0, rr_cursor=WorkerId("w0"))
    assert d.worker_id == "w0b"
    d = decide(_make_request(), workers, config, rng_seed=0, rr_cursor=d.rr_cursor)
    assert d.worker_id == "w2"


def test_random_mode_is_seeded_and_covers_all_workers():
    config = _make_config(mode=RoutingMode.RANDOM)
    picks = [decide(_make_request(), _make_workers(4), config, rng_seed=s).worker_id
             for s in range(100)]

    assert set(picks) == {"w0", "w1", "w2", "w3"}
    assert picks == [decide(_make_request(), _make_workers(4), config, rng_seed=s).worker_id
                     for s in range(100)]


def test_least_loaded_by_blocks():
    """Load = queued tokens / 16 + active blocks: w0 320/16 + 10 = 30, w1 0 + 25 = 25,
    w2 160/16 + 40 = 50 -> w1 (overlap plays no part)."""
    workers = [
        _make_worker("w0", queued_prefill_tokens=320, active_decode_blocks=10),
        _make_worker("w1", active_decode_blocks=25),
        _make_worker("w2", queued_prefill_tokens=160, active_decode_blocks=40),
    ]
    decision = decide(_make_request(), workers, _make_config(mode=RoutingMode.LEAST_LOADED),
                      rng_seed=0, overlaps={WorkerId("w2"): WorkerOverlap.of(device=128)})

    assert decision.worker_id == "w1"
    assert _costs(decision) == {"w0": 30.0, "w1": 25.0, "w2": 50.0}
    assert "chose w1 with load 25 = 0/16 + 25" in decision.reason


def test_least_loaded_by_requests_counts_the_ledger():
    """w0 reports 3 in flight, w1 reports 1 but the ledger holds 4 of ours on it: max(1, 4) = 4."""
    ledger = InflightLedger()
    for k in range(4):
        ledger.add(RequestId(f"x{k}"), WorkerId("w1"), (), 0, 1, 0.0, 60.0)
    workers = [_make_worker("w0", inflight_requests=3), _make_worker("w1", inflight_requests=1)]
    config = _make_config(mode=RoutingMode.LEAST_LOADED, least_loaded_metric="requests")

    decision = decide(_make_request(), workers, config, rng_seed=0, inflight=ledger)

    assert decision.worker_id == "w0"
    assert _costs(decision) == {"w0": 3.0, "w1": 4.0}


# ----------------------------------------------------------------------------------------------
# Config, inputs and the event
# ----------------------------------------------------------------------------------------------


def test_config_rejects_a_slower_tier_worth_more():
    with pytest.raises(RouterConfigError,
                       match="a slower tier must not be worth more than a faster one"):
        TierWeights(host=0.5, disk=0.6)


@pytest.mark.parametrize("overrides, message", [
    ({"temperature": -1.0}, "negative temperature would prefer the worst worker"),
    ({"stale_overlap_factor": 1.5}, "never more"),
    ({"imbalance_rel_threshold": 0.5}, "perfectly balanced cluster"),
    ({"prefill_load_scale": float("nan")}, "prefill_load_scale"),
    ({"inflight_ttl_s": 0.0}, "leak load forever"),
])
def test_config_validation_explains_itself(overrides, message):
    with pytest.raises(RouterConfigError, match=message):
        _make_config(**overrides)


def test_config_decodes_from_json_with_the_same_validation():
    good = msgspec.json.decode(
        json.dumps({"version": 3, "mode": "kv", "tier_weights": {"host": 0.8}}), type=RouterConfig)
    assert (good.version, good.tier_weights.host, good.tier_weights.disk) == (3, 0.8, 0.25)

    with pytest.raises(msgspec.ValidationError, match="slower tier"):
        msgspec.json.decode(json.dumps({"tier_weights": {"disk": 0.9}}), type=RouterConfig)


def test_duplicate_worker_ids_are_rejected():
    with pytest.raises(InvalidRoutingInput, match="listed twice"):
        decide(_make_request(), [_make_worker("w0"), _make_worker("w0")], _make_config(),
               rng_seed=0)


def test_request_rejects_more_hashes_than_full_prompt_blocks():
    with pytest.raises(InvalidRoutingInput, match="only full prompt blocks are hashed"):
        _make_request(prompt_tokens=100, block_hashes=_hashes(7))


def test_overlap_from_index_tier_counts():
    by_name = WorkerOverlap.from_tiers({"device": 3, "host": 2}, stale=True)
    by_order = WorkerOverlap.from_tiers((3, 2, 0, 0), stale=True)  # TIER_ORDER, as the index
    assert by_name == by_order
    assert (by_name.depth, by_name.by_tier(), by_name.stale) == (5, {"device": 3, "host": 2}, True)


def test_decision_becomes_a_request_routed_event():
    decision = decide(_make_request(), _make_workers(2), _make_config(version=7), rng_seed=99,
                      overlaps={WorkerId("w1"): WorkerOverlap.of(device=100)})

    event = decision.to_event(index_position={"kv:0": 42}, router_id="router-a")
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(event), type=RequestRouted)

    assert decoded == event
    assert (event.worker_id, event.config_version, event.rng_seed, event.mode) == (
        "w1", 7, 99, RoutingMode.KV)
    assert [s.worker_id for s in event.scores] == ["w0", "w1"]
