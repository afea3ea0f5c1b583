"""Sides measured in alternating rounds (A B, B A, ...), so a box's drift falls on both: what
the in-process A/B benches (``front_bench``, ``gen_path_bench``) share."""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Sequence


def alternate(sides: Sequence[str], rounds: int, run_one: Callable[[str], dict[str, float]]) -> None:
    """Run ``run_one(side)`` for every side in each round, in order on even rounds and reversed
    on odd ones; print each round, the box's load, and a ``RESULT`` line of each side's medians
    (``<side>_<key>=...``)."""
    print(f"load {os.getloadavg()[0]:.1f} at start", flush=True)
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in sides}
    width = max(len(s) for s in sides)
    for r in range(rounds):
        for side in (sides if r % 2 == 0 else list(reversed(sides))):
            got = run_one(side)
            runs[side].append(got)
            print(f"round {r + 1} {side:{width}} " + " ".join(f"{k}={v:.0f}" for k, v in got.items()), flush=True)
    med = {s: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for s, rs in runs.items()}
    print(f"load {os.getloadavg()[0]:.1f} at end")
    print("RESULT " + " ".join(f"{s}_{k}={v:.0f}" for s, m in med.items() for k, v in m.items()))
