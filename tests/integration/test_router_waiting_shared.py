"""The router replicas' requests waiting for a first token, shared through the stack's real Redis
(control_plane/router/shared_gate.py, ``SharedWaiting``; admission rule 4 counts the others'
in its queue term): each replica reads the sum of the others' counts, not its own; a replica
that stops writing (killed with -9) stops counting after ``live_s``; one that closes stops at
once; with Redis unreachable the others' count is 0 (this replica's own queue alone); an entry
no router could have written (over the bound, in the future, malformed) is not counted; a
replica alone polls at its idle interval."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from control_plane.router.shared_gate import SharedWaiting
from common.net import free_port
from common.stack_settings import StackSettings

pytestmark = [pytest.mark.redis]


async def _until(cond, timeout_s: float = 10.0) -> None:  # noqa: ANN001
    t0 = time.monotonic()
    while not await cond():
        assert time.monotonic() - t0 < timeout_s, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_each_replica_reads_the_others_waiting_and_a_silent_one_stops_counting(
        stack_settings: StackSettings) -> None:
    key = f"t{uuid.uuid4().hex[:10]}:router-waiting"
    counts = {"a": 3, "b": 2, "c": 4}
    made = {r: SharedWaiting.from_url(stack_settings.redis_url, replica=r, key=key, live_s=0.5,
                                      waiting=lambda r=r: counts[r]) for r in counts}
    a, b, c = made["a"], made["b"], made["c"]
    try:
        assert a.others() == 0  # nothing read yet
        for g in (a, b, c):
            await g.sync()
        assert (await a.sync(), await b.sync(), await c.sync()) == (6, 7, 5)
        assert (a.others(), b.others(), c.others()) == (6, 7, 5)
        counts["b"] = 0
        await b.sync()
        assert await a.sync() == 4
        # c stops writing (a replica killed with -9): it counts until its entry is live_s old.
        await _until(lambda: _eq(a.sync(), 0))
        # b closes: its entry is gone at once.
        counts["b"] = 5
        await b.sync()
        assert await a.sync() == 5
        await b.close()
        del made["b"]
        assert await a.sync() == 0
    finally:
        for g in made.values():
            await g.close()


async def _eq(aw, want: int) -> bool:  # noqa: ANN001
    return await aw == want


async def test_redis_unreachable_reads_no_other_replica() -> None:
    g = SharedWaiting.from_url(f"redis://127.0.0.1:{free_port()}/0", replica="a", waiting=lambda: 3)
    try:
        assert await g.sync() == 0 and g.others() == 0 and g.failures == 1
    finally:
        await g.close()


async def test_an_entry_no_router_could_have_written_is_not_counted(stack_settings: StackSettings) -> None:
    """As the routers' own Redis user, on the hash's real name pattern: an entry over
    ``max_count`` (the most requests a replica serves at once), one written an hour in the future
    (it would stay live for ever) and a malformed one count for nothing and are reported; a
    replica's own count is capped at the bound too."""
    key = f"switchyard:t{uuid.uuid4().hex[:10]}:router-waiting"
    url = stack_settings.redis_role_url("router")
    seen: list[str] = []
    a = SharedWaiting.from_url(url, replica="a", key=key, waiting=lambda: 3, max_count=8, on_rejected=seen.append)
    b = SharedWaiting.from_url(url, replica="b", key=key, waiting=lambda: 50, max_count=8)
    try:
        now_s, now_us = await a.client.time()
        now_ms = now_s * 1000 + now_us // 1000
        await a.client.hset(key, mapping={"over": f"9:{now_ms}", "future": f"1:{now_ms + 3_600_000}",
                                          "junk": "lots", "ok": f"2:{now_ms}"})
        assert await a.sync() == 2 and a.peers == 1
        assert sorted(seen) == ["future", "malformed", "over_bound"]
        assert a.rejected == {"future": 1, "malformed": 1, "over_bound": 1}
        left = {k.decode() for k in await a.client.hkeys(key)}
        assert left == {"a", "ok", "over"}  # the malformed and the future one are deleted
        await b.sync()  # b's own 50 is written as 8, its bound
        assert await a.sync() == 2 + 8
    finally:
        await a.client.delete(key)
        await a.close()
        await b.close()


async def test_a_replica_alone_polls_at_its_idle_interval_until_another_is_live(
        stack_settings: StackSettings) -> None:
    key = f"switchyard:t{uuid.uuid4().hex[:10]}:router-waiting"
    url = stack_settings.redis_role_url("router")
    a = SharedWaiting.from_url(url, replica="a", key=key, waiting=lambda: 1, live_s=1.0)
    b = SharedWaiting.from_url(url, replica="b", key=key, waiting=lambda: 1, live_s=1.0)
    try:
        await a.sync()
        assert a.peers == 0 and a.next_interval() == a.idle_interval_s == 0.5
        await b.sync()
        await a.sync()
        assert a.peers == 1 and a.next_interval() == a.interval_s == 0.025
        await b.close()
        await a.sync()
        assert a.peers == 0 and a.next_interval() == 0.5
    finally:
        await a.close()
