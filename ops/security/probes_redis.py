"""``security-check``'s probes of the stack's Redis with the components' own credentials: the
routers' shared counts (admission rule 4's waiting count, the API keys' limits) and the
planners' lease (ops/stack/redis.py, ``ROLE_KEYS``).

* **a non-router credential writes a router's count**: the planner's Redis user writes an entry
  into the routers' waiting hash of the system (a huge count there would make every router shed
  all traffic: its TTFT budget counts the others' waiting) and fills an API key's concurrency
  slots; the router's user takes the planners' lease. Refused: NOPERM. What it writes is
  harmless if it gets through (a count of 0 with a stale time, a key id of the probe's own, a
  lease name no planner uses) and is deleted at once with the super user.
* **a router's credential writes a count no router could have**: an entry over the most requests
  a replica serves at once, and one written in the future (it would stay live for ever), into a
  waiting hash of the probe's own, read by the routers' :class:`SharedWaiting`: refused means
  neither is counted (and both are reported as rejected).
"""

from __future__ import annotations

import asyncio
import time
import uuid

from control_plane.router.shared_gate import SharedWaiting, waiting_key
from ops.security.probe import ACCEPTED, REFUSED, SERVER_ERROR, SKIPPED, Probe, Targets


def _client(url: str):
    import redis

    return redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)


def _attempt(url: str, attack: str, op, undo) -> Probe:  # noqa: ANN001
    """Run ``op(client)`` as ``url``'s user: NOPERM is refused; anything it wrote is undone."""
    import redis

    c = _client(url)
    try:
        op(c)
    except redis.exceptions.NoPermissionError as e:
        return Probe("redis", attack, REFUSED, str(e)[:100])
    except redis.exceptions.AuthenticationError as e:
        return Probe("redis", attack, SKIPPED, f"the stack's Redis has no such user ({e}): `switchyard stack up` "
                                               "creates the components' users")
    except redis.exceptions.RedisError as e:
        return Probe("redis", attack, SERVER_ERROR, f"{type(e).__name__}: {e}"[:100])
    finally:
        c.close()
    undo()
    return Probe("redis", attack, ACCEPTED, "written")


def probe_foreign_keys(t: Targets) -> list[Probe]:
    """Each component's Redis user against another's keys (see the module docstring)."""
    if not (t.redis_router_url and t.redis_planner_url):
        return [Probe("redis", "the components' Redis users", SKIPPED, "no component Redis users given")]
    mine = f"security-check-{uuid.uuid4().hex[:8]}"
    waiting = waiting_key(t.topic_prefix)
    slots = f"switchyard:router-key:{{{mine}}}:slots"
    lease = f"switchyard:planner:{mine}:leader"
    admin = _client(t.redis_url)
    try:
        return [
            _attempt(t.redis_planner_url, "the planner's Redis credential writes a router's waiting count "
                                          "(admission rule 4: every router would shed)",
                     lambda c: c.hset(waiting, mine, "0:0"), lambda: admin.hdel(waiting, mine)),
            _attempt(t.redis_planner_url, "the planner's Redis credential fills an API key's concurrency slots",
                     lambda c: c.zadd(slots, {mine: 1 << 50}), lambda: admin.delete(slots)),
            _attempt(t.redis_router_url, "the router's Redis credential takes the planners' lease",
                     lambda c: c.set(lease, mine, px=1000), lambda: admin.delete(lease)),
        ]
    finally:
        admin.close()


def probe_waiting_bounds(t: Targets, max_count: int = 1024) -> list[Probe]:
    """The router's own credential writes, into a waiting hash of the probe's own, an entry over
    ``max_count`` (a router's ``max_connections``) and one in the future; a reader as the routers
    make it must count neither."""
    if not t.redis_router_url:
        return [Probe("redis", "a router's waiting count no router could have", SKIPPED, "no router Redis user given")]
    key = waiting_key(f"{t.topic_prefix}-security-check-{uuid.uuid4().hex[:8]}")
    server_ms = _server_ms(t.redis_url)
    fakes = {"over the bound": ("fake-over", f"{max_count * 1000}:{server_ms}", "over_bound"),
             "in the future": ("fake-future", f"5:{server_ms + 3_600_000}", "future")}

    async def read() -> tuple[int, dict[str, int]]:
        w = SharedWaiting.from_url(t.redis_router_url, timeout_s=5, replica="security-check-reader", key=key,
                                   waiting=lambda: 0, max_count=max_count)
        try:
            await w.client.hset(key, mapping={f: v for f, v, _ in fakes.values()})
            others = await w.sync()
            return others, dict(w.rejected)
        finally:
            await w.close()

    admin = _client(t.redis_url)
    try:
        others, rejected = asyncio.run(read())
    except Exception as e:  # noqa: BLE001 - the verdict says what failed
        import redis

        if isinstance(e, redis.exceptions.AuthenticationError):
            return [Probe("redis", f"a router's credential writes a waiting count {how}", SKIPPED,
                          f"the stack's Redis has no router user ({e})") for how in fakes]
        return [Probe("redis", f"a router's credential writes a waiting count {how}", SERVER_ERROR,
                      f"{type(e).__name__}: {e}"[:100]) for how in fakes]
    finally:
        admin.delete(key)
        admin.close()
    out = []
    for how, (_field, value, reason) in fakes.items():
        ok = others == 0 and rejected.get(reason, 0) >= 1
        out.append(Probe("redis", f"a router's credential writes a waiting count {how} ({value.split(':')[0]})",
                         REFUSED if ok else ACCEPTED,
                         f"not counted ({reason}): the reader's others = {others}" if ok
                         else f"the reader counted {others} others' waiting, rejected {rejected}"))
    return out


def _server_ms(url: str) -> int:
    c = _client(url)
    try:
        s, us = c.time()
        return s * 1000 + us // 1000
    except Exception:  # noqa: BLE001 - a probe without the server's time uses ours
        return int(time.time() * 1000)
    finally:
        c.close()


def run(t: Targets) -> list[Probe]:
    """Every Redis probe with the components' credentials (``check.run`` calls it)."""
    return [*probe_foreign_keys(t), *probe_waiting_bounds(t)]
