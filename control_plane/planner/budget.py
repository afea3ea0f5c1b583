"""Yielding the GPU budget between pools (step 6 of ``policy.py``): holders offer their
surplus, growing pools share it (pins, then pools in overload, then the largest unmet
fraction), and growth waits for GPUs that replicas drained now still hold. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from control_plane.planner.policy_types import _Plan


def _apply_budget(plans: list[_Plan], budget: int) -> dict[str, tuple[int, str]]:
    """Final replicas per pool and a note when the budget changed the proposal.

    Draining replicas still hold their GPUs until they are gone: the budget the targets share is
    ``budget`` less those. While the proposals fit, nothing changes. When they do not: pools that
    hold or shrink offer their surplus above the high end of their noise band (``yield_to``, at
    least their minimum; nothing while pending or within ``cooldown_down_s`` of their last
    change: trading a replica costs a start-up, and doing it on a noisy need is churn); growing pools start from
    what they hold; what is left of the budget goes one replica at a time to the growing pool
    with the largest unmet fraction (pins first); a holder gets back the surplus nobody took.
    Only if even that base does not fit (the budget was lowered) does every pool start again
    from its minimum. So a holder never drops below its need, and never drains for nothing. A
    pool whose last decision is still pending (``frozen``) offers nothing: no new decision for it
    until that one is applied. The exception is a pool in overload whose queue has drained
    (``policy._plan_pool``): it offers what is above its need even then.
    """
    held = sum(p.load.replicas.draining * p.config.gpus_per_replica for p in plans)
    fits = sum(p.proposed * p.config.gpus_per_replica for p in plans) <= budget - held
    if not fits and any(p.overload and p.proposed > p.current for p in plans):
        # a pool in overload is failing its SLO and the proposals do not fit: one with a wide
        # margin yields to it, even below its model need (to margin_yield_to), cooldown or not
        # (and does not grow meanwhile); while they fit, nobody is held back
        plans = [replace(p, proposed=min(p.proposed, p.current),
                         yield_to=min(p.yield_to if p.yield_to is not None else p.proposed, p.margin_yield_to))
                 if p.margin_yield_to is not None and not p.overload else p for p in plans]
    names = sorted(p.config.name for p in plans)
    by = {p.config.name: p for p in plans}
    g = {n: by[n].config.gpus_per_replica for n in names}
    floor = {n: by[n].config.min_replicas for n in names}
    proposed = {n: by[n].proposed for n in names}
    total = budget
    budget -= sum(by[n].load.replicas.draining * g[n] for n in names)
    if sum(proposed[n] * g[n] for n in names) <= budget:
        return _wait_for_drains(by, names, dict(proposed), proposed, budget)
    growing = {n for n in names if by[n].pinned or proposed[n] > by[n].current}
    need = {n: proposed[n] if n in growing or by[n].yield_to is None
            else max(min(proposed[n], by[n].yield_to), floor[n]) for n in names}
    base = {n: max(floor[n], by[n].current if n in growing else need[n]) for n in names}
    if sum(base[n] * g[n] for n in names) > budget:
        base, growing = dict(floor), set(names)  # the budget was lowered: everyone from its minimum
    alloc = dict(base)
    left = budget - sum(alloc[n] * g[n] for n in names)

    def fill(pool_names: list[str], target: dict[str, int]) -> None:
        nonlocal left
        while True:
            cands = [n for n in pool_names if alloc[n] < target[n] and g[n] <= left]
            if not cands:
                return
            # largest unmet fraction first; then the larger pool; then name order (max keeps the first)
            n = max(cands, key=lambda n: ((target[n] - alloc[n]) / target[n], target[n]))
            alloc[n] += 1
            left -= g[n]

    want = {n: proposed[n] if n in growing else need[n] for n in names}
    fill([n for n in names if n in growing and by[n].pinned], want)
    fill([n for n in names if n in growing and by[n].overload], want)  # the SLO is failing there
    fill([n for n in names if n in growing], want)
    fill([n for n in names if n not in growing], proposed)  # give back the surplus nobody took
    used = budget - left
    notes: dict[str, str] = {}
    for n in names:
        if alloc[n] != proposed[n]:
            notes[n] = (f"GPU budget: {proposed[n]} -> {alloc[n]} replicas (needs {need[n]}; {used} of {budget} "
                        f"GPUs allocated, {g[n]} per replica"
                        + (f", {total - budget} held by draining replicas)" if total != budget else ")"))
    out = _wait_for_drains(by, names, alloc, proposed, budget)
    return {n: (to, "; ".join(x for x in (notes.get(n, ""), note) if x)) for n, (to, note) in out.items()}


def _wait_for_drains(by: Mapping[str, _Plan], names: list[str], alloc: dict[str, int], proposed: Mapping[str, int],
                     budget: int) -> dict[str, tuple[int, str]]:
    """Growth never takes a GPU that a replica drained in the same tick still holds: a shrinking
    pool keeps holding its victims' GPUs until they are gone (counted as held even when a victim
    is still starting: a scaler may take a moment to stop it too). While the targets plus those
    do not fit ``budget`` (already less the replicas draining from earlier ticks), the growing
    pool whose unmet fraction is smallest gives back one replica; it asks again on a later tick,
    once the drain is through (the shrinking pool's decision is pending until then). Returns
    (replicas, note) per pool."""
    g = {n: by[n].config.gpus_per_replica for n in names}
    cur = {n: by[n].current for n in names}

    def held(n: str) -> int:
        return max(alloc[n], cur[n])

    freeing = sum((held(n) - alloc[n]) * g[n] for n in names)
    waited: dict[str, int] = {}
    while sum(held(n) * g[n] for n in names) > budget:
        growers = [n for n in names if alloc[n] > cur[n]]
        if not growers:
            break
        n = min(growers, key=lambda n: ((proposed[n] - alloc[n]) / proposed[n], n))
        alloc[n] -= 1
        waited[n] = waited.get(n, 0) + 1
    return {n: (alloc[n], f"waits for {freeing} GPUs that replicas drained now still hold ({waited[n]} replica"
                          f"{'s' if waited[n] > 1 else ''} later)" if n in waited else "") for n in names}
