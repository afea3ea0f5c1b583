"""The JSON job for Dynamo's planner replay, its planner configs and the reading of its result are
pure functions of the load (no .venv-dynamo)."""

from __future__ import annotations

import pytest

from benchmarks import dynamo_planner_replay as drv
from benchmarks import planner_bench as pb
from benchmarks import planner_dynamo as pd
from data_plane.engines import EngineRequest, load_profile
from schemas.types import RequestId


def _req(i: int, t_ms: float, digests: list[bytes], osl: int = 8) -> pb.Req:
    eng = EngineRequest(request_id=RequestId(f"r{i}"), prompt=list(range(64 * len(digests))), max_tokens=osl,
                        arrival_ms=t_ms, prompt_digests=digests)
    return pb.Req(f"r{i}", eng, osl, t_ms)


def _job(reqs: list[pb.Req], runs: list[pd.Run] | None = None) -> dict:
    runs = runs if runs is not None else [pd.Run("x", 2, 3, pd.planner("throughput", {}, 2000.0, 25.0))]
    return pd.dynamo_job(reqs, runs, budget=12, ttft_slo_ms=2000.0, itl_slo_ms=25.0, startup_s=30.0)


def test_shared_prefix_blocks_get_the_same_hash_id() -> None:
    """a,b then a,c: the shared first block is id 0 in both, the others 1 and 2; a partial last
    block gets its own id (Dynamo wants hash ids covering the whole prompt)."""
    job = _job([_req(0, 0.0, [b"a", b"b"]), _req(1, 500.0, [b"a", b"c"])])
    assert [r["hash_ids"] for r in job["requests"]] == [[0, 1], [0, 2]]
    assert [r["isl"] for r in job["requests"]] == [128, 128]


def test_partial_last_block_gets_its_own_id() -> None:
    r = _req(0, 0.0, [b"a"])
    r.engine = EngineRequest(request_id=RequestId("r0"), prompt=list(range(70)), max_tokens=8, prompt_digests=[b"a"])
    assert _job([r])["requests"][0]["hash_ids"] == [0, 1]


def test_job_carries_our_mocker_profile_max_model_len_and_round_robin() -> None:
    job = _job([_req(0, 0.0, [b"a"])])
    assert job["engine"] == {"block_size": 64, "num_gpu_blocks": 16384, "max_num_seqs": 256,
                             "max_num_batched_tokens": 8192, "max_model_len": 131072}
    assert (job["router_mode"], job["gpu_budget"], job["runs"][0]["prefill"], job["runs"][0]["decode"]) == (
        "round_robin", 12, 2, 3)
    assert drv.mooncake_rows(job["requests"]) == [{"timestamp": 0, "input_length": 64, "output_length": 8,
                                                   "hash_ids": [0]}]


def test_a_load_longer_than_128k_gets_a_256k_model_and_longer_is_refused() -> None:
    """64 prompt tokens + 131,072 output > 128k: the load is served by a 262,144-token model;
    64 + 262,144 fits neither."""
    job = _job([_req(0, 0.0, [b"a"], osl=pd.MAX_MODEL_LEN)])
    assert job["engine"]["max_model_len"] == pd.LONG_MODEL_LEN == 262144
    with pytest.raises(ValueError, match="exceed max_model_len 262144"):
        _job([_req(0, 0.0, [b"a"], osl=pd.LONG_MODEL_LEN)])


def test_the_guide_settings_and_every_target() -> None:
    """Every target starts from the guide's config: both loops on, throughput every 300 s, load
    every 10 s; the replay's fixed fields (virtual, mocker, disagg, the budget) always win."""
    for t in pd.TARGETS:
        cfg = drv.planner_config({"ttft_ms": 2000.0, "itl_ms": 25.0, "gpu_budget": 12},
                                 pd.planner(t, pd.CANDIDATES[t][0], 2000.0, 25.0))
        assert cfg["optimization_target"] == t
        assert (cfg["enable_throughput_scaling"], cfg["enable_load_scaling"]) == (True, True)
        assert (cfg["throughput_adjustment_interval_seconds"], cfg["load_adjustment_interval_seconds"]) == (300, 10)
        assert (cfg["environment"], cfg["backend"], cfg["mode"], cfg["max_gpu_budget"]) == (
            "virtual", "mocker", "disagg", 12)
    assert set(pd.CANDIDATES) == set(pd.TARGETS)
    assert all(len(c) >= pd.TUNE_BUDGET for c in pd.CANDIDATES.values())
    # load: its four thresholds are required by Dynamo's config; SLA targets as fractions of ours
    assert {"prefill_scale_up_queue_tokens", "prefill_scale_down_queue_tokens", "decode_scale_up_kv_rate",
            "decode_scale_down_kv_rate"} <= set(pd.planner("load", pd.CANDIDATES["load"][0], 2000.0, 25.0))
    sla = pd.planner("sla", {"ttft_scale": 0.5, "itl_scale": 0.8}, 2000.0, 25.0)
    assert (sla["ttft_ms"], sla["itl_ms"]) == (1000.0, 20.0)


def test_profile_fpms_are_the_mocker_timing() -> None:
    """Prefill of one 512-token prompt: 16.50142 + 1.518344e-2*512 + 4.209989e-7*512^2 = 24.386 ms;
    decode of 32 requests at 2,000 tokens each: u = 64,000 / 1,048,576 = 0.0610,
    5.74 + 54.01u - 25.74u^2 = 8.941 ms. Every point fits the engine's limits."""
    prof = load_profile("mocker")
    fpms = pd.profile_fpms()
    assert fpms["prefill"][0] == [512, pytest.approx(0.0243857, abs=1e-7)]
    assert [32, 64000, pytest.approx(0.0089406, abs=1e-7)] in fpms["decode"]
    assert all(t <= prof.max_num_batched_tokens for t, _ in fpms["prefill"])
    assert all(n <= prof.max_num_seqs and kv <= prof.kv_capacity_tokens for n, kv, _ in fpms["decode"])


def test_dynamo_result_scores_with_our_scorer() -> None:
    """Start 1P+1D; the tick at 10 s shows a second decode starting: replica-seconds over a 20 s
    span are 20 + 20 + 10 = 50, max GPUs 3, one decision."""
    reqs = [_req(0, 0.0, [b"a"], osl=3)]
    pool = lambda a, s=0: {"active": a, "starting": s, "draining": 0}  # noqa: E731
    out = {"per_request": [{"arrival_ms": 0.0, "isl": 64, "osl": 3, "first_ms": 100.0, "last_ms": 140.0,
                            "outputs": 3, "status": "completed"}],
           "ticks": [{"at_ms": 10_000.0, "prefill": pool(1), "decode": pool(1, 1)}]}
    res = pd.dynamo_result(reqs, out, 20_000.0, (1, 1))
    assert res.attainment(2000.0, 25.0) == 1.0  # TTFT 100 ms, ITL (140-100)/2 = 20 ms
    assert res.replica_seconds() == 50.0
    assert (pb.max_gpus(res), len(res.decisions)) == (3, 1)


def test_dynamo_times_are_shifted_back_to_the_trace_and_paired_by_lengths() -> None:
    """Dynamo's clock starts at the first timestamp (here 1000 ms), and two requests in the same
    millisecond come back in the other order: each still gets its own times."""
    reqs = [_req(0, 1000.2, [b"a"], osl=3), _req(1, 1000.4, [b"b", b"c"], osl=3)]
    out = {"ticks": [],
           "per_request": [{"arrival_ms": 0.0, "isl": 128, "osl": 3, "first_ms": 300.0, "last_ms": 340.0,
                            "outputs": 3, "status": "completed"},
                           {"arrival_ms": 0.0, "isl": 64, "osl": 3, "first_ms": 100.0, "last_ms": 140.0,
                            "outputs": 3, "status": "completed"}]}
    res = pd.dynamo_result(reqs, out, 1000.4, (1, 1))
    by_id = {r.rid: (r.first_ms, r.last_ms) for r in res.requests}
    assert by_id == {"r0": (1100.0, 1140.0), "r1": (1300.0, 1340.0)}


def test_round_robin_sim_cycles_each_pool() -> None:
    """Three prompts at once on 2 prefill workers go 0, 1, 0 (least-loaded would send the third
    to the worker with fewer queued tokens, worker 1, since the second prompt is shorter)."""
    long_, short = _req(0, 0.0, [b"a", b"b", b"c"], osl=2), _req(1, 0.0, [b"d"], osl=2)
    third = _req(2, 0.0, [b"e"], osl=2)
    sim = pd.RoundRobinSim([long_, short, third], prefill=2, decode=1)
    sim.run()
    assert [r.prefill_worker for r in (long_, short, third)] == ["prefill-0", "prefill-1", "prefill-0"]
    ll = pb.Sim(pb._fresh([long_, short, third]), prefill=2, decode=1)
    ll.run()
    assert [r.prefill_worker for r in ll.requests] == ["prefill-0", "prefill-1", "prefill-1"]


def test_result_keys_mark_a_missing_bootstrap_not_valid() -> None:
    good = {t: (0.5, 100.0, 0.9, 1.2, "installed" if t == "sla" else "not_required") for t in pd.TARGETS}
    keys = pd.result_keys([{"dynamo": good}, {"dynamo": {**good, "load": (0.4, 90.0, 0.9, 1.5, "not_required")}}])
    assert "dynamo_bootstrap=installed dynamo_valid=1" in keys
    assert "dynamo_best_slo_attainment=0.5000 dynamo_replica_seconds_vs_oracle=1.2000" in keys
    bad = {**good, "sla": (0.6, 100.0, 0.9, 1.0, "not_configured_load_only")}
    assert "dynamo_bootstrap=not_configured_load_only dynamo_valid=0" in pd.result_keys([{"dynamo": bad}])
    # what bench planner asserts after its RESULT line (a run without the FPMs installed fails)
    assert pd.bootstrap_status([{"dynamo": good}, {"dynamo": bad}]) == "not_configured_load_only"
    assert pd.bootstrap_status([{"dynamo": good}, {"name": "constant"}]) == "installed"
    assert pd.bootstrap_status([{"name": "constant"}]) == "not_run"


def test_a_reused_tuning_names_every_target() -> None:
    tuned = pd.chosen({"throughput": 3, "latency": 3, "load": 2, "sla": 3})
    assert tuned["load"].knobs == pd.CANDIDATES["load"][2]
    with pytest.raises(ValueError, match="no tuned config for \\['sla'\\]"):
        pd.chosen({"throughput": 0, "latency": 0, "load": 0})
