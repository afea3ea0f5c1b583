"""The admission test and queue (control_plane/router/admission.py), core only."""

from __future__ import annotations

import asyncio

import pytest

from control_plane.router.admission import AdmissionConfig, AdmissionQueue, PoolLoad, QueueRefused, has_room


def _cfg(**kw) -> AdmissionConfig:  # noqa: ANN003
    return AdmissionConfig(**{"busy_prefill_tokens": 1000, "queue_max": 2, "queue_timeout_s": 5.0, **kw})


def test_room_while_the_least_loaded_worker_is_below_the_threshold():
    """Workers at 900 and 1200 pending tokens, threshold 1000: 900 < 1000, room. 100 granted
    tokens on top: 900 + 100 = 1000 >= 1000, no room."""
    entry = [PoolLoad("a", 900), PoolLoad("b", 1200)]
    assert has_room(entry, None, _cfg())
    assert not has_room(entry, None, _cfg(), granted_tokens=100)
    assert has_room(entry, None, _cfg(busy_prefill_tokens=0), granted_tokens=10**9)  # 0: no limit


def test_decode_pool_full_holds_disaggregated_requests():
    """Decode capacity 100 blocks, busy at 0.95: 96 >= 95 busy, 94 not."""
    entry = [PoolLoad("p", 0)]
    busy = [PoolLoad("d0", active_decode_blocks=96, kv_capacity_blocks=100)]
    free = [PoolLoad("d1", active_decode_blocks=94, kv_capacity_blocks=100)]
    assert not has_room(entry, busy, _cfg())
    assert has_room(entry, busy + free, _cfg())
    assert has_room([], None, _cfg())  # no worker: the decision reports it, not admission


def test_config_refuses_what_cannot_work():
    for bad in ({"busy_prefill_tokens": -1}, {"busy_kv_fraction": 0}, {"queue_max": -1}, {"queue_timeout_s": 0}):
        with pytest.raises(ValueError):
            AdmissionConfig(**bad)


async def test_fcfs_grants_in_order_and_bounds_the_queue():
    room = {"open": False}
    q = AdmissionQueue(_cfg(poll_interval_s=0.001), lambda granted: room["open"] and granted == 0)
    order: list[str] = []

    async def take(name: str) -> None:
        await q.acquire(10)
        order.append(name)
        q.routed(10)

    a = asyncio.ensure_future(take("a"))
    b = asyncio.ensure_future(take("b"))
    while len(q) < 2:
        await asyncio.sleep(0.001)
    with pytest.raises(QueueRefused) as full:
        await q.acquire(10)
    assert full.value.status == 429 and full.value.code == "queue_full"
    room["open"] = True
    await asyncio.gather(a, b)
    assert order == ["a", "b"] and q.granted_tokens == 0 and q.admitted == 2


async def test_waiting_longer_than_the_timeout_is_a_503():
    q = AdmissionQueue(_cfg(queue_timeout_s=0.05, poll_interval_s=0.01), lambda granted: False)
    with pytest.raises(QueueRefused) as late:
        await q.acquire(10)
    assert late.value.status == 503 and late.value.code == "queue_timeout" and len(q) == 0
