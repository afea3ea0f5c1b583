"""Tune on some generated workloads, score on others: the harness the tuning benchmarks share.

A bench hands it the tune and score cases (``workloads.sets``: ``TUNE_SET``, ``SCORE_SET``, or
``--tune`` / ``--score``), its grid, and one run function per side (``run(case trace, grid
point) -> metrics``). :func:`tune` runs every grid point of a side on every tune case and picks
the point with the lowest mean over the cases of ``key`` relative to the case's best point (so
every case weighs the same, whatever its scale). Both sides get the same grid and the same
cases: the same budget. The bench then scores each side's pick on the score cases and reports
every case and the worst (:func:`workloads.sets.score_summary`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from data_plane.engines import EngineRequest, default_hash_config
from data_plane.engines.trace import MOONCAKE_BLOCK_SIZE, MooncakeTrace, TraceRecord
from workloads.generator import Spec, default_rate, generate, write
from workloads.sets import Case, check_apart, score_summary

#: Seconds of arrivals per generated case, and the factor over each family's default rate: sized
#: so that 8 mocker workers are busy (at 1x, chat and rag leave them mostly idle, where every
#: router ties) and a case simulates in seconds.
CASE_DURATION_S = 120.0
CASE_RATE_SCALE = 2.0


@dataclass(frozen=True)
class CaseTrace:
    case: Case
    path: Path
    records: list[TraceRecord]


def write_cases(cases: Sequence[Case], directory: Path, *, duration_s: float = CASE_DURATION_S,
                rate_scale: float = CASE_RATE_SCALE) -> dict[Case, CaseTrace]:
    """Each case's generated trace, also written to ``directory`` for Dynamo's replay, which reads
    files. The file leaves out ``session_id`` and ``turn``: Dynamo's replay (``ai-dynamo-runtime``
    1.6.1, ``loadgen/trace.rs``) turns a session's later lines into turns sent a delay (the
    timestamp difference) *after the previous turn completes*, a closed loop, whereas our
    simulations send every request at its timestamp. Without them each line is its own
    session, sent at its timestamp: both sides replay the same arrivals (with them, agentic:2's
    round robin p99 was 470 ms ours against 427 Dynamo's, from arrivals up to 13 s apart)."""
    out = {}
    for c in dict.fromkeys(cases):
        recs = generate(Spec(c.family, c.seed, duration_s=duration_s, rate=default_rate(c.family) * rate_scale))
        path = directory / f"{c.family}-{c.seed}.jsonl"
        write((replace(r, session_id=None, turn=None) for r in recs), path)
        out[c] = CaseTrace(c, path, recs)
    return out


def load_cases(cases: Sequence[Case], directory: Path, block_size: int, *, duration_s: float = CASE_DURATION_S,
               rate_scale: float = CASE_RATE_SCALE) -> tuple[dict[Case, CaseTrace], dict[Case, list[EngineRequest]]]:
    """:func:`write_cases` and each case's engine requests (``block_size``-token engine blocks)."""
    traces = write_cases(cases, directory, duration_s=duration_s, rate_scale=rate_scale)
    adapter = MooncakeTrace(default_hash_config(block_size), trace_block_size=MOONCAKE_BLOCK_SIZE)
    return traces, {c: list(adapter.requests(t.records)) for c, t in traces.items()}


@dataclass(frozen=True)
class Tuned:
    #: The chosen grid point.
    point: float
    #: Grid point -> the mean over the tune cases of key / the case's best key.
    objective: dict[float, float]
    #: Case -> grid point -> metrics.
    runs: dict[Case, dict[float, dict[str, Any]]]


def pick(runs: Mapping[Case, Mapping[float, Mapping[str, Any]]], key: str) -> Tuned:
    grid = sorted({g for per in runs.values() for g in per})
    objective = {}
    for g in grid:
        objective[g] = statistics.fmean(per[g][key] / min(m[key] for m in per.values()) for per in runs.values())
    best = min(grid, key=lambda g: (objective[g], g))
    return Tuned(best, objective, {c: dict(v) for c, v in runs.items()})


def tune(traces: Mapping[Case, CaseTrace], grid: Sequence[float],
         run: Callable[[CaseTrace, float], dict[str, Any]], key: str = "ttft_mean_ms") -> Tuned:
    return pick({c: {g: run(t, g) for g in grid} for c, t in traces.items()}, key)


def tuning_table(side: str, tuned: Tuned, key: str, knob: str) -> str:
    cases = sorted(tuned.runs)
    head = f"{side}: {key} on the tune set, {knob} grid (objective = mean of {key} / the case's best)"
    rows = [head, f"{knob:>10}" + "".join(f"{str(c):>16}" for c in cases) + f"{'objective':>12}"]
    for g, obj in tuned.objective.items():
        rows.append(f"{g:>10g}" + "".join(f"{tuned.runs[c][g][key]:>16.1f}" for c in cases) + f"{obj:>12.4f}"
                    + ("  <- picked" if g == tuned.point else ""))
    return "\n".join(rows)


def report(tune_cases: Sequence[Case], score_cases: Sequence[Case], grid: Sequence[float], tuned: Mapping[str, Tuned],
           scores: Mapping[Case, Mapping[str, float]], key: str, *, where: str, wall_s: float, duration_s: float,
           rate_scale: float, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Print the tuning tables and the score set (worst by ``key``, higher is better); return
    ``{"tuned": {side: point}, "tuning": {side: Tuned}, "scores": ..., "summary": ScoreSummary}``."""
    echo(f"tune and score apart ({where}; cases: {duration_s:g} s of each family at {rate_scale:g}x its default "
         f"rate; {wall_s:.0f} s): prefill_load_scale over {', '.join(f'{g:g}' for g in grid)} on every side, "
         f"picked on tune {', '.join(map(str, tune_cases))}, scored on {', '.join(map(str, score_cases))}")
    for side, t in tuned.items():
        echo(tuning_table(side, t, "ttft_mean_ms", "scale"))
    summary = score_summary(scores, key, higher_is_better=True)
    echo(f"score set (worst by {key}):")
    echo(summary.table)
    return {"tuned": {k: v.point for k, v in tuned.items()}, "tuning": dict(tuned), "scores": dict(scores),
            "summary": summary}


def checked(tune_cases: Sequence[Case], score_cases: Sequence[Case]) -> tuple[tuple[Case, ...], tuple[Case, ...]]:
    t, s = tuple(tune_cases), tuple(score_cases)
    if not t or not s:
        raise ValueError("tune and score sets must both be non-empty")
    check_apart(t, s)
    return t, s
