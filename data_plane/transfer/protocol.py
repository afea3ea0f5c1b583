"""The prefill -> decode KV handoff, as pure state (no I/O, no clock: ``now`` is an input).

The flow, as in vLLM's NixlConnector:

1. Prefill finishes a request and *holds* its KV blocks under a lease
   (:meth:`HoldTable.hold`), then hands decode a :class:`Handoff` (agent, block ids, expiry) in
   ``PrefillCompleted.kv_transfer_params``.
2. Each decode consumer READs the blocks it needs (pull: the destination decides when its memory
   is ready, and the source never writes into memory it does not own), checks them, and sends a
   done notification ``"<request_id>:<n_consumers>"`` (:func:`encode_done`) on the same NIXL
   connection. ``n_consumers`` is how many readers share the request (e.g. decode TP ranks
   reading slices of a prefill rank), so the holder learns it from the readers.
3. The holder frees the blocks when ``n_consumers`` done notifications arrived
   (:meth:`HoldTable.notify`), or when the lease runs out (:meth:`HoldTable.expire`), so a
   decode worker that died mid-handoff never pins prefill memory for longer than the lease.

A reader must not start a READ whose lease may run out before it ends (the holder would reuse
the blocks under it): :meth:`Handoff.readable` applies a safety margin for that and for clock
skew between hosts, because ``expires_at`` is the holder's wall clock.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from enum import Enum
from typing import NamedTuple

import msgspec

from data_plane.transfer.errors import HoldError, InvalidTransfer

#: Separates the request id from the consumer count; the *last* one counts, so request ids may
#: contain it.
_SEP = b":"


class DoneNotif(NamedTuple):
    request_id: str
    n_consumers: int


def encode_done(request_id: str, n_consumers: int = 1) -> bytes:
    """The notification a reader sends once it holds a verified copy of its blocks."""
    if n_consumers < 1:
        raise InvalidTransfer(f"n_consumers must be >= 1, got {n_consumers}")
    return request_id.encode() + _SEP + str(n_consumers).encode()


def parse_done(msg: bytes) -> DoneNotif | None:
    """Inverse of :func:`encode_done`; None for anything else (a peer may send other notifs)."""
    request_id, sep, count = msg.rpartition(_SEP)
    if not sep or not request_id or not count.isdigit() or int(count) < 1:
        return None
    try:
        return DoneNotif(request_id.decode(), int(count))
    except UnicodeDecodeError:
        return None


class ReleaseReason(str, Enum):
    #: Every consumer sent its done notification.
    CONSUMED = "consumed"
    #: The lease ran out first (a consumer died or never came).
    EXPIRED = "expired"
    #: The holder let go itself (request aborted, worker draining).
    RELEASED = "released"


class Hold(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    block_ids: tuple[int, ...]
    held_at: float
    expires_at: float
    #: Done notifications received so far.
    notified: int = 0


class Released(msgspec.Struct, frozen=True, kw_only=True):
    """A decision to free blocks, and why. The caller returns ``block_ids`` to its pool."""

    request_id: str
    block_ids: tuple[int, ...]
    reason: ReleaseReason
    #: How long the blocks were held, in the caller's clock.
    held_s: float


class HoldTable:
    """Blocks held for pending handoffs, keyed by request id.

    Invariants: a request is held at most once at a time; every hold leaves the table exactly
    once, through :meth:`notify`, :meth:`release` or :meth:`expire`, and that call returns its
    blocks. Two requests may hold the same block id (shared prefix blocks): the engine's block
    pool ref-counts them, the table only reports what each request held.
    """

    def __init__(self) -> None:
        self._holds: dict[str, Hold] = {}
        # (expires_at, generation, request_id); entries for holds already gone are skipped.
        self._deadlines: list[tuple[float, int, str]] = []
        self._generation: dict[str, int] = {}
        self._next_generation = 0

    def __len__(self) -> int:
        return len(self._holds)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._holds

    def get(self, request_id: str) -> Hold | None:
        return self._holds.get(request_id)

    def held_blocks(self) -> int:
        """Block ids held, counted once per request (shared blocks count once per holder)."""
        return sum(len(h.block_ids) for h in self._holds.values())

    def next_expiry(self) -> float | None:
        """When the earliest lease runs out, so a worker loop can sleep until then."""
        self._drop_stale_deadlines()
        return self._deadlines[0][0] if self._deadlines else None

    def hold(self, request_id: str, block_ids: Iterable[int], now: float, ttl: float) -> Hold:
        if ttl <= 0:
            raise HoldError(f"a lease needs ttl > 0, got {ttl}")
        if request_id in self._holds:
            raise HoldError(f"request {request_id!r} is already held")
        hold = Hold(
            request_id=request_id, block_ids=tuple(block_ids), held_at=now, expires_at=now + ttl
        )
        self._holds[request_id] = hold
        generation = self._next_generation
        self._next_generation += 1
        self._generation[request_id] = generation
        heapq.heappush(self._deadlines, (hold.expires_at, generation, request_id))
        return hold

    def notify(self, request_id: str, n_consumers: int, now: float) -> Released | None:
        """Count one done notification; free the blocks on the ``n_consumers``-th.

        None when the request is not held (already expired or released: a late reader) or when
        more consumers are still due.
        """
        hold = self._holds.get(request_id)
        if hold is None:
            return None
        notified = hold.notified + 1
        if notified < n_consumers:
            self._holds[request_id] = msgspec.structs.replace(hold, notified=notified)
            return None
        return self._pop(request_id, ReleaseReason.CONSUMED, now)

    def release(self, request_id: str, now: float) -> Released | None:
        """Let go without waiting (abort, drain). None if the request is not held."""
        if request_id not in self._holds:
            return None
        return self._pop(request_id, ReleaseReason.RELEASED, now)

    def expire(self, now: float) -> list[Released]:
        """Free every hold whose lease ran out (``expires_at <= now``), earliest first."""
        released: list[Released] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, generation, request_id = heapq.heappop(self._deadlines)
            if self._generation.get(request_id) == generation:
                released.append(self._pop(request_id, ReleaseReason.EXPIRED, now))
        return released

    def _pop(self, request_id: str, reason: ReleaseReason, now: float) -> Released:
        hold = self._holds.pop(request_id)
        del self._generation[request_id]
        return Released(
            request_id=request_id,
            block_ids=hold.block_ids,
            reason=reason,
            held_s=now - hold.held_at,
        )

    def _drop_stale_deadlines(self) -> None:
        while (
            self._deadlines and self._generation.get(self._deadlines[0][2]) != self._deadlines[0][1]
        ):
            heapq.heappop(self._deadlines)


class Handoff(msgspec.Struct, frozen=True, kw_only=True):
    """What a holder tells readers about one request's blocks.

    Carried in ``PrefillCompleted.kv_transfer_params`` (see :meth:`to_params`); the holder's
    endpoint metadata itself comes from its ``WorkerRegistered`` event, found by ``agent_name``.
    """

    request_id: str
    agent_name: str
    block_ids: list[int]
    #: The holder's wall clock (seconds since the epoch) when it frees the blocks unread.
    expires_at: float

    def readable(self, now: float, margin_s: float) -> bool:
        """Whether a READ started at ``now`` and taking up to ``margin_s`` (plus clock skew)
        ends before the lease does."""
        return now + margin_s < self.expires_at

    def to_params(self) -> dict[str, str | int | float | bool | list[int] | None]:
        return {
            "remote_request_id": self.request_id,
            "remote_agent": self.agent_name,
            "remote_block_ids": list(self.block_ids),
            "expires_at": self.expires_at,
        }

    @classmethod
    def from_params(cls, params: dict[str, object]) -> Handoff:
        try:
            return msgspec.convert(
                {
                    "request_id": params["remote_request_id"],
                    "agent_name": params["remote_agent"],
                    "block_ids": params["remote_block_ids"],
                    "expires_at": params["expires_at"],
                },
                cls,
            )
        except (KeyError, msgspec.ValidationError) as exc:
            raise InvalidTransfer(f"kv_transfer_params carry no valid handoff: {exc!r}") from exc
