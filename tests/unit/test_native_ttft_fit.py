"""The crate's TTFT solve (``native/src/ttft_fit.rs``, ``switchyard_native.TtftSolver``) against
its differential oracle (``tests/oracles/ttft_solve.py``, the Python the router ran before): the
same costs bit for bit, so a model re-derived from an old log is the one its decisions recorded.

Sums from random observations (the fit's own features and weights, some TTFTs far off any
linear rule so that costs go negative and are pinned), random priors, and degenerate systems: a
zero pivot is Python's ``ZeroDivisionError`` on both sides.
"""

from __future__ import annotations

import random

import pytest
import switchyard_native
from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.router.ttft import PRIOR, features
from control_plane.router.ttft_fit import _Sums
from schemas.events import CandidateScore
from tests.oracles import ttft_solve


def _sums(rng: random.Random, n: int) -> _Sums:
    s = _Sums()
    for _ in range(n):
        prompt = rng.randrange(1, 40_000)
        row = CandidateScore(worker_id="w", overlap_blocks=rng.randrange(0, prompt // 16 + 1),
                             queued_prefill_tokens=rng.choice([0, rng.randrange(0, 60_000)]),
                             active_decode_blocks=rng.choice([0, rng.randrange(0, 9_000)]))
        x = features(row, prompt, 16, rng.choice([512, 2048, 8192]), rng.randrange(0, 2_000), rng.random() < 0.8,
                     rng.random() < 0.8, rng.random() < 0.3, rng.randrange(2))
        y = rng.choice([rng.randrange(1, 2_000), rng.randrange(1_000, 60_000_000)])
        s.add(x, y, 1, rng.choice([0, rng.randrange(0, y + 1)]))
    return s


def _prior(rng: random.Random) -> tuple[float, ...]:
    return tuple(rng.choice([0.0, rng.uniform(0, 50), rng.uniform(0, 1e-3), rng.uniform(0, 1e-7)]) for _ in range(6))


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 60))
def test_the_crate_solves_as_the_oracle_bit_for_bit(seed: int, n: int) -> None:
    rng = random.Random(seed)
    s = _sums(rng, n)
    solver = switchyard_native.TtftSolver(*s.floats())
    for _ in range(3):  # the maps kept between solves give what a fresh solve gives
        prior = _prior(rng)
        want = ttft_solve.solve(*s.floats(), prior)
        assert solver.solve(prior) == want
        assert switchyard_native.TtftSolver(*s.floats()).solve(prior) == want


def test_the_pinned_costs_and_the_prior_alone() -> None:
    """Observations that make costs negative: pinned at 0 alike; no observation: the prior."""
    rng = random.Random(3)
    pinned = 0
    for _ in range(200):
        s = _sums(rng, rng.randrange(1, 8))
        prior = _prior(rng)
        got = s.solver().solve(prior)
        assert got == ttft_solve.solve(*s.floats(), prior)
        pinned += 0.0 in got
    assert pinned > 20
    empty = _Sums()
    cost = (1.0, 2.0, 3e-3, 4e-8, 0.0, 5e-9)
    assert empty.solver().solve(cost) == ttft_solve.solve(*empty.floats(), cost) == pytest.approx(cost)


def test_a_zero_pivot_is_a_zero_division_on_both_sides() -> None:
    zero = [0.0] * 36
    for ws in ([0.0] * 6, [1.0, 0.0, 1.0, 1.0, 1.0, 1.0]):
        with pytest.raises(ZeroDivisionError):
            ttft_solve.solve(zero, [0.0] * 6, ws, tuple(PRIOR.base_ms for _ in range(6)))
        with pytest.raises(ZeroDivisionError):
            switchyard_native.TtftSolver(zero, [0.0] * 6, ws).solve((1.0,) * 6)


def test_wrong_shapes_are_refused() -> None:
    with pytest.raises(ValueError):
        switchyard_native.TtftSolver([0.0] * 35, [0.0] * 6, [1.0] * 6)
    with pytest.raises((TypeError, ValueError)):
        switchyard_native.TtftSolver([0.0] * 36, [0.0] * 6, [1.0] * 6).solve((1.0,) * 5)
