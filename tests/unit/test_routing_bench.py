"""The routing benchmark's harness on the first 200 lines of the Mooncake trace (a few seconds).

It drives our real routing core (``decide``, ``PrefixIndex``, ``InflightLedger``) over simulated
engines, so these tests check the harness is faithful (round robin reproduces ``simulate``
exactly) and that its results are sane (KV routing reuses at least as much cache as round robin,
every request finishes, every phase is routed once).
"""

from __future__ import annotations


import pytest

from benchmarks.routing_bench import (
    AGGREGATED_8,
    DEFAULT_TRACE,
    DISAGGREGATED_4P4D,
    GRID,
    load_requests,
    main,
    run_cluster,
)
from control_plane.router import RouterConfig
from control_plane.simulation import SimRouter
from data_plane.engines import load_profile, simulate
from schemas.events import RequestCompleted
from schemas.types import RequestPhase, RoutingMode, WorkerRole

LIMIT = 200



@pytest.fixture(scope="module")
def requests():
    return load_requests(DEFAULT_TRACE, LIMIT, load_profile("mocker"))


def _config(mode: RoutingMode, **overrides) -> RouterConfig:
    return RouterConfig(mode=mode, **overrides)


def test_round_robin_reproduces_simulate_exactly(requests):
    """Same engines, same clock rules: request i on worker i mod 8, so every request's token
    times and cache hits equal ``simulate``'s (the harness adds routing, not timing drift)."""
    ours = run_cluster(requests, AGGREGATED_8, _config(RoutingMode.ROUND_ROBIN))
    ref = simulate(requests, "mocker", num_workers=8)
    assert [r.request.request_id for r in ours.records] == [r.request_id for r in ref.requests]
    for a, b in zip(ours.records, ref.requests):
        assert list(a.token_times) == list(b.token_times)
        assert a.cached_tokens == b.cached_tokens
    assert ours.steps == ref.steps


@pytest.mark.parametrize("topology", [AGGREGATED_8, DISAGGREGATED_4P4D], ids=["agg8", "4p4d"])
def test_kv_routing_reuses_at_least_round_robin(requests, topology):
    rr = run_cluster(requests, topology, _config(RoutingMode.ROUND_ROBIN)).summary()
    kv = run_cluster(requests, topology, _config(RoutingMode.KV)).summary()
    phases = 2 if topology.disaggregated else 1
    for s in (rr, kv):
        assert s["requests"] == LIMIT
        assert s["decisions"] == phases * LIMIT
        assert 0 < s["ttft_p50_ms"] <= s["ttft_p99_ms"]
        assert 0 < s["itl_p50_ms"] < s["ttft_p50_ms"]
        assert s["output_tok_s"] > 0
        assert 0.0 <= s["reuse"] < 1.0
    assert kv["kv_events"] > 0 and rr["kv_events"] == 0  # round robin never reads the index
    assert kv["reuse"] >= rr["reuse"]


def test_disaggregated_round_robin_rotates_each_pool_on_its_own(requests):
    """One cursor per pool: decode decisions must not reset the prefill rotation (with a shared
    cursor every prefill decision after a decode one would restart at the first prefill id)."""
    res = run_cluster(requests, DISAGGREGATED_4P4D, _config(RoutingMode.ROUND_ROBIN))
    prefill = [r.prefill_worker for r in res.records]
    assert prefill == [f"prefill-{i % 4:02d}" for i in range(LIMIT)]
    assert all(r.worker is not None and r.worker.startswith("decode-") for r in res.records)
    assert all(r.handoff_ms is not None and r.handoff_ms < r.token_times[0] for r in res.records)


def test_main_reports_every_topology_and_the_result_line(capsys):
    out = main(DEFAULT_TRACE, 60, dynamo=False, tune=None, score=None)
    assert set(out["configs"]) == {AGGREGATED_8.name, DISAGGREGATED_4P4D.name}
    for name, c in out["configs"].items():
        # The default and every grid point, and the best is a grid point.
        assert set(c["ours"]) == {"round_robin", "kv", *(f"kv@{g:g}" for g in GRID)}
        assert out["best"][name]["ours"] in c["ours"]
    assert out["result"].startswith("RESULT ttft_p50_gain_ours=")
    assert capsys.readouterr().out.rstrip().endswith(out["result"])


def test_tune_and_score_apart():
    """Our prefill_load_scale is picked on the tune cases only (the grid point with the lowest
    objective), its pick is scored on the score cases and used as the trace's "best", and the
    RESULT line keeps its keys and adds the worst score case's figures."""
    from workloads.sets import Case, parse_cases

    out = main(DEFAULT_TRACE, 60, topologies=(AGGREGATED_8,), dynamo=False, tune=parse_cases("chat:1,agentic:1"),
               score=parse_cases("agentic:2,rag:2"), case_duration_s=20)
    apart = out["apart"]
    tuned = apart["tuning"]["ours"]
    assert set(tuned.runs) == {Case("chat", 1), Case("agentic", 1)}
    assert set(tuned.objective) == set(GRID) and tuned.point == min(GRID, key=lambda g: tuned.objective[g])
    assert set(apart["scores"]) == {Case("agentic", 2), Case("rag", 2)}
    assert out["best"][AGGREGATED_8.name]["ours"] == f"kv@{tuned.point:g}"
    worst = apart["summary"].worst
    assert apart["scores"][worst]["ttft_p99_gain_ours"] == min(s["ttft_p99_gain_ours"] for s in apart["scores"].values())
    assert out["result"].startswith("RESULT ttft_p50_gain_ours=")
    assert f" score_cases=2 worst_case={worst} worst_ttft_p50_gain_ours=" in out["result"]


def test_tune_and_score_sets_must_not_overlap():
    from workloads.sets import Case

    with pytest.raises(ValueError, match="share chat:1"):
        main(DEFAULT_TRACE, 20, topologies=(AGGREGATED_8,), dynamo=False, tune=(Case("chat", 1),),
             score=(Case("chat", 1), Case("rag", 2)))


def test_case_files_for_dynamo_are_open_loop(tmp_path):
    """Dynamo's replay sends a session's later lines a delay after the previous turn completes;
    ours sends every request at its timestamp. The case files it reads carry no session, so both
    replay the same arrivals."""
    from benchmarks.tune_score import write_cases
    from data_plane.engines.trace import read_mooncake
    from workloads.sets import Case

    traces = write_cases((Case("agentic", 2),), tmp_path, duration_s=20)
    t = traces[Case("agentic", 2)]
    assert any(r.turn for r in t.records)  # multi-turn sessions in the generated records
    on_file = read_mooncake(t.path)
    assert all(r.session_id is None and r.turn is None for r in on_file)
    assert [(r.timestamp_ms, r.hash_ids) for r in on_file] == [(r.timestamp_ms, r.hash_ids) for r in t.records]


@pytest.mark.parametrize("family", ["agentic", "long-context"])
def test_round_robin_is_the_same_on_both_engines(tmp_path, family):
    """With the same arrivals and the same percentile rule, round robin gives the same TTFT
    distribution on our engine and on Dynamo's mocker: what the bench compares is the routers."""
    pytest.importorskip("dynamo._core")
    from benchmarks import tune_score
    from benchmarks.routing_bench import run_dynamo, run_ours
    from workloads.sets import Case

    prof = load_profile("mocker")
    case = Case(family, 2)
    traces, reqs = tune_score.load_cases((case,), tmp_path, prof.block_size, duration_s=30)
    ours = run_ours(reqs[case], AGGREGATED_8, _config(RoutingMode.ROUND_ROBIN), profile=prof)
    dyn = run_dynamo(traces[case].path, None, AGGREGATED_8, "round_robin")
    assert ours["requests"] == dyn["requests"] == len(reqs[case])
    for k in ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "ttft_mean_ms"):
        assert ours[k] == pytest.approx(dyn[k], abs=0.05), k
    assert ours["reuse"] == pytest.approx(dyn["reuse"], abs=1e-9)


def test_several_loads_add_the_issue_figures():
    """Each load is tuned and scored on its own; the first one's worst case makes the worst_*
    fields, and the RESULT line adds the figures over all loads (NaN without a peer)."""
    from workloads.sets import parse_cases

    out = main(DEFAULT_TRACE, 30, topologies=(AGGREGATED_8,), dynamo=False, tune=parse_cases("chat:1"),
               score=parse_cases("rag:2"), case_duration_s=15, case_rate_scale=(2.0, 1.0))
    r = out["result"]
    assert " rate_scale=2 score_cases=1 worst_case=rag:2 " in r
    assert r.endswith(" rate_scales=2,1 ttft_p50_gain_vs_best_peer=nan ttft_p99_gain_vs_best_peer=nan "
                      "ttft_gain_at_1x_min=nan")


@pytest.mark.parametrize("disaggregated", [False, True], ids=["agg", "pd"])
def test_the_simulated_router_records_the_client_ttft(disaggregated):
    """The virtual router's ``RequestCompleted.ttft_ms`` is the client's TTFT (admission to the
    first token of an aggregated or decode worker; a prefill worker's first token only hands
    off), so its ledger's TTFT fit learns in virtual time as it does live."""
    roles = ([("p", WorkerRole.PREFILL), ("d", WorkerRole.DECODE)] if disaggregated
             else [("w", WorkerRole.AGGREGATED)])
    r = SimRouter(RouterConfig(), roles, hash_algo="xxh3_64", block_size=64, kv_capacity_blocks=1024, record=True)
    r.admit("r1", [], 100, 8, 1000.0)
    first = r.route("r1", r.entry_phase, 1000.0)
    if disaggregated:
        r.on_first_token(first, "r1", 1030.0)
        first = r.route("r1", RequestPhase.DECODE, 1030.0)
    r.on_first_token(first, "r1", 1042.5)
    r.on_complete(first, "r1", 1100.0)
    done = [e.data for e in r.recorded if isinstance(e.data, RequestCompleted)]
    assert [d.ttft_ms for d in done] == [42.5]
    assert r.ledger.ttft_fit.observations() == 1
