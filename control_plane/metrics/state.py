"""The metrics fold's state that survives a snapshot: msgspec structs, encoded with msgpack by
:meth:`~control_plane.metrics.projection.MetricsProjection.snapshot` (field names and order are
the snapshot's format: add fields with defaults, never rename)."""

from __future__ import annotations

import msgspec

from control_plane.metrics.catalog import MetricSpec
from control_plane.metrics.families import HistogramValue
from common.fleet import Lifecycle

SNAPSHOT_FORMAT = 1



class WorkerState(msgspec.Struct, kw_only=True):
    worker_id: str
    epoch: int
    pool: str
    role: str
    state: str = "ready"  # ready | draining | gone
    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    tier_usage: dict[str, float] = {}


class PoolState(msgspec.Struct, kw_only=True):
    ttft_slo_ms: float | None = None
    itl_slo_ms: float | None = None
    min_replicas: int | None = None
    max_replicas: int | None = None
    pinned: int | None = None
    applied: int | None = None
    #: role -> replicas the latest ScalingDecision asked for.
    target: dict[str, int] = {}


class Pending(msgspec.Struct, array_like=True):
    endpoint: str
    prompt_tokens: int
    prompt_blocks: int
    block_size: int
    admitted_ns: int
    #: The requests partition it was admitted on (-1: restored from a snapshot without it).
    partition: int = -1


#: Histogram sums are integers in units of 2^-30 (about a nanosecond for seconds): integer
#: addition is associative, so a sum does not depend on the order values were folded in.
SUM_SCALE = 2**30


class Hist(msgspec.Struct, array_like=True):
    counts: list[int]  # per bucket, not cumulative; the last is +Inf
    #: Sum of a snapshot written before ``qsum`` existed; new values go to ``qsum``.
    sum: float = 0.0
    qsum: int = 0

    @property
    def total(self) -> float:
        return self.sum + self.qsum / SUM_SCALE

    def merged(self, other: Hist) -> Hist:
        return Hist([a + b for a, b in zip(self.counts, other.counts)], self.sum + other.sum, self.qsum + other.qsum)


class Snapshot(msgspec.Struct, kw_only=True):
    format: int
    hash_algo: str
    block_size: int
    counters: list[tuple[str, list[str], float]]
    hists: list[tuple[str, list[str], Hist]]
    workers: list[WorkerState]
    pools: dict[str, PoolState]
    routers: dict[str, str]
    config_versions: dict[str, int]
    pending: list[tuple[str, Pending]]
    positions: list[tuple[str, int, int]]
    last_ts_ms: dict[str, int]
    tracker: bytes
    index: bytes
    applied: int
    #: Series keyed by worker id where the metric's pool label goes (see ``WORKER_JOINED``).
    wcounters: list[tuple[str, list[str], float]] = []
    whists: list[tuple[str, list[str], Hist]] = []
    #: worker id -> (TTFT ms, ITL ms or None) of completions not yet judged against an SLO.
    unjudged: dict[str, list[tuple[float, float | None]]] = {}
    #: router id -> (event time, event id) of the decision ``routers`` holds the state of.
    router_at: dict[str, tuple[int, str]] = {}
    #: Each worker's lifecycle (common/fleet.py); absent in snapshots written before it.
    lifecycles: dict[str, Lifecycle] = {}



def hist_value(spec: MetricSpec, h: Hist) -> HistogramValue:
    running, cumulative = 0, []
    for c in h.counts:
        running += c
        cumulative.append(running)
    return HistogramValue(spec.buckets, tuple(cumulative), h.total)
