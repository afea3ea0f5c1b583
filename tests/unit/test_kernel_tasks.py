"""common.tasks.cancel_and_wait: the task's own cancellation ends there, nothing else does."""

from __future__ import annotations

import asyncio

import pytest

from common.tasks import cancel_and_wait


async def test_cancels_and_waits_for_the_end():
    ended = asyncio.Event()

    async def forever():
        try:
            await asyncio.Event().wait()
        finally:
            ended.set()

    task = asyncio.create_task(forever())
    await asyncio.sleep(0)
    await cancel_and_wait(task)
    assert task.cancelled() and ended.is_set()
    await cancel_and_wait(None)


async def test_an_exception_the_task_ended_with_is_raised():
    async def fails():
        raise ValueError("boom")

    task = asyncio.create_task(fails())
    await asyncio.wait([task])
    with pytest.raises(ValueError, match="boom"):
        await cancel_and_wait(task)


async def test_a_cancellation_of_the_caller_is_not_swallowed():
    release = asyncio.Event()

    async def slow_to_stop():
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await release.wait()  # cleanup that takes a while
            raise

    inner = asyncio.create_task(slow_to_stop())
    await asyncio.sleep(0)
    outer = asyncio.create_task(cancel_and_wait(inner))
    await asyncio.sleep(0)
    outer.cancel()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await outer
