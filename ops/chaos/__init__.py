"""Fault injection as a command (``switchyard chaos``): a seeded plan of faults (kill -9 and
SIGSTOP of brokers, kill -9 of routers, metrics processor, planner leader and workers) run
against the whole system on private ports, under open-loop load with an overload phase; then
the log is checked against every producer's ack ledger, the routers' views against the oracle
fold, and every admitted request for an end with a reason.

* :mod:`.plan` is pure: (seed, duration, faults) -> the schedule.
* :mod:`.system` starts and restarts the processes (adapter).
* :mod:`.client` is the open-loop client, a process of its own; :mod:`.load` the runner's side of
  it; :mod:`.run` executes a plan against a system;
  :mod:`.report` folds what was recorded and what the log holds into the verdict.
"""

from ops.chaos.errors import ChaosError, PlanError

__all__ = ["ChaosError", "PlanError"]
