"""Router API keys: the key table (a fold of the ``admin`` stream), verification of a presented
bearer, and the per-key limits. Pure: the time is an input, nothing here does I/O.

A key is ``sk-sy_<key_id>_<secret>`` (:mod:`common.bearer`, the admin tokens' scheme). The admin
API issues it (``RouterKeyIssued``: id, name, salt, hash, expiry, limits; never the secret) and
revokes it (``RouterKeyRevoked``); every router replica folds those events from the start of
the ``admin`` stream, so a new replica knows every key, and a revocation takes effect on a
running one within the fold's latency (a poll of the stream, well under a second).

Invariants:

* **The log decides.** The table holds exactly what the events say: the first issue of an id
  wins (a second ``RouterKeyIssued`` of the same id changes nothing), a revoked id stays revoked
  (an issue after its revocation is ignored: ids are never reused), and a revocation of an id
  never issued is kept, so it still holds if the issue turns up later.
* **The secret is checked first.** :meth:`KeyTable.verify` tells a caller that its key is
  revoked or expired only when the secret is right; anyone else reads "invalid", whatever the
  id. One sha256 of the presented secret and a constant-time compare: cheap on the hot path.
* **Limits are counted here per replica; the router shares them.** :class:`KeyGate` counts in
  this process (a token bucket per key for the rate, a counter for the requests in flight), so
  on its own N replicas would let a key through up to N times its limit. The router counts in
  Redis instead (:mod:`control_plane.router.shared_gate`: the same bucket and refusals in one
  Lua script on Redis's clock, concurrency slots as leases a killed replica cannot keep), and
  falls back to this gate, per replica, for a call Redis does not answer (``--key-limits local``:
  always). Concurrency is checked before the rate, so a request refused for concurrency does
  not spend a rate token.

Threads: the table is folded in a follower thread and read on the event loop. Each entry is a
frozen :class:`RouterKey` replaced whole (a revocation swaps in a revoked copy), so a reader
sees the old entry or the new one, never a half-made one; the gate lives on the loop only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from common import bearer
from common.bucket import Bucket, level_at
from schemas.envelope import Envelope
from schemas.events import Event, RouterKeyIssued, RouterKeyRevoked

#: The prefix of every router API key (an admin token, ``sy_...``, is not a router key).
KEY_PREFIX = "sk-sy"


@dataclass(frozen=True)
class KeyLimits:
    """What one key may do at once (across the router's replicas when its limits are shared, else on
    one replica); None: unlimited."""

    #: Requests per second (the bucket's refill rate) and how many may come at once above it
    #: (the bucket's size; default: one second's worth, at least 1).
    rate_per_s: float | None = None
    burst: int | None = None
    #: Requests in flight (a streamed answer counts until its last byte).
    max_concurrent: int | None = None

    def __post_init__(self) -> None:
        if self.rate_per_s is not None and not (self.rate_per_s > 0 and math.isfinite(self.rate_per_s)):
            raise ValueError(f"rate_per_s={self.rate_per_s}: a rate must be a positive number (None: no limit)")
        if self.burst is not None and self.burst < 1:
            raise ValueError(f"burst={self.burst}: at least 1, or no request could ever start")
        if self.burst is not None and self.rate_per_s is None:
            raise ValueError("burst without rate_per_s: a burst is the size of a rate's bucket")
        if self.max_concurrent is not None and self.max_concurrent < 1:
            raise ValueError(f"max_concurrent={self.max_concurrent}: at least 1 (None: no limit)")

    @property
    def bucket_size(self) -> float:
        assert self.rate_per_s is not None
        return float(self.burst if self.burst is not None else max(1, math.ceil(self.rate_per_s)))


@dataclass(frozen=True)
class RouterKey:
    """One key as the log states it."""

    key_id: str
    name: str
    salt: str
    key_hash: str
    limits: KeyLimits = KeyLimits()
    expires_at_ns: int | None = None
    issued_at_ns: int = 0
    revoked_at_ns: int | None = None
    #: The OpenAI ``user`` field names the request's session (``RouterKeyIssued.session_from_user``).
    session_from_user: bool = False


class Refusal(str, Enum):
    """Why a generation call is refused: 401 for the credential, 429 for a limit."""

    MISSING = "missing_api_key"
    INVALID = "invalid_api_key"
    REVOKED = "api_key_revoked"
    EXPIRED = "api_key_expired"
    RATE = "rate_limit_exceeded"
    CONCURRENCY = "concurrency_limit_exceeded"

    @property
    def status(self) -> int:
        return 429 if self in (Refusal.RATE, Refusal.CONCURRENCY) else 401


@dataclass(frozen=True)
class Denied:
    """A refusal with what the client is told."""

    why: Refusal
    message: str
    #: Whole seconds after which the same call may pass (a rate refusal).
    retry_after_s: int | None = None


class KeyTable:
    """Every router API key the ``admin`` stream has issued, revoked or not."""

    def __init__(self) -> None:
        self.keys: dict[str, RouterKey] = {}
        #: Revoked ids never issued (yet): an issue arriving later stays revoked.
        self.revoked_unknown: dict[str, int] = {}
        #: Events that changed the table.
        self.applied = 0

    # -- the fold -------------------------------------------------------------------------

    def apply(self, env: Envelope[Event]) -> bool:
        """Fold one admin event; True if the table changed."""
        handler = _HANDLERS.get(type(env.data))
        if handler is None or not handler(self, env):
            return False
        self.applied += 1
        return True

    def _issued(self, env: Envelope[Event]) -> bool:
        ev: RouterKeyIssued = env.data  # type: ignore[assignment]
        if ev.key_id in self.keys:
            return False  # the first issue of an id wins: a key's hash never changes
        limits = KeyLimits(rate_per_s=ev.rate_per_s, burst=ev.burst, max_concurrent=ev.max_concurrent)
        self.keys[ev.key_id] = RouterKey(key_id=ev.key_id, name=ev.name, salt=ev.salt, key_hash=ev.key_hash,
                                         limits=limits, expires_at_ns=ev.expires_at_ns,
                                         issued_at_ns=env.occurred_at_ns,
                                         revoked_at_ns=self.revoked_unknown.pop(ev.key_id, None),
                                         session_from_user=ev.session_from_user)
        return True

    def _revoked(self, env: Envelope[Event]) -> bool:
        ev: RouterKeyRevoked = env.data  # type: ignore[assignment]
        cur = self.keys.get(ev.key_id)
        if cur is None:
            if ev.key_id in self.revoked_unknown:
                return False
            self.revoked_unknown[ev.key_id] = env.occurred_at_ns
            return True
        if cur.revoked_at_ns is not None:
            return False
        self.keys[ev.key_id] = dataclasses.replace(cur, revoked_at_ns=env.occurred_at_ns)
        return True

    # -- verification -----------------------------------------------------------------------

    def verify(self, presented: str | None, now_ns: int) -> RouterKey | Denied:
        """The key a bearer names, or why it does not authenticate at ``now_ns``."""
        if not presented:
            return Denied(Refusal.MISSING, "You didn't provide an API key: send Authorization: Bearer sk-sy_... "
                                           "(an admin issues keys: POST /router-keys on the admin API)")
        parsed = bearer.parse(presented, KEY_PREFIX)
        key = self.keys.get(parsed[0]) if parsed is not None else None
        if key is None or not bearer.verify_secret(key.salt, key.key_hash, parsed[1]):
            return Denied(Refusal.INVALID, "Incorrect API key provided")
        if key.revoked_at_ns is not None:
            return Denied(Refusal.REVOKED, f"API key {key.key_id} ({key.name}) has been revoked")
        if key.expires_at_ns is not None and now_ns >= key.expires_at_ns:
            return Denied(Refusal.EXPIRED, f"API key {key.key_id} ({key.name}) has expired")
        return key

    def session_from_user(self, presented: str | None) -> bool:
        """Whether the key a bearer names opts in to ``user`` as the session id. Read after
        :meth:`verify` admitted the same bearer (the route checks the key before the body), so
        only its id is parsed here, not its secret hashed again."""
        parsed = bearer.parse(presented, KEY_PREFIX) if presented else None
        key = self.keys.get(parsed[0]) if parsed is not None else None
        return key is not None and key.session_from_user

    def as_dict(self) -> dict[str, Any]:
        """Comparable form (tests compare a live table with a fold of the log)."""
        return {k: dataclasses.asdict(v) for k, v in sorted(self.keys.items())}


_HANDLERS: dict[type[Event], Callable[[KeyTable, Envelope[Event]], bool]] = {
    RouterKeyIssued: KeyTable._issued,
    RouterKeyRevoked: KeyTable._revoked,
}


# -- limits ------------------------------------------------------------------------------------


def concurrency_denied(key: RouterKey, n: int) -> Denied:
    """The refusal of a key with ``n`` requests in flight, at or over its limit."""
    return Denied(Refusal.CONCURRENCY, f"API key {key.key_id} has {n} requests in flight, its limit is "
                                       f"{key.limits.max_concurrent}: wait for one to finish", retry_after_s=1)


def rate_denied(key: RouterKey, level: float) -> Denied:
    """The refusal of a key whose bucket holds ``level`` (< 1) tokens: retry once one has refilled."""
    lim = key.limits
    assert lim.rate_per_s is not None
    wait = max(1, math.ceil((1.0 - level) / lim.rate_per_s))
    return Denied(Refusal.RATE, f"API key {key.key_id} is over its rate of {lim.rate_per_s:g} requests/s "
                                f"(burst {lim.bucket_size:g}); retry in {wait} s", retry_after_s=wait)


class KeyGate:
    """Per-key rate (token bucket) and concurrency on one replica. Single-threaded (the event
    loop); the time is an input, in seconds of any monotonic clock."""

    def __init__(self) -> None:
        self._buckets: dict[str, Bucket] = {}
        self._inflight: dict[str, int] = {}

    def admit(self, key: RouterKey, now_s: float) -> Denied | None:
        """Start one request of ``key`` (then :meth:`release` it once), or why not."""
        lim = key.limits
        n = self._inflight.get(key.key_id, 0)
        if lim.max_concurrent is not None and n >= lim.max_concurrent:
            return concurrency_denied(key, n)
        if lim.rate_per_s is not None:
            level = level_at(self._buckets.get(key.key_id), now_s, lim.bucket_size, lim.rate_per_s)
            if level < 1.0:
                self._buckets[key.key_id] = Bucket(level, now_s)
                return rate_denied(key, level)
            self._buckets[key.key_id] = Bucket(level - 1.0, now_s)
        self._inflight[key.key_id] = n + 1
        return None

    def release(self, key: RouterKey) -> None:
        n = self._inflight.get(key.key_id, 0) - 1
        if n > 0:
            self._inflight[key.key_id] = n
        else:
            self._inflight.pop(key.key_id, None)

    def inflight(self, key_id: str) -> int:
        return self._inflight.get(key_id, 0)


__all__ = ["KEY_PREFIX", "Denied", "KeyGate", "KeyLimits", "KeyTable", "Refusal", "RouterKey", "concurrency_denied",
           "rate_denied"]
