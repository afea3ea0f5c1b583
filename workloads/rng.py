"""Seeded draws that give the same numbers on any machine and Python version.

Python documents one stability guarantee for :mod:`random`: the same seed gives the same
sequence from ``Random.random()`` (string seeds hash with SHA-512). Its other methods
(``gauss``, ``choices``, ``randrange``...) and numpy's distributions may change between
versions, so every distribution here is built from ``random()`` alone, by inverse transform or
a fixed textbook method. Streams are named (``Draws("chat", 7, "sessions")``): adding a draw to
one stream never shifts another's numbers.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate


class Draws:
    """One named, seeded stream of random draws."""

    __slots__ = ("_random",)

    def __init__(self, *name: object) -> None:
        self._random = random.Random(":".join(str(p) for p in name)).random

    def uniform(self) -> float:
        """In [0, 1)."""
        return self._random()

    def exponential(self, mean: float) -> float:
        return -mean * math.log(1.0 - self._random())

    def normal(self) -> float:
        """Standard normal (Box-Muller, one value per pair of uniforms: no hidden state)."""
        u1, u2 = self._random(), self._random()
        return math.sqrt(-2.0 * math.log(1.0 - u1)) * math.cos(2.0 * math.pi * u2)

    def lognormal(self, median: float, sigma: float) -> float:
        """Log-normal with the given median; its mean is ``median * exp(sigma**2 / 2)``."""
        return median * math.exp(sigma * self.normal())

    def geometric(self, mean: float) -> int:
        """On 1, 2, 3, ... with the given mean (>= 1)."""
        if mean <= 1.0:
            return 1
        p = 1.0 / mean
        return 1 + int(math.log(1.0 - self._random()) / math.log(1.0 - p))

    def gamma(self, shape: float, scale: float) -> float:
        """Gamma (Marsaglia and Tsang 2000; shape < 1 by the ``U ** (1 / shape)`` boost)."""
        if shape < 1.0:
            return self.gamma(shape + 1.0, scale) * (1.0 - self._random()) ** (1.0 / shape)
        d = shape - 1.0 / 3.0
        c = 1.0 / math.sqrt(9.0 * d)
        while True:
            x = self.normal()
            v = (1.0 + c * x) ** 3
            if v <= 0.0:
                continue
            u = 1.0 - self._random()
            if math.log(u) < 0.5 * x * x + d - d * v + d * math.log(v):
                return d * v * scale

    def index(self, cdf: Sequence[float]) -> int:
        """An index drawn from a cumulative weight table (:func:`cdf`)."""
        return min(bisect_right(cdf, self._random() * cdf[-1]), len(cdf) - 1)

    def below(self, n: int) -> int:
        """Uniform on 0..n-1."""
        return min(int(self._random() * n), n - 1)


def cdf(weights: Sequence[float]) -> list[float]:
    return list(accumulate(weights))


def zipf_cdf(n: int, s: float) -> list[float]:
    """Cumulative weights of ranks 1..n with weight ``rank ** -s``."""
    return cdf([(k + 1) ** -s for k in range(n)])
