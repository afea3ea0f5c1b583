"""One active planner: a Redis lease with a fencing token.

* Acquire: ``SET <key> <holder> NX PX <ttl>``; the winner then takes a fencing token with
  ``INCR <key>:fencing``. Tokens only grow, across leaders and restarts.
* Renew: a Lua compare-and-extend (``PEXPIRE`` only if the key still holds our value), every
  ``ttl / 3``. A failed or late renewal means the lease may be someone else's: we stop acting.
* Release: a Lua compare-and-delete, so a passive replica takes over at once on a clean stop.

A passive replica retries the acquire every ``retry_s``; when the leader dies without releasing
(SIGKILL) its key expires after at most ``ttl``, so the takeover happens within ``ttl +
retry_s``. Leadership is also judged locally: we count ourselves leader only until the last
successful renewal plus ``ttl`` minus a safety margin, by the monotonic clock; a process paused
longer than that (GC, SIGSTOP) stops acting before another can start. The fencing token covers
the remaining window: every decision carries it and scalers reject tokens older than the newest
they have seen.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable

import redis

from control_plane.planner.errors import LeaseLost, PlannerError

log = logging.getLogger(__name__)

_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('del', KEYS[1])
end
return 0
"""


class LeaderLease:
    """The lease operations (no thread). ``holder`` names this incarnation in the key's value."""

    def __init__(self, client: redis.Redis, name: str, holder: str, ttl_ms: int = 3000) -> None:
        if ttl_ms < 100:
            raise ValueError("ttl_ms must be >= 100: shorter leases expire between two renewals")
        self.client = client
        self.key = f"switchyard:planner:{name}:leader"
        self.token_key = f"{self.key}:fencing"
        #: Unique per incarnation: a restarted process with the same id must not "renew" a lease
        #: its previous incarnation held.
        self.value = f"{holder}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.ttl_ms = ttl_ms
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)

    def try_acquire(self) -> int | None:
        """The new fencing token if we won the lease, else None."""
        try:
            if not self.client.set(self.key, self.value, nx=True, px=self.ttl_ms):
                return None
            return int(self.client.incr(self.token_key))
        except redis.RedisError as e:
            raise PlannerError(f"lease acquire on {self.key} failed: {e}") from e

    def renew(self) -> bool:
        try:
            return bool(self._renew(keys=[self.key], args=[self.value, self.ttl_ms]))
        except redis.RedisError as e:
            log.warning("lease renew failed: %s", e)
            return False

    def release(self) -> bool:
        try:
            return bool(self._release(keys=[self.key], args=[self.value]))
        except redis.RedisError as e:
            log.warning("lease release failed: %s", e)
            return False

    def holder(self) -> str | None:
        v = self.client.get(self.key)
        return v.decode() if isinstance(v, bytes) else v


class LeaderElector:
    """Keeps trying to lead in a background thread; ``token`` is set only while leading.

    ``on_elected(token)`` and ``on_lost()`` run on the elector thread.
    """

    def __init__(self, lease: LeaderLease, *, retry_s: float = 0.5, safety_s: float | None = None,
                 on_elected: Callable[[int], None] | None = None, on_lost: Callable[[], None] | None = None) -> None:
        self.lease = lease
        self.retry_s = retry_s
        ttl_s = lease.ttl_ms / 1000
        self.renew_every_s = ttl_s / 3
        #: We stop counting ourselves leader this long before the lease could have expired.
        self.safety_s = ttl_s / 5 if safety_s is None else safety_s
        self.on_elected = on_elected
        self.on_lost = on_lost
        self._token: int | None = None
        self._valid_until = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="leader-elector", daemon=True)
        self._lock = threading.Lock()

    @property
    def token(self) -> int | None:
        """The fencing token while we lead (and the lease is surely still ours), else None."""
        with self._lock:
            if self._token is not None and time.monotonic() < self._valid_until:
                return self._token
            return None

    def require(self) -> int:
        t = self.token
        if t is None:
            raise LeaseLost("this planner does not hold the leader lease")
        return t

    def start(self) -> LeaderElector:
        self._thread.start()
        return self

    def stop(self, release: bool = True) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if release and self._token is not None:
            self.lease.release()
        with self._lock:
            self._token = None

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._token is None:
                t0 = time.monotonic()
                try:
                    token = self.lease.try_acquire()
                except PlannerError as e:
                    log.warning("%s", e)
                    token = None
                if token is not None:
                    with self._lock:
                        self._token = token
                        self._valid_until = t0 + self.lease.ttl_ms / 1000 - self.safety_s
                    log.info("elected leader (%s), fencing token %d", self.lease.value, token)
                    if self.on_elected:
                        self.on_elected(token)
                    self._stop.wait(self.renew_every_s)
                else:
                    self._stop.wait(self.retry_s)
                continue
            t0 = time.monotonic()
            if self.lease.renew():
                with self._lock:
                    self._valid_until = t0 + self.lease.ttl_ms / 1000 - self.safety_s
                self._stop.wait(self.renew_every_s)
            else:
                with self._lock:
                    lost, self._token = self._token, None
                log.warning("lost the leader lease (token %s)", lost)
                if self.on_lost:
                    self.on_lost()
