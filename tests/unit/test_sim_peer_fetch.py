"""Peer fetch in the cluster simulator: a request the router sends to a worker without the
prefix, crediting it with a peer's blocks, pulls them into that worker's host tier first; the
request enters the engine once the modelled transfer is over, and the engine onboards them."""

from __future__ import annotations

from control_plane.router import RouterConfig, TierWeights
from control_plane.simulation import Topology, run_cluster
from data_plane.engines import EngineRequest, load_profile
from schemas.types import RoutingMode, Tier

PROF = load_profile("mocker")
BS = PROF.block_size


def _req(i: int, at: float, prompt: list[int], out: int = 4) -> EngineRequest:
    # The shared prefix's 40 full blocks: the same chained digests in every request; the rest
    # of each prompt is its own.
    digests = [(1000 + b if b < 40 else (i << 20) + b).to_bytes(32, "big") for b in range(len(prompt) // BS)]
    return EngineRequest(request_id=f"r{i}", prompt=prompt, max_tokens=out, arrival_ms=at, prompt_digests=digests)


def _run(peer: float):
    shared = list(range(40 * BS))
    # r0 warms worker A; then a burst of the same prefix: the router spreads it, and with peer
    # fetch the spread requests pull the prefix instead of recomputing it.
    reqs = [_req(0, 0.0, shared + [1])] + [_req(i, 2000.0 + i, shared + [i + 7] * (60 * BS), 64)
                                           for i in range(1, 9)]
    cfg = RouterConfig(mode=RoutingMode.KV, tier_weights=TierWeights(peer=peer))
    return run_cluster(reqs, Topology("2", aggregated=2), cfg, tiers={Tier.HOST: 4096})


def test_a_spread_request_fetches_its_prefix_from_the_peer():
    off, on = _run(0.0), _run(0.9)
    assert off.router.peer_fetches == 0
    assert on.router.peer_fetches >= 1 and on.router.peer_blocks >= 40
    assert on.tier_moves.get(("peer", "host"), 0) >= 40
    onboarded = sum(r.onboarded_tokens for r in on.records)
    assert onboarded >= 39 * BS
    assert on.summary()["reuse"] > off.summary()["reuse"]
