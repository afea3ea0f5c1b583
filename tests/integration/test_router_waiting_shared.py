"""The router replicas' requests waiting for a first token, shared through the stack's real Redis
(control_plane/router/shared_gate.py, ``SharedWaiting``; admission rule 4 counts the others'
in its queue term): each replica reads the sum of the others' counts, not its own; a replica
that stops writing (killed with -9) stops counting after ``live_s``; one that closes stops at
once; with Redis unreachable the others' count is 0 (this replica's own queue alone)."""

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
