"""What operators told the planner, folded from the ``admin`` stream. Pure.

* ``PoolPinned(pool, replicas)``: hold the pool at ``replicas`` (a manual override the core
  applies before anything else, clamped to the pool's bounds); ``replicas=None`` unpins.
* ``PlannerConfigChanged(config_version, config)``: a whole new planner config (any version can
  be re-applied alone); its ``version`` is what the decisions record from then on.
* ``PoolUpdated(pool, role, SLOs, bounds, gpus_per_replica, gpu_budget)``: the full new state of
  one pool's targets and bounds, laid over the current config.

The admin stream is kept forever and is small: a planner folds it from the start at every
start-up, so pins and config changes survive restarts and leader changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from control_plane.planner.config import PlannerConfig, PoolConfig
from control_plane.planner.errors import PlannerConfigError
from control_plane.planner.policy import Pin
from schemas.envelope import Envelope
from schemas.events import Event, PlannerConfigChanged, PoolPinned, PoolUpdated
from schemas.types import WorkerRole


@dataclass
class AdminInputs:
    pins: dict[str, Pin] = field(default_factory=dict)
    config: PlannerConfigChanged | None = None
    pool_updates: dict[str, PoolUpdated] = field(default_factory=dict)
    #: Bumped by every event that changes the effective config (callers re-resolve on change).
    generation: int = 0
    #: Admin events that could not be applied, with the reason (the planner logs them).
    rejected: list[str] = field(default_factory=list)

    def apply(self, env: Envelope[Event]) -> bool:
        """Fold one admin event; True if it changed anything the planner reads."""
        ev = env.data
        if isinstance(ev, PoolPinned):
            if ev.replicas is None:
                return self.pins.pop(ev.pool, None) is not None
            self.pins[ev.pool] = Pin(ev.replicas, ev.actor, ev.reason)
            return True
        if isinstance(ev, PlannerConfigChanged):
            self.config = ev
            self.generation += 1
            return True
        if isinstance(ev, PoolUpdated):
            self.pool_updates[ev.pool] = ev
            self.generation += 1
            return True
        return False

    def effective_config(self, base: PlannerConfig) -> PlannerConfig:
        """``base``, replaced by the newest PlannerConfigChanged, with each PoolUpdated laid over
        it. Raises :class:`PlannerConfigError` if the result is invalid (the caller keeps the
        previous config and reports why)."""
        cfg = base
        if self.config is not None:
            body = {**self.config.config, "version": self.config.config_version}
            try:
                cfg = msgspec.convert(body, PlannerConfig)
            except msgspec.ValidationError as e:
                raise PlannerConfigError(f"PlannerConfigChanged v{self.config.config_version}: {e}") from None
        if self.pool_updates:
            pools = {p.name: p for p in cfg.pools}
            budget = cfg.gpu_budget
            for name, u in sorted(self.pool_updates.items()):
                fields = {"name": name, "role": WorkerRole(u.role), "ttft_slo_ms": u.ttft_slo_ms,
                          "itl_slo_ms": u.itl_slo_ms, "min_replicas": u.min_replicas,
                          "max_replicas": u.max_replicas, "gpus_per_replica": u.gpus_per_replica}
                try:
                    old = pools.get(name)
                    pools[name] = (msgspec.structs.replace(old, **fields, performance=old.performance)
                                   if old is not None else PoolConfig(**fields))
                    pools[name].__post_init__()
                except (ValueError, TypeError) as e:
                    raise PlannerConfigError(f"PoolUpdated {name}: {e}") from None
                if u.gpu_budget is not None:
                    budget = u.gpu_budget
            try:
                cfg = cfg.replace(pools=tuple(pools[k] for k in sorted(pools)), gpu_budget=budget)
                cfg.__post_init__()
            except ValueError as e:
                raise PlannerConfigError(f"pool updates make the config invalid: {e}") from None
        return cfg
