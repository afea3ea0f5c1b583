"""The event loop's side of the crate's batch wake-up (``native/src/wake.rs``): the crate's
threads collect the ids of what changed and write one byte to a socket pair per batch; the loop
(``add_reader``) takes the batch and completes the futures waiting on those ids. The router's
HTTP server (:mod:`common.native_http`) and its worker calls
(:mod:`control_plane.router.worker_calls`) both wait this way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable


class Waiters:
    """Futures keyed by id, completed by :meth:`wake`. Every waiter on one id shares its future."""

    __slots__ = ("_loop", "_futures")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._futures: dict[int, asyncio.Future] = {}

    def changed(self, key: int) -> asyncio.Future:
        """Done when ``key`` is next woken."""
        fut = self._futures.get(key)
        if fut is None or fut.done():
            fut = self._futures[key] = self._loop.create_future()
        return fut

    def wake(self, keys: Iterable[int]) -> None:
        futures = self._futures
        for key in keys:
            fut = futures.pop(key, None)
            if fut is not None and not fut.done():
                fut.set_result(None)

    def forget(self, key: int) -> None:
        """``key`` is over: nobody waits on it again (a cancelled waiter leaves its future behind)."""
        self._futures.pop(key, None)

    def fail(self, exc: BaseException) -> None:
        """Every waiter gets ``exc`` (the side that wakes them is gone)."""
        futures, self._futures = self._futures, {}
        for fut in futures.values():
            if not fut.done():
                fut.set_exception(exc)
