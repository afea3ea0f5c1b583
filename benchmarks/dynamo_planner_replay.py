"""Drive Dynamo's own planner through its offline replay, for ``switchyard bench planner``.

Runs only in ``.venv-dynamo`` (``scripts/dynamo-planner-env.sh``), as a child process: reads one
JSON job on stdin and writes one JSON result on stdout. Nothing here is imported by Switchyard.

Job (built by ``planner_dynamo.dynamo_job``)::

    {"requests": [{"t_ms": 0.0, "isl": 1000, "osl": 20, "hash_ids": [0, 1, ...]}, ...],
     "engine": {"block_size": 64, "num_gpu_blocks": 16384, "max_num_seqs": 256,
                "max_num_batched_tokens": 8192, "max_model_len": 131072},
     "startup_s": 30.0, "ttft_ms": 2000.0, "itl_ms": 25.0, "gpu_budget": 12,
     "router_mode": "round_robin",
     "profile_fpms": {"prefill": [[prompt_tokens, wall_s], ...],
                      "decode": [[decoding_requests, kv_tokens, wall_s], ...]},
     "runs": [{"prefill": 3, "decode": 3, "planner": {...} | null}, ...]}

Every run replays the same requests on Dynamo's mocker (Rust), ``prefill`` + ``decode`` workers
to start with, the job's engine limits (``max_model_len`` included: its easy-mode prefill scaling
reads ``context_length`` from it) and worker start-up time, routed by ``router_mode``. ``planner``
null runs no planner (a static split); otherwise it is Dynamo's ``PlannerConfig`` as JSON (the
same schema ``--planner-config`` takes), to which the driver adds only what the replay fixes:
``environment="virtual"``, ``backend="mocker"``, ``mode="disagg"``, the GPU budget, one GPU per
engine, and the job's TTFT/ITL unless the run sets its own.

The performance model. Dynamo's replay bootstraps its planner's regression from benchmark forward
passes (FPMs) only through an AISimulate session, i.e. for engines whose timing is AIC's
(``aic_*`` engine arguments). The engine here is the mocker's own polynomial timing (the one our
simulator reproduces), so for an ``optimization_target="sla"`` run the driver hands the planner
the profile of *that* engine: ``profile_fpms``, one forward pass per point, computed by the bench
from the same timing model, installed through the adapter's ``install_benchmark_fpms`` (the call
Dynamo's own bootstrap makes) right after Dynamo prepares the adapter and before its first tick.
The bootstrap status is ``installed`` only when both regressions then report enough data
(``has_sufficient_data()``); Dynamo's own line "falling back to load-based scaling only", logged
while preparing (before the install), is kept in the warnings. Other targets never load FPMs
(Dynamo: "no perf models needed"): their status stays Dynamo's own (``not_required``).

Result: ``{"runs": [{"per_request": [{"arrival_ms", "isl", "first_ms", "last_ms", "outputs", "osl",
"ttft_ms", "itl_ms", "status"}], "ticks": [{"at_ms", "prefill": {active,starting,draining},
"decode": ...}], "scaling_events": [...], "summary": {...}, "bootstrap": {...},
"warnings": ["..."]}]}``. Dynamo's replay starts its clock at the trace's first timestamp: every
time in the result is relative to it (the bench shifts them back). On failure the traceback goes
to stderr and the exit code is non-zero: the bench prints it, never a number.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

#: Fields of Dynamo's PlannerConfig that the replay set-up fixes (the rest come from the run).
FIXED = {"environment": "virtual", "backend": "mocker", "mode": "disagg",
         "prefill_engine_num_gpu": 1, "decode_engine_num_gpu": 1}


def mooncake_rows(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The job's requests as Mooncake trace rows (integer ms timestamps, as the format wants)."""
    return [{"timestamp": int(round(r["t_ms"])), "input_length": int(r["isl"]),
             "output_length": int(r["osl"]), "hash_ids": list(r.get("hash_ids", []))} for r in requests]


def planner_config(job: dict[str, Any], planner: dict[str, Any]) -> dict[str, Any]:
    """Dynamo's planner config of one run: the run's fields, the replay's fixed ones, the budget."""
    return {"ttft_ms": job["ttft_ms"], "itl_ms": job["itl_ms"], **planner, **FIXED,
            "max_gpu_budget": job["gpu_budget"]}


def engine_args(job: dict[str, Any], worker_type: str) -> dict[str, Any]:
    return {"engine": dict(job["engine"], worker_type=worker_type), "startup_time": job["startup_s"]}


def profile_fpms(job: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """The job's profile points as Dynamo's ForwardPassMetrics (one request per prefill point with
    no cached prefix, as Dynamo's own benchmark FPMs; decode points at a batch and its KV)."""
    from dynamo.common.forward_pass_metrics import ForwardPassMetrics, ScheduledRequestMetrics

    prof = job["profile_fpms"]
    prefill = [ForwardPassMetrics(wall_time=float(w), scheduled_requests=ScheduledRequestMetrics(
        num_prefill_requests=1, sum_prefill_tokens=int(t))) for t, w in prof["prefill"]]
    decode = [ForwardPassMetrics(wall_time=float(w), scheduled_requests=ScheduledRequestMetrics(
        num_decode_requests=int(n), sum_decode_kv_tokens=int(kv))) for n, kv, w in prof["decode"]]
    return prefill, decode


def install_profile(adapter: Any, job: dict[str, Any]) -> None:
    """Bootstrap an SLA planner's regressions from the job's profile (see the module docstring)."""
    prefill, decode = profile_fpms(job)
    adapter.install_benchmark_fpms(prefill_fpms=prefill, decode_fpms=decode)
    state = adapter._engine._scaling_state  # the regressions the SLA scaling reads
    ready = {role: getattr(state, f"_{role}_regression").has_sufficient_data() for role in ("prefill", "decode")}
    digest = hashlib.sha256(json.dumps(job["profile_fpms"], sort_keys=True).encode()).hexdigest()
    adapter.set_bootstrap_metadata({
        "status": "installed" if all(ready.values()) else "insufficient_data",
        "source": "profile_fpms: the mocker profile's timing model (planner_dynamo.profile_fpms)",
        "prefill_fpm_count": len(prefill), "decode_fpm_count": len(decode), "ready": ready,
        "fpm_sha256": digest})


class _Warnings(logging.Handler):
    """Collects the WARNING and higher lines Dynamo logs during one run."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name}: {record.getMessage()}")


def run_one(job: dict[str, Any], run: dict[str, Any], trace: Path) -> dict[str, Any]:
    from dynamo.replay import api
    from dynamo.replay.planner import planner_replay_adapter

    planner = run.get("planner")
    sla = bool(planner) and planner.get("optimization_target") == "sla"

    @contextlib.contextmanager
    def with_profile(**kwargs: Any):
        with planner_replay_adapter(**kwargs) as adapter:
            if sla:
                install_profile(adapter, job)
            yield adapter

    handler = _Warnings()
    logging.getLogger().addHandler(handler)
    saved = api._planner_replay_adapter
    api._planner_replay_adapter = lambda: with_profile  # the one step added to Dynamo's flow
    try:
        report = api.run_trace_replay(
            [str(trace)], prefill_engine_args=engine_args(job, "prefill"),
            decode_engine_args=engine_args(job, "decode"), num_prefill_workers=run["prefill"],
            num_decode_workers=run["decode"], router_mode=job["router_mode"],
            trace_block_size=job["engine"]["block_size"], sla_ttft_ms=job["ttft_ms"],
            sla_itl_ms=job["itl_ms"], capture_per_request=True,
            planner_config=planner_config(job, planner) if planner else None)
    finally:
        api._planner_replay_adapter = saved
        logging.getLogger().removeHandler(handler)
    d = report.to_dict()
    per_request = [{"arrival_ms": r["arrival_time_ms"], "isl": r["input_length"], "first_ms": r["first_token_ms"],
                    "last_ms": r["last_token_ms"], "outputs": r["output_length"],
                    "osl": r["requested_output_length"], "ttft_ms": r["ttft_ms"], "itl_ms": r["itl_ms"],
                    "status": r["terminal_status"]} for r in d["per_request"] or []]
    details = d["planner"] or {}
    ticks = [{"at_ms": t["at_ms"],
              **{pool: {k: t["topology"][pool][f"{k}_count"] for k in ("active", "starting", "draining")}
                 for pool in ("prefill", "decode")}}
             for t in details.get("ticks", []) if t.get("topology")]
    bootstrap = (details.get("metadata") or {}).get("bootstrap", {"status": "no planner"})
    return {"per_request": per_request, "ticks": ticks, "scaling_events": details.get("scaling_events", []),
            "summary": d["summary"], "bootstrap": bootstrap, "warnings": distinct(handler.lines)}


def distinct(lines: list[str]) -> list[str]:
    """Each warning once, by its text with the numbers left out: the first one, and how many."""
    first: dict[str, str] = {}
    count: dict[str, int] = {}
    for line in lines:
        key = re.sub(r"[0-9.]+", "#", line)
        first.setdefault(key, line)
        count[key] = count.get(key, 0) + 1
    return [first[k] + (f" (x{count[k]})" if count[k] > 1 else "") for k in first]


def run(job: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # the replay writes planner_reports/ into the working directory
        trace = Path(tmp) / "trace.jsonl"
        trace.write_text("".join(json.dumps(r) + "\n" for r in mooncake_rows(job["requests"])))
        return {"runs": [run_one(job, r, trace) for r in job["runs"]]}


def main() -> None:
    json.dump(run(json.load(sys.stdin)), sys.stdout, default=str)


if __name__ == "__main__":
    main()
