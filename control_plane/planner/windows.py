"""The planner's event-time windows: per pool, one accumulator per hopping step, and the
statistics a window answers.

Windows are keyed by *event time* (the envelope's ``at``): every pool keeps one
:class:`Accumulator` per ``bucket_s`` (the hopping step). A tumbling window is
``tumbling_s / bucket_s`` consecutive buckets, a hopping window ``hopping_s / bucket_s``; a window
is *closed* once ``now`` passes its end plus ``grace_s`` (events may arrive that late across
partitions). Percentiles come from mergeable log-bucket histograms (2% relative resolution) with
exact integer sums, so windows merge exactly and the fold (``load_view.py``) is
order-independent within a window. Goodput counts completions that met the pool's
:class:`PoolSlo`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec

NS = 1_000_000_000

# ----------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PoolSlo:
    """Latency targets a pool's completions are judged against (None: not judged)."""

    ttft_ms: float | None = None
    itl_ms: float | None = None

    def met(self, ttft_ms: float | None, itl_ms: float | None) -> bool:
        if self.ttft_ms is not None and ttft_ms is not None and ttft_ms > self.ttft_ms:
            return False
        if self.itl_ms is not None and itl_ms is not None and itl_ms > self.itl_ms:
            return False
        return True


@dataclass(frozen=True, slots=True)
class LoadViewConfig:
    """Window geometry and judgement rules of a :class:`LoadView`."""

    #: Tumbling window length (the planner's observation interval).
    tumbling_s: float = 10.0
    #: Hopping window length and step; the step is the accumulator bucket.
    hopping_s: float = 60.0
    hop_step_s: float = 10.0
    #: A window closes this long after its end (late events across partitions).
    grace_s: float = 1.0
    #: Buckets older than this behind the newest event are dropped.
    retention_s: float = 900.0
    #: Completions on a worker ready for less than this are left out of the steady latency.
    warmup_s: float = 0.0
    #: A ready worker silent this long counts as stale, not ready.
    stale_after_s: float = 15.0
    #: Requests whose join state is older than this (no completion seen) are forgotten.
    request_ttl_s: float = 600.0
    #: SLO per pool; pools not listed use ``default_slo``.
    slos: Mapping[str, PoolSlo] = field(default_factory=dict)
    default_slo: PoolSlo = PoolSlo()

    def __post_init__(self) -> None:
        step = self.hop_step_s
        for name in ("tumbling_s", "hopping_s"):
            v = getattr(self, name)
            if step <= 0 or v <= 0 or abs(v / step - round(v / step)) > 1e-9:
                raise ValueError(f"{name}={v} must be a positive multiple of hop_step_s={step}: windows are "
                                 "unions of step-sized buckets, so that every window merges exactly")
        if self.retention_s < max(self.tumbling_s, self.hopping_s) + self.grace_s:
            raise ValueError("retention_s must cover the longest window plus the grace period, else a "
                             "window could close with some of its buckets already dropped")

    @property
    def bucket_ns(self) -> int:
        return int(round(self.hop_step_s * NS))

    def slo(self, pool: str) -> PoolSlo:
        return self.slos.get(pool, self.default_slo)


# ----------------------------------------------------------------------------------------------
# Histogram (mergeable, deterministic)
# ----------------------------------------------------------------------------------------------

_LOG_STEP = math.log1p(0.02)
_ZERO = -(10**6)


#: Sums are kept as integers in these fixed-point units (value * 2^30, square * 2^8): integer
#: addition is associative, so a sum does not depend on the order the values were folded in
#: (float addition is not: two interleavings would differ in the last bits).
_SUM_SCALE = 2**30
_SQ_SCALE = 2**8


class Histogram(msgspec.Struct, kw_only=True):
    """Log-bucket histogram: bucket ``b`` holds values in ``[(1.02)^b, (1.02)^(b+1))``; values
    <= 0 share one bucket. Quantiles answer the bucket's geometric middle (<= 1% off). The sum
    and the sum of squares are exact fixed-point integers (see ``_SUM_SCALE``)."""

    counts: dict[int, int] = {}
    n: int = 0
    total_q: int = 0
    total_sq_q: int = 0

    def add(self, x: float) -> None:
        b = _ZERO if x <= 0 else math.floor(math.log(x) / _LOG_STEP)
        self.counts[b] = self.counts.get(b, 0) + 1
        self.n += 1
        self.total_q += round(x * _SUM_SCALE)
        self.total_sq_q += round(x * x * _SQ_SCALE)

    def merge(self, other: Histogram) -> None:
        for b, c in other.counts.items():
            self.counts[b] = self.counts.get(b, 0) + c
        self.n += other.n
        self.total_q += other.total_q
        self.total_sq_q += other.total_sq_q

    @property
    def total(self) -> float:
        return self.total_q / _SUM_SCALE

    @property
    def mean(self) -> float | None:
        return self.total_q / _SUM_SCALE / self.n if self.n else None

    @property
    def sd(self) -> float | None:
        """Population standard deviation (from the sums, not the buckets)."""
        if not self.n:
            return None
        m = self.total_q / _SUM_SCALE / self.n
        return math.sqrt(max(self.total_sq_q / _SQ_SCALE / self.n - m * m, 0.0))

    def quantile(self, q: float) -> float | None:
        """Nearest-rank quantile (rank ``ceil(q*n)``)."""
        if not self.n:
            return None
        rank = max(1, math.ceil(q * self.n))
        seen = 0
        for b in sorted(self.counts):
            seen += self.counts[b]
            if seen >= rank:
                return 0.0 if b == _ZERO else math.exp((b + 0.5) * _LOG_STEP)
        return None  # unreachable: counts sum to n


class Accumulator(msgspec.Struct, kw_only=True):
    """One pool's accumulator for one bucket (one hopping step)."""

    arrivals: int = 0
    isl: Histogram = msgspec.field(default_factory=Histogram)
    completions: int = 0
    good: int = 0
    failures: int = 0
    osl: Histogram = msgspec.field(default_factory=Histogram)
    ttft: Histogram = msgspec.field(default_factory=Histogram)
    itl: Histogram = msgspec.field(default_factory=Histogram)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    #: Completions that may count as steady, sorted: (event time, worker, TTFT, ITL), -1.0 for
    #: a latency not attributed here. Whether the worker was warmed up at that time is decided
    #: when a window is read (its first load report may be folded after the completion).
    steady: list[tuple[int, str, float, float]] = []

    def merge(self, o: Accumulator) -> None:
        self.arrivals += o.arrivals
        self.isl.merge(o.isl)
        self.completions += o.completions
        self.good += o.good
        self.failures += o.failures
        self.osl.merge(o.osl)
        self.ttft.merge(o.ttft)
        self.itl.merge(o.itl)
        self.prompt_tokens += o.prompt_tokens
        self.cached_tokens += o.cached_tokens
        # ``steady`` is not merged: LoadView.window sums it per bucket (``_steady_sums``).


# ----------------------------------------------------------------------------------------------
# What a window answers (immutable)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Percentiles:
    p50: float | None = None
    p95: float | None = None
    p99: float | None = None


@dataclass(frozen=True, slots=True)
class WindowStats:
    """Aggregates of one pool over one event-time window ``[start_ns, end_ns)``."""

    start_ns: int
    end_ns: int
    arrivals: int = 0
    isl_mean: float | None = None
    isl_sd: float | None = None
    isl: Percentiles = Percentiles()
    completions: int = 0
    osl_mean: float | None = None
    osl_sd: float | None = None
    osl: Percentiles = Percentiles()
    ttft_mean: float | None = None
    ttft: Percentiles = Percentiles()
    itl_mean: float | None = None
    itl: Percentiles = Percentiles()
    #: Completions that met the pool's SLO, and failures (never good).
    good: int = 0
    failures: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    #: Mean latencies over completions on warmed-up workers only (None: no such completion).
    steady_ttft_mean: float | None = None
    steady_itl_mean: float | None = None
    steady_samples: int = 0

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / NS

    @property
    def arrival_rate(self) -> float:
        return self.arrivals / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def goodput(self) -> float:
        """Good completions per second."""
        return self.good / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def slo_attainment(self) -> float | None:
        judged = self.completions + self.failures
        return self.good / judged if judged else None

    @property
    def prefix_hit_rate(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


def _pct(h: Histogram) -> Percentiles:
    return Percentiles(h.quantile(0.50), h.quantile(0.95), h.quantile(0.99))


def window_stats(a: Accumulator, start_ns: int, end_ns: int, nttft: int, sttft: int, nitl: int, sitl: int) -> WindowStats:
    return WindowStats(
        start_ns=start_ns, end_ns=end_ns, arrivals=a.arrivals, isl_mean=a.isl.mean, isl_sd=a.isl.sd,
        isl=_pct(a.isl), completions=a.completions, osl_mean=a.osl.mean, osl_sd=a.osl.sd, osl=_pct(a.osl), ttft_mean=a.ttft.mean,
        ttft=_pct(a.ttft), itl_mean=a.itl.mean, itl=_pct(a.itl), good=a.good, failures=a.failures,
        prompt_tokens=a.prompt_tokens, cached_tokens=a.cached_tokens,
        steady_ttft_mean=sttft / _SUM_SCALE / nttft if nttft else None,
        steady_itl_mean=sitl / _SUM_SCALE / nitl if nitl else None,
        steady_samples=max(nttft, nitl))
