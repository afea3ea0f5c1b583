"""A view whose fold stopped while the log moved says so (issue 36, item 1): common/log/progress.py."""

from __future__ import annotations

from control_plane.router.health import assess
from common.log.progress import ProgressWatch, behind

TP = ("t.kv", 0)


def test_a_fold_at_the_log_end_is_following_however_long_nothing_arrives() -> None:
    w = ProgressWatch(stall_after_s=10)
    for now in range(0, 100, 5):
        assert w.observe(now, 7, {TP: 7}, {TP: 7}) is None


def test_a_fold_behind_a_moving_log_that_applies_nothing_is_stopped_after_the_window() -> None:
    """Applied stands at 7 while the log end goes 7 -> 9 -> 12: at 10 s without progress, stopped."""
    w = ProgressWatch(stall_after_s=10)
    assert w.observe(0, 7, {TP: 7}, {TP: 7}) is None
    assert w.observe(5, 7, {TP: 7}, {TP: 9}) is None
    why = w.observe(10, 7, {TP: 7}, {TP: 12})
    assert why is not None and "5 records behind" in why
    assert w.observe(12, 8, {TP: 8}, {TP: 12}) is None  # it moved again


def test_a_partition_never_handed_to_the_fold_counts_whole() -> None:
    assert behind({TP: 3}, {TP: 3, ("t.kv", 1): 40}) == 40


def test_a_stopped_fold_degrades_the_router_view_whatever_its_own_lag_says() -> None:
    """Before: the consumer that lost its partitions saw no new high watermark, so lag 0 read EXACT."""
    assert assess({TP: 5}, {TP: 5}, {}, [], 0.0, True).state == "EXACT"
    h = assess({TP: 5}, {TP: 5}, {}, [], 0.0, True, stopped="the fold stopped")
    assert h.state == "DEGRADED" and "the fold stopped" in h.reasons
