"""The planner bench's workload cases (benchmarks/planner_bench.py): the burst shape, the rate a
family is scaled to, and the tune/score sets kept apart. Pure arithmetic, no simulation."""

from __future__ import annotations

import math

import pytest

from benchmarks.planner_bench import (
    PEAK_FILL,
    SCORE_SHAPES,
    TUNE_GRID,
    TUNE_SHAPES,
    base_shape,
    burst_shape,
    family_peak_rate,
    fast_kwargs,
    main,
    planner_config,
    tune,
)
from benchmarks.planner_dynamo import TUNE_BUDGET
from control_plane.planner.policy import needed_replicas
from workloads.sets import Case, case_records


def test_burst_shape_is_issue_35s_trace_shape():
    """A third of the peak for 120 s, a 60 s ramp, 60 s at the peak, 60 s down, 60 s calm."""
    s = burst_shape(3.0)
    assert s.duration_s == 360.0
    assert [s.rate(t) for t in (0, 119, 150, 180, 239, 270, 300, 359)] == [1.0, 1.0, 2.0, 3.0, 3.0, 2.0, 1.0, 1.0]
    # the causal bound's surprise: nothing before the ramp's start tells the load from a steady one
    assert s.surprise_s == 120.0 and s.rate(119.9) == s.rate(0.0)


def test_the_tune_only_burst_ramps_in_40_s_and_keeps_the_peak_s_end():
    """burst_ramp40: the same calm, peak and ramp down; the ramp up 40 s (a window or two longer
    than a 30 s start-up), the peak held 80 s. Tuned on, not scored by default."""
    s = base_shape("burst_ramp40")
    assert s.name == "burst_ramp40" and s.duration_s == 360.0 and s.surprise_s == 120.0
    assert [s.rate(t) for t in (0, 119, 140, 160, 239, 270, 300)] == pytest.approx([1 / 3, 1 / 3, 2 / 3, 1, 1, 2 / 3, 1 / 3])
    assert base_shape("burst").rate(150) == burst_shape(1.0).rate(150)
    assert "burst_ramp40" in TUNE_SHAPES and "burst_ramp40" not in SCORE_SHAPES


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


def test_both_sides_get_the_same_tuning_budget():
    """Ours tries as many points as Dynamo tries configs per target (4)."""
    assert math.prod(len(v) for v in TUNE_GRID.values()) == TUNE_BUDGET == 4


def test_the_fast_run_tunes_and_scores_apart():
    """The smoke run: one family, the tune seed for tuning, the score seed for scoring, one
    config a side."""
    from workloads.sets import check_apart

    kw = fast_kwargs()
    check_apart(kw["tune_set"], kw["score"])
    assert [c.family for c in kw["tune_set"]] == [c.family for c in kw["score"]] == ["chat"]
    assert kw["dynamo_tune_configs"] == 1 and all(len(v) == 1 for v in kw["grid"].values())
