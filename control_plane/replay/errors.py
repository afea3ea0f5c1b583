"""Errors of the replay package (one base, so the CLI and the API can report any of them)."""

from __future__ import annotations


class ReplayError(Exception):
    """Base of every error raised by ``control_plane.replay``."""


class BadPoint(ReplayError, ValueError):
    """A ``--at`` / ``--from`` / ``--to`` value that names no point of the log."""
