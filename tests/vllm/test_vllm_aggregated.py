"""Two real vLLM workers behind the router: vLLM's KV events in the log with hashes the router
reproduces, the openai client streaming and not, prefix-sharing requests on the holder, the
router's predicted overlap equal to vLLM's own ``num_cached_tokens``, and SIGTERM drain.

The second worker (``va-1``) also runs our KVBM as vLLM's tier backend
(``--vllm-kv-connector switchyard``: host 128 blocks, disk 1,024 admitting blocks used once,
and a 96-block vLLM cache so
that vLLM evicts after a few requests): prefixes vLLM evicted come back from host and from
disk with the same output tokens as a worker that recomputes them (``va-0``, the same seeded
dummy weights), corrupt and missing disk blocks are recomputed and recorded, and after
``kill -9`` the restarted worker serves from the disk blocks it verified. One engine pair (and
one restart) serves the whole module: the tier tests need no engine of their own."""

from __future__ import annotations

import json
import random
import signal

import httpx
import openai
import pytest

from benchmarks.vllm_overlap import expected_cached_tokens
from common.hashing import HashAlgo, HashConfig, hash_blocks
from common.settings import BusSettings, worker_credential, worker_token
from schemas.events import (
    BlockMoved,
    BlockRemoved,
    BlockStored,
    KvTransferFailed,
    RequestCompleted,
    RequestRouted,
    WorkerDeregistered,
    WorkerDraining,
    WorkerLoadReported,
)
from tests.integration.test_router import _wait_http
from tests.integration.workerproc import WorkerProc
from tests.support.events import read_stream, router_ids
from tests.support.waits import wait_for
from tests.vllm.conftest import (
    BLOCK,
    READY_TIMEOUT,
    WORKER_ENV,
    listeners_outside_loopback,
    serving,
    vllm_prompt,
    vllm_python,
    wait_router_caught_up,
)

HASH = HashConfig(HashAlgo.SHA256, BLOCK)
#: va-1: our tiers under vLLM, and a vLLM cache small enough to evict (96 blocks, 3,072 tokens).
TIERS = ("--vllm-kv-connector", "switchyard", "--host-blocks", "128", "--disk-blocks", "1024",
         "--disk-admission-min-uses", "1",
         "--vllm-args", json.dumps({"num_gpu_blocks_override": 96}))


@pytest.fixture(scope="module")
def agg(vbus: BusSettings, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-agg")
    py = vllm_python()
    workers = [WorkerProc(vbus, f"va-{i}", tmp / f"va{i}", tmp, args=("--engine", "vllm", *(TIERS if i else ())),
                          python=py, env=WORKER_ENV) for i in range(2)]
    with serving(vbus, workers) as base:
        yield workers, base


def _stored(bus: BusSettings, worker: str) -> list[BlockStored]:
    return [e.data for e in read_stream(bus, "kv") if isinstance(e.data, BlockStored) and e.producer == worker]


def test_vllm_block_hashes_are_the_routers_hashes(agg, vbus: BusSettings) -> None:
    workers, _ = agg
    w = workers[0]
    prompt = vllm_prompt(1, 200)  # 6 full blocks + 8 tokens
    r = httpx.post(f"{w.url}/v1/completions", json={"prompt": prompt, "max_tokens": 4, "request_id": "hash-1"},
                   timeout=120, headers=w.credential())
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["token_ids"]) == 4
    mine = hash_blocks(prompt[: 6 * BLOCK], HASH)
    stored = wait_for(lambda: [h for ev in _stored(vbus, w.worker_id) for h in ev.block_hashes], timeout=30,
                      what="vLLM's BlockStored bridged into the log")
    assert [int(h) for h in mine] == [int(h) for h in stored[:6]]
    ev = _stored(vbus, w.worker_id)[0]
    assert ev.block_size == BLOCK and ev.tier.value == "device" and ev.hash_algo == HASH.hash_algo
    assert list(ev.token_ids[: BLOCK]) == prompt[:BLOCK]
    # The worker's residency is vLLM's own, as the bridge saw it.
    assert set(int(h) for h in mine) <= set(w.state()["device_cached"])


def test_openai_client_streaming_and_not(agg) -> None:
    _, base = agg
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
    one = client.completions.create(model="switchyard-sim", prompt=vllm_prompt(2, 100), max_tokens=5)
    assert one.usage.completion_tokens == 5 and one.usage.prompt_tokens == 100
    chunks = list(client.completions.create(model="switchyard-sim", prompt=vllm_prompt(3, 90), max_tokens=6,
                                            stream=True, stream_options={"include_usage": True}))
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason is None) + 1 == 6
    assert chunks[-1].usage.completion_tokens == 6


def _routed(bus: BusSettings, rid: str) -> RequestRouted:
    rid = router_ids(bus).get(rid, rid)  # the client's id -> the router's
    ev = [e.data for e in read_stream(bus, "requests") if e.correlation_id == rid and isinstance(e.data, RequestRouted)]
    assert ev, f"no RequestRouted for {rid}"
    return ev[-1]


def _reported_idle_after(bus: BusSettings, worker: str, rid: str) -> bool:
    """Whether ``worker`` reported its load, with no prefill queued, after ``rid`` ended. A
    load report lags by its interval, and the router takes the larger of a worker's report and
    its own ledger: a report taken while ``rid`` was queued would still weigh on the next
    decision."""
    evs = read_stream(bus, "requests")
    rid = router_ids(bus).get(rid, rid)
    done = [e.occurred_at_ns for e in evs if e.correlation_id == rid and isinstance(e.data, RequestCompleted)]
    if not done:
        return False
    reports = [e.data for e in read_stream(bus, "workers")
               if isinstance(e.data, WorkerLoadReported) and e.data.worker_id == worker and e.occurred_at_ns > done[0]]
    return bool(reports) and reports[-1].queued_prefill_tokens == 0


def test_prefix_sharing_lands_on_the_holder_and_prediction_equals_vllm(agg, vbus: BusSettings) -> None:
    """Predicted overlap (router, from the Kafka-built index) vs vLLM's num_cached_tokens: a
    base prompt of 10 blocks goes somewhere; then 4 prompts extending it must land on the same
    worker, each with predicted == reported cached tokens (vLLM always computes the last prompt
    token, so a prompt of exactly k blocks can hit at most k-1 of them)."""
    workers, base = agg
    client = httpx.Client(timeout=120)
    shared = vllm_prompt(10, 10 * BLOCK)
    r = client.post(f"{base}/v1/completions", json={"prompt": shared + [5, 6, 7], "max_tokens": 2,
                                                    "request_id": "pfx-base"})
    assert r.status_code == 200, r.text
    holder = _routed(vbus, "pfx-base").worker_id
    # The router routes on what the log says: wait until vLLM's stores reached its index.
    want = {int(h) for h in hash_blocks(shared, HASH)}
    wait_for(lambda: want <= {int(h) for ev in _stored(vbus, holder) for h in ev.block_hashes}, timeout=30,
             what="the base prompt's blocks in the log")
    wait_router_caught_up(base, vbus)
    agree = 0
    previous = "pfx-base"
    for i, extra in enumerate((17, 40, 64, 95)):
        # Equal loads, so the prefix decides: the holder's load after the previous request is in.
        wait_for(lambda: _reported_idle_after(vbus, holder, previous), timeout=30,
                 what=f"{holder}'s load report after {previous}")
        wait_router_caught_up(base, vbus, stream="workers")
        rid = previous = f"pfx-{i}"
        prompt = shared + vllm_prompt(100 + i, extra)
        body = client.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": 2, "request_id": rid}).json()
        routed = _routed(vbus, rid)
        assert routed.worker_id == holder, f"{rid} went to {routed.worker_id}, the prefix is on {holder}"
        row = next(s for s in routed.scores if s.worker_id == holder)
        predicted = expected_cached_tokens(row.overlap_by_tier.get("device", 0), len(prompt), BLOCK)
        reported = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert reported == 10 * BLOCK
        agree += predicted == reported
        wait_router_caught_up(base, vbus)
    assert agree == 4


def test_bridge_restarts_lose_nothing(agg, vbus: BusSettings) -> None:
    """vLLM's PUB socket connects to the bridge, so ZMQ queues the batches published while the
    bridge is down and delivers them on reconnection: a stop, a request, a start loses nothing.
    A bridge that lost its position (starts expecting seq 0) sees a gap at its first batch and
    fills it from vLLM's replay endpoint: no resync, the stores in the log, in order."""
    workers, _ = agg
    w = workers[0]
    seed = iter(range(60, 400))

    def bridged(n: int) -> bool:
        # The new bridge's SUB needs vLLM's PUB to reconnect: poke until batches arrive.
        httpx.post(f"{w.url}/v1/completions", json={"prompt": vllm_prompt(next(seed), BLOCK + 1), "max_tokens": 1},
                   timeout=120, headers=w.credential())
        return w.state()["vllm"]["bridge"]["batches_applied"] >= n

    def in_log(prompt: list[int]) -> bool:
        want = {int(h) for h in hash_blocks(prompt[: len(prompt) // BLOCK * BLOCK], HASH)}
        return want <= {int(h) for ev in _stored(vbus, w.worker_id) for h in ev.block_hashes}

    assert httpx.post(f"{w.url}/admin/kv_bridge/stop", timeout=30, headers=w.credential()).status_code == 200
    lost = vllm_prompt(50, 5 * BLOCK + 1)
    assert httpx.post(f"{w.url}/v1/completions", json={"prompt": lost, "max_tokens": 1}, timeout=120,
                      headers=w.credential()).status_code == 200
    assert httpx.post(f"{w.url}/admin/kv_bridge/start", timeout=30, headers=w.credential()).status_code == 200
    wait_for(lambda: bridged(1), timeout=60, interval=0.2, what="a batch through the restarted bridge")
    wait_for(lambda: in_log(lost), timeout=30, what="the batch published while the bridge was down")
    st = w.state()["vllm"]["bridge"]
    assert st["incarnations"] == 2 and st["gaps"] == 0 and st["resyncs"] == 0

    assert httpx.post(f"{w.url}/admin/kv_bridge/stop", timeout=30, headers=w.credential()).status_code == 200
    assert httpx.post(f"{w.url}/admin/kv_bridge/start?from_seq=0", timeout=30, headers=w.credential()).status_code == 200
    wait_for(lambda: bridged(2), timeout=60, interval=0.2, what="batches through the bridge that lost its position")
    st = w.state()["vllm"]["bridge"]
    assert st["incarnations"] == 3 and st["gaps"] >= 1 and st["replays"] >= 1
    assert st["replayed_batches"] >= 1 and st["resyncs"] == 0


def test_listeners_stay_on_loopback(agg) -> None:
    workers, _ = agg
    assert listeners_outside_loopback([w.proc.pid for w in workers]) == []


# -- our KVBM as vLLM's tier backend (va-1) -----------------------------------------------------


def _auth(url: str) -> dict[str, str]:
    """The bearer of the worker at ``url`` (its id from its open /health)."""
    wid = httpx.get(f"{url}/health", timeout=30).json()["worker_id"]
    return {"Authorization": f"Bearer {worker_token(worker_credential(), wid)}"}


def _complete(url: str, prompt: list[int], rid: str, max_tokens: int = 8) -> tuple[list[int], int]:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "request_id": rid},
                   timeout=300, headers=_auth(url))
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["token_ids"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def _kv(bus: BusSettings, worker: str, kind: type) -> list:
    return [e.data for e in read_stream(bus, "kv") if e.producer == worker and isinstance(e.data, kind)]


def _hashes_in(events: list, tier: str, attr: str = "tier") -> set[int]:
    return {int(h) for ev in events if getattr(ev, attr).value == tier for h in ev.block_hashes}


def _tier_prompt(seed: int, n: int) -> list[int]:
    # Independent streams per seed (``vllm_prompt``'s repeat every 1,000 seeds).
    rng = random.Random(seed * 1_000_003 + 7)
    return [rng.randrange(3, 1000) for _ in range(n)]


def _fill(url: str, base: int, n: int) -> None:
    """n distinct 12-block prompts: they push older blocks out of vLLM's 96-block cache and,
    through the write-through saves, down our host tier (128 blocks)."""
    for i in range(n):
        _complete(url, _tier_prompt(base + i, 12 * BLOCK + 3), f"fill-{base + i}", 1)


def _tiers(w: WorkerProc) -> dict:
    st = w.state()
    return {"kvbm": st["vllm"]["tiers"], "vllm": st["vllm"]["connector_prefix_cache"],
            "residency": {t: set(hs) for t, hs in st["tiers"].items()}}


P_TIER = _tier_prompt(1, 10 * BLOCK + 7)  # 10 full blocks + 7 tokens
P_HASHES = {int(h) for h in hash_blocks(P_TIER[: 10 * BLOCK], HASH)}


def test_a_prefix_vllm_evicted_is_served_from_host_then_disk_with_recomputed_tokens(agg, vbus: BusSettings) -> None:
    """P (10 blocks) computed once on va-1 is saved to our host tier (BlockStored(host) in the
    log). 108 blocks of other prompts later vLLM has evicted it (its own BlockRemoved(device)),
    our host still has it: P is served from host, vLLM reporting 320 cached tokens, all ten
    external (its connector stats, by tier), output tokens equal to va-0's recomputation, and
    the bytes in vLLM's blocks after the load equal to those vLLM computed (digests). 144 more
    blocks push P down to disk (BlockMoved(host->disk)): served from disk the same way."""
    plain, tiered = agg[0]
    want, cached = _complete(plain.url, P_TIER, "tier-ref")  # va-0: no tiers, computes P
    assert cached == 0
    out, cached = _complete(tiered.url, P_TIER, "tier-p0")
    assert out == want and cached == 0
    wait_for(lambda: P_HASHES <= _hashes_in(_kv(vbus, tiered.worker_id, BlockStored), "host"), timeout=30,
             what="P's blocks stored in va-1's host tier")

    _fill(tiered.url, 100, 9)
    wait_for(lambda: P_HASHES <= _hashes_in(_kv(vbus, tiered.worker_id, BlockRemoved), "device"), timeout=30,
             what="vLLM's own eviction of P (BlockRemoved(device))")
    before = _tiers(tiered)
    assert P_HASHES <= before["residency"]["host"]
    out, cached = _complete(tiered.url, P_TIER, "tier-p1")
    assert out == want and cached == 10 * BLOCK
    after = wait_for(lambda: (t := _tiers(tiered))["vllm"]["hits_by_source"].get("host", 0)
                     >= before["vllm"]["hits_by_source"].get("host", 0) + 10 * BLOCK and t, timeout=30,
                     what="vLLM's connector stats counting 320 tokens from host")
    assert after["kvbm"]["loads_verified"] - before["kvbm"]["loads_verified"] == 10
    assert after["kvbm"]["loads_mismatched"] == 0 and after["kvbm"]["fallbacks"] == 0

    _fill(tiered.url, 200, 12)
    wait_for(lambda: P_HASHES <= _hashes_in(_kv(vbus, tiered.worker_id, BlockMoved), "disk", "to_tier"), timeout=30,
             what="P demoted from host to disk (BlockMoved)")
    before = _tiers(tiered)
    assert P_HASHES <= before["residency"]["disk"] and not P_HASHES & before["residency"]["host"]
    host_stores = len(_kv(vbus, tiered.worker_id, BlockStored))
    out, cached = _complete(tiered.url, P_TIER, "tier-p2")
    assert out == want and cached == 10 * BLOCK
    after = wait_for(lambda: (t := _tiers(tiered))["vllm"]["hits_by_source"].get("disk", 0)
                     >= before["vllm"]["hits_by_source"].get("disk", 0) + 10 * BLOCK and t, timeout=30,
                     what="vLLM's connector stats counting 320 tokens from disk")
    assert after["kvbm"]["loaded_by_tier"]["disk"] - before["kvbm"]["loaded_by_tier"].get("disk", 0) == 10
    assert after["kvbm"]["loads_verified"] - before["kvbm"]["loads_verified"] == 10
    # Onboarding copied P back into host (kept on disk): reported BlockStored(host) after the bytes.
    onboarded = _kv(vbus, tiered.worker_id, BlockStored)[host_stores:]
    assert P_HASHES <= _hashes_in(onboarded, "host")


def test_corrupt_and_missing_disk_blocks_fall_back_to_recompute_and_are_recorded(agg, vbus: BusSettings) -> None:
    """Q and R (8 blocks each) pushed down to disk; one byte of Q's block 3 flipped on disk, R's
    block 5 file deleted. Q is then served 3 blocks from disk and recomputes the rest (96
    cached tokens), R 5 (160): both with va-0's output tokens. The KVBM dropped the bad copies
    (BlockRemoved(disk)) and each request's fallback is in the log as
    KvTransferFailed(fallback="recompute")."""
    plain, tiered = agg[0]
    q, r = _tier_prompt(2, 8 * BLOCK + 5), _tier_prompt(3, 8 * BLOCK + 9)
    qh, rh = [int(h) for h in hash_blocks(q[: 8 * BLOCK], HASH)], [int(h) for h in hash_blocks(r[: 8 * BLOCK], HASH)]
    want = {"q": _complete(plain.url, q, "tier-qref")[0], "r": _complete(plain.url, r, "tier-rref")[0]}
    assert _complete(tiered.url, q, "tier-q0")[0] == want["q"]
    assert _complete(tiered.url, r, "tier-r0")[0] == want["r"]
    _fill(tiered.url, 300, 14)
    wait_for(lambda: set(qh + rh) <= _tiers(tiered)["residency"]["disk"] - _tiers(tiered)["residency"]["host"],
             timeout=30, what="Q and R on disk only")
    g3 = tiered.data_dir / "kvbm" / "g3"
    bad = g3 / f"{qh[3]:016x}.kvb"
    blob = bytearray(bad.read_bytes())
    blob[-1] ^= 0xFF
    bad.write_bytes(bytes(blob))
    (g3 / f"{rh[5]:016x}.kvb").unlink()

    for name, prompt, hashes, good in (("q", q, qh, 3), ("r", r, rh, 5)):
        rid = f"tier-{name}1"
        out, cached = _complete(tiered.url, prompt, rid)
        assert out == want[name] and cached == good * BLOCK, (name, cached)
        failed = wait_for(lambda: [e.data for e in read_stream(vbus, "requests")
                                   if e.correlation_id == rid and isinstance(e.data, KvTransferFailed)],
                          timeout=30, what=f"{rid}'s recorded fallback")
        assert failed[0].fallback == "recompute" and failed[0].blocks == 8 - good
        assert failed[0].src_worker == failed[0].dst_worker == tiered.worker_id
        assert hashes[good] in _hashes_in(_kv(vbus, tiered.worker_id, BlockRemoved), "disk")
    assert _tiers(tiered)["kvbm"]["fallbacks"] >= 2


def test_kill9_is_routed_around_and_the_restart_rejoins_under_a_new_epoch(agg, vbus: BusSettings) -> None:
    """kill -9 one vLLM worker (its engine core dies with it) under requests: every request
    completes on the other one, none is finally routed to the dead one; its restart takes a new
    epoch whose first KV fact is AllBlocksCleared(device), so the index drops its old blocks."""
    workers, base = agg
    w = workers[1]
    old_epoch = w.state()["epoch"]
    w.kill()
    client = httpx.Client(timeout=120)
    for i in range(4):
        r = client.post(f"{base}/v1/completions", json={"prompt": vllm_prompt(300 + i, 70), "max_tokens": 2,
                                                        "request_id": f"k9-{i}"})
        assert r.status_code == 200, r.text
    assert all(_routed(vbus, f"k9-{i}").worker_id != w.worker_id for i in range(4))
    w.start(READY_TIMEOUT)
    assert w.state()["epoch"] > old_epoch
    kv = [e for e in read_stream(vbus, "kv") if e.producer == w.worker_id and e.epoch > old_epoch]
    assert kv and type(kv[0].data).__name__ == "AllBlocksCleared" and kv[0].data.tier.value == "device"
    _wait_http(f"{base}/health", lambda r: r.status_code == 200 and r.json()["workers"] == 2, timeout=120)


def test_the_restarted_worker_serves_from_the_disk_blocks_it_verified(agg, vbus: BusSettings) -> None:
    """After kill -9 and the restart above, va-1's disk tier came back: its new epoch
    re-announced the verified disk blocks (P's among them) as BlockStored(disk), and P, in
    neither vLLM's (empty) cache nor our (volatile) host tier, is served from disk with va-0's
    output tokens."""
    (plain, tiered), _ = agg
    epoch = tiered.state()["epoch"]
    restored = _hashes_in([e.data for e in read_stream(vbus, "kv") if e.producer == tiered.worker_id
                           and e.epoch == epoch and isinstance(e.data, BlockStored)], "disk")
    assert P_HASHES <= restored
    want, _ = _complete(plain.url, P_TIER, "tier-ref2")
    out, cached = _complete(tiered.url, P_TIER, "tier-p3")
    assert out == want and cached == 10 * BLOCK
    st = _tiers(tiered)
    assert st["kvbm"]["loaded_by_tier"].get("disk", 0) >= 10 and st["kvbm"]["fallbacks"] == 0


def test_sigterm_drains_a_vllm_worker(agg, vbus: BusSettings) -> None:
    workers, _ = agg
    w = workers[1]
    w.signal(signal.SIGTERM)
    assert w.wait(120) == 0
    evs = [e.data for e in read_stream(vbus, "workers") if e.producer == w.worker_id]
    kinds = [type(e) for e in evs]
    assert WorkerDraining in kinds and kinds[-1] is WorkerDeregistered
