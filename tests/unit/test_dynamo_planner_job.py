"""The JSON job for Dynamo's planner replay is a pure function of the load (no .venv-dynamo)."""

from __future__ import annotations

from benchmarks import dynamo_planner_replay as drv
from benchmarks import planner_bench as pb
from data_plane.engines import EngineRequest
from schemas.types import RequestId


def _req(i: int, t_ms: float, digests: list[bytes], osl: int = 8) -> pb.Req:
    eng = EngineRequest(request_id=RequestId(f"r{i}"), prompt=list(range(64 * len(digests))), max_tokens=osl,
                        arrival_ms=t_ms, prompt_digests=digests)
    return pb.Req(f"r{i}", eng, osl, t_ms)


def _job(reqs: list[pb.Req], **overrides) -> dict:
    args = dict(budget=12, ttft_slo_ms=2000.0, itl_slo_ms=25.0, startup_s=30.0, prefill=2, decode=3,
                optimization_target="throughput", adjustment_interval_s=None)
    return pb.dynamo_job(reqs, **{**args, **overrides})


def test_shared_prefix_blocks_get_the_same_hash_id() -> None:
    """a,b then a,c: the shared first block is id 0 in both, the others 1 and 2; a partial last
    block gets its own id (Dynamo wants hash ids covering the whole prompt)."""
    job = _job([_req(0, 0.0, [b"a", b"b"]), _req(1, 500.0, [b"a", b"c"])])
    assert [r["hash_ids"] for r in job["requests"]] == [[0, 1], [0, 2]]
    assert [r["isl"] for r in job["requests"]] == [128, 128]


def test_job_carries_our_mocker_profile_and_the_same_budget() -> None:
    job = _job([_req(0, 0.0, [b"a"])], adjustment_interval_s=30)
    assert job["engine"] == {"block_size": 64, "num_gpu_blocks": 16384, "max_num_seqs": 256,
                             "max_num_batched_tokens": 8192}
    cfg = drv.planner_config(job)
    assert (cfg["mode"], cfg["max_gpu_budget"], cfg["throughput_adjustment_interval_seconds"]) == ("disagg", 12, 30)
    assert "throughput_adjustment_interval_seconds" not in drv.planner_config({**job, "adjustment_interval_s": None})
    assert cfg["optimization_target"] == "throughput"
    assert drv.planner_config(_job([_req(0, 0.0, [b"a"])], optimization_target="sla"))["optimization_target"] == "sla"
    assert drv.mooncake_rows(job["requests"]) == [{"timestamp": 0, "input_length": 64, "output_length": 8,
                                                   "hash_ids": [0]}]


def test_dynamo_result_scores_with_our_scorer() -> None:
    """Start 1P+1D; the tick at 10 s shows a second decode starting: replica-seconds over a 20 s
    span are 20 + 20 + 10 = 50, max GPUs 3, one decision."""
    reqs = [_req(0, 0.0, [b"a"], osl=3)]
    pool = lambda a, s=0: {"active": a, "starting": s, "draining": 0}  # noqa: E731
    out = {"start": (1, 1), "per_request": [{"arrival_ms": 0.0, "isl": 64, "osl": 3, "first_ms": 100.0,
                                             "last_ms": 140.0, "outputs": 3, "status": "completed"}],
           "ticks": [{"at_ms": 10_000.0, "prefill": pool(1), "decode": pool(1, 1)}]}
    res = pb.dynamo_result(reqs, out, end_arrival_ms=20_000.0)
    assert res.attainment(2000.0, 25.0) == 1.0  # TTFT 100 ms, ITL (140-100)/2 = 20 ms
    assert res.replica_seconds() == 50.0
    assert (pb.max_gpus(res), len(res.decisions)) == (3, 1)


def test_partial_last_block_gets_its_own_id() -> None:
    r = _req(0, 0.0, [b"a"])
    r.engine = EngineRequest(request_id=RequestId("r0"), prompt=list(range(70)), max_tokens=8, prompt_digests=[b"a"])
    assert _job([r])["requests"][0]["hash_ids"] == [0, 1]


def test_dynamo_times_are_shifted_back_to_the_trace_and_paired_by_lengths() -> None:
    """Dynamo's clock starts at the first timestamp (here 1000 ms), and two requests in the same
    millisecond come back in the other order: each still gets its own times."""
    reqs = [_req(0, 1000.2, [b"a"], osl=3), _req(1, 1000.4, [b"b", b"c"], osl=3)]
    out = {"start": (1, 1), "ticks": [],
           "per_request": [{"arrival_ms": 0.0, "isl": 128, "osl": 3, "first_ms": 300.0, "last_ms": 340.0,
                            "outputs": 3, "status": "completed"},
                           {"arrival_ms": 0.0, "isl": 64, "osl": 3, "first_ms": 100.0, "last_ms": 140.0,
                            "outputs": 3, "status": "completed"}]}
    res = pb.dynamo_result(reqs, out, end_arrival_ms=1000.4)
    by_id = {r.rid: (r.first_ms, r.last_ms) for r in res.requests}
    assert by_id == {"r0": (1100.0, 1140.0), "r1": (1300.0, 1340.0)}
