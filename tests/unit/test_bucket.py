"""The token bucket's refill rule (common.bucket), shared by the admin API's failed-auth limit
and the router's per-key rate."""

from __future__ import annotations

from common.bucket import Bucket, level_at


def test_no_bucket_is_full():
    assert level_at(None, 123.0, 5, 2.0) == 5.0


def test_refills_at_the_rate_up_to_the_size():
    """0.5 tokens at t=10, 2 tokens/s: 1.5 at t=10.5, 4.5 at t=12, capped at 5 from t=12.25."""
    b = Bucket(0.5, 10.0)
    assert level_at(b, 10.5, 5, 2.0) == 1.5
    assert level_at(b, 12.0, 5, 2.0) == 4.5
    assert level_at(b, 60.0, 5, 2.0) == 5.0


def test_a_clock_stepping_back_neither_refills_nor_takes_back():
    assert level_at(Bucket(0.5, 10.0), 9.0, 5, 2.0) == 0.5
