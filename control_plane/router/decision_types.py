"""The routing decision's shapes: the request to place, each candidate's load and prefix
match, and the :class:`Decision` with its score rows (``decision.py`` makes it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache

import msgspec

from control_plane.router.errors import InvalidRoutingInput
from schemas.events import CandidateScore, PairScore, RequestRouted
from schemas.types import (
    TIER_INDEX,
    TIER_ORDER,
    BlockHash,
    RequestId,
    RequestPhase,
    RoutingMode,
    Tier,
    WorkerId,
    WorkerRole,
)

# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------


class RoutingRequest(msgspec.Struct, frozen=True, kw_only=True):
    """The request (or one phase of it) to place."""

    request_id: RequestId
    prompt_tokens: int
    #: Tokens per KV block (the engines' block size).
    block_size: int
    #: Chained hashes of the prompt's full blocks, from the root (``RequestAdmitted``).
    block_hashes: tuple[BlockHash, ...] = ()
    #: Expected output length (``max_tokens`` or a prediction); sizes the decode footprint.
    expected_output_tokens: int = 0
    phase: RequestPhase = RequestPhase.AGGREGATED

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise InvalidRoutingInput(f"block_size={self.block_size} must be > 0")
        if self.prompt_tokens < 0 or self.expected_output_tokens < 0:
            raise InvalidRoutingInput(
                f"prompt_tokens={self.prompt_tokens} and expected_output_tokens="
                f"{self.expected_output_tokens} must be >= 0"
            )
        if len(self.block_hashes) * self.block_size > self.prompt_tokens:
            raise InvalidRoutingInput(
                f"{len(self.block_hashes)} block hashes of {self.block_size} tokens exceed the "
                f"{self.prompt_tokens}-token prompt: only full prompt blocks are hashed"
            )

    @property
    def request_blocks(self) -> int:
        """KV blocks the request holds at its end: ceil((prompt + output) / block_size)."""
        return -(-(self.prompt_tokens + self.expected_output_tokens) // self.block_size)


class WorkerOverlap(msgspec.Struct, frozen=True, kw_only=True):
    """The prefix index's match for one worker: matched blocks per tier, and staleness.

    ``tiers`` holds the counts in :data:`~schemas.types.TIER_ORDER` (fastest first; missing
    trailing tiers count 0), each matched block counted in the fastest tier that holds it, so
    the matched depth is their sum and the two can never disagree. A new tier is one
    ``Tier`` value and its weight in :class:`~control_plane.router.config.TierWeights`; nothing
    here names a tier.
    """

    tiers: tuple[int, ...] = ()
    #: The index's view of this worker is not trusted to be current (lag, gap, new incarnation).
    stale: bool = False
    #: Blocks beyond this worker's own match that another worker (``peer_from``) holds in host
    #: or device memory, which this worker can pull over NIXL instead of recomputing
    #: (``control_plane.router.inputs.with_peer_reach``). Weighted by ``TierWeights.peer`` and
    #: laid after the worker's own tiers along the prefix. 0 when peer fetch is off.
    peer: int = 0
    peer_from: WorkerId = ""

    def __post_init__(self) -> None:
        if len(self.tiers) > len(TIER_ORDER) or any(c < 0 for c in self.tiers):
            raise InvalidRoutingInput(f"tier counts {self.tiers!r}: at most {len(TIER_ORDER)}, none negative")
        if self.peer < 0 or (self.peer > 0) != bool(self.peer_from):
            raise InvalidRoutingInput(f"peer reach {self.peer} from {self.peer_from!r}: a count >= 0, "
                                      "and a source exactly when it is > 0")

    def slots(self) -> tuple[int, ...]:
        """The counts the cost weighs, in weight order: the tiers, then the peer reach (padded
        so the peer count meets ``TierWeights.peer``)."""
        if not self.peer:
            return self.tiers
        return (*self.tiers, *_ZEROS[len(self.tiers):], self.peer)

    @property
    def depth(self) -> int:
        return sum(self.tiers)

    def count(self, tier: Tier | str) -> int:
        i = TIER_INDEX[Tier(tier)]
        return self.tiers[i] if i < len(self.tiers) else 0

    @classmethod
    def of(cls, *, stale: bool = False, **counts: int) -> WorkerOverlap:
        """``WorkerOverlap.of(device=3, host=1)``."""
        return cls.from_tiers(counts, stale=stale)

    @classmethod
    def from_tiers(
        cls, by_tier: Mapping[Tier | str, int] | Sequence[int], *, stale: bool = False,
        peer_from: WorkerId = "",
    ) -> WorkerOverlap:
        """Build from ``{Tier.HOST: 3, ...}``, ``{"host": 3, ...}`` or counts in
        ``TIER_ORDER`` (the prefix index's ``Match.by_tier``)."""
        if isinstance(by_tier, Mapping):
            counts = [0] * len(TIER_ORDER)
            peer = 0
            for k, v in by_tier.items():
                if k == PEER:
                    peer = int(v)
                else:
                    counts[TIER_INDEX[Tier(k)]] = int(v)
            return cls(tiers=tuple(counts), stale=stale, peer=peer, peer_from=peer_from if peer else "")
        return cls(tiers=tuple(by_tier), stale=stale)

    def by_tier(self) -> dict[str, int]:
        """Non-zero tiers by tier name (``CandidateScore.overlap_by_tier``). Built for every
        matched candidate of every decision: the few distinct count vectors of a moment come
        from a cache (a copy of a small dict costs a fifth of building it). The peer reach,
        when there is one, is the key ``"peer"``."""
        return dict(_named_counts(self.slots()))


#: The name of the peer reach in ``overlap_by_tier`` and reasons (not a ``Tier``: a peer's
#: blocks are another worker's residency, reachable from here).
PEER = "peer"
TIER_NAMES = (*(t.value for t in TIER_ORDER), PEER)
_ZEROS = (0,) * len(TIER_ORDER)


@lru_cache(maxsize=4096)
def _named_counts(tiers: tuple[int, ...]) -> dict[str, int]:
    return {name: c for name, c in zip(TIER_NAMES, tiers) if c}


NO_OVERLAP = WorkerOverlap()


class WorkerLoad(msgspec.Struct, frozen=True, kw_only=True):
    """One candidate worker as the registry and its latest load report describe it."""

    worker_id: WorkerId
    role: WorkerRole = WorkerRole.AGGREGATED
    registered: bool = True
    draining: bool = False
    queued_prefill_tokens: int = 0
    active_decode_blocks: int = 0
    inflight_requests: int = 0
    #: Device KV capacity in blocks; 0 when unknown (the capacity guard then skips the worker).
    kv_capacity_blocks: int = 0



# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    """A routing decision, its evidence, and the state to carry forward."""

    request_id: RequestId
    phase: RequestPhase
    worker_id: WorkerId
    mode: RoutingMode
    #: One row per candidate, sorted by worker id; ineligible ones have ``eligible=False``.
    scores: tuple[CandidateScore, ...]
    reason: str
    config_version: int
    rng_seed: int
    #: Round-robin cursor for the next decision (the last worker round robin chose).
    rr_cursor: WorkerId | None = None
    #: What to record in the in-flight ledger for the chosen worker (``InflightLedger.add``):
    #: prompt tokens it must compute (after its cache and in-flight hits) ...
    prefill_tokens: int = 0
    #: ... and every KV block the request will hold there.
    decode_blocks: int = 0
    #: Blocks of the prompt held by in-flight requests, per worker (non-zero only); also in
    #: each row's ``speculative_overlap``.
    speculative_overlap: dict[WorkerId, int] = {}
    #: Guards that changed the candidate set ("capacity", "imbalance").
    guards: tuple[str, ...] = ()
    #: P/D pairs (``RouterConfig.pd_pairs``, ``pairs.py``): a prefill decision's decode worker,
    #: or the pairing a decode decision honoured or passed over ...
    paired_worker_id: WorkerId = ""
    #: ... and a prefill decision's pairs and the decode candidates' rows they were built on.
    pairs: tuple[PairScore, ...] = ()
    decode_scores: tuple[CandidateScore, ...] = ()

    def to_event(
        self,
        *,
        index_position: Mapping[str, int] | None = None,
        router_id: str = "",
        attempt: int = 0,
    ) -> RequestRouted:
        return RequestRouted(
            request_id=self.request_id,
            worker_id=self.worker_id,
            phase=self.phase,
            mode=self.mode,
            scores=list(self.scores),
            reason=self.reason,
            config_version=self.config_version,
            rng_seed=self.rng_seed,
            index_position=dict(index_position or {}),
            router_id=router_id,
            attempt=attempt,
            paired_worker_id=self.paired_worker_id,
            pairs=list(self.pairs),
            decode_scores=list(self.decode_scores),
        )

