"""Performance profiles: what one replica can serve at a latency target. Pure data + lookups.

A :class:`PerformanceProfile` is a table, like the profiling output Dynamo's planner reads: the
planner core only *looks things up* in it. :func:`derive_profile` fills the table from an engine
hardware profile (``data_plane/engines/profiles/*.toml``) by asking its timing model how long
the relevant steps take, so the planner sizes replicas with the same formulas the simulated
workers run on. A table measured on real hardware can replace it field for field.

Prefill (prefill and aggregated pools)
--------------------------------------
* ``prefill_ms[i]``: time to prefill one prompt of ``prefill_isl[i]`` new tokens alone, in
  chunks of ``max_batched_tokens`` (the isolated TTFT). Mocker: ``c2*T^2 + c1*T + c0`` per chunk,
  so 4,096 tokens take 4.209989e-7*4096^2 + 1.518344e-2*4096 + 16.50142 = 85.76 ms.
* ``prefill_tokens_per_s``: saturated throughput, one full chunk per step. Mocker:
  8,192 / 169.14 ms = 48,434 tokens/s.

:meth:`PerformanceProfile.prefill_capacity` turns that into tokens/s per replica while meeting a
TTFT target. A prompt's service time is ``S = prefill_ms(isl)``. A pool of ``k`` replicas behind
least-loaded routing queues like one M/G/k queue (measured on the mocker: 6 prefill workers at
utilisation 0.78 wait 5x less than 6 independent queues would), so the wait in front of the
prompt is Allen-Cunneen's ``Wq = C(k, k*rho) * S / (k*(1-rho)) * (1+cv^2)/2``, with ``C`` the
Erlang C probability of waiting, ``rho`` the utilisation and ``cv`` the prompt lengths'
coefficient of variation. For ``k = 1`` this is exactly Pollaczek-Khinchine's M/G/1 wait
``rho*S*(1+cv^2) / (2*(1-rho))``. A *mean* TTFT <= target needs ``Wq <= slack = target - S``;
the largest such rho, clamped to ``[min_utilization, max_utilization]``, times the saturated
throughput is the capacity. Example (mocker, ISL 4,096, cv 0, one replica, target 500 ms):
S = 85.76, slack = 414.24, rho = 2*414.24 / (85.76 + 2*414.24) = 0.906 -> capped at 0.85 ->
0.85 * 48,434 = 41,169 tokens/s per replica.

With a target *quantile* q of requests (``slo_quantile``), the wait's tail is taken as
exponential, ``P(W > t) ~ C * exp(-k*(1-rho)*t / (S*(1+cv^2)/2))``, and rho is the largest with
``P(W > slack) <= 1 - q``. Example (one replica, S = 200 ms, slack 800 ms, cv 0, q = 0.9):
``rho * exp(-8*(1-rho)) <= 0.1`` gives rho = 0.748 (0.75 gives 0.1015).

Decode (decode and aggregated pools)
------------------------------------
``decode_itl_ms[c][n]`` is the step time with ``n = decode_seqs[n]`` sequences decoding at
``decode_context[c]`` tokens of context each, i.e. the inter-token latency each of them sees.
Mocker: ``max(1, -25.74*u^2 + 54.01*u + 5.74)`` with ``u = n*context / (16,384*64)``.
:meth:`PerformanceProfile.best_decode` scans ``n`` for the highest throughput ``n / itl`` with
``itl <= target`` and ``n*context <= KV capacity``. Example (mocker, context 4,096, ITL target
20 ms): u* solves -25.74u^2 + 54.01u + 5.74 = 20 -> u* = 0.3097 -> n <= 0.3097 * 1,048,576 /
4,096 = 79.3 -> n = 79, u = 0.30859, itl = 19.956 ms -> 79 / 19.956 ms = 3,959 tokens/s per
replica.

With a quantile q the decode concurrency is taken as Poisson: a replica is planned at
``n - z_q*sqrt(n)`` sequences on average so that q of the time it runs at most ``n``. Example
(n = 79, q = 0.9, z = 1.2816): 79 - 11.4 = 67.6 sequences, throughput x 0.856.

The derived tables use powers of two and their 1.5x midpoints as grid points (exact at the usual
sizes, interpolated between them).
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from control_plane.planner.errors import ProfileLookupError


@dataclass(frozen=True, slots=True)
class PrefillCapacity:
    """Answer of :meth:`PerformanceProfile.prefill_capacity` (every number goes to the record)."""

    tokens_per_s: float
    #: Isolated prefill time of one prompt of the looked-up size.
    service_ms: float
    utilization: float
    #: The TTFT target cannot be met even by an idle replica (service time >= target).
    infeasible: bool = False


@dataclass(frozen=True, slots=True)
class DecodeCapacity:
    """Answer of :meth:`PerformanceProfile.best_decode`."""

    tokens_per_s: float
    #: Concurrent sequences per replica at that throughput.
    seqs: int
    itl_ms: float
    #: Even one sequence misses the ITL target (or does not fit the KV cache).
    infeasible: bool = False


@dataclass(frozen=True, slots=True)
class PerformanceProfile:
    """Per-replica performance table (see the module docstring for the formulas)."""

    name: str
    #: Prompt lengths (new tokens, ascending) of the prefill table.
    prefill_isl: tuple[int, ...]
    #: Isolated prefill time of one prompt of ``prefill_isl[i]`` tokens, ms.
    prefill_ms: tuple[float, ...]
    #: Saturated prefill throughput of one replica (full chunks back to back), tokens/s.
    prefill_tokens_per_s: float
    #: Context lengths (ascending) of the decode table.
    decode_context: tuple[int, ...]
    #: Concurrencies (ascending) of the decode table.
    decode_seqs: tuple[int, ...]
    #: ``decode_itl_ms[c][n]``: step time with ``decode_seqs[n]`` sequences at ``decode_context[c]``.
    decode_itl_ms: tuple[tuple[float, ...], ...]
    #: KV cache capacity of one replica in tokens (bounds the decode concurrency).
    kv_capacity_tokens: int
    #: Where the numbers come from.
    source: str = ""

    def __post_init__(self) -> None:
        if not self.prefill_isl or len(self.prefill_isl) != len(self.prefill_ms):
            raise ProfileLookupError(f"profile {self.name!r}: prefill table is empty or ragged")
        if self.prefill_tokens_per_s <= 0 or any(v <= 0 for v in self.prefill_ms):
            raise ProfileLookupError(f"profile {self.name!r}: prefill times and throughput must be > 0")
        if not self.decode_context or not self.decode_seqs:
            raise ProfileLookupError(f"profile {self.name!r}: decode table is empty")
        if len(self.decode_itl_ms) != len(self.decode_context) or any(
                len(row) != len(self.decode_seqs) for row in self.decode_itl_ms):
            raise ProfileLookupError(f"profile {self.name!r}: decode table is ragged")

    # -- prefill ----------------------------------------------------------------------------

    def prefill_time_ms(self, isl: float) -> float:
        """Isolated prefill time of ``isl`` new tokens (linear interpolation; linear
        extrapolation past the last point, proportional below the first)."""
        xs, ys = self.prefill_isl, self.prefill_ms
        if isl <= xs[0]:
            return ys[0] * max(isl, 1.0) / xs[0] if isl < xs[0] else ys[0]
        i = bisect.bisect_left(xs, isl)
        if i >= len(xs):
            i = len(xs) - 1
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (isl - x0) / (x1 - x0)

    def prefill_capacity(self, isl: float, ttft_target_ms: float, *, cv: float = 0.0, quantile: float | None = None,
                         servers: int = 1, min_utilization: float = 0.3,
                         max_utilization: float = 0.85) -> PrefillCapacity:
        """Prefill tokens/s *per replica* that a pool of ``servers`` replicas, fed by
        least-loaded routing, takes while meeting ``ttft_target_ms`` for prompts of ``isl`` new
        tokens whose lengths vary with coefficient of variation ``cv`` (M/G/k, see the module
        docstring): the mean wait fits the slack, or with ``quantile`` the wait's quantile does."""
        s = self.prefill_time_ms(max(isl, 1.0))
        slack = ttft_target_ms - s
        infeasible = slack <= 0
        if infeasible:
            # Even an idle replica misses the target: more replicas cannot fix a service time,
            # so do not buy any; keep the queue short (a quarter of the service time) instead.
            slack = 0.25 * s
        k = max(int(servers), 1)
        g = (1 + cv * cv) / 2

        def ok(rho: float) -> bool:
            c = erlang_c(k, k * rho)
            if quantile is None:
                return c * s * g / (k * (1 - rho)) <= slack  # Allen-Cunneen mean wait
            return c * math.exp(-k * (1 - rho) * slack / (s * g)) <= 1 - quantile

        lo, hi = 0.0, 1.0 - 1e-9
        for _ in range(50):  # the wait grows with rho: the largest rho that is ok
            mid = (lo + hi) / 2
            if ok(mid):
                lo = mid
            else:
                hi = mid
        rho = min(max(lo, min_utilization), max_utilization)
        return PrefillCapacity(rho * self.prefill_tokens_per_s, s, rho, infeasible=infeasible)

    # -- decode -----------------------------------------------------------------------------

    def decode_itl(self, seqs: float, context: float) -> float:
        """Inter-token latency with ``seqs`` sequences at ``context`` tokens each (interpolated
        in log-context, linear in concurrency)."""
        row = self._row(context)
        ns = self.decode_seqs
        n = min(max(seqs, ns[0]), ns[-1])
        j = bisect.bisect_left(ns, n)
        if j == 0 or ns[j] == n:
            return row[j]
        return row[j - 1] + (row[j] - row[j - 1]) * (n - ns[j - 1]) / (ns[j] - ns[j - 1])

    def best_decode(self, itl_target_ms: float, context: float, *, quantile: float | None = None) -> DecodeCapacity:
        """Highest decode throughput of one replica with ITL <= target at ``context``. With
        ``quantile``, the number of sequences in decode is taken as Poisson: the replica is
        planned at ``n - z*sqrt(n)`` sequences on average, so that ``quantile`` of the time it
        runs at most the ``n`` that still meet the target."""
        row = self._row(context)
        ctx = max(context, 1.0)
        best: DecodeCapacity | None = None
        for n, itl in zip(self.decode_seqs, row):
            if n * ctx > self.kv_capacity_tokens or itl > itl_target_ms:
                continue
            tps = n / itl * 1000.0
            if best is None or tps > best.tokens_per_s:
                best = DecodeCapacity(tps, n, itl)
        if best is None:
            itl = row[0]
            return DecodeCapacity(self.decode_seqs[0] / itl * 1000.0, self.decode_seqs[0], itl, infeasible=True)
        if quantile is not None and best.seqs > 1:
            z = _normal_quantile(quantile)
            n = best.seqs
            mean_seqs = max(n - z * math.sqrt(n), 1.0)
            best = DecodeCapacity(best.tokens_per_s * mean_seqs / n, best.seqs, best.itl_ms)
        return best

    def _row(self, context: float) -> tuple[float, ...]:
        lc = math.log(max(context, 1.0))
        logs = [math.log(max(c, 1)) for c in self.decode_context]
        if lc <= logs[0]:
            return self.decode_itl_ms[0]
        if lc >= logs[-1]:
            return self.decode_itl_ms[-1]
        i = bisect.bisect_left(logs, lc)
        w = (lc - logs[i - 1]) / (logs[i] - logs[i - 1])
        lo, hi = self.decode_itl_ms[i - 1], self.decode_itl_ms[i]
        return tuple(a + (b - a) * w for a, b in zip(lo, hi))


def erlang_c(k: int, a: float) -> float:
    """Probability that an arrival waits in an M/M/k queue with offered load ``a`` (< k)."""
    if a <= 0:
        return 0.0
    if a >= k:
        return 1.0
    term, total = 1.0, 1.0  # a^i / i!, summed for i < k
    for i in range(1, k):
        term *= a / i
        total += term
    last = term * a / k * k / (k - a)  # a^k / k! * k / (k - a)
    return last / (total + last)


def _normal_quantile(q: float) -> float:
    """Standard normal quantile."""
    from statistics import NormalDist

    return NormalDist().inv_cdf(q)


def flat_profile(*, name: str = "flat", prefill_tokens_per_s: float = 10_000.0, prefill_base_ms: float = 0.0,
                 itl_ms: float = 10.0, max_seqs: int = 100, kv_capacity_tokens: int = 10**9) -> PerformanceProfile:
    """A profile with round numbers for worked examples: prefill of ``isl`` tokens takes
    ``prefill_base_ms + isl / prefill_tokens_per_s`` seconds, saturated throughput is
    ``prefill_tokens_per_s``; every concurrency up to ``max_seqs`` decodes at ``itl_ms``
    (so one replica decodes ``max_seqs / itl_ms`` tokens/ms)."""
    isl = (1, 1_000_000)
    ms = tuple(prefill_base_ms + x / prefill_tokens_per_s * 1000.0 for x in isl)
    return PerformanceProfile(
        name=name, prefill_isl=isl, prefill_ms=ms, prefill_tokens_per_s=prefill_tokens_per_s,
        decode_context=(1, 1_000_000), decode_seqs=tuple(range(1, max_seqs + 1)),
        decode_itl_ms=((itl_ms,) * max_seqs,) * 2, kv_capacity_tokens=kv_capacity_tokens, source="flat")


def _pow2_grid(lo: int, hi: int) -> tuple[int, ...]:
    """Powers of two and their 1.5x midpoints in [lo, hi]: exact at the usual sizes."""
    out = set()
    k = 1
    while k <= hi:
        for v in (k, k + k // 2):
            if lo <= v <= hi:
                out.add(v)
        k *= 2
    return tuple(sorted(out))


def derive_from_hardware(hw, *, speedup: float = 1.0, isl_points: Sequence[int] | None = None,
                         context_points: Sequence[int] | None = None) -> PerformanceProfile:
    """Fill a table from an engine :class:`~data_plane.engines.profiles.HardwareProfile` by
    evaluating its timing model on the step shapes that matter (every time divided by
    ``speedup``, the factor a worker started with ``--speedup`` runs faster)."""
    # lazy: start-up time: loads numpy, switchyard_native, xxhash only when called
    from data_plane.engines.timing import StepShape  # pure: the timing formulas only

    cap = hw.kv_capacity_tokens
    chunk = hw.max_num_batched_tokens
    timing = hw.timing
    isls = tuple(isl_points or _pow2_grid(16, 262_144))

    def isolated_prefill(isl: int) -> float:
        done, total = 0, 0.0
        while done < isl:
            c = min(chunk, isl - done)
            total += timing.step_ms(StepShape(
                prefill_tokens=c, prefill_seqs=1, prefill_attention_pairs=c * (done + (c + 1) / 2),
                prefill_kv_tokens=done + c, kv_capacity_tokens=cap))
            done += c
        return total / speedup

    full = timing.step_ms(StepShape(prefill_tokens=chunk, prefill_seqs=1,
                                    prefill_attention_pairs=chunk * (chunk + 1) / 2,
                                    prefill_kv_tokens=chunk, kv_capacity_tokens=cap)) / speedup
    ctxs = tuple(context_points or _pow2_grid(64, 262_144))
    seqs = tuple(range(1, hw.max_num_seqs + 1))
    itl = tuple(
        tuple(timing.step_ms(StepShape(decode_seqs=n, decode_context_tokens=n * c, kv_capacity_tokens=cap)) / speedup
              for n in seqs)
        for c in ctxs)
    return PerformanceProfile(
        name=f"{hw.name}" + (f"@x{speedup:g}" if speedup != 1.0 else ""),
        prefill_isl=isls, prefill_ms=tuple(isolated_prefill(i) for i in isls),
        prefill_tokens_per_s=chunk / full * 1000.0,
        decode_context=ctxs, decode_seqs=seqs, decode_itl_ms=itl, kv_capacity_tokens=cap,
        source=f"derived from engine profile {hw.name} (timing model, speedup {speedup:g})")


@functools.lru_cache(maxsize=32)
def derive_profile(name_or_path: str, speedup: float = 1.0) -> PerformanceProfile:
    """The table for a shipped engine profile name (``mocker``, ``h100_llama3_8b``) or a TOML
    path. Reads the profile file (config-load time, never inside the decision core)."""
    # lazy: start-up time: loads numpy, switchyard_native, xxhash only when called
    from data_plane.engines.profiles import load_profile

    return derive_from_hardware(load_profile(name_or_path if not Path(name_or_path).suffix else Path(name_or_path)),
                                speedup=speedup)
