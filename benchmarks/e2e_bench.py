"""``switchyard bench e2e``: the full stack, ``kv`` vs ``round_robin``, same trace slice, same
workers (fresh caches for each run).

Each run starts, on a fresh topic prefix: 2 prefill + 2 decode simulated workers (mocker
profile, real NIXL handoffs) and a router in the given mode, all real processes on the local
broker; then replays the first ``limit`` requests of the trace at ``rate``x through the
router's OpenAI API (``control_plane.loadgen``). Needs ``switchyard stack up``.

Last line: ``RESULT ttft_p50_gain=<rr/kv> ttft_p99_gain=... hit_rate=<kv> ideal_hit_rate=...``.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
import uuid
from pathlib import Path

from control_plane.bus.admin import apply_topics
from control_plane.demo import Supervisor, free_port, wait_http
from control_plane.loadgen import run_trace
from control_plane.settings import BusSettings, StackSettings

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def one_run(mode: str, trace: Path, limit: int, rate: float, max_output: int, speedup: float) -> dict:
    prefix = f"e2e{mode[:2]}{uuid.uuid4().hex[:6]}"
    bus = BusSettings.from_env(topic_prefix=prefix)
    apply_topics(bus)
    env_backup = os.environ.get("SWITCHYARD_TOPIC_PREFIX")
    os.environ["SWITCHYARD_TOPIC_PREFIX"] = prefix
    with tempfile.TemporaryDirectory(prefix="sy-e2e-") as tmp:
        sup = Supervisor(StackSettings.from_env(state_dir=Path(tmp)))
        try:
            for role in ("prefill", "decode"):
                for i in range(2):
                    sup.start(f"worker-{role}-{i}", ["worker", "--worker-id", f"{role}-{i}", "--role", role,
                                                     "--port", str(free_port()), "--speedup", str(speedup),
                                                     "--data-dir", f"{tmp}/{role}-{i}", "--lease-s", "10"])
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            sup.start("router", ["router", "--port", str(port), "--router-id", f"e2e-{mode}", "--mode", mode])
            wait_http(f"{url}/health", lambda r: r.status_code == 200 and r.json().get("workers") == 4, timeout=120)
            t0 = time.monotonic()
            s = asyncio.run(run_trace(url, trace, limit=limit, speedup=rate, max_output=max_output, progress=False))
            s["run_s"] = time.monotonic() - t0
            return s
        finally:
            sup.stop_all(grace=15)
            if env_backup is None:
                os.environ.pop("SWITCHYARD_TOPIC_PREFIX", None)
            else:
                os.environ["SWITCHYARD_TOPIC_PREFIX"] = env_backup


def main(trace: Path = DEFAULT_TRACE, limit: int = 300, rate: float = 10.0, max_output: int = 64,
         speedup: float = 10.0) -> dict:
    runs = {m: one_run(m, Path(trace), limit, rate, max_output, speedup) for m in ("round_robin", "kv")}
    print(f"full stack, 2 prefill + 2 decode workers (mocker profile at {speedup}x), {limit} requests at {rate}x")
    print(f"{'router':<12}{'ok':>6}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'tok/s':>8}{'hit rate':>10}")
    for m, s in runs.items():
        print(f"{m:<12}{s['completed']:>6}{s['ttft_p50_ms']:>10.0f}{s['ttft_p99_ms']:>10.0f}{s['itl_p50_ms']:>9.1f}"
              f"{s['itl_p99_ms']:>9.1f}{s['output_tokens_per_s']:>8.0f}{s['hit_rate']:>10.3f}")
    rr, kv = runs["round_robin"], runs["kv"]
    print(f"RESULT ttft_p50_gain={rr['ttft_p50_ms'] / kv['ttft_p50_ms']:.3f} "
          f"ttft_p99_gain={rr['ttft_p99_ms'] / kv['ttft_p99_ms']:.3f} hit_rate={kv['hit_rate']:.3f} "
          f"ideal_hit_rate={kv['ideal_hit_rate']:.3f} hit_rate_rr={rr['hit_rate']:.3f}")
    return {m: {k: v for k, v in s.items() if k != "results"} for m, s in runs.items()}
