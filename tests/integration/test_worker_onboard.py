"""One real worker process with a host tier: a prefix evicted from its device is offloaded by the
KVBM, then onboarded back to the device for the next request that shares it instead of being
recomputed: the client sees the cached tokens, ``/metrics`` counts the blocks per direction, and
the log says where the device blocks came from (``BlockStored(device, source_tier=host)``)."""

from __future__ import annotations

import httpx
import openai
import pytest

from common.settings import BusSettings
from schemas.types import Tier
from tests.integration.workerproc import WorkerProc, of, read_log
from tests.support.waits import wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(120)]

BS = 16


@pytest.fixture
def worker(bus: BusSettings, tmp_path):
    # 10 device blocks: prompt B (9 blocks + its output) evicts all of prompt A's.
    w = WorkerProc(bus, "w-onb", tmp_path / "data", tmp_path, args=(
        "--speedup", "20", "--block-size", str(BS), "--device-blocks", "10", "--host-blocks", "16",
        "--load-interval", "0.3"))
    w.start()
    yield w
    w.kill()


def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_an_offloaded_prefix_is_onboarded_not_recomputed(worker: WorkerProc, bus: BusSettings):
    client = openai.OpenAI(base_url=f"{worker.url}/v1", api_key=worker.token(), max_retries=0)
    prompt_a = list(range(500, 564))  # 4 full blocks
    prompt_b = list(range(1000, 1144))  # 9 full blocks
    first = client.completions.create(model="switchyard-sim", prompt=prompt_a, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    client.completions.create(model="switchyard-sim", prompt=prompt_b, max_tokens=2)

    def offloaded() -> float:
        text = httpx.get(f"{worker.url}/metrics").text
        return _metric(text, "switchyard_worker_kvbm_offload_blocks_total", from_tier="device", to_tier="host")

    wait_for(lambda: offloaded() >= 4, 10, "A's 4 blocks offloaded to host")
    again = client.completions.create(model="switchyard-sim", prompt=prompt_a, max_tokens=2)
    # 3 blocks (the last block is recomputed for its logits), all loaded from host.
    assert again.usage.prompt_tokens_details.cached_tokens == 48
    text = httpx.get(f"{worker.url}/metrics").text
    assert _metric(text, "switchyard_worker_kvbm_onboard_blocks_total", from_tier="host", to_tier="device") == 3

    def onboard_stores():
        kv = [r for r in of(read_log(bus, "kv"), "w-onb", "BlockStored")
              if r.env.data.tier is Tier.DEVICE and r.env.data.source_tier is Tier.HOST]
        return [h for r in kv for h in r.env.data.block_hashes]

    wait_for(lambda: len(onboard_stores()) == 3, 10, "the onboarded device blocks in the log")
