"""Small asyncio helpers shared by both planes."""

from __future__ import annotations

import asyncio


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel ``task`` (None: nothing) and wait until it has ended. The task's own cancellation
    ends here; any other exception it ended with is raised, and so is a cancellation of the
    caller while it waits."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
