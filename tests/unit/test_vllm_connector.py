"""SwitchyardKVConnector's scheduler side and the worker's tier service, without vLLM: the
scheduler side's decisions (what to load, what to save, leases) driven through vLLM-shaped
request objects, against a real KVBM (host pool in a real shared-memory region, disk tier in
memory) over the real wire codec. The worker side's tensor copies need torch and run in
``tests/vllm/test_vllm_aggregated.py`` against real vLLM."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import xxhash

from data_plane.kvbm import ADMIT_ALL, KvBlockManager, KvbmSettings
from data_plane.kvbm.stores import HostStore, MemoryStore
from data_plane.vllm import tier_protocol as proto
from data_plane.vllm.connector import LoadSpec, SaveSpec, SchedulerSide, request_key
from data_plane.vllm.tier_server import SharedRegion, TierService, map_region
from common.log.sink import MemorySink
from schemas.events import BlockMoved, BlockRemoved, BlockStored, KvTransferFailed
from schemas.types import Tier

BS = 4  # tokens per block
BPB = 32  # bytes per block


class WirePort:
    """The connector's port, in process: every message goes through the real codec to a real
    TierService (what TierServer does, minus the socket)."""

    def __init__(self, service: TierService) -> None:
        self.service = service
        self.sent: list[proto.Message] = []

    def call(self, msg, timeout_s):
        reply = self.service.handle(proto.decode(proto.encode(msg)))
        return proto.decode(proto.encode(reply))

    def send(self, msg, frames=()):
        self.sent.append(msg)
        self.service.handle(proto.decode(proto.encode(msg)), [memoryview(bytes(f)) for f in frames])


class Kit:
    def __init__(self, host: int = 8, disk: int = 16, **overrides) -> None:
        # Every block admitted to disk (these tests push blocks used once down to it).
        overrides.setdefault("admission", ADMIT_ALL)
        self.settings = KvbmSettings(worker_id="w1", bytes_per_block=BPB, block_size=BS, hash_algo="sha256",
                                     host_capacity=host, disk_capacity=disk, device_eviction_events=False,
                                     **overrides)
        self.region = SharedRegion(host * BPB, tag="unit")
        self.disk = MemoryStore(Tier.DISK, BPB)
        self.sink = MemorySink()
        self.kvbm = KvBlockManager(self.settings, self.sink,
                                   {Tier.HOST: HostStore(host, BPB, buffer=self.region.array), Tier.DISK: self.disk})
        self.clock = [0.0]
        self.service = TierService(self.kvbm, self.sink, lease_ttl_s=60, clock=lambda: self.clock[0])
        self.port = WirePort(self.service)
        #: vLLM's block table per request id.
        self.tables: dict[str, list[int]] = {}
        self.sched = SchedulerSide(self.port, BS, lambda rid: self.tables[rid])

    def close(self) -> None:
        self.region.unlink()

    def store(self, hashes: list[int]) -> None:
        """What the worker side sends after a forward pass: block bytes = the hash, repeated."""
        frames = [_bytes(h) for h in hashes]
        self.port.send(proto.Store(hashes=hashes, parents=[None, *hashes[:-1]],
                                   digests=[xxhash.xxh3_64_intdigest(f) for f in frames]), frames)


@pytest.fixture
def kit():
    k = Kit()
    yield k
    k.close()


def _bytes(h: int) -> bytes:
    return (h.to_bytes(8, "little") * (BPB // 8))


def _request(rid: str, hashes: list[int], num_tokens: int, worker_rid: str | None = None):
    # vLLM's block hashes are digests; the wire (and router) form is their last 8 bytes.
    return SimpleNamespace(request_id=rid, num_tokens=num_tokens,
                           block_hashes=[b"\x00" * 24 + h.to_bytes(8, "big") for h in hashes],
                           sampling_params=SimpleNamespace(extra_args={"switchyard_request_id": worker_rid or rid}))


def test_request_key_is_the_workers_id():
    assert request_key(_request("cmpl-1-ab12cd34", [], 1, "cmpl-1")) == "cmpl-1"
    assert request_key(SimpleNamespace(request_id="x", sampling_params=SimpleNamespace(extra_args=None))) == "x"


def test_codec_round_trip_and_refusal():
    msg = proto.Onboard(call=3, lease="r#3", request_id="r", hashes=[1, 2**64 - 1], replaces=["r#1"])
    assert proto.decode(proto.encode(msg)) == msg
    with pytest.raises(Exception):
        proto.decode(b"\x01\x02")


def test_saves_cover_blocks_computed_this_step_with_their_parents(kit):
    """A 10-token prompt (2 full blocks of 4) prefilled in one step: both blocks are saved, the
    first with no parent; a decode step that fills block 3 saves only block 3 (parent block 2);
    a block whose hash vLLM does not know yet (tokens not sampled) waits."""
    req = _request("a", [11, 12], 10)
    kit.sched.on_new_request(req)
    kit.tables["a"] = [7, 8, 9]
    assert kit.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    kit.sched.update_state_after_alloc(req, 0)
    meta = kit.sched.build_meta([("a", 0, 10, True)])
    assert meta.loads == () and meta.saves == (SaveSpec((7, 8), (11, 12), (None, 11)),)
    # Decode: tokens 10, 11 computed; block 3 (tokens 8..11) becomes full once token 11 is known.
    assert kit.sched.build_meta([("a", 10, 1, False)]).saves == ()
    req.block_hashes.append(b"\x00" * 24 + (13).to_bytes(8, "big"))
    assert kit.sched.build_meta([("a", 11, 1, False)]).saves == (SaveSpec((9,), (13,), (12,)),)


def test_a_store_is_reported_after_its_bytes_are_in_the_shared_pool(kit):
    kit.store([11, 12])
    stored = [e for e in kit.sink.events if isinstance(e, BlockStored)]
    assert [(e.tier, e.block_hashes, e.parent_hash) for e in stored] == [(Tier.HOST, [11, 12], None)]
    view = map_region(kit.region.path, kit.region.nbytes)  # what the engine core maps
    slot = kit.kvbm.host_pool.slot_of(12)
    assert bytes(view[slot * BPB:(slot + 1) * BPB]) == _bytes(12)


def test_onboard_offers_exact_blocks_never_the_last_token_and_pins_them(kit):
    """Held: blocks 11, 12, 13. A 12-token prompt (3 full blocks) may load 2 (vLLM computes the
    last token); with block 11 already in vLLM's cache (num_computed 4) it loads only 12. The
    pins hold until the worker side releases the lease."""
    kit.store([11, 12, 13])
    req = _request("b", [11, 12, 13], 12, "cmpl-b")
    kit.sched.on_new_request(req)
    assert kit.sched.get_num_new_matched_tokens(req, 4) == (4, False)
    kit.tables["b"] = [5, 6, 7]
    kit.sched.update_state_after_alloc(req, 4)
    (load,) = kit.sched.build_meta([("b", 4, 8, True)]).loads
    assert load.block_ids == (6,) and load.request_id == "cmpl-b"
    assert load.slots == (kit.kvbm.host_pool.slot_of(12),)
    assert kit.sched.hit_sources(req) == {"host": 4}
    assert kit.service.leases == 1
    kit.port.send(proto.Release(leases=[load.lease]))  # the worker side, after its copy
    kit.sched.request_finished(req)  # releasing again is harmless
    assert kit.service.leases == 0 and kit.service.stats.leases_released == 1


def test_an_unscheduled_request_asked_again_replaces_its_lease(kit):
    kit.store([11, 12])
    req = _request("c", [11, 12], 9)
    kit.sched.on_new_request(req)
    assert kit.sched.get_num_new_matched_tokens(req, 0) == (8, False)
    assert kit.sched.get_num_new_matched_tokens(req, 0) == (8, False)  # no blocks free last step
    assert kit.service.leases == 1
    kit.sched.request_finished(req)
    assert kit.service.leases == 0
    # Every pin went with its lease: the two blocks can be evicted again.
    kit.store([21, 22, 23, 24, 25, 26, 27, 28])
    assert kit.kvbm.tiers_of(11) == (Tier.DISK,)


def test_blocks_demoted_to_disk_are_onboarded_and_attributed_to_disk(kit):
    kit.store([11, 12])
    kit.store(list(range(100, 108)))  # host holds 8: 11 and 12 move to disk
    moved = [e for e in kit.sink.events if isinstance(e, BlockMoved) and 11 in e.block_hashes]
    assert moved and moved[0].from_tier is Tier.HOST and moved[0].to_tier is Tier.DISK
    kit.sink.clear()
    req = _request("d", [11, 12], 9)
    kit.sched.on_new_request(req)
    assert kit.sched.get_num_new_matched_tokens(req, 0) == (8, False)
    kit.tables["d"] = [1, 2, 3]
    kit.sched.update_state_after_alloc(req, 8)
    assert kit.sched.hit_sources(req) == {"disk": 8}
    (load,) = kit.sched.build_meta([("d", 0, 9, True)]).loads
    view = map_region(kit.region.path, kit.region.nbytes)
    assert [bytes(view[s * BPB:(s + 1) * BPB]) for s in load.slots] == [_bytes(11), _bytes(12)]
    assert [(e.tier, e.block_hashes) for e in kit.sink.events if isinstance(e, BlockStored)] == [
        (Tier.HOST, [11, 12])]


def test_a_corrupt_disk_block_cuts_the_load_and_records_the_fallback(kit):
    """Blocks 11, 12, 13 on disk, 12 corrupt: vLLM is offered block 11 only (it recomputes 12
    and 13); the KVBM drops 12 from disk (BlockRemoved) and the request's fallback is in the
    log as KvTransferFailed(recompute) under the worker's request id."""
    kit.store([11, 12, 13])
    kit.store(list(range(100, 108)))
    kit.disk.corrupt(12)
    kit.sink.clear()
    req = _request("e-1234abcd", [11, 12, 13], 13, "e")
    kit.sched.on_new_request(req)
    assert kit.sched.get_num_new_matched_tokens(req, 0) == (4, False)
    removed = [e for e in kit.sink.events if isinstance(e, BlockRemoved)]
    assert [(e.tier, e.block_hashes) for e in removed] == [(Tier.DISK, [12])]
    (failed,) = kit.sink.of_type(KvTransferFailed)
    assert failed.request_id == "e" and failed.fallback == "recompute" and failed.blocks == 2
    assert "corrupt" in failed.reason and "disk" in failed.backend
    assert kit.sink.correlation[kit.sink.events.index(failed)] == "e"
    assert kit.service.stats.fallbacks == 1


def test_a_missing_disk_file_is_a_recorded_recompute_too(kit):
    kit.store([11, 12])
    kit.store(list(range(100, 108)))
    kit.disk.delete(11)  # gone behind the KVBM's back
    kit.sink.clear()
    req = _request("f", [11, 12], 9)
    kit.sched.on_new_request(req)
    assert kit.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert kit.sink.of_type(KvTransferFailed)[0].blocks == 2
    assert kit.service.leases == 0


def test_a_load_failure_reported_by_the_worker_side_is_recorded():
    k = Kit()
    try:
        k.port.send(proto.LoadFailed(lease="g#1", request_id="g", blocks=3, reason="ValueError: slot"))
        (failed,) = k.sink.of_type(KvTransferFailed)
        assert failed.blocks == 3 and failed.fallback == "recompute" and failed.bytes == 3 * BPB
    finally:
        k.close()


def test_leases_of_a_dead_engine_expire(kit):
    kit.store([11, 12])
    req = _request("h", [11, 12], 9)
    kit.sched.on_new_request(req)
    kit.sched.get_num_new_matched_tokens(req, 0)
    kit.clock[0] = 61.0
    other = _request("i", [99], 5)
    kit.sched.on_new_request(other)
    kit.sched.get_num_new_matched_tokens(other, 0)  # any onboard sweeps expired leases
    assert kit.service.stats.leases_expired == 1 and kit.service.leases == 0


def test_bad_store_frames_are_refused(kit):
    kit.port.send(proto.Store(hashes=[1, 2], parents=[None, 1]), [b"x" * BPB])
    kit.port.send(proto.Store(hashes=[1], parents=[None]), [b"x" * (BPB - 1)])
    assert kit.service.stats.bad_messages == 2 and not kit.sink.events


def test_load_spec_is_plain_data():
    # Sent to vLLM's workers inside the connector metadata (pickled with the mp executor).
    import pickle

    spec = LoadSpec("l", "r", (1, 2), (3, 4))
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert np.dtype(np.uint8).itemsize == 1


def test_loaded_blocks_are_checked_against_what_vllm_computed(kit):
    """The worker side reports the digests of the blocks it reads back from vLLM's tensors after
    a load; the service compares them with the digests of the bytes vLLM computed when it saved
    them. A block saved again (recomputed) is compared too: vLLM's KV is deterministic."""
    kit.store([11, 12])
    good, bad = xxhash.xxh3_64_intdigest(_bytes(11)), xxhash.xxh3_64_intdigest(b"other")
    kit.port.send(proto.Loaded(lease="l#1", request_id="r", hashes=[11, 12, 99], digests=[good, bad, 1]))
    st = kit.service.stats
    assert (st.loads_verified, st.loads_mismatched, st.loads_unverified) == (1, 1, 1)
    kit.store([11, 12])
    assert (st.recomputed_same, st.recomputed_different) == (2, 0)


# -- configuration ------------------------------------------------------------------------------


def test_tiers_under_vllm_need_the_switchyard_connector_and_a_host_tier():
    from data_plane.vllm.serving import VllmEngineSettings
    from data_plane.workers.settings import WorkerConfigError, WorkerSettings

    with pytest.raises(WorkerConfigError, match="--vllm-kv-connector switchyard"):
        WorkerSettings(worker_id="w", engine="vllm", disk_blocks=8)
    with pytest.raises(WorkerConfigError, match="--host-blocks"):
        WorkerSettings(worker_id="w", engine="vllm", disk_blocks=8,
                       vllm=VllmEngineSettings(kv_connector="switchyard"))
    s = WorkerSettings(worker_id="w", engine="vllm", host_blocks=4, disk_blocks=8,
                       vllm=VllmEngineSettings(kv_connector="switchyard"))
    kv = s.kvbm_settings(block_size=32, hash_algo="sha256", bytes_per_block=65536)
    # Real KV bytes: only the frame checksum can check them.
    assert kv.bytes_per_block == 65536 and not kv.verify_synthetic_content and kv.host_capacity == 4
    with pytest.raises(ValueError, match="nixl"):
        VllmEngineSettings(kv_connector="switchyard", kv_role="kv_producer")


def test_block_size_predicted_from_the_model_config():
    """The tiny Llama: 2 layers x (K, V) x 32 tokens x 2 KV heads x head_dim 64 x 4 bytes."""
    from data_plane.vllm.serving import TINY_MODEL_DIR, predict_bytes_per_block

    assert predict_bytes_per_block(str(TINY_MODEL_DIR), "float32", 32) == 2 * 2 * 32 * 2 * 64 * 4
    assert predict_bytes_per_block(str(TINY_MODEL_DIR), "bfloat16", 32) == 2 * 2 * 32 * 2 * 64 * 2


def test_the_socket_carries_onboards_stores_and_failed_calls(kit):
    """TierServer and TierClient on loopback, as between the worker and vLLM's processes: a
    store with its block frames, an onboard answered with the pinned slots, and an onboard the
    KVBM fails on answered as a miss at once (vLLM's scheduler never waits for the timeout)."""
    from data_plane.vllm.connector import TierClient
    from data_plane.vllm.tier_server import TierServer

    server = TierServer(kit.service)
    server.start()
    client = TierClient(server.endpoint)
    try:
        frames = [_bytes(11), _bytes(12)]
        client.send(proto.Store(hashes=[11, 12], parents=[None, 11]), frames)
        # One socket keeps its messages in order: the store is in before the onboard is read.
        reply = client.call(proto.Onboard(call=1, lease="s#1", request_id="s", hashes=[11, 12]), 5.0)
        assert reply is not None and [b.block_hash for b in reply.blocks] == [11, 12]
        assert reply.blocks[0].slot == kit.kvbm.host_pool.slot_of(11)
        client.send(proto.Release(leases=["s#1"]))
        broken = kit.service.manager
        kit.service.manager = None  # every KVBM call now raises
        try:
            fail = client.call(proto.Onboard(call=99, lease="s#99", request_id="s", hashes=[11]), 5.0)
        finally:
            kit.service.manager = broken
        assert fail is not None and fail.blocks == [] and fail.stop_reason == "error"
    finally:
        client.close()
        server.stop()
    assert server.error is None and kit.service.leases == 0
