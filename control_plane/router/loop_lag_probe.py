"""The asyncio adapter of :mod:`control_plane.router.loop_lag`: a task on the router's loop that
wakes every ``interval_s`` and feeds how late it woke into the pure smoothing.

It does nothing else: reading the result (:attr:`LoopLagProbe.lag`) is free, and the metrics
and admission read it there. One wake-up every 50 ms is about 20 callbacks a second: nothing
beside a request's dozens.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from common.tasks import cancel_and_wait
from control_plane.router.loop_lag import DEFAULT_TAU_S, LoopLag, observe

#: Between two samples. Short enough to see a saturated loop in a fraction of a second.
DEFAULT_INTERVAL_S = 0.05


class LoopLagProbe:
    """Samples the running loop's scheduling delay; ``on_sample(lag_s)`` is called with each
    sample's own lag (the router's histogram)."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S, tau_s: float = DEFAULT_TAU_S,
                 on_sample: Callable[[float], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s={interval_s}: must be > 0")
        self.interval_s = interval_s
        self.tau_s = tau_s
        self.lag = LoopLag()
        self._on_sample = on_sample
        self._clock = clock
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-lag-probe")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self) -> None:
        while True:
            due = self._clock() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self.lag = observe(self.lag, due, self._clock(), self.tau_s)
            if self._on_sample is not None:
                self._on_sample(self.lag.last_s)
