"""The tiers benchmark's harness on the first 300 lines of the Mooncake trace, our side only
(Dynamo's mocker is the bench group's): the RESULT line, and tiers never lose reuse."""

from __future__ import annotations

from benchmarks.tiers_bench import DEFAULT_TRACE, derived_router_config, main
from data_plane.engines.tiers import OnboardCosts
from schemas.types import RoutingMode


def test_router_weights_are_derived_from_the_onboarding_cost():
    cfg = derived_router_config(OnboardCosts())
    assert cfg.mode is RoutingMode.KV
    assert cfg.tier_weights.device == 1.0 and 0.0 < cfg.tier_weights.host < 1.0


def test_main_reports_reuse_by_tier_and_the_result_line(capsys):
    out = main(DEFAULT_TRACE, 300, dynamo=False)
    rows = out["rows"]
    device, host = rows["ours kv, device only"], rows["ours kv, +host"]
    assert host["reuse"] >= device["reuse"]
    assert abs(host["reuse"] - host["reuse_device"] - sum(host["reuse_by_tier"].values())) < 1e-9
    assert device["reuse_by_tier"] == {} and device["bytes_moved"] == {}
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("RESULT reuse_tiered=")


def test_peer_fetch_row_pulls_from_peers_and_keeps_reuse(capsys):
    out = main(DEFAULT_TRACE, 300, dynamo=False)
    rows = out["rows"]
    tiered, peered = rows["ours kv, +host+disk"], rows["ours kv, +host+disk+peer"]
    assert peered["peer_fetches"] > 0
    assert any(k.startswith("peer->host") for k in peered["bytes_moved"])
    assert peered["reuse"] >= tiered["reuse"] - 0.01
    assert "reuse_peer=" in capsys.readouterr().out.strip().splitlines()[-1]


def test_the_peer_weight_comes_from_the_same_cost():
    from data_plane.engines import load_profile
    from data_plane.engines.tiers import TierLink, peer_weight

    prof = load_profile("mocker")
    fast = peer_weight(OnboardCosts(), prof.timing, prof.block_size)
    slow = peer_weight(OnboardCosts(peer=TierLink(1e9, 50.0)), prof.timing, prof.block_size)
    assert 0.0 < fast < 1.0 and slow < fast
    assert derived_router_config(OnboardCosts(), peer=True).tier_weights.peer == fast
    assert derived_router_config(OnboardCosts()).tier_weights.peer == 0.0
