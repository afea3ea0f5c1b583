"""Peers as a tier, the router's side: which blocks a peer can send a worker
(``with_peer_reach``), how the decision weighs them (``TierWeights.peer``), what the score row
records, and that the recorded row rebuilds the same inputs (replay's verify)."""

from __future__ import annotations

import pytest

from control_plane.router.config import RouterConfig, RouterConfigError, TierWeights
from control_plane.router.decision import RoutingRequest, WorkerLoad, WorkerOverlap, decide
from control_plane.router.inputs import with_peer_reach
from tests.oracles.scoring import oracle_steps

BS = 16
HASHES = tuple(range(1, 11))  # 10 full blocks
REQ = RoutingRequest(request_id="r", prompt_tokens=10 * BS, block_size=BS, block_hashes=HASHES,
                     expected_output_tokens=16)


def _workers(**queued: int) -> list[WorkerLoad]:
    return [WorkerLoad(worker_id=w, queued_prefill_tokens=q, kv_capacity_blocks=1000) for w, q in queued.items()]


def test_the_best_other_holder_lends_its_device_and_host_run():
    overlaps = {"a": WorkerOverlap.of(device=6, host=2, disk=2), "c": WorkerOverlap.of(disk=3),
                "d": WorkerOverlap.of(device=9, stale=True)}
    out = with_peer_reach(overlaps, _workers(a=0, b=0, c=0, d=0))
    # a serves 8 blocks (device + host; a peer does not serve its disk); d is stale.
    assert out["b"].peer == 8 and out["b"].peer_from == "a" and out["b"].tiers == ()
    assert out["c"].peer == 5 and out["c"].peer_from == "a"
    assert out["a"].peer == 0  # nobody else holds more than a itself
    assert out["d"].peer == 0  # d's own (stale) match is 9 deep: a's 8 add nothing
    assert overlaps["c"].peer == 0  # the input is not changed


def test_draining_or_unregistered_workers_lend_nothing():
    overlaps = {"a": WorkerOverlap.of(device=6)}
    workers = [WorkerLoad(worker_id="a", draining=True), WorkerLoad(worker_id="b")]
    assert "b" not in with_peer_reach(overlaps, workers)


def test_a_loaded_holder_sends_the_request_to_a_peer_that_fetches():
    overlaps = with_peer_reach({"a": WorkerOverlap.of(device=10)}, _workers(a=4000, b=0))
    cfg = RouterConfig(tier_weights=TierWeights(peer=0.5))
    d = decide(REQ, _workers(a=4000, b=0), cfg, rng_seed=1, overlaps=overlaps)
    assert d.worker_id == "b"
    row = {r.worker_id: r for r in d.scores}["b"]
    assert row.peer_from == "a" and row.overlap_by_tier == {"peer": 10} and row.overlap_blocks == 0
    # prefill = 10 blocks - 0.5 x 10 peer blocks
    assert row.prefill_blocks == pytest.approx(5.0)
    assert "peer 10x0.5" in d.reason
    # Without the peer weight b recomputes everything: prefill 10.
    plain = decide(REQ, _workers(a=4000, b=0), RouterConfig(), rng_seed=1,
                   overlaps={"a": WorkerOverlap.of(device=10)})
    assert {r.worker_id: r for r in plain.scores}["b"].prefill_blocks == pytest.approx(10.0)


def test_native_scoring_gives_the_oracle_decision_with_peers():
    overlaps = with_peer_reach({"a": WorkerOverlap.of(device=7, host=1), "b": WorkerOverlap.of(device=2)},
                               _workers(a=900, b=100, c=0))
    cfg = RouterConfig(tier_weights=TierWeights(peer=0.6))
    with oracle_steps():
        spec = decide(REQ, _workers(a=900, b=100, c=0), cfg, rng_seed=7, overlaps=overlaps)
    core = decide(REQ, _workers(a=900, b=100, c=0), cfg, rng_seed=7, overlaps=overlaps)
    assert core == spec


def test_the_recorded_row_rebuilds_the_overlap():
    ov = WorkerOverlap(tiers=(1, 0, 2, 0), peer=3, peer_from="a")
    assert ov.by_tier() == {"device": 1, "disk": 2, "peer": 3}
    assert WorkerOverlap.from_tiers(ov.by_tier(), peer_from="a") == ov
    assert WorkerOverlap.from_tiers({"device": 2}, peer_from="a") == WorkerOverlap.of(device=2)


def test_peer_inputs_are_checked():
    with pytest.raises(Exception, match="peer reach"):
        WorkerOverlap(peer=2)
    with pytest.raises(RouterConfigError, match="peer"):
        TierWeights(peer=1.5)
