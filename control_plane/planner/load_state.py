"""The load view's state records and their checkpoint format: what ``LoadView`` folds into, and
what ``LoadView.to_bytes`` writes (msgpack of :class:`ViewState`; ``from_bytes`` refuses any
other ``SNAPSHOT_FORMAT``). The fold itself is ``load_view.py``."""

from __future__ import annotations

import msgspec

from common.fleet import Lifecycle
from control_plane.planner.windows import Accumulator

SNAPSHOT_FORMAT = 2


class Incarnation(msgspec.Struct, array_like=True):
    """An earlier incarnation of a worker, kept so a completion is judged warm or not by the
    incarnation that was serving at its event time."""

    epoch: int
    registered_at_ns: int
    ready_at_ns: int | None


class WorkerRecord(msgspec.Struct, kw_only=True):
    worker_id: str
    epoch: int
    pool: str
    role: str
    state: str = "starting"
    registered_at_ns: int = 0
    ready_at_ns: int | None = None
    reported_at_ns: int = 0
    gone_at_ns: int | None = None
    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    active_decode_blocks: int = 0
    kv_usage: float = 0.0
    #: Earlier incarnations, newest last (at most ``MAX_INCARNATIONS``).
    earlier: list[Incarnation] = []


class RequestRecord(msgspec.Struct, kw_only=True):
    seen_ns: int
    prompt_tokens: int = -1
    #: Pools the request was counted in as an arrival.
    pools: list[str] = []
    prefill_worker: str | None = None


class Step(msgspec.Struct, array_like=True):
    """What one request event contributes once its worker's pool is known: the fold's unit of
    work, and what waits in ``_parked`` while it is not."""

    kind: str  # "routed" | "prefill" | "completed" | "failed"
    request_id: str
    worker_id: str
    at_ns: int
    phase: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_ms: float = 0.0
    itl_ms: float | None = None


class ViewState(msgspec.Struct, kw_only=True):
    format: int
    workers: dict[str, WorkerRecord]
    requests: dict[str, RequestRecord]
    #: pool -> bucket index -> accumulator
    buckets: dict[str, dict[int, Accumulator]]
    #: request id -> its steps waiting for a worker's registration, in the request's log order.
    parked: dict[str, list[Step]]
    positions: list[tuple[str, int, int]]
    watermark_ns: int
    start_ns: int | None
    start_fixed: bool
    applied: int
    late_dropped: int
    #: Each worker's lifecycle (common/fleet.py); absent in snapshots written before it.
    lifecycles: dict[str, Lifecycle] = {}
