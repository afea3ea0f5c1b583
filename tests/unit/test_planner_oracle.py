"""The planner oracle's schedule (benchmarks/planner_oracle.py): pure arithmetic, no simulation."""

from __future__ import annotations

from benchmarks.planner_bench import planner_config
from benchmarks.planner_oracle import WindowNeed, oracle_schedule


def _needs(pairs):
    return [WindowNeed(10.0 * k, p, d, 100) for k, (p, d) in enumerate(pairs)]


def test_orders_come_one_start_up_ahead_and_go_after_the_hold():
    """10 s windows, 30 s start-up: the order at window k is the most any window k..k+3 wants.
    Needs (prefill) 1, 1, 1, 1, 4.2, 4.2, 1, 1, 1 at factor 1 -> wanted 1, 1, 1, 1, 5, 5, 1, 1, 1:
    the 5 is ordered at window 1 (10 s: windows 1-4 include window 4), ready at 40 s, when window
    4 starts; it goes at window 6 (60 s) with no hold, at window 9 with a 30 s hold (windows 6-8
    still see window 5 within 30 s back)."""
    cfg = planner_config(12, 2000.0, 25.0, "kalman")
    needs = _needs([(1, 1)] * 4 + [(4.2, 1)] * 2 + [(1, 1)] * 6)
    start, sched = oracle_schedule(needs, cfg, factor=1.0, hold_s=0.0, startup_s=30.0, window_s=10.0)
    assert start == (1, 1)
    assert sched == [(10.0, "prefill", 5), (60.0, "prefill", 1)]
    _, held = oracle_schedule(needs, cfg, factor=1.0, hold_s=30.0, startup_s=30.0, window_s=10.0)
    assert held == [(10.0, "prefill", 5), (90.0, "prefill", 1)]


def test_over_the_budget_the_pools_share_it_in_proportion_and_blind_holds_a_fleet():
    """Wanted 9 prefill + 6 decode of 12 GPUs: 12 * 9 / 15 = 7.2 -> 7 prefill, 5 decode. The causal
    bound's blind fleet (3, 3) stands until 20 s, then the oracle's orders follow."""
    cfg = planner_config(12, 2000.0, 25.0, "kalman")
    needs = _needs([(9, 6)] * 6)
    start, sched = oracle_schedule(needs, cfg, factor=1.0, hold_s=0.0, startup_s=30.0, window_s=10.0)
    assert start == (7, 5) and sched == []
    start, sched = oracle_schedule(needs, cfg, factor=1.0, hold_s=0.0, startup_s=30.0, window_s=10.0,
                                   blind=(3, 3), blind_until_s=20.0)
    assert start == (3, 3)
    assert sched == [(20.0, "prefill", 7), (20.0, "decode", 5)]
