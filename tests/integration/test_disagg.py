"""Disaggregated serving between two real worker processes, driven over HTTP the way the router
does it (vLLM NixlConnector protocol): prefill with ``do_remote_decode``, hand the returned
``kv_transfer_params`` to the decode worker, which pulls the blocks by NIXL READ.

* 256 blocks move, every byte verified against its block hash, ``KvTransferCompleted`` on the
  log, the holder frees its blocks on the done notification;
* an unread handoff is freed when its lease runs out, and a decode given the stale params
  recomputes;
* the prefill worker is killed (SIGKILL) between prefill and the decode's READ: the decode
  reports ``KvTransferFailed(fallback="recompute")`` and still answers in full, with no hang and
  no staging slot leaked.
"""

from __future__ import annotations

import time

import httpx
import pytest

from data_plane.engines import default_hash_config
from data_plane.engines.request import pseudo_token, request_seed
from common.hashing import hash_blocks
from common.settings import BusSettings
from tests.integration.workerproc import WorkerProc, of, read_log, start_all
from tests.support.waits import wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(120)]

BS = 16
BPB = 64 * 1024
N_BLOCKS = 256
LEASE_S = 3.0
COMMON = ("--speedup", "20", "--block-size", str(BS), "--bytes-per-block", str(BPB),
          "--transfer-blocks", "512", "--load-interval", "0.5")


def chain_of(records, rid: str) -> list[str]:  # noqa: ANN001
    return [r.type for r in records if r.topic.endswith(".requests") and r.env.key == rid]


def _expected(rid: str, n: int) -> list[int]:
    return [pseudo_token(request_seed(rid), i) for i in range(n)]


def _prefill(w: WorkerProc, rid: str, prompt: list[int]) -> dict:
    r = httpx.post(f"{w.url}/v1/completions", timeout=30, headers=w.credential(), json={
        "model": "switchyard-sim", "prompt": prompt, "max_tokens": 1, "stream": False, "request_id": rid,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["token_ids"] == _expected(rid, 1)
    return body["kv_transfer_params"]


def _decode(w: WorkerProc, rid: str, prompt: list[int], params: dict, max_tokens: int) -> tuple[list[int], dict]:
    """Stream from the decode worker as the router does; returns (token ids, usage)."""
    ids: list[int] = []
    usage: dict = {}
    done = False
    body = {"model": "switchyard-sim", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "request_id": rid, "kv_transfer_params": params}
    with httpx.stream("POST", f"{w.url}/v1/completions", json=body, timeout=30, headers=w.credential()) as r:
        assert r.status_code == 200
        import json

        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            if obj["choices"]:
                ids.extend(obj["choices"][0]["token_ids"])
            else:
                usage = obj["usage"]
    assert done
    return ids, usage


@pytest.fixture
def pair(bus: BusSettings, tmp_path):
    p = WorkerProc(bus, "w-prefill", tmp_path / "p", tmp_path, role="prefill",
                   args=(*COMMON, "--lease-s", str(LEASE_S)))
    d = WorkerProc(bus, "w-decode", tmp_path / "d", tmp_path, role="decode", args=COMMON)
    start_all(p, d)
    yield p, d
    p.kill()
    d.kill()


def test_handoff_moves_verified_blocks_and_survives_a_dead_prefill(pair, bus: BusSettings):
    p, d = pair
    cfg = default_hash_config(BS)

    # 1. 256 blocks by NIXL READ.
    prompt = list(range(1_000, 1_000 + N_BLOCKS * BS))
    params = _prefill(p, "r-move", prompt)
    assert params["do_remote_prefill"] is True and params["remote_engine_id"] == "w-prefill"
    assert len(params["remote_block_ids"]) == N_BLOCKS
    assert params["remote_block_hashes"] == hash_blocks(prompt, cfg)
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", p.port)
    assert p.state()["holds"] == 1
    ids, usage = _decode(d, "r-move", prompt, params, max_tokens=8)
    assert ids == _expected("r-move", 8)
    assert usage["prompt_tokens"] == len(prompt) and usage["completion_tokens"] == 8
    ds = d.state()
    assert ds["transfers"]["pulls_ok"] == 1 and ds["transfers"]["blocks_verified"] == N_BLOCKS
    assert ds["staging_free"] == ds["staging_total"]
    # The done notification freed the holder's blocks and staging slots.
    wait_for(lambda: p.state()["holds"] == 0, 5, "hold released on the done notification")
    ps = p.state()
    assert ps["transfers"]["holds_consumed"] == 1 and ps["staging_free"] == ps["staging_total"]
    assert ps["engine"]["held"] == 0

    # 2. An unread handoff is freed by its lease; the stale params make the decode recompute.
    short = list(range(50_000, 50_000 + 4 * BS))
    stale = _prefill(p, "r-lease", short)
    assert p.state()["holds"] == 1
    wait_for(lambda: p.state()["holds"] == 0, LEASE_S + 3, "lease expiry")
    assert p.state()["transfers"]["holds_expired"] == 1 and p.state()["engine"]["held"] == 0
    ids, _ = _decode(d, "r-lease", short, stale, max_tokens=3)
    assert ids == _expected("r-lease", 3)

    # 3. The prefill worker dies between prefill and READ.
    prompt2 = list(range(9_000, 9_000 + 32 * BS))
    params2 = _prefill(p, "r-dead", prompt2)
    p.kill()
    t0 = time.monotonic()
    ids, usage = _decode(d, "r-dead", prompt2, params2, max_tokens=6)
    assert time.monotonic() - t0 < 15
    assert ids == _expected("r-dead", 6) and usage["completion_tokens"] == 6
    ds = d.state()
    assert ds["transfers"]["pulls_failed"] == 2 and ds["inflight"] == 0
    assert ds["staging_free"] == ds["staging_total"]  # no slot leaked on the failure path

    # 4. Prefill and decode on the same worker: nothing moves, the held blocks become prefix
    #    hits. The prefill's token continues the sequence (129 tokens), so all 8 prompt blocks
    #    hit: 128 cached tokens.
    prompt3 = list(range(70_000, 70_000 + 8 * BS))
    params3 = _prefill(d, "r-self", prompt3)
    ids, usage = _decode(d, "r-self", prompt3, params3, max_tokens=4)
    assert ids == _expected("r-self", 4) and usage["prompt_tokens_details"]["cached_tokens"] == 8 * BS
    assert d.state()["holds"] == 0 and d.state()["transfers"]["holds_released"] == 1

    # The log tells the same story.
    records = read_log(bus, "requests", "kv")
    chain = {rid: chain_of(records, rid) for rid in ("r-move", "r-lease", "r-dead")}
    assert chain["r-move"] == ["PrefillCompleted", "KvTransferStarted", "KvTransferCompleted"]
    assert chain["r-lease"] == ["PrefillCompleted", "KvTransferStarted", "KvTransferFailed"]
    assert chain["r-dead"] == ["PrefillCompleted", "KvTransferStarted", "KvTransferFailed"]
    assert chain_of(records, "r-self") == ["PrefillCompleted"]
    (done,) = [r.env.data for r in of(records, "w-decode", "KvTransferCompleted")]
    assert (done.src_worker, done.dst_worker, done.blocks, done.bytes, done.backend) == (
        "w-prefill", "w-decode", N_BLOCKS, N_BLOCKS * BPB, "UCX")
    assert done.duration_ms > 0
    pc = next(r.env.data for r in of(records, "w-prefill", "PrefillCompleted") if r.env.key == "r-move")
    assert pc.prompt_tokens == len(prompt) and pc.kv_transfer_params["remote_block_ids"] == params["remote_block_ids"]
    failed = {r.env.key: r.env.data for r in of(records, "w-decode", "KvTransferFailed")}
    assert failed["r-lease"].fallback == failed["r-dead"].fallback == "recompute"
    assert "lease" in failed["r-lease"].reason
    assert "PeerLost" in failed["r-dead"].reason or "lost" in failed["r-dead"].reason.lower()
    # The decode worker stored the transferred prompt in its device tier.
    decode_stored = {h for r in of(records, "w-decode", "BlockStored") for h in r.env.data.block_hashes}
    assert set(hash_blocks(prompt, cfg)) <= decode_stored
    assert set(hash_blocks(prompt2, cfg)) <= decode_stored  # recomputed: stored all the same
