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
