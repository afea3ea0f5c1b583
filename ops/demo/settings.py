"""What ``switchyard up --demo`` runs, apart from the code that runs it: the CLI reads these
defaults for its options without importing the demo's machinery (every ``switchyard`` command
would pay for it, the router's restart included)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.settings import repo_root

#: The workload shipped in the repository: the first 1,000 lines of the Mooncake conversation
#: trace (Apache-2.0; see traces/README.md), so a plain clone runs the demo.
#: The workloads the repository ships (traces/README.md): the demo's slice and the whole trace.
DEMO_TRACE = repo_root() / "traces" / "mooncake_conversation_head1000.jsonl"
WHOLE_TRACE = repo_root() / "traces" / "mooncake_conversation_trace.jsonl"


@dataclass(frozen=True)
class DemoSettings:
    """What ``switchyard up --demo`` runs. The defaults are sized for a 2-core box: the load is
    what the simulator says 2 prefill + 2 decode mocker-profile engines serve (see the
    prediction the demo prints), at an engine speed whose token rate the router can stream."""

    trace: Path = DEMO_TRACE
    limit: int = 200
    #: Arrival speed-up over the trace's timestamps. Measured on a 2-core box (the demo's
    #: summary prints it): 1.5x at model speed leaves about a third of the CPU free and TTFT
    #: p50 within 1.4x of the simulator's; 2x leaves ~7% and sits at 1.9x; 4x saturates it.
    rate: float = 1.5
    max_output: int = 128
    prefill_workers: int = 2
    decode_workers: int = 2
    #: Engine speed-up over the mocker profile's real time (1: the model's own speed; faster
    #: engines stream more tokens per second than the router and workers can proxy on 2 cores).
    speedup: float = 1.0
    router_port: int = 8000
    metrics_port: int = 59100
    admin_port: int = 8080
    stop_after: bool = False
    with_admin: bool = True
    with_planner: bool = True
    #: ``sim`` (simulated workers) or ``vllm`` (real vLLM workers from .venv-vllm, prefill and
    #: decode over vLLM's NixlConnector; see ops/demo/vllm.py).
    engine: str = "sim"


DEMO_DEFAULTS = DemoSettings()
