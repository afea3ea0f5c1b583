"""Upcasters: pure functions lifting an old payload (as builtins) one version up.

Keyed by ``(type name, from version)``. The codec chains them, v1 -> v2 -> ... -> latest, so each
step only ever knows about its two neighbours.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Doc = dict[str, Any]


def worker_load_reported_v1_to_v2(doc: Doc) -> Doc:
    """v1 had one device usage fraction ``kv_usage``; v2 reports usage per tier."""
    out = dict(doc)
    out["tier_usage"] = {"device": float(out.pop("kv_usage"))}
    return out


UPCASTERS: dict[tuple[str, int], Callable[[Doc], Doc]] = {
    ("WorkerLoadReported", 1): worker_load_reported_v1_to_v2,
}
