"""When to stop calling a KV tier that does not answer, and when to try it again. Pure: the
time is an argument, never a clock read.

An unavailable object store costs each call the client's timeouts (``S3Settings``:
``connect_timeout_s`` per attempt, ``max_attempts`` attempts), and the KVBM makes its calls
under its one lock: without a breaker every demotion into the tier and every onboard from it
waits that long, and so does everything queued behind the lock. So, per tier:

* **closed** (the tier answers): every call goes through;
* a call fails with ``TierUnavailable``: **open** for ``backoff_s``. Calls meanwhile are not
  made: they fail at once as unavailable (a demotion is dropped from the tier above, a read
  recomputes and keeps its claim, a delete leaves an orphan the next rebuild removes), counted
  as skipped;
* once the backoff is over, the next call is the **probe**: it goes through. An answer closes
  the breaker; another failure opens it again for twice the backoff, up to ``max_backoff_s``.

Calls are serialised by the KVBM's lock, so at most one probe is ever in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from data_plane.kvbm.errors import KvbmConfigError
from schemas.types import Tier


@dataclass(frozen=True)
class BreakerConfig:
    """How long an unavailable tier is skipped."""

    #: Skip the tier this long after the first failure of an outage.
    backoff_s: float = 1.0
    #: Each failed probe doubles the skip, up to this.
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.backoff_s > 0 or not self.max_backoff_s >= self.backoff_s:
            raise KvbmConfigError(f"breaker backoff must be > 0 and <= its maximum, got {self}")


class Verdict(str, Enum):
    #: The tier answers: call it.
    CALL = "call"
    #: Open, backoff over: call it, the answer decides whether it closes.
    PROBE = "probe"
    #: Open: do not call, treat the tier as unavailable.
    SKIP = "skip"


@dataclass
class _Open:
    until: float
    backoff_s: float


@dataclass
class TierBreaker:
    """One breaker per tier (a tier not in ``open`` is closed)."""

    config: BreakerConfig = field(default_factory=BreakerConfig)
    open: dict[Tier, _Open] = field(default_factory=dict)

    def verdict(self, tier: Tier, now: float) -> Verdict:
        o = self.open.get(tier)
        if o is None:
            return Verdict.CALL
        return Verdict.PROBE if now >= o.until else Verdict.SKIP

    def failed(self, tier: Tier, now: float) -> float:
        """A call to ``tier`` found it unavailable: open (or reopen, doubled). Returns the
        backoff until the next probe."""
        o = self.open.get(tier)
        backoff = self.config.backoff_s if o is None else min(2 * o.backoff_s, self.config.max_backoff_s)
        self.open[tier] = _Open(now + backoff, backoff)
        return backoff

    def answered(self, tier: Tier) -> bool:
        """A call to ``tier`` got an answer: closed. True if it was open (the outage is over)."""
        return self.open.pop(tier, None) is not None

    def is_open(self, tier: Tier) -> bool:
        return tier in self.open
