"""The NIXL pacing plugin (data_plane/vllm/nixl_pacing.py) as vLLM loads it: vLLM's plugin loader
finds it through the entry point, an agent built the way vLLM's NixlConnector builds one gets a
paced progress thread, and that agent, idle, uses a fraction of a core. The same agent with the
floor set to 0 (NIXL's own busy polling) is the control: it shows the measurement can see a
spinning thread."""

from __future__ import annotations

import json
import subprocess

from tests.integration.workerproc import ROOT
from tests.vllm.conftest import WORKER_ENV, vllm_python

PROBE = r"""
import json, os, time
import numpy as np
from vllm.plugins import load_general_plugins
load_general_plugins()
from nixl._api import nixl_agent, nixl_agent_config, nixlBind

probe = nixlBind.nixlAgentConfig()
probe.pthrDelay = 0
agent = nixl_agent("pacing-probe", nixl_agent_config(num_threads=4, capture_telemetry=True))
buf = np.zeros(1 << 20, dtype=np.uint8)
agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")

def cpu_s():
    tick, total = os.sysconf("SC_CLK_TCK"), 0
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / tick

c0, t0 = cpu_s(), time.monotonic()
time.sleep(3.0)
print(json.dumps({"cores": (cpu_s() - c0) / (time.monotonic() - t0),
                  "floor_us": getattr(nixlBind.nixlAgentConfig, "switchyard_floor_us", None),
                  "pthr_delay_readback": probe.pthrDelay}))
"""


def _idle_agent(floor_us: str) -> dict:
    env = {**WORKER_ENV, "PATH": "/usr/bin:/bin", "HOME": str(ROOT),
           "SWITCHYARD_NIXL_PROGRESS_DELAY_US": floor_us}
    out = subprocess.run([vllm_python(), "-c", PROBE], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_vllm_loads_the_plugin_and_an_idle_agent_stops_spinning() -> None:
    paced = _idle_agent("1000")
    busy = _idle_agent("0")
    assert paced["floor_us"] == 1000 and paced["pthr_delay_readback"] == 1000, paced
    assert busy["floor_us"] == 0 and busy["pthr_delay_readback"] == 0, busy
    assert paced["cores"] < 0.25, (paced, busy)
    assert busy["cores"] > paced["cores"], (paced, busy)
