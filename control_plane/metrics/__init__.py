"""Event-derived metrics: every number here is a fold of the log.

* :mod:`control_plane.metrics.catalog`: every metric's name, type, labels and buckets (pure).
* :mod:`control_plane.metrics.projection`: the fold of enveloped events into those metrics
  (pure: no Kafka, no HTTP, no clock; ``now`` is passed in where a gauge needs it).
  Beside it, pure too: :mod:`~control_plane.metrics.state` (what its snapshot keeps),
  :mod:`~control_plane.metrics.gauges` (the gauges read from that state),
  :mod:`~control_plane.metrics.families` (the read shapes and the processor's own families),
  :mod:`~control_plane.metrics.labels` (bounded label values).
* :mod:`control_plane.metrics.exposition`: the projection as a prometheus_client collector on a
  registry of its own.

The Faust stream processor that feeds the projection from the broker and serves ``/metrics`` is
:mod:`control_plane.metrics.stream`.
"""
