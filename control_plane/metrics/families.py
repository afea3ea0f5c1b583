"""What the metrics processor exposes: families of samples (the fold's, read with
:meth:`~control_plane.metrics.projection.MetricsProjection.families`, and the processor's own
from a broker probe, :func:`processor_families`). Values only; the exposition turns them into
Prometheus' registry (:mod:`control_plane.metrics.exposition`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from control_plane.metrics.catalog import BY_NAME, EVENT_STREAMS, MetricSpec

Labels = tuple[str, ...]
#: Metrics the processor knows beyond the fold: broker probes and its own errors
#: (see :func:`processor_families`).
PROCESSOR_METRICS = frozenset({"switchyard_metrics_lag_records", "switchyard_log_end_offset",
                               "switchyard_consumer_group_lag_records", "switchyard_consumer_group_members",
                               "switchyard_metrics_fold_errors_total"})


@dataclass(frozen=True)
class HistogramValue:
    """One histogram series: cumulative counts per bucket (the last one is ``+Inf``) and sum."""

    bounds: tuple[float, ...]
    cumulative: tuple[int, ...]
    sum: float

    @property
    def count(self) -> int:
        return self.cumulative[-1]


@dataclass(frozen=True)
class Family:
    """A metric and its samples: ``{labels: value}`` (a HistogramValue for histograms)."""

    spec: MetricSpec
    samples: dict[Labels, float | HistogramValue] = field(default_factory=dict)


@dataclass(frozen=True)
class BrokerState:
    """What a broker probe saw (the processor's adapter fills it; tests build it by hand)."""

    #: (stream, partition) -> high watermark (the offset the next record will get).
    end_offsets: dict[tuple[str, int], int] = field(default_factory=dict)
    #: group id -> member count.
    group_members: dict[str, int] = field(default_factory=dict)
    #: group id -> {(stream, partition): committed offset}; partitions never committed absent.
    group_offsets: dict[str, dict[tuple[str, int], int]] = field(default_factory=dict)


def lag(positions: dict[tuple[str, int], int], end_offsets: dict[tuple[str, int], int]) -> dict[tuple[str, int], int]:
    """Records behind the log end per partition (never negative: a probe may be older than the
    position)."""
    return {tp: max(end - positions.get(tp, 0), 0) for tp, end in end_offsets.items()}


def processor_families(broker: BrokerState, positions: dict[tuple[str, int], int],
                       fold_errors: int = 0) -> list[Family]:
    """What the processor knows beyond the fold: its own lag (its positions against the high
    watermarks), the log end offsets, every consumer group's committed lag and members, and how
    many records its fold failed on."""
    own = {tp: end for tp, end in broker.end_offsets.items() if tp[0] in (*EVENT_STREAMS, "deadletter")}
    lag_s = {(s, str(p)): float(n) for (s, p), n in lag(positions, own).items()}
    ends = {(s, str(p)): float(end) for (s, p), end in broker.end_offsets.items()}
    group_lag: dict[Labels, float] = {}
    for group, committed in broker.group_offsets.items():
        for (s, p), off in committed.items():
            end = broker.end_offsets.get((s, p))
            if end is not None and off >= 0:
                group_lag[(group, s, str(p))] = float(max(end - off, 0))
    members = {(g,): float(n) for g, n in broker.group_members.items()}
    return [Family(BY_NAME["switchyard_metrics_lag_records"], lag_s),
            Family(BY_NAME["switchyard_log_end_offset"], ends),
            Family(BY_NAME["switchyard_consumer_group_lag_records"], group_lag),
            Family(BY_NAME["switchyard_consumer_group_members"], members),
            Family(BY_NAME["switchyard_metrics_fold_errors_total"], {(): float(fold_errors)})]
