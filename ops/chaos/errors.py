"""One exception base for the chaos package."""

from __future__ import annotations


class ChaosError(Exception):
    """A chaos run could not be set up or carried out (not a failed check: that is the report)."""


class PlanError(ChaosError, ValueError):
    """The requested plan cannot be built (unknown fault, too short a run...)."""
