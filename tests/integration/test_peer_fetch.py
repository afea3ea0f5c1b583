"""Peers as a KV tier, with two real worker processes: worker B pulls a prompt's prefix that
worker A holds over NIXL (UCX, loopback), verifies every block against its hash, stores it in its
host tier and onboards it to its device instead of recomputing it. The client sees the cached
tokens; the log says what moved (``KvTransferCompleted(purpose="peer_fetch")``, B's
``BlockStored(host)`` then ``BlockStored(device, source_tier=host)``); A's hold is released by
B's done notification. A peer that is gone is a recorded fallback, and the request still runs."""

from __future__ import annotations

import openai
import pytest

from common.net import free_port
from common.settings import BusSettings
from schemas.types import Tier
from tests.integration.workerproc import WorkerProc, of, read_log, start_all
from tests.support.waits import wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(120)]

BS = 16
ARGS = ("--speedup", "20", "--block-size", str(BS), "--host-blocks", "32", "--load-interval", "0.3")


@pytest.fixture
def pair(bus: BusSettings, tmp_path):
    a = WorkerProc(bus, "w-holder", tmp_path / "a", tmp_path, args=ARGS)
    b = WorkerProc(bus, "w-reader", tmp_path / "b", tmp_path, args=ARGS)
    yield start_all(a, b, timeout=60)
    a.kill()
    b.kill()


def _client(w: WorkerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{w.url}/v1", api_key=w.token(), max_retries=0, timeout=30)


def test_a_prefix_is_pulled_from_a_peer_not_recomputed(pair, bus: BusSettings):
    a, b = pair
    prompt = list(range(2000, 2000 + 8 * BS + 5))  # 8 full blocks and a partial one
    first = _client(a).completions.create(model="switchyard-sim", prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    peer = {"worker_id": a.worker_id, "host": "127.0.0.1", "port": a.port, "blocks": 8}
    got = _client(b).completions.create(model="switchyard-sim", prompt=prompt, max_tokens=2,
                                        extra_body={"kv_transfer_params": {"peer_fetch": peer}})
    # All 8 full blocks arrived and were onboarded (the partial block is computed).
    assert got.usage.prompt_tokens_details.cached_tokens == 8 * BS

    sb = b.state()
    assert sb["peer_fetch"]["peer_fetches_ok"] == 1, sb["peer_fetch"]
    assert sb["peer_fetch"]["peer_blocks_fetched"] == 8
    wait_for(lambda: a.state()["transfers"]["holds_consumed"] >= 1, 10, "A's peer hold released by B's done")
    assert a.state()["peer_fetch"]["peer_blocks_served"] == 8

    def moved():
        recs = read_log(bus, "requests", "kv")
        done = [r for r in of(recs, b.worker_id, "KvTransferCompleted") if r.env.data.purpose == "peer_fetch"]
        host = [h for r in of(recs, b.worker_id, "BlockStored") if r.env.data.tier is Tier.HOST
                for h in r.env.data.block_hashes]
        dev = [h for r in of(recs, b.worker_id, "BlockStored")
               if r.env.data.tier is Tier.DEVICE and r.env.data.source_tier is Tier.HOST
               for h in r.env.data.block_hashes]
        return done, host, dev

    # Asked again, B already holds the prefix: nothing is pulled.
    again = _client(b).completions.create(model="switchyard-sim", prompt=prompt, max_tokens=2,
                                          extra_body={"kv_transfer_params": {"peer_fetch": peer}})
    assert again.usage.prompt_tokens_details.cached_tokens == 8 * BS
    assert b.state()["peer_fetch"]["peer_fetches_ok"] == 1

    wait_for(lambda: all(moved()), 15, "the peer fetch and its stores in the log")
    done, host, dev = moved()
    assert done[0].env.data.src_worker == a.worker_id and done[0].env.data.blocks == 8
    assert done[0].env.data.bytes > 0
    assert len(set(host)) == 8 and set(dev) == set(host)


def test_a_gone_peer_is_a_recorded_fallback(pair, bus: BusSettings):
    _a, b = pair
    prompt = list(range(3000, 3000 + 6 * BS))
    peer = {"worker_id": "w-gone", "host": "127.0.0.1", "port": free_port(), "blocks": 6}
    got = _client(b).completions.create(model="switchyard-sim", prompt=prompt, max_tokens=2,
                                        extra_body={"kv_transfer_params": {"peer_fetch": peer}})
    assert got.usage.prompt_tokens_details.cached_tokens == 0
    assert len(got.choices[0].text) > 0
    sb = b.state()
    assert sb["peer_fetch"]["peer_fetches_failed"] == 1
    assert "unreachable" in sb["peer_fetch"]["last_error"]

    def failed():
        return [r for r in of(read_log(bus, "requests"), b.worker_id, "KvTransferFailed")
                if r.env.data.purpose == "peer_fetch"]

    wait_for(failed, 15, "the failed peer fetch in the log")
    ev = failed()[0].env.data
    assert ev.fallback == "recompute" and ev.src_worker == "w-gone"


def test_a_malformed_peer_source_is_a_400(pair):
    _a, b = pair
    with pytest.raises(openai.BadRequestError, match="peer_fetch"):
        _client(b).completions.create(model="switchyard-sim", prompt=list(range(64)), max_tokens=2,
                                      extra_body={"kv_transfer_params": {"peer_fetch": {"worker_id": "x"}}})
