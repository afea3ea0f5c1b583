"""The projection as a prometheus_client collector, on a registry of its own (no globals).

Values are read at scrape time from whatever ``source`` returns, so a scrape always sees one
consistent state of the fold (the processor calls it on the event loop that folds).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from control_plane.metrics.catalog import Kind
from control_plane.metrics.families import Family, HistogramValue


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))


def to_metrics(families: Iterable[Family]) -> list[Metric]:
    out: list[Metric] = []
    for f in families:
        spec, labels = f.spec, list(f.spec.labels)
        if spec.kind is Kind.COUNTER:
            m = CounterMetricFamily(spec.name, spec.help, labels=labels)
            for lv, v in sorted(f.samples.items()):
                m.add_metric(list(lv), float(v))  # type: ignore[arg-type]
        elif spec.kind is Kind.GAUGE:
            m = GaugeMetricFamily(spec.name, spec.help, labels=labels)
            for lv, v in sorted(f.samples.items()):
                m.add_metric(list(lv), float(v))  # type: ignore[arg-type]
        else:
            m = HistogramMetricFamily(spec.name, spec.help, labels=labels)
            for lv, h in sorted(f.samples.items()):
                assert isinstance(h, HistogramValue)
                buckets = [(_le(b), c) for b, c in zip((*h.bounds, math.inf), h.cumulative)]
                m.add_metric(list(lv), buckets, h.sum)
        out.append(m)
    return out


class FamiliesCollector:
    """A custom collector: ``source()`` returns the families to expose."""

    def __init__(self, source: Callable[[], Iterable[Family]]) -> None:
        self._source = source

    def collect(self) -> Iterable[Metric]:
        return to_metrics(self._source())


def build_registry(source: Callable[[], Iterable[Family]]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FamiliesCollector(source))
    return registry


def write_targets(targets_dir: Path, name: str, targets: list[str], labels: dict[str, str] | None = None) -> Path:
    """Write one file_sd file ``<targets_dir>/<name>.json`` atomically (Prometheus watches the
    directory: a half-written file would drop the targets until the next write).

    ``name`` must start with the job's glob: ``metrics``, ``router`` or ``worker``."""
    if not name.startswith(("metrics", "router", "worker")):
        raise ValueError(f"target file {name!r} matches no scrape job (metrics*, router*, worker*)")
    targets_dir.mkdir(parents=True, exist_ok=True)
    path = targets_dir / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps([{"targets": list(targets), "labels": dict(labels or {})}], indent=2) + "\n")
    os.replace(tmp, path)
    return path
