"""Drive Dynamo's own planner through its offline replay, for ``switchyard bench planner``.

Runs only in ``.venv-dynamo`` (``scripts/dynamo-planner-env.sh``), as a child process: reads one
JSON job on stdin and writes one JSON result on stdout. Nothing here is imported by Switchyard.

Job (every field required; the bench builds it)::

    {"requests": [{"t_ms": 0.0, "isl": 1000, "osl": 20, "hash_ids": [0, 1, ...]}, ...],
     "engine": {"block_size": 64, "num_gpu_blocks": 16384, "max_num_seqs": 256,
                "max_num_batched_tokens": 8192},
     "startup_s": 30.0, "ttft_ms": 2000.0, "itl_ms": 25.0, "gpu_budget": 12,
     "prefill": 1, "decode": 1, "optimization_target": "throughput", "adjustment_interval_s": null}

``optimization_target`` is Dynamo's: ``throughput`` (its default: reactive load-based scaling on
static queue and KV thresholds; it ignores the SLOs and turns throughput-based scaling off, so the
adjustment interval does nothing there) or ``sla`` (throughput-based scaling on its performance
model toward the job's TTFT/ITL, with load-based scaling on top); null runs no planner: the
mocker at the job's split, static (the engine calibration row). ``adjustment_interval_s`` null
keeps Dynamo's default (its throughput-scaling interval, 180 s); otherwise it sets
``throughput_adjustment_interval_seconds``. The planner runs in its defaults for
the disaggregated topology (``mode="disagg"``, ``environment="virtual"``, ``backend="mocker"``),
with the job's SLOs and GPU budget, on Dynamo's mocker (Rust) with the job's engine limits and
worker start-up time. The request trace is written as a Mooncake JSONL (timestamp, lengths,
hash_ids), the format Dynamo's replay reads. Dynamo's replay starts its clock at the trace's
first timestamp: every time in the result is relative to it (the bench shifts them back).

Result: ``{"per_request": [{"arrival_ms", "isl", "first_ms", "last_ms", "outputs", "osl", "ttft_ms",
"itl_ms", "status"}], "ticks": [{"at_ms", "prefill": {active,starting,draining}, "decode": ...}],
"lifecycle_operations": [...], "scaling_events": [...], "summary": {...}}``. On failure the
traceback goes to stderr and the exit code is non-zero: the bench prints it, never a number.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any


def mooncake_rows(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The job's requests as Mooncake trace rows (integer ms timestamps, as the format wants)."""
    return [{"timestamp": int(round(r["t_ms"])), "input_length": int(r["isl"]),
             "output_length": int(r["osl"]), "hash_ids": list(r.get("hash_ids", []))} for r in requests]


def planner_config(job: dict[str, Any]) -> dict[str, Any]:
    cfg: dict[str, Any] = {"environment": "virtual", "backend": "mocker", "mode": "disagg",
                           "ttft_ms": job["ttft_ms"], "itl_ms": job["itl_ms"],
                           "max_gpu_budget": job["gpu_budget"], "optimization_target": job["optimization_target"]}
    if job.get("adjustment_interval_s") is not None:
        cfg["throughput_adjustment_interval_seconds"] = int(job["adjustment_interval_s"])
    return cfg


def engine_args(job: dict[str, Any], worker_type: str) -> dict[str, Any]:
    return {"engine": dict(job["engine"], worker_type=worker_type), "startup_time": job["startup_s"]}


def run(job: dict[str, Any]) -> dict[str, Any]:
    from dynamo.replay.api import run_trace_replay

    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # the replay writes planner_reports/ into the working directory
        trace = Path(tmp) / "trace.jsonl"
        trace.write_text("".join(json.dumps(r) + "\n" for r in mooncake_rows(job["requests"])))
        report = run_trace_replay(
            [str(trace)], prefill_engine_args=engine_args(job, "prefill"),
            decode_engine_args=engine_args(job, "decode"), num_prefill_workers=job["prefill"],
            num_decode_workers=job["decode"], router_mode="round_robin",
            trace_block_size=job["engine"]["block_size"], sla_ttft_ms=job["ttft_ms"],
            sla_itl_ms=job["itl_ms"], capture_per_request=True,
            planner_config=planner_config(job) if job["optimization_target"] else None)
    d = report.to_dict()
    per_request = [{"arrival_ms": r["arrival_time_ms"], "isl": r["input_length"], "first_ms": r["first_token_ms"],
                    "last_ms": r["last_token_ms"], "outputs": r["output_length"],
                    "osl": r["requested_output_length"], "ttft_ms": r["ttft_ms"], "itl_ms": r["itl_ms"],
                    "status": r["terminal_status"]} for r in d["per_request"] or []]
    planner = d["planner"] or {}
    ticks = [{"at_ms": t["at_ms"],
              **{pool: {k: t["topology"][pool][f"{k}_count"] for k in ("active", "starting", "draining")}
                 for pool in ("prefill", "decode")}}
             for t in planner.get("ticks", []) if t.get("topology")]
    return {"per_request": per_request, "ticks": ticks,
            "lifecycle_operations": planner.get("lifecycle_operations", []),
            "scaling_events": planner.get("scaling_events", []), "summary": d["summary"]}


def main() -> None:
    json.dump(run(json.load(sys.stdin)), sys.stdout, default=str)


if __name__ == "__main__":
    main()
