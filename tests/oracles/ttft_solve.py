"""The TTFT fit's solve in pure Python: the executable specification of the Rust core's
``TtftSolver`` (``native/src/ttft_fit.rs``), kept as a differential oracle. It is the code the
router ran before the solve moved into the crate, operation for operation, so the crate's models
(and so the decisions old logs recorded with them, which ``replay verify`` re-derives) must
match it bit for bit (``tests/unit/test_native_ttft_fit.py``).

:func:`solve` takes the same floats the crate does (``ttft_fit._Sums.floats``): the sums as
floats, ``X^T W y`` over 1000, and the prior weights.
"""

from __future__ import annotations

_N = 6
_SCALE = (1.0, 1.0, 2048.0, 2048.0 * 2048.0, 1024.0, 2048.0 * 2048.0)

Affine = tuple[tuple[float, ...], tuple[tuple[float, ...], ...]]


def solve(xx: list[float], xy_ms: list[float], ws: list[float], prior: tuple[float, ...]) -> tuple[float, ...]:
    """Ridge around ``prior`` with costs >= 0 (negative ones pinned at 0, re-solved over the
    others)."""
    free = tuple(range(_N))
    while True:
        c, k = affine(xx, xy_ms, ws, free)
        p = [prior[i] * _SCALE[i] for i in free]
        theta = [0.0] * _N
        for r, i in enumerate(free):
            z, kr = c[r], k[r]
            for j in range(len(free)):
                z += kr[j] * p[j]
            theta[i] = z / _SCALE[i]
        neg = [i for i in free if theta[i] < 0]
        if not neg:
            return tuple(theta)
        free = tuple(i for i in free if i not in neg)
        if not free:
            return tuple(0.0 for _ in range(_N))


def affine(xx: list[float], xy_ms: list[float], ws: list[float], free: tuple[int, ...]) -> Affine:
    """``c = (A + D)^-1 b`` and ``K = (A + D)^-1 D`` over the ``free`` costs, in the scaled space."""
    k = len(free)
    a = [[xx[min(i, j) * _N + max(i, j)] / (_SCALE[i] * _SCALE[j]) + (ws[i] if i == j else 0.0) for j in free]
         + [xy_ms[i] / _SCALE[i]]
         + [ws[i] if r == c else 0.0 for c in range(k)]
         for r, i in enumerate(free)]
    z = gauss_columns(a, 1 + k)
    return tuple(row[0] for row in z), tuple(tuple(row[1:]) for row in z)


def gauss_columns(a: list[list[float]], m: int) -> list[list[float]]:
    """Solve ``a`` (k rows of k coefficients then ``m`` right-hand sides) for every right-hand
    side at once (partial pivoting); the solutions as rows, one value per side."""
    k = len(a)
    for col in range(k):
        piv = max(range(col, k), key=lambda r: abs(a[r][col]))
        a[col], a[piv] = a[piv], a[col]
        for r in range(col + 1, k):
            f = a[r][col] / a[col][col]
            if f:
                for c in range(col, k + m):
                    a[r][c] -= f * a[col][c]
    z = [[0.0] * m for _ in range(k)]
    for r in range(k - 1, -1, -1):
        row, d = a[r], a[r][r]
        for j in range(m):
            acc = row[k + j]
            for c in range(r + 1, k):
                acc -= row[c] * z[c][j]
            z[r][j] = acc / d
    return z
