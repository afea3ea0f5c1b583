"""The router context: the pure decision core and its adapters.

Pure (no I/O, no clock): :mod:`.decision` (``decide`` picks a worker and explains why, over
:mod:`.decision_types`, :mod:`.scoring` and :mod:`.choice`),
:mod:`.config` (the typed, versioned router config), :mod:`.ledger` (the router's in-flight
account, a fold of the events the router itself publishes), :mod:`.inputs` (the one path from
view + ledger + request to ``decide``'s inputs and back to ``RequestRouted``), :mod:`.view`
(the router's view of the log), :mod:`.admission`, :mod:`.health`.

Adapters: :mod:`.proxy` (the request path: admit, decide, record, proxy, retry),
:mod:`.worker_calls` (its HTTP calls to workers), :mod:`.server` (the OpenAI-compatible FastAPI
app, over :mod:`.protocol` and :mod:`.serving`), :mod:`.stream` (the fold following the log into the view),
:mod:`.wiring` (one process). This package's ``__init__`` imports only the pure core.
"""


from control_plane.router.config import RouterConfig, TierWeights
from control_plane.router.decision import (
    NO_OVERLAP,
    Decision,
    RoutingRequest,
    WorkerLoad,
    WorkerOverlap,
    decide,
)
from control_plane.router.errors import (
    InvalidRoutingInput,
    NoEligibleWorker,
    RouterConfigError,
    RoutingError,
)
from control_plane.router.ledger import NO_INFLIGHT, InflightLedger, InflightLoad, InflightView

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
