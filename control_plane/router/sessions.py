"""Sessions: the worker of a session's previous turn, a fold of ``RequestRouted``.

A client names a session (an ``x-session-id`` header, or the OpenAI ``user`` field when its
API key opts in: ``RouterKeyIssued.session_from_user``). The router records it on each
decision (``RequestRouted.session``); this table folds those events into "session -> the
worker its last prefill-bearing phase went to, and when". The next turn of the session reads
it (``RequestRouted.session_worker`` records what it read) and the decision gives that worker a
bounded affinity that yields to predicted TTFT (``decision.py``, ``docs/sessions.md``).

Bounds, so that a client minting session ids cannot grow the router:

* **size**: at most :data:`SESSIONS_MAX` sessions, least recently routed evicted first. A
  constant of the fold, not a config knob: replay folds the same log to the same table whatever
  config it re-executes with;
* **age**: an entry older than ``RouterConfig.session_ttl_s`` at the decision's ``now`` is not
  read (the lookup's bound, so a what-if may try another age on the same fold); entries older
  than :data:`SESSION_MAX_AGE_S` are dropped when the table is touched.

Pure: the time is an input, every mutation is :meth:`SessionTable.routed` from an event.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from schemas.types import WorkerId

#: The most sessions the fold keeps (least recently routed evicted first). ~100 bytes each.
SESSIONS_MAX = 65_536
#: The oldest entry the fold keeps, whatever the config's age bound (seconds).
SESSION_MAX_AGE_S = 3_600.0
#: The longest session id recorded (longer ones are refused at the request's parsing).
SESSION_ID_MAX_LEN = 256


class SessionTable:
    """Session id -> (worker of its last routed turn, when), least recently routed first."""

    __slots__ = ("_entries", "evicted")

    def __init__(self) -> None:
        self._entries: OrderedDict[str, tuple[WorkerId, float]] = OrderedDict()
        #: Entries dropped by the size bound (for tests and metrics).
        self.evicted = 0

    def routed(self, session: str, worker: WorkerId, at_s: float) -> None:
        """Fold one routed turn: the session now sits on ``worker`` since ``at_s``."""
        entries = self._entries
        entries[session] = (worker, at_s)
        entries.move_to_end(session)
        while len(entries) > SESSIONS_MAX:
            entries.popitem(last=False)
            self.evicted += 1
        # Age: the oldest first (routed in time order), so stop at the first young one.
        horizon = at_s - SESSION_MAX_AGE_S
        while entries:
            first = next(iter(entries.values()))
            if first[1] >= horizon:
                break
            entries.popitem(last=False)

    def worker(self, session: str, now: float, ttl_s: float) -> WorkerId:
        """The worker of ``session``'s last turn if it was routed within ``ttl_s`` of ``now``,
        else ""."""
        if not session:
            return ""
        got = self._entries.get(session)
        if got is None or now - got[1] > ttl_s:
            return ""
        return got[0]

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session: object) -> bool:
        return session in self._entries


# ----------------------------------------------------------------------------------------------
# The affinity: keep the session's worker unless another is faster by the margin
# ----------------------------------------------------------------------------------------------

APPLIED = "applied"
YIELDED = "yielded"


def affinity(worker_ids: Sequence[WorkerId], competing: Sequence[int], chosen: int, predicted: Sequence[float],
             session_worker: WorkerId, margin_ms: float, margin_rel: float) -> tuple[int, int | None, str, str]:
    """The decision's choice after the session's affinity, by position in ``worker_ids``:
    (chosen, the session worker's position or None, ``APPLIED`` / ``YIELDED`` / "", the words).

    The session's worker is kept when it competes (the guards left it in) and its predicted
    TTFT is at most the chosen one's plus ``margin_ms + margin_rel x`` the chosen one's: e.g.
    chosen at 120 ms, margin 50 ms + 0.25: the session's worker is kept up to 200 ms. Else the
    decision yields to its own choice. Pure."""
    at = next((i for i, w in enumerate(worker_ids) if w == session_worker), None)
    if at is None:
        return chosen, None, "", f"session's worker {session_worker} is not a candidate"
    if at not in competing:
        return chosen, at, YIELDED, f"session affinity yielded: {session_worker} does not compete"
    if at == chosen:
        return chosen, at, APPLIED, f"session affinity: {session_worker} is also the choice"
    best, mine = predicted[chosen], predicted[at]
    limit = best + margin_ms + margin_rel * best
    said = (f"{session_worker} predicted {mine:.1f} ms against {worker_ids[chosen]} {best:.1f} ms "
            f"+ margin {margin_ms:g} ms + {margin_rel:g} x {best:.1f}")
    if mine <= limit:
        return at, at, APPLIED, f"session affinity kept {said}"
    return chosen, at, YIELDED, f"session affinity yielded: {said}"
