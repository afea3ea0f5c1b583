"""Pure parts of the worker: staging slots, handoff params, epochs, partitioning, settings."""

from __future__ import annotations

import pytest
import xxhash

from data_plane.transfer import Handoff, InvalidTransfer
from data_plane.workers.handoff import (
    SlotPool,
    is_prefill_request,
    mismatch,
    parse_decode_params,
    prefill_params,
)
from data_plane.workers.history import next_epoch, partition_for
from data_plane.workers.settings import WorkerConfigError, WorkerSettings


def _params(**overrides) -> dict:
    handoff = Handoff(request_id="r1", agent_name="p1:100", block_ids=[8, 9, 10], expires_at=1030.0)
    base = prefill_params(handoff, engine_id="p1", block_hashes=[11, 22, 33], remote_host="127.0.0.1",
                          remote_port=8100, block_size=16, bytes_per_block=4096, first_token_ids=[7])
    base.update(overrides)
    return base


def test_slot_pool_is_all_or_nothing_and_refuses_double_free():
    """Slots 8..11 (a region whose first 8 blocks are the host pool): 3 then 2 does not fit."""
    pool = SlotPool(8, 4)
    a = pool.allocate(3)
    assert a == [8, 9, 10] and pool.free_count == 1
    assert pool.allocate(2) is None and pool.free_count == 1
    pool.free(a)
    assert pool.free_count == 4
    with pytest.raises(ValueError):
        pool.free([8])


def test_prefill_params_round_trip_to_the_decode_side():
    params = _params()
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_block_ids"] == [8, 9, 10] and params["remote_engine_id"] == "p1"
    h = parse_decode_params(params)
    assert h is not None and h.blocks == 3
    assert (h.handoff.agent_name, h.handoff.request_id, h.handoff.expires_at) == ("p1:100", "r1", 1030.0)
    assert (h.remote_host, h.remote_port, h.first_token_ids) == ("127.0.0.1", 8100, [7])


def test_which_params_ask_for_what():
    assert is_prefill_request({"do_remote_decode": True})
    assert not is_prefill_request(None) and not is_prefill_request({"do_remote_decode": "yes"})
    assert parse_decode_params(None) is None
    assert parse_decode_params({"do_remote_decode": True}) is None
    assert parse_decode_params(_params(do_remote_prefill=False)) is None
    with pytest.raises(InvalidTransfer):
        parse_decode_params({"do_remote_prefill": True})
    with pytest.raises(InvalidTransfer):
        parse_decode_params(_params(remote_block_hashes=[11, 22]))
    with pytest.raises(InvalidTransfer):
        parse_decode_params(_params(remote_block_ids="x"))


def test_mismatch_names_why_a_handoff_is_not_for_this_prompt():
    h = parse_decode_params(_params())
    assert mismatch(h, [11, 22, 33, 44], block_size=16, bytes_per_block=4096) is None
    assert "prefix" in mismatch(h, [11, 99, 33], block_size=16, bytes_per_block=4096)
    assert "block size" in mismatch(h, [11, 22, 33], block_size=64, bytes_per_block=4096)
    assert "byte" in mismatch(h, [11, 22, 33], block_size=16, bytes_per_block=8192)


def test_next_epoch_is_the_clock_but_never_goes_back():
    assert next_epoch(1_000, None) == 1_000
    assert next_epoch(1_000, 999) == 1_000
    assert next_epoch(1_000, 1_000) == 1_001  # same millisecond as the last incarnation
    assert next_epoch(1_000, 5_000) == 5_001  # the clock stepped back


def test_partition_is_the_producers_partitioner():
    """xxh64(key) % n, as EventProducer places keyed events (not crc32)."""
    for key in ("w0", "w1", "w-restart", "prefill-7"):
        assert partition_for(key, 6) == xxhash.xxh64_intdigest(key.encode()) % 6


def test_settings_explain_what_cannot_work(tmp_path):
    ok = WorkerSettings(worker_id="w1", role="decode", data_dir=tmp_path, host_blocks=8, transfer_blocks=4)
    assert ok.region_blocks(100) == 12 and ok.role.value == "decode"
    # 0 staging slots: sized from the pool, as many as the engine's device blocks.
    auto = WorkerSettings(worker_id="w1", role="decode", data_dir=tmp_path, host_blocks=8)
    assert auto.staging_blocks(100) == 100 and auto.region_blocks(100) == 108
    kv = ok.kvbm_settings(block_size=16, hash_algo="sha256")
    assert kv.host_capacity == 8 and not kv.device_eviction_events and kv.verify_synthetic_content
    for bad in (dict(worker_id="a:b"), dict(worker_id=""), dict(worker_id="w" * 257), dict(object_blocks=4),
                dict(lease_s=1.0, lease_margin_s=1.0), dict(role="router"), dict(transfer_blocks=-1), dict(staging_wait_s=-1),
                dict(s3_bucket="b", s3_access_key_id="k")):
        with pytest.raises((WorkerConfigError, ValueError)):
            WorkerSettings(**{"worker_id": "w1", **bad})


def test_the_object_tiers_credentials_reach_its_s3_settings_and_stay_out_of_reprs(tmp_path):
    from switchyard.cli import _s3_credentials

    creds = tmp_path / "s3-credentials"
    creds.write_text("[default]\naws_access_key_id = switchyard\naws_secret_access_key = s3cr3t\n")
    key_id, secret = _s3_credentials(creds)
    w = WorkerSettings(worker_id="w1", data_dir=tmp_path, s3_endpoint="http://127.0.0.1:9", s3_bucket="b",
                       s3_access_key_id=key_id, s3_secret_access_key=secret)
    s3 = w.kvbm_settings(block_size=16, hash_algo="sha256").s3
    assert (s3.access_key_id, s3.secret_access_key, s3.create_bucket) == ("switchyard", "s3cr3t", True)
    assert "s3cr3t" not in repr(w) and "s3cr3t" not in repr(s3)
    creds.write_text("[other]\naws_access_key_id = x\n")
    with pytest.raises(ValueError, match="no \\[default\\]"):
        _s3_credentials(creds)
