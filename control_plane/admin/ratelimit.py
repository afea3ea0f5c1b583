"""Failed authentications, rate-limited per key with token buckets. Pure (the time is an input).

Each key has a bucket of ``burst`` tokens that refills at ``per_s`` tokens a second; every
failed authentication takes one token from the bucket of each key it carries, and a key whose
bucket is empty makes the caller answer 429 with ``Retry-After``. Successful authentications take
nothing, so a client with a good token is never slowed by its own traffic.

The keys are the admin API's (control_plane/admin/deps.py): a token id with the source address
it was guessed from, and a source address alone for tokens that name no real id.

A full bucket is the same as no bucket, so buckets are forgotten once full, and at most
``max_keys`` are kept (the least recently touched go first): memory stays bounded however many
ids or addresses a client invents. In-process: each admin replica limits on its own.

Checking and charging are two steps, so requests already in flight when a bucket empties still
count against it but are not stopped: a guesser gains at most one request per worker thread of
the server per refill (tens, against a 256-bit secret). Charging every request up front and
refunding the good ones would close that, at the price of 429s for a client that simply sends
more than ``burst`` good requests at once.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Iterable

from common.bucket import Bucket, level_at


class FailureLimiter:
    """Token buckets of failed authentications; thread-safe (routes run in a thread pool)."""

    def __init__(self, burst: int, per_s: float, *, max_keys: int = 10_000) -> None:
        if burst < 1 or not per_s > 0 or max_keys < 1:
            raise ValueError("need burst >= 1, per_s > 0 and max_keys >= 1")
        self.burst = burst
        self.per_s = per_s
        self.max_keys = max_keys
        self._buckets: OrderedDict[str, Bucket] = OrderedDict()
        self._lock = threading.Lock()

    def _level(self, key: str, now: float) -> float:
        return level_at(self._buckets.get(key), now, self.burst, self.per_s)

    def retry_after(self, keys: Iterable[str], now: float) -> int | None:
        """Whole seconds until every key's bucket holds a token again; None if they all do."""
        with self._lock:
            wait = max(((1.0 - self._level(k, now)) / self.per_s for k in keys), default=0.0)
        return max(1, math.ceil(wait)) if wait > 0 else None

    def failed(self, keys: Iterable[str], now: float) -> None:
        """Take one token from each key's bucket (a failed authentication)."""
        with self._lock:
            for k in keys:
                level = max(0.0, self._level(k, now) - 1.0)
                self._buckets[k] = Bucket(level, now)
                self._buckets.move_to_end(k)
            self._forget(now)

    def _forget(self, now: float) -> None:
        if len(self._buckets) <= self.max_keys:
            return
        for k in [k for k in self._buckets if self._level(k, now) >= self.burst]:
            del self._buckets[k]
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)

    def __len__(self) -> int:
        return len(self._buckets)
