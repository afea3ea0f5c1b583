"""Routing: the pure decision core (no I/O) and the router's in-flight account.

``decide`` picks a worker and explains why; ``InflightLedger`` is the router's own record of
what it sent where. Adapters (index lookups, load views, publishing ``RequestRouted``) live
elsewhere and only call into this package.
"""

from control_plane.routing.config import RouterConfig, TierWeights
from control_plane.routing.decision import (
    NO_OVERLAP,
    Decision,
    RoutingRequest,
    WorkerLoad,
    WorkerOverlap,
    decide,
)
from control_plane.routing.errors import (
    InvalidRoutingInput,
    NoEligibleWorker,
    RouterConfigError,
    RoutingError,
)
from control_plane.routing.inflight import NO_INFLIGHT, InflightLedger, InflightLoad, InflightView

__all__ = [
    "NO_INFLIGHT",
    "NO_OVERLAP",
    "Decision",
    "InflightLedger",
    "InflightLoad",
    "InflightView",
    "InvalidRoutingInput",
    "NoEligibleWorker",
    "RouterConfig",
    "RouterConfigError",
    "RoutingError",
    "RoutingRequest",
    "TierWeights",
    "WorkerLoad",
    "WorkerOverlap",
    "decide",
]
