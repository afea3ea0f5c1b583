"""Seeded workload families in the Mooncake trace format, their statistics, and the tune/score
case sets the benchmarks share (``docs/workloads.md``).

    from workloads import Spec, generate, trace_stats
    records = generate(Spec("agentic", seed=1, duration_s=600))
    print(trace_stats(records).result_line())

The names below load their module on first use, so ``switchyard --help`` (which registers the
``workload`` commands) does not import numpy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ARRIVALS": "workloads.arrivals",
    "FAMILY_NAMES": "workloads.generator", "Spec": "workloads.generator", "default_rate": "workloads.generator",
    "dumps": "workloads.generator", "generate": "workloads.generator", "record_json": "workloads.generator",
    "write": "workloads.generator",
    "SCORE_SET": "workloads.sets", "TUNE_SET": "workloads.sets", "Case": "workloads.sets",
    "case_records": "workloads.sets", "check_apart": "workloads.sets", "parse_cases": "workloads.sets",
    "score_summary": "workloads.sets", "ScoreSummary": "workloads.sets",
    "TraceStats": "workloads.stats", "ideal_hit_rate": "workloads.stats",
    "shared_block_fraction": "workloads.stats", "trace_stats": "workloads.stats",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from workloads.arrivals import ARRIVALS
    from workloads.generator import FAMILY_NAMES, Spec, default_rate, dumps, generate, record_json, write
    from workloads.sets import (SCORE_SET, TUNE_SET, Case, ScoreSummary, case_records, check_apart, parse_cases,
                                score_summary)
    from workloads.stats import TraceStats, ideal_hit_rate, shared_block_fraction, trace_stats


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'workloads' has no attribute {name!r}")
    return getattr(importlib.import_module(mod), name)
