"""The schedule of a chaos run. Pure and deterministic: the same (seed, duration, faults, order)
always gives the same plan, so a failing run can be repeated exactly.

A plan is three phases on one clock (seconds from the start of the load):

* warm-up ``[0, warmup_s)``: load only, so every component has served traffic before it is hurt;
* faults: each requested fault once, at seeded-random times (or, with ``in_order``, in the
  order given, evenly spaced), consecutive faults at least ``gap_s`` apart so that the system
  can recover from one before the next;
* overload ``[duration_s - overload_s, duration_s)``: the arrival rate times
  ``overload_factor``, after the last fault's gap, so that shedding load is judged on a healthy
  system.

The runner keeps the order and the spacing but never injects a fault before the previous one
has recovered: a slow recovery shifts the rest of the plan later (:meth:`Plan.shifted`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from ops.chaos.errors import PlanError

#: Every fault kind, in the default order of ``--in-order``.
FAULT_KINDS: tuple[str, ...] = (
    "broker_kill",   # kill -9 the broker leading the probe partition; restart it
    "broker_hang",   # SIGSTOP that broker past the session timeout (it is fenced), then SIGCONT
    "router_kill",   # kill -9 one router replica; restart it on its port with its id
    "metrics_kill",  # kill -9 the metrics processor; restart it
    "planner_kill",  # kill -9 the planner replica holding the leader lease; restart it
    "prefill_kill",  # kill -9 one prefill worker; restart it with its id and data dir
    "decode_kill",   # kill -9 one decode worker; restart it
    "disk_full",     # fill the filesystem under one worker's KV disk tier (ENOSPC), then free it
)

BROKER_FAULTS = frozenset({"broker_kill", "broker_hang"})


#: The routers' TTFT budget in a chaos run unless told otherwise (ms, ``RouterConfig.ttft_slo_ms``;
#: docs/faults.md, "Admission under overload", has the runs behind it).
CHAOS_TTFT_SLO_MS = 1000.0


@dataclass(frozen=True)
class Topology:
    """How many of each component the chaos system runs. Sized by default for a 2-core box."""

    brokers: int = 3
    routers: int = 2
    prefill: int = 2
    decode: int = 2
    #: Planner replicas sharing one Redis lease (0: no planner).
    planners: int = 2


@dataclass(frozen=True)
class PlanConfig:
    """What a plan is built from. Times are seconds of load."""

    #: Seed of every random choice (fault times, order, which replica is hit).
    seed: int = 0
    #: Nominal length of the load, overload phase included.
    duration_s: float = 180.0
    #: Fault kinds to inject, each once (a subset of :data:`FAULT_KINDS`).
    faults: tuple[str, ...] = FAULT_KINDS
    #: Inject in the order given, evenly spaced, instead of a seeded order at seeded times.
    in_order: bool = False
    #: Load before the first fault.
    warmup_s: float = 5.0
    #: Least time between two faults (and between the last fault and the overload phase).
    gap_s: float = 5.0
    #: Length of the overload phase at the end of the run (0: none).
    overload_s: float = 20.0
    #: Arrival rate multiplier during the overload phase.
    overload_factor: float = 8.0
    #: How long a hung broker stays stopped.
    hang_s: float = 6.0
    #: How long a worker's KV disk tier stays full.
    disk_full_s: float = 8.0
    #: The brokers' session timeout (ops/stack/kafka.py:
    #: BROKER_SESSION_TIMEOUT_MS; tests/unit/test_chaos_plan.py holds the two equal).
    session_timeout_s: float = 1.5

    def __post_init__(self) -> None:
        unknown = [f for f in self.faults if f not in FAULT_KINDS]
        if unknown:
            raise PlanError(f"unknown fault(s) {', '.join(map(repr, unknown))}; known: {', '.join(FAULT_KINDS)}")
        repeated = sorted({f for f in self.faults if self.faults.count(f) > 1})
        if repeated:
            raise PlanError(f"fault(s) {', '.join(repeated)} given twice: each kind is injected once per run")
        if self.duration_s <= 0 or self.warmup_s < 0 or self.gap_s < 0 or self.overload_s < 0:
            raise PlanError("duration_s must be > 0 and warmup_s, gap_s, overload_s >= 0")
        if self.overload_factor < 1:
            raise PlanError(f"overload_factor {self.overload_factor} < 1: the overload phase must not lower the rate")
        if "broker_hang" in self.faults and self.hang_s <= self.session_timeout_s:
            raise PlanError(f"hang_s {self.hang_s} must exceed the brokers' session timeout "
                            f"({self.session_timeout_s} s): a shorter stop is a GC pause the cluster rides out "
                            "without fencing the broker, which is not the fault being tested")
        need = self.warmup_s + self.gap_s * len(self.faults) + self.overload_s
        if self.faults and need > self.duration_s:
            raise PlanError(f"duration {self.duration_s:g} s is too short for {len(self.faults)} faults: warm-up "
                            f"{self.warmup_s:g} s + {len(self.faults)} x gap {self.gap_s:g} s + overload "
                            f"{self.overload_s:g} s = {need:g} s")


@dataclass(frozen=True)
class FaultAt:
    """One fault of the plan."""

    #: Seconds from the start of the load.
    at_s: float
    kind: str
    #: A seeded number the runner reduces modulo the replicas of the component (which router,
    #: which worker), so the plan does not depend on how many there are.
    pick: int


@dataclass(frozen=True)
class Overload:
    start_s: float
    end_s: float
    factor: float

    def covers(self, t_s: float) -> bool:
        return self.start_s <= t_s < self.end_s


@dataclass(frozen=True)
class Plan:
    config: PlanConfig
    faults: tuple[FaultAt, ...]
    overload: Overload | None

    @property
    def duration_s(self) -> float:
        return self.config.duration_s

    def rate_factor(self, t_s: float) -> float:
        """The arrival-rate multiplier at ``t_s`` (1 outside the overload phase)."""
        return self.overload.factor if self.overload is not None and self.overload.covers(t_s) else 1.0

    def shifted(self, after: int, by_s: float) -> Plan:
        """The plan with every fault after index ``after``, the overload phase and the end
        moved ``by_s`` seconds later (a recovery that overran the gap)."""
        if by_s <= 0:
            return self
        faults = tuple(f if i <= after else replace(f, at_s=f.at_s + by_s) for i, f in enumerate(self.faults))
        ov = self.overload and replace(self.overload, start_s=self.overload.start_s + by_s,
                                       end_s=self.overload.end_s + by_s)
        return Plan(replace(self.config, duration_s=self.config.duration_s + by_s), faults, ov)

    def as_dict(self) -> dict:
        return {"seed": self.config.seed, "duration_s": self.config.duration_s, "in_order": self.config.in_order,
                "gap_s": self.config.gap_s, "faults": [{"at_s": round(f.at_s, 3), "kind": f.kind, "pick": f.pick}
                                                      for f in self.faults],
                "overload": None if self.overload is None else
                {"start_s": self.overload.start_s, "end_s": self.overload.end_s, "factor": self.overload.factor}}


def make_plan(config: PlanConfig) -> Plan:
    """The plan of ``config``; see the module docstring for the phases.

    Seeded times: ``n`` points drawn uniformly from the fault window shortened by the gaps
    ``(n - 1) * gap_s``, sorted, the ``i``-th moved ``i * gap_s`` later; that is uniform over
    every placement whose spacing is at least ``gap_s``.
    """
    c = config
    rng = random.Random(c.seed)
    overload_start = c.duration_s - c.overload_s
    lo, hi = c.warmup_s, overload_start - c.gap_s  # the last fault leaves a gap before the overload
    n = len(c.faults)
    kinds = list(c.faults)
    if c.in_order:
        step = (hi - lo) / (n - 1) if n > 1 else 0.0
        times = [lo + i * step for i in range(n)]
    else:
        rng.shuffle(kinds)
        slack = (hi - lo) - (n - 1) * c.gap_s
        times = [lo + x + i * c.gap_s for i, x in enumerate(sorted(rng.uniform(0, slack) for _ in range(n)))]
    faults = tuple(FaultAt(round(t, 3), k, rng.randrange(1 << 30)) for t, k in zip(times, kinds, strict=True))
    overload = Overload(overload_start, c.duration_s, c.overload_factor) if c.overload_s > 0 else None
    return Plan(c, faults, overload)


def parse_faults(text: str | None) -> tuple[str, ...]:
    """``--faults`` (comma list; empty or ``all``: every kind) -> kinds, checked."""
    if text is None or text.strip() in ("", "all"):
        return FAULT_KINDS
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    PlanConfig(faults=kinds, duration_s=1e9)  # the one place names are checked
    return kinds
