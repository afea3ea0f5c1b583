"""Router API-key limits shared by every router replica: the token bucket and the concurrency
slots of each key live in Redis, so N replicas together admit a key's rate, not N times it.

The gates the router's ``api_key`` dependency awaits (:class:`Gate`): :class:`LocalGate`, the
per-replica :class:`~control_plane.router.keys.KeyGate` (``--key-limits local``, and in-process
tests), and :class:`SharedKeyGate` (``--key-limits shared``, the default when a Redis URL is
configured).

Invariants of the shared gate:

* **One atomic script per admit, one round trip.** ``_ADMIT`` drops the key's expired slot
  leases, checks concurrency before the rate (a request refused for concurrency spends no
  token), refills and takes from the bucket, and takes a slot, all inside Redis; a release is
  one ``ZREM``. The refusals (reason, message, Retry-After) are :func:`keys.concurrency_denied`
  and :func:`keys.rate_denied`, the same as :class:`KeyGate`'s.
* **Redis's clock, not the replicas'.** The script reads ``TIME``: the bucket's refill and the
  leases' expiries are in the server's time, so replicas whose clocks disagree still share one
  bucket. (``redis.replicate_commands()`` is called where it exists: Redis < 5 needs it before a
  write that follows ``TIME``; 7.x replicates a script's effects anyway.)
* **A slot is a lease, so a killed replica leaks nothing for long.** A concurrency slot is a
  member of the key's sorted set scored by its expiry (server ms). The replica holding it
  renews all its slots every ``lease_s / 3`` (one pipelined round trip) while the requests run;
  a replica killed with -9 stops renewing, and its slots are dropped by the next admit of that
  key after at most ``lease_s``. A renewal only extends slots still there (``ZADD XX``): a slot
  whose lease lapsed while Redis was unreachable is not taken back, so a late renewal cannot
  resurrect a released one.
* **Redis down never fails a generation.** A call that cannot reach Redis (connection refused,
  timeout, an error reply) is decided by this replica's own :class:`KeyGate` instead, counted
  (``on_fallback``: the router's ``switchyard_router_key_gate_fallbacks_total``) and logged at
  most once per ``log_every_s``; for ``retry_s`` after a failure calls go to the local gate at
  once rather than wait on a dead Redis again. The price while Redis is down is the old one:
  each replica admits a key's whole rate.

Each admit is paired with one release by the caller (the ``api_key`` dependency); a key's
requests on this replica are interchangeable, so :meth:`SharedKeyGate.release` releases the one
admitted last, wherever it was counted (a Redis slot, no slot, or the local gate).

The same Redis carries one more shared count, for the TTFT budget test (admission rule 4):
:class:`SharedWaiting`, each replica's requests waiting for their first token, so that a
replica's queue term counts the others' too. A burst's first requests reach every replica at
once; each saw only its own share (docs/admission.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from control_plane.router.keys import Denied, KeyGate, RouterKey, concurrency_denied, rate_denied
from common.tasks import cancel_and_wait

if TYPE_CHECKING:  # redis is imported where a gate is made: every router imports this module
    import redis.asyncio as aioredis

log = logging.getLogger(__name__)

#: KEYS[1] the key's bucket (hash: level, at in server us), KEYS[2] its slots (zset: slot id ->
#: lease expiry in server ms). ARGV: rate/s ("" none), bucket size, max concurrent ("" none),
#: slot id, lease ms. Returns {0, n} admitted, {1, n} over concurrency (n in flight),
#: {2, n, level} over the rate. Numbers go back to Redis through string.format: Redis renders a
#: Lua number with 14 significant digits, too few for microseconds since 1970.
_ADMIT = """
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now_ms = math.floor(now_us / 1000)
local maxc = tonumber(ARGV[3])
local n = 0
if maxc then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', string.format('%d', now_ms))
  n = redis.call('ZCARD', KEYS[2])
  if n >= maxc then return {1, n} end
end
local rate = tonumber(ARGV[1])
if rate then
  local size = tonumber(ARGV[2])
  local b = redis.call('HMGET', KEYS[1], 'level', 'at')
  local level = size
  if b[1] then
    -- A clock that steps back refills nothing.
    level = math.min(size, tonumber(b[1]) + math.max(0, now_us - tonumber(b[2])) / 1000000 * rate)
  end
  local admitted = level >= 1
  if admitted then level = level - 1 end
  redis.call('HSET', KEYS[1], 'level', string.format('%.17g', level), 'at', string.format('%d', now_us))
  -- Once a bucket could have refilled, its absence reads the same: full.
  redis.call('PEXPIRE', KEYS[1], math.ceil(size / rate * 1000) + 1000)
  if not admitted then return {2, n, string.format('%.17g', level)} end
end
if maxc then
  local lease = tonumber(ARGV[5])
  redis.call('ZADD', KEYS[2], string.format('%d', now_ms + lease), ARGV[4])
  redis.call('PEXPIRE', KEYS[2], lease * 2)
end
return {0, n}
"""

#: KEYS[1] a key's slots; ARGV[1] lease ms, ARGV[2..] this replica's slot ids of that key.
_RENEW = """
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local expiry = string.format('%d', math.floor((tonumber(t[1]) * 1000000 + tonumber(t[2])) / 1000) + tonumber(ARGV[1]))
local renewed = 0
for i = 2, #ARGV do
  renewed = renewed + redis.call('ZADD', KEYS[1], 'XX', 'CH', expiry, ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]) * 2)
return renewed
"""


def _client(url: str, timeout_s: float) -> aioredis.Redis:
    """A client of the Redis at ``url`` whose calls wait at most ``timeout_s`` and are never
    retried: the caller has an answer of its own for a Redis that does not answer in time."""
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    return aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                   retry=Retry(NoBackoff(), 0), health_check_interval=0)


class Gate(Protocol):
    """What the router's ``api_key`` dependency awaits: :class:`KeyGate`'s contract, async."""

    async def admit(self, key: RouterKey, now_s: float) -> Denied | None: ...

    async def release(self, key: RouterKey) -> None: ...

    def inflight(self, key_id: str) -> int: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...


class LocalGate:
    """This replica's :class:`KeyGate` behind the async :class:`Gate` contract."""

    def __init__(self, gate: KeyGate | None = None) -> None:
        self.gate = gate if gate is not None else KeyGate()

    async def admit(self, key: RouterKey, now_s: float) -> Denied | None:
        return self.gate.admit(key, now_s)

    async def release(self, key: RouterKey) -> None:
        self.gate.release(key)

    def inflight(self, key_id: str) -> int:
        return self.gate.inflight(key_id)

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None


#: Where an admitted request of this replica is counted: a Redis slot id, Redis without a slot
#: (a key with no concurrency limit), or the local gate (Redis was unreachable).
_NO_SLOT = ""
_LOCAL = None


class SharedKeyGate:
    """Per-key rate and concurrency counted in Redis for every replica (see the module
    docstring); this replica's :class:`KeyGate` when Redis cannot be reached."""

    def __init__(self, client: aioredis.Redis, *, lease_s: float = 10.0, prefix: str = "switchyard:router-key",
                 fallback: KeyGate | None = None, on_fallback: Callable[[str], None] | None = None,
                 retry_s: float = 1.0, log_every_s: float = 10.0, monotonic: Callable[[], float] = time.monotonic,
                 replica: str | None = None) -> None:
        if lease_s < 0.3:
            raise ValueError(f"lease_s={lease_s}: a slot is renewed every lease_s / 3, at least 0.1 s")
        from redis.exceptions import RedisError

        #: What a Redis call that did not answer raises (the local gate answers instead).
        self._down = (RedisError, OSError)
        self.client = client
        self.lease_ms = int(lease_s * 1000)
        self.prefix = prefix
        self.local = fallback if fallback is not None else KeyGate()
        self.on_fallback = on_fallback
        self.retry_s = retry_s
        self.log_every_s = log_every_s
        self.monotonic = monotonic
        #: Unique per incarnation, so a restarted replica never renews or releases its
        #: predecessor's slots.
        self.replica = replica or uuid.uuid4().hex[:12]
        self._admit = client.register_script(_ADMIT)
        self._renew = client.register_script(_RENEW)
        self._seq = 0
        #: key id -> where each of its requests on this replica is counted, in admit order.
        self._held: dict[str, list[str | None]] = {}
        self._down_until = float("-inf")
        self._next_log = float("-inf")
        self._unlogged = 0
        self._renewer: asyncio.Task | None = None
        #: Fallbacks by operation, for tests and logs (the metric is ``on_fallback``'s).
        self.fallbacks: dict[str, int] = {}

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float = 0.25, **kw) -> SharedKeyGate:
        """A gate on the Redis at ``url``; a call waits at most ``timeout_s`` for it, and is never
        retried (the local gate answers instead)."""
        return cls(_client(url, timeout_s), **kw)

    def _keys(self, key_id: str) -> list[str]:
        # One hash tag per key: both keys land on one slot of a Redis Cluster.
        return [f"{self.prefix}:{{{key_id}}}:bucket", f"{self.prefix}:{{{key_id}}}:slots"]

    # -- the contract -----------------------------------------------------------------------

    async def admit(self, key: RouterKey, now_s: float) -> Denied | None:
        lim = key.limits
        if lim.rate_per_s is None and lim.max_concurrent is None:
            self._held.setdefault(key.key_id, []).append(_NO_SLOT)
            return None
        if self.monotonic() >= self._down_until:
            slot = _NO_SLOT
            if lim.max_concurrent is not None:
                self._seq += 1
                slot = f"{self.replica}:{self._seq}"
            args = ["" if lim.rate_per_s is None else repr(lim.rate_per_s),
                    "" if lim.rate_per_s is None else repr(lim.bucket_size),
                    "" if lim.max_concurrent is None else str(lim.max_concurrent), slot, str(self.lease_ms)]
            try:
                got = await self._admit(keys=self._keys(key.key_id), args=args)
            except self._down as e:
                self._failed("admit", e)
            else:
                code, n = int(got[0]), int(got[1])
                if code == 1:
                    return concurrency_denied(key, n)
                if code == 2:
                    return rate_denied(key, float(got[2]))
                self._held.setdefault(key.key_id, []).append(slot)
                return None
        else:
            self._count("admit")
        over = self.local.admit(key, now_s)
        if over is None:
            self._held.setdefault(key.key_id, []).append(_LOCAL)
        return over

    async def release(self, key: RouterKey) -> None:
        held = self._held.get(key.key_id)
        if not held:
            return
        where = held.pop()
        if not held:
            del self._held[key.key_id]
        if where is _LOCAL:
            self.local.release(key)
        elif where:
            try:
                await self.client.zrem(self._keys(key.key_id)[1], where)
            except self._down as e:
                # Not renewed from now on: its lease frees it.
                self._failed("release", e)

    def inflight(self, key_id: str) -> int:
        """This replica's requests of ``key_id`` (the shared count is in Redis)."""
        return len(self._held.get(key_id, ()))

    async def shared_inflight(self, key: RouterKey) -> int:
        """Every replica's live slots of ``key`` (expired leases not counted)."""
        t = await self.client.time()
        now_ms = t[0] * 1000 + t[1] // 1000
        return int(await self.client.zcount(self._keys(key.key_id)[1], f"({now_ms}", "+inf"))

    # -- leases -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Start renewing this replica's slots (the router's start-up)."""
        if self._renewer is None:
            self._renewer = asyncio.create_task(self._renew_forever(), name="key-slot-renewer")

    async def close(self) -> None:
        """Stop renewing (held slots then expire) and close the client."""
        if self._renewer is not None:
            await cancel_and_wait(self._renewer)
            self._renewer = None
        await self.client.aclose()

    async def renew(self) -> int:
        """Extend every slot this replica holds by a lease; the number renewed. One round trip."""
        slots = {k: [s for s in held if s] for k, held in self._held.items()}
        slots = {k: s for k, s in slots.items() if s}
        if not slots:
            return 0
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for key_id, ids in slots.items():
                    await self._renew(keys=[self._keys(key_id)[1]], args=[self.lease_ms, *ids], client=pipe)
                return sum(int(n) for n in await pipe.execute())
        except self._down as e:
            self._failed("renew", e)
            return 0

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.lease_ms / 3000)
            await self.renew()

    # -- Redis unreachable ------------------------------------------------------------------

    def _failed(self, op: str, e: BaseException) -> None:
        self._down_until = self.monotonic() + self.retry_s
        self._count(op, e)

    def _count(self, op: str, e: BaseException | None = None) -> None:
        self.fallbacks[op] = self.fallbacks.get(op, 0) + 1
        if self.on_fallback is not None:
            self.on_fallback(op)
        self._unlogged += 1
        now = self.monotonic()
        if e is not None and now >= self._next_log:
            log.warning("router key limits: Redis unreachable (%s: %s); %d call(s) counted by this replica "
                        "alone since the last warning (its own KeyGate: up to N replicas x a key's limits)",
                        op, e, self._unlogged)
            self._unlogged = 0
            self._next_log = now + self.log_every_s


#: KEYS[1] the replicas' hash (field: replica id -> "count:server ms"). ARGV: this replica's id,
#: its count, how old (ms) another's entry may be and still count, the most a replica's entry
#: may say (its requests served at once). Writes this replica's entry and returns {sum of the
#: others' live counts, how many others are live, then a (reason, replica id) pair per entry it
#: refused}: malformed (deleted), written in the future (deleted: a live replica rewrites its own
#: within an interval) or over the bound (not counted). Drops entries ten times too old.
_WAITING = """
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now_ms = math.floor((tonumber(t[1]) * 1000000 + tonumber(t[2])) / 1000)
local live = tonumber(ARGV[3])
local bound = tonumber(ARGV[4])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ':' .. string.format('%d', now_ms))
local all = redis.call('HGETALL', KEYS[1])
local sum, peers, refused = 0, 0, {}
for i = 1, #all, 2 do
  if all[i] ~= ARGV[1] then
    local n, at = string.match(all[i + 1], '^(%d+):(%d+)$')
    if not n or string.len(n) > 12 or string.len(at) > 15 then
      redis.call('HDEL', KEYS[1], all[i])
      table.insert(refused, 'malformed'); table.insert(refused, all[i])
    elseif tonumber(at) > now_ms + live then
      redis.call('HDEL', KEYS[1], all[i])
      table.insert(refused, 'future'); table.insert(refused, all[i])
    elseif now_ms - tonumber(at) > 10 * live then
      redis.call('HDEL', KEYS[1], all[i])
    elseif now_ms - tonumber(at) <= live then
      if tonumber(n) > bound then
        table.insert(refused, 'over_bound'); table.insert(refused, all[i])
      else
        sum = sum + tonumber(n)
        peers = peers + 1
      end
    end
  end
end
redis.call('PEXPIRE', KEYS[1], 10 * live)
local out = {sum, peers}
for i = 1, #refused do out[#out + 1] = refused[i] end
return out
"""

#: Why an entry of the waiting hash was not counted (``SharedWaiting.on_rejected``'s reasons).
WAITING_REJECTIONS = ("malformed", "future", "over_bound")


class SharedWaiting:
    """The other router replicas' requests waiting for their first token, through Redis.

    Every ``interval_s`` one script (one round trip) writes this replica's count (``waiting()``:
    ``PromiseMargin.waiting``) with Redis's time and reads the sum of the other replicas'
    entries written in the last ``live_s`` (a replica killed with -9 stops counting after that).
    :meth:`others` is the last sum read: what the budget test records in
    ``AdmissionTerms.others_waiting`` (replay re-executes with the recorded number, so the test
    stays a pure function of its terms). Redis unreachable, or the last answer older than
    ``live_s``: 0, the rule-3 count (this replica's own), logged at most once per ``log_every_s``.

    Why: a burst's first requests reach every replica at once, and each one's queue term saw
    only its own share (a chaos run's x8 onset: admitted 5 and 4 in 0.3 s, served in 1.4-1.7 s).
    Why polled, not read per request: the decision is synchronous and a round trip per request
    would add to the router's own loop; at 25 ms the count trails a burst by about one request.

    Who may write it: the hash is a key of the routers' own Redis ACL user (``ops/stack/redis.py``
    ``ROLE_KEYS``), so no other component's credential writes a count. What a router's own
    credential could still write is bounded: an entry over ``max_count`` (the most requests a
    replica serves at once: none can have more waiting), written in the future (it would stay
    "live" for ever) or malformed is not counted, is counted by ``on_rejected(reason)`` (the
    router's ``switchyard_router_waiting_entries_rejected_total``) and logged at most once per
    ``log_every_s``.

    Polled only while it is needed (the caller makes one only when rule 4's budget test is in
    force: :func:`waiting_shared`): every ``interval_s`` while another replica's entry is live,
    else every ``idle_interval_s`` (default ``live_s`` / 2), which still keeps this replica's
    own entry live for the others, so that a second replica that starts is seen within it
    (:meth:`next_interval`)."""

    def __init__(self, client: aioredis.Redis, *, replica: str, waiting: Callable[[], int],
                 key: str = "switchyard:router-waiting", interval_s: float = 0.025, live_s: float = 1.0,
                 idle_interval_s: float | None = None, max_count: int = 1024,
                 on_rejected: Callable[[str], None] | None = None,
                 log_every_s: float = 10.0, monotonic: Callable[[], float] = time.monotonic) -> None:
        idle_interval_s = live_s / 2 if idle_interval_s is None else idle_interval_s
        if interval_s <= 0 or live_s <= interval_s:
            raise ValueError(f"interval_s={interval_s}, live_s={live_s}: need 0 < interval_s < live_s")
        if not interval_s <= idle_interval_s < live_s:
            raise ValueError(f"idle_interval_s={idle_interval_s}: need interval_s <= idle_interval_s < live_s "
                             "(this replica's entry must stay live between two writes)")
        if max_count < 0:
            raise ValueError(f"max_count={max_count}: the most requests one replica serves at once, >= 0")
        from redis.exceptions import RedisError

        self._down = (RedisError, OSError)
        self.client = client
        self.replica = replica
        self.waiting = waiting
        self.key = key
        self.interval_s = interval_s
        self.idle_interval_s = idle_interval_s
        self.live_ms = int(live_s * 1000)
        self.max_count = max_count
        self.on_rejected = on_rejected
        self.log_every_s = log_every_s
        self.monotonic = monotonic
        self._script = client.register_script(_WAITING)
        self._others = 0
        #: Other replicas whose entry was live and counted at the last answer.
        self.peers = 0
        self._read_at = float("-inf")
        self._next_log = float("-inf")
        self._next_reject_log = float("-inf")
        self._task: asyncio.Task | None = None
        #: Round trips that failed (tests and logs).
        self.failures = 0
        #: Entries not counted, by reason (tests and logs; the metric is ``on_rejected``'s).
        self.rejected: dict[str, int] = {}

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float = 0.25, **kw) -> SharedWaiting:
        """A shared count on the Redis at ``url``; a round trip waits at most ``timeout_s``."""
        return cls(_client(url, timeout_s), **kw)

    def others(self) -> int:
        """The other replicas' requests waiting for their first token (0: none, or not known)."""
        return self._others if self.monotonic() - self._read_at <= self.live_ms / 1000 else 0

    def next_interval(self) -> float:
        """How long until the next round trip: ``interval_s`` while another replica was live at
        the last answer, else ``idle_interval_s`` (alone: nothing to read, only to stay seen)."""
        return self.interval_s if self.peers else self.idle_interval_s

    async def sync(self) -> int:
        """Write this replica's count and read the others' (one round trip); the others' sum."""
        try:
            got = await self._script(keys=[self.key], args=[self.replica, min(max(0, int(self.waiting())), self.max_count),
                                                            self.live_ms, self.max_count])
        except self._down as e:
            self.failures += 1
            now = self.monotonic()
            if now >= self._next_log:
                log.warning("router waiting count: Redis unreachable (%s); the TTFT budget's queue counts this "
                            "replica's own requests alone until it answers", e)
                self._next_log = now + self.log_every_s
            return self.others()
        self._others, self.peers, self._read_at = int(got[0]), int(got[1]), self.monotonic()
        if len(got) > 2:
            self._refused([(_text(got[i]), _text(got[i + 1])) for i in range(2, len(got) - 1, 2)])
        return self._others

    def _refused(self, entries: list[tuple[str, str]]) -> None:
        for reason, _replica in entries:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1
            if self.on_rejected is not None:
                self.on_rejected(reason)
        now = self.monotonic()
        if now >= self._next_reject_log:
            log.warning("router waiting count: %d entr%s of %s not counted (%s): only routers write it (their "
                        "Redis user), none has more than %d requests waiting, and none writes in the future",
                        len(entries), "y" if len(entries) == 1 else "ies", self.key,
                        ", ".join(f"{r[:64]!r}: {why}" for why, r in entries[:5]), self.max_count)
            self._next_reject_log = now + self.log_every_s

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._forever(), name="router-waiting-share")

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        try:
            await self.client.hdel(self.key, self.replica)
        except self._down:
            pass  # its entry stops counting after live_s anyway
        await self.client.aclose()

    async def _forever(self) -> None:
        while True:
            await self.sync()
            await asyncio.sleep(self.next_interval())


def _text(b: bytes | str) -> str:
    return b.decode("utf-8", "replace") if isinstance(b, bytes) else str(b)


def waiting_key(topic_prefix: str) -> str:
    """The waiting hash of the system on topic prefix ``topic_prefix``: one per system."""
    return f"switchyard:{topic_prefix}:router-waiting"


def waiting_shared(redis_url: str | None, ttft_slo_ms: float, rule: int) -> bool:
    """Whether a router shares its waiting count (:class:`SharedWaiting`): with a Redis, and
    only when admission rule 4 is the rule in force (``rule``, :data:`admission.RULE`) with the
    router's TTFT budget on (``RouterConfig.ttft_slo_ms`` > 0, the config it folded from the
    log at start). Otherwise nothing reads the count (a client's own budget on a router whose
    SLO is off counts this replica's waiting alone)."""
    return bool(redis_url) and rule >= 4 and ttft_slo_ms > 0


__all__ = ["Gate", "LocalGate", "SharedKeyGate", "SharedWaiting", "WAITING_REJECTIONS", "waiting_key", "waiting_shared"]
