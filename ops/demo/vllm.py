"""``switchyard up --demo --engine vllm``: what differs from the simulated demo.

Workers run in the vLLM environment (``.venv-vllm``) with vLLM's NixlConnector (prefill and
decode move real KV over NIXL/UCX on loopback); the router hashes 32-token blocks as vLLM does;
the trace slice is replayed with prompts scaled to the tiny model's context
(:mod:`ops.demo.trace_tokens`), and the summary has the shape of
:func:`ops.demo.loadgen.run_trace`'s so the same report and plot apply.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import httpx

from ops.demo.loadgen import _one, _pct
from workloads.stats import ideal_hit_rate
from ops.demo.trace_tokens import prompt_of
from data_plane.engines.trace import read_mooncake
from common.settings import repo_root

ROOT = repo_root()
BLOCK = 32
MAX_MODEL_LEN = 2048
#: A vLLM worker's start on a loaded 2-core box takes minutes (two vLLM imports and the KV cache).
READY_TIMEOUT_S = 1500.0
WORKER_ARGS = ["--engine", "vllm", "--vllm-kv-connector", "nixl", "--vllm-block-size", str(BLOCK),
               "--vllm-max-model-len", str(MAX_MODEL_LEN)]
WORKER_ENV = {"UCX_NET_DEVICES": "lo", "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1",
              "VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
ROUTER_ARGS = ["--block-size", str(BLOCK), "--hash-algo", "sha256"]


def vllm_python() -> str:
    py = os.environ.get("SWITCHYARD_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(py).exists():
        raise RuntimeError(f"no vLLM environment at {py}: run `bash scripts/vllm-env.sh`")
    return py


def replay(router_url: str, d: Any, echo=print, api_key: str | None = None) -> dict:  # noqa: ANN001 - DemoSettings
    """The trace slice through the router, arrivals compressed by ``d.rate``; every request
    carries ``api_key`` (the demo's router key) when there is one."""
    records = read_mooncake(d.trace, d.limit)
    max_out = min(d.max_output, 16)
    prompts = [prompt_of(r, BLOCK, MAX_MODEL_LEN - max_out - 1) for r in records]
    echo(f"prompts: each 512-token trace block -> {BLOCK} token ids (lengths / 16, capped at "
         f"{MAX_MODEL_LEN - max_out - 1}), at most {max_out} output tokens")

    async def run() -> list:
        start = time.monotonic()
        t_first = records[0].timestamp_ms if records else 0
        sem = asyncio.Semaphore(8)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0),
                                     headers={"Authorization": f"Bearer {api_key}"} if api_key else None) as client:
            async def fire(i: int) -> Any:
                delay = (records[i].timestamp_ms - t_first) / 1000 / d.rate - (time.monotonic() - start)
                if delay > 0:
                    await asyncio.sleep(delay)
                async with sem:
                    return await _one(client, f"{router_url}/v1/completions", "switchyard-sim", i, f"vd-{i}",
                                      prompts[i], max(1, min(records[i].output_length, max_out)))
            return await asyncio.gather(*(fire(i) for i in range(len(records))))

    t0 = time.monotonic()
    results = asyncio.run(run())
    wall = time.monotonic() - t0
    ok = [r for r in results if r.ok]
    itls = [x for r in ok for x in r.itls_ms]
    prompt_total = sum(r.prompt_tokens for r in ok)
    return {
        "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5], "wall_s": wall,
        "ttft_p50_ms": _pct([r.ttft_ms for r in ok], 0.5), "ttft_p90_ms": _pct([r.ttft_ms for r in ok], 0.9),
        "ttft_p99_ms": _pct([r.ttft_ms for r in ok], 0.99), "itl_p50_ms": _pct(itls, 0.5),
        "itl_p99_ms": _pct(itls, 0.99), "e2e_p50_ms": _pct([r.e2e_ms for r in ok], 0.5),
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / wall if wall else 0.0,
        "hit_rate": sum(r.cached_tokens for r in ok) / prompt_total if prompt_total else 0.0,
        "ideal_hit_rate": ideal_hit_rate(records), "results": results,
    }
