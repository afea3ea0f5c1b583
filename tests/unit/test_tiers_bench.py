"""The tiers benchmark's harness on the first 300 lines of the Mooncake trace, our side only
(Dynamo's mocker is the bench group's): the RESULT line, and tiers never lose reuse."""

from __future__ import annotations

import pytest

from benchmarks.tiers_bench import DEFAULT_TRACE, derived_router_config, main
from data_plane.engines.tiers import OnboardCosts
from schemas.types import RoutingMode


def test_router_weights_are_derived_from_the_onboarding_cost():
    cfg = derived_router_config(OnboardCosts())
    assert cfg.mode is RoutingMode.KV
    assert cfg.tier_weights.device == 1.0 and 0.0 < cfg.tier_weights.host < 1.0


def test_main_reports_reuse_by_tier_and_the_result_line(capsys):
    out = main(DEFAULT_TRACE, 300, dynamo=False, tune=None, score=None)
    rows = out["rows"]
    device, host = rows["ours kv, device only"], rows["ours kv, +host"]
    assert host["reuse"] >= device["reuse"]
    assert abs(host["reuse"] - host["reuse_device"] - sum(host["reuse_by_tier"].values())) < 1e-9
    assert device["reuse_by_tier"] == {} and device["bytes_moved"] == {}
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("RESULT reuse_tiered=")
    # The breakdown adds up, and the bound is below every request's alone time with its own
    # reuse (one infinite cache serves at least as much).
    for r in rows.values():
        for band in ("p50", "p99"):
            b = r[f"breakdown_{band}"]
            assert b["ttft"] == pytest.approx(b["queue"] + b["service"])
            assert b["service"] >= b["alone"] - 1e-6 or band == "p99"
    assert out["result"]["ttft_p99_bound_ms"] <= device["ttft_p99_ms"]
    assert out["result"]["ttft_p50_bound_ms"] <= device["ttft_p50_ms"]


def test_the_ideal_cache_hits_every_prefix_an_earlier_arrival_had():
    """Three prompts: A, then A's first two blocks plus a new one (hits 2 of its blocks), then
    A again (hits all but its last token's block). 64-token blocks."""
    from benchmarks.tiers_bench import ideal_uncached
    from data_plane.engines import EngineRequest

    a = list(range(64 * 3 + 1))
    b = a[:128] + list(range(5000, 5065))
    reqs = [EngineRequest(request_id=r, prompt=p, max_tokens=1, arrival_ms=t)
            for r, p, t in (("a", a, 0.0), ("b", b, 1.0), ("a2", a, 2.0))]
    assert ideal_uncached(reqs, 64) == [len(a), len(b) - 128, 1]


def test_peer_fetch_row_pulls_from_peers_and_keeps_reuse(capsys):
    out = main(DEFAULT_TRACE, 300, dynamo=False, tune=None, score=None)
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


def test_tune_and_score_apart(capsys):
    """The scale is picked on the tune cases, the trace runs with the pick, and the RESULT line
    keeps its keys and adds the worst score case (lowest p99 gain over device only, without
    Dynamo)."""
    from workloads.sets import Case, parse_cases

    out = main(DEFAULT_TRACE, 60, dynamo=False, tune=parse_cases("agentic:1,long-context:1"),
               score=parse_cases("agentic:2,mixed:2"), case_duration_s=20)
    apart = out["apart"]
    assert set(apart["tuning"]["ours"].runs) == {Case("agentic", 1), Case("long-context", 1)}
    assert set(apart["scores"]) == {Case("agentic", 2), Case("mixed", 2)}
    worst = apart["summary"].worst
    assert apart["scores"][worst]["ttft_p99_gain_vs_device_only"] == min(
        s["ttft_p99_gain_vs_device_only"] for s in apart["scores"].values())
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == out["line"] and last.startswith("RESULT reuse_tiered=")
    assert f" score_cases=2 worst_case={worst} " in last
