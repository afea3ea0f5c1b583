"""Handoff protocol and endpoint metadata: pure state, no NIXL, no clock.

Unless a test says otherwise a hold is made at t=100 with a 30 s lease, so it expires at 130.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from data_plane.transfer import (
    BlockRegion,
    EndpointMetadata,
    Handoff,
    HoldError,
    HoldTable,
    InvalidTransfer,
    ReleaseReason,
    TransferError,
    encode_done,
    parse_done,
)
from schemas.events import TransferInfo, WorkerRegistered

T0 = 100.0
TTL = 30.0


def _make_table(*holds: tuple[str, list[int]], now: float = T0, ttl: float = TTL) -> HoldTable:
    table = HoldTable()
    for request_id, blocks in holds:
        table.hold(request_id, blocks, now, ttl)
    return table


def _make_metadata(**overrides) -> EndpointMetadata:
    fields = {
        "agent_name": "prefill-0:3",
        "agent_metadata": b"\x01nixl-md" * 50,
        "region": BlockRegion(base_addr=0x7F00_0000_0000, block_len=65536, n_blocks=256),
    }
    fields.update(overrides)
    return EndpointMetadata(**fields)


# ----------------------------------------------------------------------------------------------
# Done notifications
# ----------------------------------------------------------------------------------------------


def test_done_notif_round_trips_and_keeps_colons_in_request_ids():
    msg = encode_done("cmpl-1:retry:2", 4)
    assert msg == b"cmpl-1:retry:2:4"
    assert parse_done(msg) == ("cmpl-1:retry:2", 4)


@pytest.mark.parametrize(
    "msg", [b"", b"req", b"req:", b":3", b"req:0", b"req:-1", b"req:x", b"\xff:1"]
)
def test_parse_done_ignores_other_messages(msg):
    assert parse_done(msg) is None


def test_encode_done_refuses_zero_consumers():
    with pytest.raises(InvalidTransfer):
        encode_done("r", 0)


# ----------------------------------------------------------------------------------------------
# HoldTable
# ----------------------------------------------------------------------------------------------


def test_single_consumer_notify_frees_the_blocks():
    table = _make_table(("r1", [4, 5, 6]))

    released = table.notify("r1", 1, now=T0 + 2.5)

    assert released is not None
    assert (released.request_id, released.block_ids, released.reason) == (
        "r1",
        (4, 5, 6),
        ReleaseReason.CONSUMED,
    )
    assert released.held_s == 2.5
    assert "r1" not in table and len(table) == 0


def test_blocks_are_freed_on_the_last_of_n_consumers():
    """Two decode ranks each read half: the first done keeps the hold, the second frees it."""
    table = _make_table(("r1", [1, 2]))

    assert table.notify("r1", 2, now=T0 + 1) is None
    assert table.get("r1").notified == 1
    released = table.notify("r1", 2, now=T0 + 2)

    assert released is not None and released.reason is ReleaseReason.CONSUMED
    assert len(table) == 0


def test_expire_frees_only_leases_that_ran_out_earliest_first():
    table = HoldTable()
    table.hold("late", [1], T0, ttl=50)  # expires 150
    table.hold("early", [2], T0, ttl=10)  # expires 110
    table.hold("mid", [3], T0, ttl=30)  # expires 130

    assert table.expire(T0 + 9.999) == []
    released = table.expire(T0 + 30)  # 130: 'early' and 'mid' (expires_at <= now)

    assert [r.request_id for r in released] == ["early", "mid"]
    assert all(r.reason is ReleaseReason.EXPIRED for r in released)
    assert "late" in table and "early" not in table and "mid" not in table
    assert table.next_expiry() == T0 + 50


def test_late_notification_after_expiry_is_ignored():
    """A decode worker finishing after the lease must not free blocks a second time."""
    table = _make_table(("r1", [7]))
    assert [r.request_id for r in table.expire(T0 + TTL)] == ["r1"]

    assert table.notify("r1", 1, now=T0 + TTL + 1) is None


def test_release_is_idempotent_and_beats_the_lease():
    table = _make_table(("r1", [7, 8]))

    released = table.release("r1", now=T0 + 1)

    assert released is not None and released.reason is ReleaseReason.RELEASED
    assert released.block_ids == (7, 8)
    assert table.release("r1", now=T0 + 2) is None
    assert table.expire(T0 + 1000) == []
    assert table.next_expiry() is None


def test_rehold_after_release_gets_a_fresh_lease():
    """The stale deadline of the first hold (130) must not expire the second one (t=120 + 30)."""
    table = _make_table(("r1", [1]))
    table.release("r1", now=T0 + 5)
    table.hold("r1", [2], now=T0 + 20, ttl=TTL)

    assert table.expire(T0 + TTL) == []
    assert table.next_expiry() == T0 + 20 + TTL
    [released] = table.expire(T0 + 20 + TTL)
    assert released.block_ids == (2,)


def test_holding_a_request_twice_is_refused():
    table = _make_table(("r1", [1]))
    with pytest.raises(HoldError):
        table.hold("r1", [2], T0, TTL)
    with pytest.raises(HoldError):
        table.hold("r2", [2], T0, ttl=0)
    assert isinstance(HoldError("x"), TransferError)


def test_shared_blocks_are_reported_per_holder():
    """Prefix blocks shared by two requests are returned once per request; the pool ref-counts."""
    table = _make_table(("a", [1, 2, 3]), ("b", [1, 2, 9]))
    assert table.held_blocks() == 6

    assert table.notify("a", 1, now=T0).block_ids == (1, 2, 3)
    assert table.get("b").block_ids == (1, 2, 9)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["hold", "notify", "release", "expire"]),
            st.integers(0, 5),  # request index
            st.integers(1, 3),  # n_consumers
            st.floats(0, 5),  # time step
        ),
        max_size=60,
    )
)
def test_every_hold_leaves_exactly_once(ops):
    """Whatever the interleaving, each hold is released exactly once (or is still held)."""
    table = HoldTable()
    now = 0.0
    made: list[str] = []
    freed: list[str] = []
    for n, (op, idx, consumers, step) in enumerate(ops):
        now += step
        rid = f"r{idx}"
        if op == "hold" and rid not in table:
            table.hold(rid, [n], now, ttl=3)
            made.append(rid)
        elif op == "notify":
            if (r := table.notify(rid, consumers, now)) is not None:
                freed.append(r.request_id)
        elif op == "release":
            if (r := table.release(rid, now)) is not None:
                freed.append(r.request_id)
        else:
            freed.extend(r.request_id for r in table.expire(now))
    still_held = [rid for rid in set(made) if rid in table]
    assert sorted(freed + still_held) == sorted(made)


# ----------------------------------------------------------------------------------------------
# Handoff params and endpoint metadata
# ----------------------------------------------------------------------------------------------


def test_handoff_round_trips_through_kv_transfer_params():
    handoff = Handoff(
        request_id="r1", agent_name="prefill-0:3", block_ids=[3, 1, 2], expires_at=1.7e9
    )
    params = handoff.to_params()
    assert params["remote_block_ids"] == [3, 1, 2]
    assert Handoff.from_params(params) == handoff
    with pytest.raises(InvalidTransfer):
        Handoff.from_params({"remote_request_id": "r1"})


def test_handoff_is_readable_only_with_margin_before_expiry():
    handoff = Handoff(request_id="r1", agent_name="a", block_ids=[1], expires_at=130.0)
    assert handoff.readable(now=120.0, margin_s=5.0)
    assert not handoff.readable(now=125.0, margin_s=5.0)


def test_metadata_round_trips_through_worker_registered():
    md = _make_metadata()
    info = md.to_transfer_info()
    assert info.bytes_per_block == 65536 and info.agent_name == "prefill-0:3"

    event = WorkerRegistered(
        worker_id="prefill-0",
        role="prefill",
        pool="p",
        endpoint="http://x",
        block_size=16,
        hash_algo="sha256_cbor",
        transfer=info,
    )
    wire = msgspec.msgpack.encode(event)
    decoded = msgspec.msgpack.decode(wire, type=WorkerRegistered)

    assert EndpointMetadata.from_transfer_info(decoded.transfer) == md


def test_metadata_size_does_not_grow_with_the_block_count():
    """Geometry, not one descriptor per block: 256 or 1M blocks cost the same few bytes."""
    small = _make_metadata()
    big = _make_metadata(
        region=BlockRegion(base_addr=0x7F00_0000_0000, block_len=65536, n_blocks=1 << 20)
    )
    assert len(big.encode()) - len(small.encode()) <= 4
    assert len(small.encode()) < len(small.agent_metadata) + 100


def test_metadata_decode_rejects_garbage_and_mismatched_names():
    with pytest.raises(InvalidTransfer):
        EndpointMetadata.decode(b"\x93not-md")
    info = TransferInfo(agent_name="other", agent_metadata=_make_metadata().encode())
    with pytest.raises(InvalidTransfer):
        EndpointMetadata.from_transfer_info(info)


@pytest.mark.parametrize(
    "fields",
    [
        {"base_addr": 0x1000, "block_len": 0, "n_blocks": 1},
        {"base_addr": 0x1000, "block_len": 64, "n_blocks": 0},
        {"base_addr": 0, "block_len": 64, "n_blocks": 1},
    ],
)
def test_block_region_refuses_empty_geometry(fields):
    with pytest.raises(InvalidTransfer):
        BlockRegion(**fields)
