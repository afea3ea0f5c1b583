"""SequenceTracker: the dedupe/gap logic every consumer relies on. Pure, no broker."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from common.log.sequencing import SequenceTracker, Verdict

S = "sy.kv:0"


def test_in_order_then_redelivery_is_duplicate() -> None:
    t = SequenceTracker()
    assert [t.observe(S, "w1", 1, s).verdict for s in (0, 1, 2)] == [Verdict.NEW] * 3
    assert t.observe(S, "w1", 1, 1).verdict is Verdict.DUPLICATE
    assert t.duplicates == 1


def test_gap_is_reported_once_with_its_range_and_fills_in() -> None:
    """0, 1 then 5: seqs 2..4 are missing. A later 3 fills part of the hole, no new gap."""
    t = SequenceTracker()
    t.observe(S, "w1", 1, 0)
    t.observe(S, "w1", 1, 1)
    obs = t.observe(S, "w1", 1, 5)
    assert obs.accepted and obs.gap == (2, 4)
    assert t.observe(S, "w1", 1, 3).gap is None
    assert t.outstanding_gaps() == {(S, "w1"): [(2, 2), (4, 4)]}
    t.observe(S, "w1", 1, 2)
    t.observe(S, "w1", 1, 4)
    assert t.outstanding_gaps() == {}
    assert t.position(S, "w1") == (1, 5)


def test_new_epoch_resets_and_old_epoch_is_fenced() -> None:
    t = SequenceTracker()
    t.observe(S, "w1", 1, 0)
    t.observe(S, "w1", 1, 1)
    obs = t.observe(S, "w1", 2, 0)
    assert obs.accepted and obs.new_epoch and obs.previous_epoch == 1
    assert t.observe(S, "w1", 1, 2).verdict is Verdict.STALE_EPOCH
    assert t.observe(S, "w1", 2, 0).verdict is Verdict.DUPLICATE


def test_first_event_mid_stream_is_not_a_gap() -> None:
    """A consumer that starts after retention removed the head sees seq 1000 first."""
    t = SequenceTracker()
    assert t.observe(S, "w1", 1, 1000).gap is None
    assert t.observe(S, "w1", 1, 1001).gap is None


def test_pending_is_bounded_and_the_hole_is_declared_lost() -> None:
    t = SequenceTracker(max_pending=3)
    t.observe(S, "w1", 1, 0)
    for s in (2, 3, 4, 5):
        t.observe(S, "w1", 1, s)
    assert t.lost == 1
    assert t.position(S, "w1") == (1, 5)


def test_scopes_and_producers_are_independent() -> None:
    t = SequenceTracker()
    t.observe("a:0", "p", 1, 0)
    assert t.observe("a:1", "p", 1, 0).verdict is Verdict.NEW
    assert t.observe("a:0", "q", 1, 0).verdict is Verdict.NEW


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=200))
def test_each_seq_is_accepted_exactly_once_whatever_the_redelivery_pattern(seqs: list[int]) -> None:
    t = SequenceTracker()
    t.observe(S, "p", 1, 0)
    accepted = [s for s in seqs if t.observe(S, "p", 1, s).accepted]
    assert sorted(accepted) == sorted(set(seqs) - {0})


def test_snapshot_restore_keeps_dedupe_state() -> None:
    t = SequenceTracker()
    for s in (0, 1, 2, 7):
        t.observe(S, "w1", 3, s)
    r = SequenceTracker.restore(t.snapshot())
    assert r.observe(S, "w1", 3, 7).verdict is Verdict.DUPLICATE
    assert r.observe(S, "w1", 3, 1).verdict is Verdict.DUPLICATE
    assert r.observe(S, "w1", 3, 3).verdict is Verdict.NEW
    assert r.outstanding_gaps() == {(S, "w1"): [(4, 6)]}
