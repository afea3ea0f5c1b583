"""The planner bench's workload cases (benchmarks/planner_bench.py): the burst shape, the rate a
family is scaled to, and the tune/score sets kept apart. Pure arithmetic, no simulation."""

from __future__ import annotations

import pytest

from benchmarks.planner_bench import PEAK_FILL, burst_shape, family_peak_rate, main, planner_config, tune
from control_plane.planner.policy import needed_replicas
from workloads.sets import Case, case_records


def test_burst_shape_is_issue_35s_trace_shape():
    """A third of the peak for 120 s, a 60 s ramp, 60 s at the peak, 60 s down, 60 s calm."""
    s = burst_shape(3.0)
    assert s.duration_s == 360.0
    assert [s.rate(t) for t in (0, 119, 150, 180, 239, 270, 300, 359)] == [1.0, 1.0, 2.0, 3.0, 3.0, 2.0, 1.0, 1.0]


def test_family_peak_rate_needs_the_stated_share_of_the_budget():
    """At the returned rate the planner's model needs PEAK_FILL (75%) of the 12 GPUs, prefill and
    decode together, for the family's mean lengths and ideal round-robin hit rate."""
    from workloads.stats import ideal_hit_rate

    cfg = planner_config(12, 2000.0, 25.0, "kalman")
    recs = case_records(Case("agentic", 1), duration_s=120.0)
    r = family_peak_rate(recs, cfg)
    isl = [x.input_length for x in recs]
    m = sum(isl) / len(isl)
    cv = (sum(x * x for x in isl) / len(isl) - m * m) ** 0.5 / m
    osl = sum(x.output_length for x in recs) / len(recs)
    hit = ideal_hit_rate(recs, 8)
    need = (needed_replicas(cfg.pool("prefill"), cfg, r, m, osl, hit, isl_cv=cv)
            + needed_replicas(cfg.pool("decode"), cfg, r, m, osl, hit))
    assert need == pytest.approx(PEAK_FILL * 12, rel=1e-3)


def test_scoring_on_a_tune_case_and_tuning_on_a_score_case_are_refused():
    with pytest.raises(ValueError, match="share chat:1"):
        main(None, shapes=[], score=(Case("chat", 1),), dynamo=False)
    with pytest.raises(ValueError, match="share chat:2"):
        tune((Case("chat", 2),))
