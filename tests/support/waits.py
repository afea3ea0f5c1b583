"""Condition waits for tests: poll a predicate until it holds, never sleep a fixed time.

A fixed sleep is either too short on a loaded machine (the test then checks something else, or
flakes) or too long everywhere else. Wait for the condition the sleep stood for instead, with a
deadline that only bounds a failure, and say what was awaited when it times out.

``pred`` returns something truthy when the condition holds; that value is returned, so a wait
can hand back what it observed (the records read, the response). ``what`` names the condition
in the failure message: a string, or a callable giving the state seen last (evaluated only on
timeout).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")


def _describe(what: str | Callable[[], object], pred: Callable[[], object]) -> str:
    if callable(what):
        return str(what())
    return what or getattr(pred, "__name__", repr(pred))


def _polls(pred: Callable[[], T], timeout: float, what: str | Callable[[], object]) -> Iterator[T]:
    """Yield ``pred()`` once a poll, the one wait loop of both waits below (the caller stops at
    a truthy value and sleeps its own way between polls); past ``timeout`` seconds with no
    truthy value, raise ``AssertionError`` naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        yield value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {_describe(what, pred)}")


def wait_for(pred: Callable[[], T], timeout: float = 20.0, what: str | Callable[[], object] = "",
             interval: float = 0.05) -> T:
    """Poll ``pred`` every ``interval`` seconds until it returns something truthy; return it.
    Raises ``AssertionError`` naming ``what`` after ``timeout`` seconds."""
    for value in _polls(pred, timeout, what):
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("unreachable: _polls ends only by raising")


async def until(pred: Callable[[], T], timeout: float = 20.0, what: str | Callable[[], object] = "",
                interval: float = 0.01) -> T:
    """``wait_for`` on the event loop: polls without blocking it, so the tasks that make the
    condition true keep running."""
    for value in _polls(pred, timeout, what):
        if value:
            return value
        await asyncio.sleep(interval)
    raise AssertionError("unreachable: _polls ends only by raising")
