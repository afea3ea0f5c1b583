"""Tune and score apart: the (family, seed) cases every tuning benchmark shares.

A benchmark that tunes a knob (a router's load scale, a planner's margins, tier weights) tunes
both sides, ours and the anchor, with the same budget on :data:`TUNE_SET` only, and reports
each side scored on :data:`SCORE_SET`: every case, and the **worst** one. The two sets hold
every family, with disjoint seeds, so a knob fitted to one trace's accidents cannot score well
by luck of the draw on the same trace.

    tune = parse_cases("chat:1,agentic:1")      # the --tune / --score option format
    summary = score_summary({case: {"ttft_p99_gain": g, ...} ...}, "ttft_p99_gain", higher_is_better=True)
    print(summary.table)
    print("RESULT ... " + summary.result_fields)   # score_cases=N worst_case=family:seed worst_<key>=...
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from data_plane.engines.trace import TraceRecord
from workloads.generator import FAMILY_NAMES, Spec, generate


@dataclass(frozen=True, order=True)
class Case:
    family: str
    seed: int

    def __str__(self) -> str:
        return f"{self.family}:{self.seed}"


#: Tuning cases: every family, seed 1.
TUNE_SET: tuple[Case, ...] = tuple(Case(f, 1) for f in FAMILY_NAMES)
#: Scoring cases: every family, seed 2 (disjoint from the tune set's).
SCORE_SET: tuple[Case, ...] = tuple(Case(f, 2) for f in FAMILY_NAMES)


def parse_cases(text: str) -> tuple[Case, ...]:
    """``"chat:1,agentic:3"`` -> cases; ``"all:2"`` is every family with seed 2."""
    out: list[Case] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        fam, sep, seed = part.rpartition(":")
        if not sep or not fam:
            raise ValueError(f"case {part!r}: expected family:seed (families: {', '.join(FAMILY_NAMES)}, or all)")
        try:
            s = int(seed)
        except ValueError:
            raise ValueError(f"case {part!r}: seed {seed!r} is not an integer") from None
        if fam == "all":
            out.extend(Case(f, s) for f in FAMILY_NAMES)
        elif fam in FAMILY_NAMES:
            out.append(Case(fam, s))
        else:
            raise ValueError(f"case {part!r}: unknown family {fam!r} (one of {', '.join(FAMILY_NAMES)}, or all)")
    if not out:
        raise ValueError("no cases given")
    return tuple(dict.fromkeys(out))


def check_apart(tune: tuple[Case, ...], score: tuple[Case, ...]) -> None:
    """Refuse a score set that shares a case with the tune set."""
    both = sorted(set(tune) & set(score))
    if both:
        raise ValueError(f"tune and score sets share {', '.join(map(str, both))}: score on other seeds")


def case_records(case: Case, *, duration_s: float, rate: float | None = None, arrival: str = "poisson") -> list[TraceRecord]:
    """The generated trace of ``case`` (a benchmark picks the duration and rate its budget allows)."""
    return generate(Spec(case.family, case.seed, duration_s=duration_s, rate=rate, arrival=arrival))


@dataclass(frozen=True)
class ScoreSummary:
    worst: Case
    #: One line per case (the worst one marked).
    table: str
    #: ``score_cases=N worst_case=family:seed worst_<figure>=...`` for a RESULT line.
    result_fields: str


def score_summary(scores: Mapping[Case, Mapping[str, float]], key: str, *, higher_is_better: bool,
                  fmt: str = ".4f") -> ScoreSummary:
    """Each score case's figures and the worst case by ``key`` (a NaN counts as the worst)."""
    if not scores:
        raise ValueError("no score cases")

    def badness(c: Case) -> float:
        v = scores[c][key]
        if math.isnan(v):
            return math.inf
        return -v if higher_is_better else v

    worst = max(sorted(scores), key=badness)
    keys = list(scores[worst])
    width = {k: max(12, len(k) + 2) for k in keys}
    rows = [f"{'case':<18}" + "".join(f"{k:>{width[k]}}" for k in keys)]
    for c in sorted(scores):
        rows.append(f"{str(c):<18}" + "".join(f"{scores[c][k]:>{width[k]}{fmt}}" for k in keys)
                    + ("   <- worst" if c == worst else ""))
    fields = " ".join([f"score_cases={len(scores)}", f"worst_case={worst}"]
                      + [f"worst_{k}={scores[worst][k]:{fmt}}" for k in keys])
    return ScoreSummary(worst, "\n".join(rows), fields)
