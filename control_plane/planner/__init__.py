"""Planner bounded context: load view (pure projection, ``load_view.py``), decision core (pure),
scalers and leader election (adapters). See ``policy.py`` for the decision rules and
``profile.py`` for the sizing arithmetic."""

from control_plane.planner.config import PlannerConfig, PoolConfig, load_config, resolve_profiles
from control_plane.planner.errors import (
    LeaseLost,
    PlannerConfigError,
    PlannerError,
    ScalerError,
    StaleFencingToken,
)
from control_plane.planner.load_view import LoadSnapshot, LoadView, LoadViewConfig, PoolLoad, WindowStats
from control_plane.planner.policy import PlannerState, PlannerTick, PoolReport, PoolState, ScaleEffect, decide
from control_plane.planner.predictors import PredictorKind
from control_plane.planner.profile import PerformanceProfile, derive_profile, flat_profile

__all__ = [
    "PlannerTick",
    "LeaseLost",
    "LoadSnapshot",
    "LoadView",
    "LoadViewConfig",
    "PerformanceProfile",
    "PlannerConfig",
    "PlannerConfigError",
    "PlannerError",
    "PlannerState",
    "PoolConfig",
    "PoolLoad",
    "PoolReport",
    "PoolState",
    "PredictorKind",
    "ScaleEffect",
    "ScalerError",
    "StaleFencingToken",
    "WindowStats",
    "decide",
    "derive_profile",
    "flat_profile",
    "load_config",
    "resolve_profiles",
]
