"""Builders of the planner core's inputs (tests only), shared by the planner test modules.

Each builder takes the defaults of ``test_planner_core`` (the worked examples); a module whose
scenario needs other defaults passes them as overrides (see ``test_planner_ahead``). Windows are
``WINDOW_S`` long and the profile is :func:`flat_profile` unless overridden.
"""

from __future__ import annotations

from control_plane.planner import PlannerConfig, PoolConfig, flat_profile
from control_plane.planner.load_view import NS, WindowStats

WINDOW_S = 10


def make_pool(**overrides) -> PoolConfig:
    """A prefill pool of 1..10 replicas with a 1,000 ms TTFT target."""
    fields = {"name": "p", "role": "prefill", "min_replicas": 1, "max_replicas": 10,
              "ttft_slo_ms": 1000.0, "performance": flat_profile()}
    fields.update(overrides)
    return PoolConfig(**fields)


def make_config(*pools: PoolConfig, **overrides) -> PlannerConfig:
    """``pools`` (default: one :func:`make_pool`), a 16-GPU budget, no cooldowns, 10 s ticks, no
    safety stock (``safety_z`` 0: the worked examples size the forecast itself; the stock has
    its own tests)."""
    fields = {"pools": pools or (make_pool(),), "gpu_budget": 16, "tick_s": WINDOW_S,
              "cooldown_up_s": 0.0, "cooldown_down_s": 0.0, "warmup_s": 30.0, "safety_z": 0.0}
    fields.update(overrides)
    return PlannerConfig(**fields)


def make_window(end_s: float, **overrides) -> WindowStats:
    """A 10 s window ending at ``end_s``; defaults: 100 arrivals (10 req/s) of ISL 2,000, OSL 500."""
    fields = {"start_ns": int((end_s - WINDOW_S) * NS), "end_ns": int(end_s * NS), "arrivals": 100,
              "isl_mean": 2000.0, "osl_mean": 500.0}
    fields.update(overrides)
    return WindowStats(**fields)
