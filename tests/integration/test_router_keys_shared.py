"""Router API-key limits shared through the stack's real Redis (control_plane/router/shared_gate.py):
two gates stand for two router replicas sharing one key. Together they admit the key's burst
then its rate, hold at most its concurrency, a slot held by a replica killed mid-request frees
itself after its lease, and with Redis unreachable each call is admitted by the replica's own
gate and counted as a fallback."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from control_plane.router.keys import KeyGate, KeyLimits, Refusal, RouterKey
from control_plane.router.shared_gate import SharedKeyGate
from common.stack_settings import StackSettings
from common.net import free_port

pytestmark = [pytest.mark.redis]


def _key(**limits) -> RouterKey:
    return RouterKey(key_id=uuid.uuid4().hex[:8], name="k", salt="00", key_hash="x", limits=KeyLimits(**limits))


@pytest.fixture
async def gates(stack_settings: StackSettings):
    """Two replicas' gates on the stack's Redis, under a prefix unique to this test."""
    prefix = f"t{uuid.uuid4().hex[:10]}:router-key"
    made: list[SharedKeyGate] = []

    def make(**kw) -> SharedKeyGate:
        g = SharedKeyGate.from_url(stack_settings.redis_url, prefix=prefix, **kw)
        made.append(g)
        return g

    yield make
    for g in made:
        await g.close()


async def test_two_replicas_together_admit_the_burst_then_the_rate(gates) -> None:
    """rate 5/s, burst 4: alternating between two gates for 1.2 s admits 4 + floor(5 x 1.2) = 10
    (give or take one token: the last refill lands on the loop's end), where two local gates would
    admit twice that."""
    a, b = gates(), gates()
    key = _key(rate_per_s=5.0, burst=4)
    first = [await g.admit(key, 0.0) for g in (a, b, a, b, a)]
    assert first[:4] == [None] * 4
    assert first[4].why is Refusal.RATE and first[4].retry_after_s == 1
    local = KeyGate()
    assert [local.admit(key, 0.0) for _ in range(4)] == [None] * 4
    assert first[4] == local.admit(key, 0.0)  # KeyGate's reason, words and Retry-After

    t0, admitted = time.monotonic(), 4
    while time.monotonic() - t0 < 1.2:
        for g in (a, b):
            if await g.admit(key, 0.0) is None:
                admitted += 1
        await asyncio.sleep(0.01)
    elapsed = time.monotonic() - t0
    assert 4 + 5 * elapsed - 1.5 <= admitted <= 4 + 5 * elapsed + 1, (admitted, elapsed)


async def test_concurrency_across_both_replicas_is_at_most_max_concurrent(gates) -> None:
    a, b = gates(), gates()
    key = _key(max_concurrent=3)
    assert await a.admit(key, 0.0) is None and await a.admit(key, 0.0) is None and await b.admit(key, 0.0) is None
    over = await b.admit(key, 0.0)
    assert over.why is Refusal.CONCURRENCY and over.retry_after_s == 1
    assert "has 3 requests in flight, its limit is 3" in over.message
    assert (await a.admit(key, 0.0)).why is Refusal.CONCURRENCY
    assert await a.shared_inflight(key) == 3 and a.inflight(key.key_id) == 2 and b.inflight(key.key_id) == 1
    await a.release(key)
    assert await b.admit(key, 0.0) is None  # the slot a freed is b's now
    for g, n in ((a, 1), (b, 2)):
        for _ in range(n):
            await g.release(key)
    assert await a.shared_inflight(key) == 0


async def test_a_refusal_for_concurrency_spends_no_rate_token(gates) -> None:
    a, b = gates(), gates()
    key = _key(max_concurrent=1, rate_per_s=0.01, burst=2)
    assert await a.admit(key, 0.0) is None
    assert (await b.admit(key, 0.0)).why is Refusal.CONCURRENCY
    await a.release(key)
    assert await b.admit(key, 0.0) is None  # the second token: the refusal took none
    await b.release(key)
    assert (await a.admit(key, 0.0)).why is Refusal.RATE


async def test_a_killed_replicas_slot_frees_itself_after_its_lease_and_a_live_one_keeps_its_own(gates) -> None:
    """Lease 1 s. The "killed" gate took the key's one slot and never renews or releases it: the
    other is refused until the lease ran out, then admitted. A live gate (renewing every 1/3 s)
    keeps its slot for 2.5 leases, until it releases it."""
    killed, other = gates(lease_s=1.0), gates(lease_s=1.0)
    key = _key(max_concurrent=1)
    assert await killed.admit(key, 0.0) is None
    t0 = time.monotonic()
    assert (await other.admit(key, 0.0)).why is Refusal.CONCURRENCY
    while await other.admit(key, 0.0) is not None:
        assert time.monotonic() - t0 < 3.0, "the dead replica's slot never expired"
        await asyncio.sleep(0.05)
    freed_after = time.monotonic() - t0
    assert 0.7 <= freed_after <= 1.5, freed_after

    live = gates(lease_s=1.0)
    await other.release(key)
    await live.start()
    assert await live.admit(key, 0.0) is None
    await asyncio.sleep(2.5)
    assert (await other.admit(key, 0.0)).why is Refusal.CONCURRENCY
    await live.release(key)
    assert await other.admit(key, 0.0) is None
    await other.release(key)


async def test_redis_unreachable_falls_back_to_the_local_gate_and_counts_it() -> None:
    """Nothing listens on the port: every call is decided by the replica's own KeyGate (so its
    limits still hold, per replica), counted by operation, and generation never fails."""
    seen: list[str] = []
    g = SharedKeyGate.from_url(f"redis://127.0.0.1:{free_port()}/0", on_fallback=seen.append)
    try:
        key = _key(rate_per_s=0.01, burst=2, max_concurrent=5)
        assert await g.admit(key, 0.0) is None and await g.admit(key, 0.0) is None
        assert (await g.admit(key, 0.0)).why is Refusal.RATE  # the local bucket, burst 2
        assert g.local.inflight(key.key_id) == 2 and g.inflight(key.key_id) == 2
        await g.release(key)
        await g.release(key)
        assert g.local.inflight(key.key_id) == 0
        assert seen == ["admit"] * 3 and g.fallbacks == {"admit": 3}
    finally:
        await g.close()


async def test_the_router_metric_counts_fallbacks(stack_settings: StackSettings) -> None:
    """The wiring's callback: ``switchyard_router_key_gate_fallbacks_total{op}``."""
    from control_plane.router.serving import RouterMetrics

    metrics = RouterMetrics()
    g = SharedKeyGate.from_url(f"redis://127.0.0.1:{free_port()}/0",
                               on_fallback=lambda op: metrics.key_gate_fallbacks.labels(op).inc())
    try:
        key = _key(max_concurrent=1)
        assert await g.admit(key, 0.0) is None
        await g.release(key)
        assert metrics.registry.get_sample_value("switchyard_router_key_gate_fallbacks_total", {"op": "admit"}) == 1
    finally:
        await g.close()


async def test_a_refused_login_is_a_fallback_too(stack_settings: StackSettings) -> None:
    """Redis answers but refuses the credential (an error reply, not a dead socket)."""
    s = stack_settings
    g = SharedKeyGate.from_url(f"redis://switchyard:wrong-password@{s.host}:{s.redis_port}/0")
    try:
        key = _key(max_concurrent=1)
        assert await g.admit(key, 0.0) is None
        assert (await g.admit(key, 0.0)).why is Refusal.CONCURRENCY  # the local gate's one slot
        await g.release(key)
        assert g.fallbacks == {"admit": 2} and g.local.inflight(key.key_id) == 0
    finally:
        await g.close()
