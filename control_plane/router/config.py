"""Typed, versioned router config.

A config is a value: the router records ``version`` in every ``RequestRouted`` so a replay can
re-score a past decision under exactly the config it was made with (or under another one, for a
counterfactual). Validation runs on construction *and* on decoding (``msgspec`` turns the
``ValueError`` raised in ``__post_init__`` into a ``ValidationError``); each message says which
rule failed and why the rule exists.
"""

from __future__ import annotations

import math
from operator import attrgetter
from typing import Literal

import msgspec

from control_plane.router.errors import RouterConfigError
from control_plane.router.sessions import SESSION_MAX_AGE_S
from schemas.types import TIER_ORDER, RoutingMode, Tier

LoadCombine = Literal["max", "sum"]
LeastLoadedMetric = Literal["blocks", "requests"]
KvCost = Literal["blocks", "ttft"]


class TierWeights(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How many blocks of prefill one cached block saves, per tier it sits in.

    A weight is the fraction of a block's prefill compute that a hit saves *after* paying to bring
    the block back into device memory. Order-of-magnitude numbers behind the defaults (Llama-3-8B,
    fp16 KV: 128 KiB per token, 2 MiB per 16-token block; recomputing a block on an H100 takes
    roughly 0.6-1.5 ms):

    * ``device`` 1.0: the block is already in the engine's pool; the hit is free.
    * ``host`` 0.75 (Dynamo's value): onboarding over PCIe (~25 GB/s, ~0.1 ms a block) is far
      cheaper than recomputing, but it is not free: it competes with offloads for the link and
      needs pinned staging. A profile may justify ~0.9; we keep Dynamo's number so counterfactual
      replays against Dynamo compare like with like.
    * ``disk`` 0.25 (Dynamo's value): local NVMe (~3-7 GB/s, ~0.1 ms per IO) is 4-8x slower than
      host DRAM; for small models on fast GPUs the load approaches the cost of recomputing.
    * ``object`` 0.1 (Dynamo has no such tier; its nearest, "shared beyond", gets 0.5): object
      storage has 10-100 ms to first byte and ~0.1-1 GB/s per stream, which pays off only for
      long prefixes of large models (a 70B block is 5 MiB and ~5 ms to recompute). Small but
      positive: it breaks ties toward a worker that can fetch, and never outweighs a faster tier.

    Invariants (checked): each weight in [0, 1]; non-increasing from device to object.
    """

    #: Weight of a block resident in accelerator memory (G1).
    device: float = 1.0
    #: Weight of a block resident in host DRAM (G2).
    host: float = 0.75
    #: Weight of a block resident on local disk (G3).
    disk: float = 0.25
    #: Weight of a block resident in object storage (G4).
    object: float = 0.1
    #: Weight of a block another worker holds in host or device memory, which the chosen
    #: worker pulls over NIXL before its prefill (peers as a tier, ``data_plane.workers.
    #: peer_fetch``). 0, the default, turns peer fetch off: the router then credits no peer
    #: reach and sends no ``peer_fetch``. A 100 Gb/s NIC (12.5 GB/s) plus a hold round trip of
    #: ~1 ms makes a 2 MiB block ~0.17 ms + its share of the round trip against ~0.6-1.5 ms to
    #: recompute it: ~0.5-0.8 for long prefixes. Not bound by the tier order (a peer's DRAM over
    #: RDMA can beat a local disk).
    peer: float = 0.0

    def __post_init__(self) -> None:
        previous: tuple[Tier, float] | None = None
        for tier in TIER_ORDER:
            weight = self.weight(tier)
            if not (isinstance(weight, (int, float)) and math.isfinite(weight)):
                raise RouterConfigError(
                    f"tier weight {tier.value}={weight!r} must be a finite number"
                )
            if not 0.0 <= weight <= 1.0:
                raise RouterConfigError(
                    f"tier weight {tier.value}={weight} must lie in [0, 1]: a cached block can "
                    "save at most the whole prefill of that block (1) and never costs more than "
                    "recomputing it (0)"
                )
            if previous is not None and weight > previous[1]:
                raise RouterConfigError(
                    f"tier weight {tier.value}={weight} exceeds {previous[0].value}={previous[1]}: "
                    "weights must be non-increasing from device to object, because a slower tier "
                    "must not be worth more than a faster one"
                )
            previous = (tier, weight)
        if not (isinstance(self.peer, (int, float)) and math.isfinite(self.peer) and 0.0 <= self.peer <= 1.0):
            raise RouterConfigError(f"tier weight peer={self.peer!r} must be a finite number in [0, 1]")

    def weight(self, tier: Tier) -> float:
        return getattr(self, tier.value)

    def as_tuple(self) -> tuple[float, ...]:
        """Weights in ``TIER_ORDER`` (fastest first), then the peer weight (the order of
        ``WorkerOverlap.slots``). Read on every decision: one C call, no per-tier lookups."""
        return _WEIGHTS_IN_ORDER(self)


#: ``TierWeights.as_tuple``: the weights in ``TIER_ORDER``, then ``peer``.
_WEIGHTS_IN_ORDER = attrgetter(*(t.value for t in TIER_ORDER), "peer")


class RouterConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything a routing decision depends on besides its inputs and seed."""

    #: Monotonic config version, recorded in every ``RequestRouted.config_version``.
    version: int = 0
    #: Routing policy: ``kv`` (cache- and load-aware cost), ``round_robin``, ``random`` (seeded)
    #: or ``least_loaded``.
    mode: RoutingMode = RoutingMode.KV
    #: Prefill blocks saved per cached block, by tier (see :class:`TierWeights`).
    tier_weights: TierWeights = msgspec.field(default_factory=TierWeights)
    #: Multiplier of the prefill term against the decode term (Dynamo's
    #: ``overlap_score_weight``, whose default is 1.0). Above 1 favours cache hits and short
    #: prefill queues (TTFT); below 1 favours spreading decode load (ITL). Default 5: with
    #: chunked prefill an uncomputed block (~1 ms of compute on the mocker profile) delays every
    #: request sharing its steps, while a resident decode block costs a step ~3 us, so a block of
    #: prefill is worth several blocks of decode. On the whole Mooncake trace (8 workers,
    #: ``switchyard bench routing``) scale 3..10 is a plateau (mean TTFT 262..248 ms vs 285 at
    #: 1, reuse 0.226..0.242 vs 0.196); above ~10 ITL and e2e p99 start to pay.
    prefill_load_scale: float = 5.0
    #: The kv mode's cost: ``blocks`` (the block count above, ``prefill_load_scale`` x prefill
    #: blocks + decode blocks) or ``ttft`` (each candidate's predicted TTFT in ms under its fitted
    #: model, ``control_plane/router/ttft.py``: the queue ahead, its own uncached prefill and the
    #: fitted base; issue 39 step 2). Every prefill row carries its prediction either way.
    cost: KvCost = "blocks"
    #: Disaggregated serving: choose the prefill and the decode worker as one decision (issue 39
    #: item 5, ``control_plane/router/pairs.py``). Each pair costs the prefill worker's predicted
    #: TTFT + the hand-off between the two (transfer and the decode worker's first step, fitted
    #: from this router's decode hops) + the decode worker's predicted ITL with the request, plus
    #: the ITL penalty; decode workers that cannot take the request now (capacity guard) are left
    #: out. With ``cost = "ttft"`` the pair argmin also picks the prefill worker; with
    #: ``blocks`` the prefill worker is the blocks argmin and the pair picks its decode worker.
    #: The decode decision then takes the paired worker unless it can no longer take the request.
    #: Off by default: in virtual time it did not beat the decode decision at hand-off
    #: (docs/routing-cost.md, "P/D pairs").
    pd_pairs: bool = False
    #: The ITL (ms) a pair's decode worker should keep (0 = no penalty): a pair whose predicted
    #: ITL with the request exceeds it costs the excess times the request's expected output tokens.
    itl_slo_ms: float = 0.0
    #: Sessions (issue 39 item 6, ``docs/sessions.md``): a request naming a session goes back to
    #: the worker of the session's previous turn (``sessions.py``, a fold of ``RequestRouted``)
    #: unless that worker's predicted TTFT exceeds the best candidate's by more than
    #: ``session_margin_ms`` + ``session_margin_rel`` x the best's. Kv mode, phases that prefill.
    #: Off by default: in virtual time (agentic and chat, 8 aggregated and 4P+4D) it adds
    #: nothing to the ttft cost (the tune set picks off; any margin > 0 raised the mean TTFT),
    #: and with the blocks cost its gain is the prediction's, not the affinity's
    #: (docs/sessions.md). Margin and age: the tune set's pick with the blocks cost.
    session_affinity: bool = False
    session_margin_ms: float = 0.0
    session_margin_rel: float = 0.0
    #: A session's previous turn counts only if it was routed within this many seconds (at most
    #: ``sessions.SESSION_MAX_AGE_S``, the fold's own bound).
    session_ttl_s: float = 60.0
    #: Admission on the promise (issue 39 step 4): when the best eligible candidate's predicted
    #: TTFT (times the learned margin) plus what the request already spent in the router plus
    #: the router's loop lag exceeds this budget (ms), the request is rejected at once (429,
    #: Retry-After, a reason in ``RequestRejected``) instead of being served late
    #: (``admission.over_ttft_budget``). 0 = off (the default: a budget is the workload's, and
    #: docs/faults.md has the chaos runs with one).
    ttft_slo_ms: float = 0.0
    #: The router's own load (issue 39 step 4): while its event loop's smoothed lag
    #: (``control_plane/router/loop_lag.py``: a 50 ms periodic callback's delay, time constant
    #: 0.5 s) exceeds this (ms), a new request is rejected at once (503 ``router_overloaded``,
    #: Retry-After, the lag in ``RequestRejected.reason``) instead of queueing behind a loop
    #: that cannot serve it. 0 = off (the default: at 100 ms it shed healthy requests in one of
    #: five runs and did not lower the client's TTFT; docs/router.md, Admission, has the runs).
    max_loop_lag_ms: float = 0.0
    #: 0: argmin of the cost, ties broken by the seeded RNG. > 0: sample from a softmax over the
    #: costs normalised to [0, 1] (logit = -normalised / temperature), like Dynamo.
    temperature: float = 0.0
    #: Multiplier of the overlap of a worker whose index view is stale (consumer lag, gap in its
    #: KV event stream, or an incarnation not yet rebuilt). Default 0: a stale view may claim
    #: blocks that were evicted or lost in a restart, and over-claiming residency sends traffic
    #: to a worker that will recompute anyway (a hot spot *and* a miss), while ignoring it costs
    #: at most one avoidable prefill. The router's own speculative overlap is never discounted.
    stale_overlap_factor: float = 0.0
    #: How the worker's reported load and the router's in-flight ledger combine, per term.
    #: ``max`` (default): both usually count this router's recent requests (the report lags, the
    #: ledger leads), so summing would count them twice; the max keeps whichever is newer.
    #: ``sum``: when the reports exclude this router's requests (e.g. other replicas' load only).
    load_combine: LoadCombine = "max"
    #: SGLang-style load-imbalance guard (kv mode): when in-flight requests over the eligible
    #: workers spread by more than ``imbalance_abs_threshold`` *and* the busiest has more than
    #: ``imbalance_rel_threshold`` times the least busy, only the least busy workers compete.
    imbalance_guard: bool = True
    imbalance_abs_threshold: int = 64
    imbalance_rel_threshold: float = 1.5
    #: Exclude a worker whose KV capacity (when reported) cannot hold its active blocks plus this
    #: request's, unless no eligible worker can: it would preempt (recompute) running requests.
    capacity_guard: bool = True
    #: What ``least_loaded`` minimises: ``blocks`` = queued prefill tokens / block size + active
    #: decode blocks (the kv cost's load terms without the cache), or ``requests`` = in-flight.
    least_loaded_metric: LeastLoadedMetric = "blocks"
    #: Lifetime of an in-flight ledger entry whose completion never arrived (lost event, crashed
    #: worker). Long enough for a slow request to finish; the normal end is ``complete()``.
    inflight_ttl_s: float = 600.0

    def __post_init__(self) -> None:
        if not isinstance(self.version, int) or self.version < 0:
            raise RouterConfigError(f"version={self.version!r} must be a non-negative integer")
        if not isinstance(self.mode, RoutingMode):
            raise RouterConfigError(
                f"mode={self.mode!r} is not one of {[m.value for m in RoutingMode]}"
            )
        _finite_at_least("prefill_load_scale", self.prefill_load_scale, 0.0,
                         "a negative scale would reward long prefill queues")
        if self.cost not in ("blocks", "ttft"):
            raise RouterConfigError(f"cost={self.cost!r} must be 'blocks' or 'ttft'")
        _finite_at_least("ttft_slo_ms", self.ttft_slo_ms, 0.0, "0 turns the TTFT budget off")
        _finite_at_least("itl_slo_ms", self.itl_slo_ms, 0.0, "0 turns the pairs' ITL penalty off")
        _finite_at_least("session_margin_ms", self.session_margin_ms, 0.0,
                         "a negative margin would move a session off a worker that is faster")
        _finite_at_least("session_margin_rel", self.session_margin_rel, 0.0,
                         "a negative margin would move a session off a worker that is faster")
        if not (_is_finite(self.session_ttl_s) and 0 < self.session_ttl_s <= SESSION_MAX_AGE_S):
            raise RouterConfigError(
                f"session_ttl_s={self.session_ttl_s!r} must lie in (0, {SESSION_MAX_AGE_S:g}]: the session "
                "fold keeps no older entry to read")
        _finite_at_least("max_loop_lag_ms", self.max_loop_lag_ms, 0.0, "0 turns the router's own load test off")
        _finite_at_least("temperature", self.temperature, 0.0,
                         "0 means argmin; a negative temperature would prefer the worst worker")
        if not (_is_finite(self.stale_overlap_factor) and 0.0 <= self.stale_overlap_factor <= 1.0):
            raise RouterConfigError(
                f"stale_overlap_factor={self.stale_overlap_factor!r} must lie in [0, 1]: a stale "
                "view can only be trusted less than a fresh one, never more"
            )
        if self.load_combine not in ("max", "sum"):
            raise RouterConfigError(f"load_combine={self.load_combine!r} must be 'max' or 'sum'")
        if self.least_loaded_metric not in ("blocks", "requests"):
            raise RouterConfigError(
                f"least_loaded_metric={self.least_loaded_metric!r} must be 'blocks' or 'requests'"
            )
        if not isinstance(self.imbalance_abs_threshold, int) or self.imbalance_abs_threshold < 0:
            raise RouterConfigError(
                f"imbalance_abs_threshold={self.imbalance_abs_threshold!r} must be an integer >= 0"
            )
        _finite_at_least("imbalance_rel_threshold", self.imbalance_rel_threshold, 1.0,
                         "below 1 even a perfectly balanced cluster (max == min) would count as "
                         "imbalanced once the absolute spread is met")
        if not (_is_finite(self.inflight_ttl_s) and self.inflight_ttl_s > 0):
            raise RouterConfigError(
                f"inflight_ttl_s={self.inflight_ttl_s!r} must be > 0: entries that never expire "
                "would leak load forever when a completion event is lost"
            )


def _is_finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _finite_at_least(name: str, value: object, low: float, why: str) -> None:
    if not (_is_finite(value) and value >= low):  # type: ignore[operator]
        raise RouterConfigError(f"{name}={value!r} must be a finite number >= {low}: {why}")


def load_router_config(path=None, **fields) -> RouterConfig:
    """A :class:`RouterConfig` from a TOML or JSON file (when given) over ``fields`` (defaults a
    file may override, e.g. ``version`` and ``mode``); validated, and a file's error names it."""
    data = dict(fields)
    if path is not None:
        from pathlib import Path

        raw = Path(path).read_bytes()
        data.update(msgspec.toml.decode(raw) if str(path).endswith(".toml") else msgspec.json.decode(raw))
    try:
        return msgspec.convert(data, RouterConfig)
    except msgspec.ValidationError as e:
        raise RouterConfigError(f"{path}: {e}" if path is not None else str(e)) from None

