"""Event payload types, one frozen struct per event type and schema version.

These structs and the JSON Schema files under ``schemas/json/`` describe the same contract;
``switchyard schemas check`` (run in CI) fails if they drift apart. Rules for changing them:

* A payload is an immutable fact. Never change the meaning of a field.
* Add fields with defaults (readers of the same version ignore what they do not know).
* Anything else (rename, remove, retype) is a new version: keep the old struct here under
  ``<Name>V<n>``, add an upcaster in :mod:`schemas.upcasters`, store a sample in
  ``tests/samples/`` and never delete it.
* The type name on the wire is the ``TYPE`` string, never a Python path: renaming a class must
  not change the wire format.
"""

from __future__ import annotations

import math

from typing import Any, ClassVar

import msgspec

from schemas.types import (
    BlockHash,
    CacheGroup,
    PoolName,
    RequestId,
    RequestPhase,
    RoutingMode,
    Tier,
    WorkerId,
    WorkerRole,
)


class Event(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Base of every payload. ``TYPE``/``VERSION`` identify it on the wire."""

    TYPE: ClassVar[str]
    VERSION: ClassVar[int]
    #: Kafka topic family the event belongs to (see common.log.catalog).
    STREAM: ClassVar[str]
    #: The payload field that *is* the envelope's key, written once on the wire: as the key.
    #: The codec leaves it out of the payload's bytes and fills it in from the key on read (so
    #: every reader still finds it on the payload). None: the payload carries all its fields.
    KEY_FIELD: ClassVar[str | None] = None

    def key(self) -> str:
        """Partition key: the aggregate this fact is about."""
        raise NotImplementedError


# --------------------------------------------------------------------------------------------
# KV cache events (stream "kv", keyed by worker so each worker's history stays ordered)
# --------------------------------------------------------------------------------------------


class KvEvent(Event, frozen=True, kw_only=True, omit_defaults=True):
    STREAM: ClassVar[str] = "kv"
    worker_id: WorkerId

    def key(self) -> str:
        return self.worker_id


class BlockStored(KvEvent, frozen=True, kw_only=True, omit_defaults=True):
    """Blocks became resident in ``tier`` on ``worker_id``.

    ``block_hashes`` form a chain: each block's parent is the previous one, the first one's
    parent is ``parent_hash`` (None at the start of a sequence). Stores are idempotent upserts:
    engines re-send prefix hits as stores.
    """

    TYPE: ClassVar[str] = "BlockStored"
    VERSION: ClassVar[int] = 1
    tier: Tier
    block_hashes: list[BlockHash]
    parent_hash: BlockHash | None = None
    #: Tokens per block (the engine's block size).
    block_size: int
    #: Token count of each block; all ``block_size`` except possibly none (only full blocks are
    #: hashed). Empty means every block is full.
    token_counts: list[int] = []
    #: Prefix-hash algorithm and seed, e.g. ``sha256_cbor`` or ``xxh3_64:1337``. The index
    #: refuses events whose algorithm differs from its own.
    hash_algo: str
    cache_group: CacheGroup = CacheGroup.FULL_ATTENTION
    lora_id: int | None = None
    lora_name: str | None = None
    #: All token ids of all blocks, when the producer shares them (vLLM does).
    token_ids: list[int] = []
    dp_rank: int = 0
    #: Device stores only: the tier the blocks were loaded (onboarded) from instead of being
    #: computed; None when computed. Added in place (a default, omitted when unset), so every
    #: earlier payload still decodes to the same event.
    source_tier: Tier | None = None


class BlockRemoved(KvEvent, frozen=True, kw_only=True, omit_defaults=True):
    """Blocks left ``tier`` on ``worker_id`` (evicted or freed; not moved elsewhere)."""

    TYPE: ClassVar[str] = "BlockRemoved"
    VERSION: ClassVar[int] = 1
    tier: Tier
    block_hashes: list[BlockHash]
    cache_group: CacheGroup = CacheGroup.FULL_ATTENTION
    dp_rank: int = 0


class BlockMoved(KvEvent, frozen=True, kw_only=True, omit_defaults=True):
    """Blocks moved between tiers of one worker (offload or onboard).

    Emitted only after the bytes are durably in ``to_tier``.
    """

    TYPE: ClassVar[str] = "BlockMoved"
    VERSION: ClassVar[int] = 1
    block_hashes: list[BlockHash]
    from_tier: Tier
    to_tier: Tier
    cache_group: CacheGroup = CacheGroup.FULL_ATTENTION
    dp_rank: int = 0


class AllBlocksCleared(KvEvent, frozen=True, kw_only=True, omit_defaults=True):
    """Every block of ``worker_id`` in ``tier`` (all tiers when None) is gone."""

    TYPE: ClassVar[str] = "AllBlocksCleared"
    VERSION: ClassVar[int] = 1
    tier: Tier | None = None
    dp_rank: int = 0


# --------------------------------------------------------------------------------------------
# Request lifecycle (stream "requests", keyed by request id)
# --------------------------------------------------------------------------------------------


class RequestEvent(Event, frozen=True, kw_only=True, omit_defaults=True):
    """Base of the request events. From v2 the request id is on the wire once, as the envelope's
    key (the Kafka record's key too): ``request_id`` is not in the payload's bytes, and the
    envelope's ``corr`` (the request the event belongs to) is not either; the codec reads both
    back from the key. v1 payloads carried it (and ``corr``) besides the key: three copies of one
    id in every event, about 90 of a ~350-byte ``PrefillCompleted``."""

    STREAM: ClassVar[str] = "requests"
    KEY_FIELD: ClassVar[str | None] = "request_id"
    #: The envelope's key (see the class docstring); "" only while a v2 payload is on the wire.
    request_id: RequestId = ""

    def key(self) -> str:
        return self.request_id


class RequestAdmitted(RequestEvent, frozen=True, kw_only=True, omit_defaults=True):
    """The router accepted a request. Carries what any later re-scoring needs."""

    TYPE: ClassVar[str] = "RequestAdmitted"
    VERSION: ClassVar[int] = 2
    model: str
    prompt_tokens: int
    max_tokens: int
    stream: bool = False
    #: Chained block hashes of the prompt's full blocks, under ``hash_algo``/``block_size``.
    block_hashes: list[BlockHash] = []
    block_size: int
    hash_algo: str
    endpoint: str = "completions"
    priority: int = 0
    #: The client's own id for the request (metadata only: ``request_id`` is the router's).
    client_request_id: str | None = None


# Not kw_only: the native decision core builds a row per candidate per decision by position
# (``control_plane.router.scoring._ROW_AT``), several times cheaper than matching 15 keyword
# names. Build it with keywords anywhere else; new fields go at the end, with defaults.
class CandidateScore(msgspec.Struct, frozen=True, omit_defaults=True):
    """One row of a routing decision's score table."""

    worker_id: WorkerId
    #: Matched prefix length in blocks, and how many of those blocks sit in each tier.
    overlap_blocks: int = 0
    overlap_by_tier: dict[str, int] = {}
    #: Load inputs as the router saw them (including its own in-flight accounting).
    queued_prefill_tokens: int = 0
    active_decode_blocks: int = 0
    inflight_requests: int = 0
    stale: bool = False
    #: Terms of the cost and the cost itself (lower wins); None when the mode has no cost.
    prefill_blocks: float = 0.0
    decode_blocks: float = 0.0
    cost: float | None = None
    #: Sampling probability when the decision samples (temperature > 0).
    probability: float | None = None
    eligible: bool = True
    #: Blocks of the prompt held by this router's in-flight requests on this worker (counted
    #: as overlap at full weight, since the engine will store them once).
    speculative_overlap: int = 0
    #: Why an ineligible row was excluded ("draining", "role", "capacity", "imbalance"...).
    excluded: str = ""
    #: The worker's device KV capacity in blocks as the router saw it (0 = unknown).
    kv_capacity_blocks: int = 0
    #: Peer fetch: the worker holding the ``overlap_by_tier["peer"]`` blocks this one would pull
    #: (empty when there is no peer reach). Added in place (a default, omitted when unset).
    peer_from: WorkerId = ""
    #: The TTFT (ms) this worker would give the request (``control_plane/router/ttft.py``, under
    #: its fitted model): the cost itself when ``RouterConfig.cost`` is ``ttft``. None for a
    #: decode phase and in logs written before rows carried it. Added in place.
    predicted_ttft_ms: float | None = None
    #: Of ``queued_prefill_tokens``, what the worker's load report adds beyond this router's own
    #: in-flight prefill tokens there (its ledger). ``predicted_ttft_ms`` waits behind the rest
    #: (``ttft.queue_ahead``): the report lags by its interval and keeps work already done in
    #: the queue (on the bench e2e logs, prediction error p50/p90 0.203/0.982 with it,
    #: 0.170/0.641 without). 0 (omitted) when the ledger covers the queue, in rows without a
    #: prediction, and in logs written before the field existed (whose predictions waited
    #: behind ``queued_prefill_tokens``). Added in place.
    report_only_prefill_tokens: int = 0
    #: Session affinity (``RouterConfig.session_affinity``, ``docs/sessions.md``), on the row of
    #: the worker the request's session last went to: ``applied`` (the decision kept it there)
    #: or ``yielded`` (another worker's predicted TTFT beat it by the margin, or it no longer
    #: competed). "" (omitted) on every other row, without a session, and in older logs.
    session_affinity: str = ""


class PairScore(msgspec.Struct, frozen=True, omit_defaults=True):
    """One (prefill worker, decode worker) pair of a disaggregated request's joint choice
    (``RouterConfig.pd_pairs``, ``control_plane/router/pairs.py``): the times the pair's cost
    sums, as the router predicted them. Added with the joint choice (absent before it)."""

    prefill_worker: WorkerId
    decode_worker: WorkerId
    #: The prefill worker's predicted TTFT (its row's ``predicted_ttft_ms``).
    prefill_ttft_ms: float = 0.0
    #: The hand-off between the two: the KV transfer and the decode worker's first step, as
    #: fitted from this router's own decode hops (decode decision to first token).
    transfer_ms: float = 0.0
    #: The decode worker's predicted inter-token latency with this request joined.
    itl_ms: float = 0.0
    #: ``(itl_ms - RouterConfig.itl_slo_ms) x expected output tokens`` when over the SLO, else 0.
    itl_penalty_ms: float = 0.0
    #: ``prefill_ttft_ms + transfer_ms + itl_ms + itl_penalty_ms``: lower wins.
    cost: float = 0.0
    #: KV blocks of requests already paired with the decode worker and not handed off yet
    #: (``itl_ms`` counts them joined: without them a burst pairs with one decode worker).
    paired_blocks: int = 0


class TtftModel(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Parameters of the router's TTFT prediction (``control_plane/router/ttft.py``), in
    milliseconds or tokens, with the evidence behind them: the prior, or a fit from the log
    (``control_plane/router/ttft_fit.py``). The chosen worker's is recorded with each decision
    (``RequestRouted.ttft_model``) so replay's table check re-derives its prediction; the state
    check re-derives every model from the log."""

    #: Fixed cost of one request, whatever its length (HTTP, scheduling, the P/D handoff and
    #: the decode worker's first step).
    base_ms: float = 0.0
    #: Fixed cost of one engine step.
    step_ms: float = 2.0
    #: Cost of one prompt token, context aside (the weights' share).
    ms_per_token: float = 0.05
    #: Extra cost of one prompt token per token of context it attends to.
    ms_per_token_ctx: float = 2e-6
    #: Prompt tokens one step computes at most (vLLM's ``max_num_batched_tokens``).
    chunk_tokens: int = 2048
    #: Confidence: the observations behind the fit, the worker's own and its pool's (all
    #: workers of the router's log in the fit window); 0 and 0 is the prior.
    samples: int = 0
    pool_samples: int = 0
    #: At one decision, the tokens of the queue ahead that the worker has computed since they
    #: were routed (``ttft.queue_done``: the router's in-flight prefills drained first come,
    #: first served at this model's rate); the prediction waits behind the rest. None for a
    #: model not bound to a decision, and in events written before the drain existed (added in
    #: place, omitted when None: every earlier payload decodes to the same model, and replay
    #: re-derives those decisions without the drain).
    queue_done_tokens: int | None = None
    #: Extra cost of one engine step per KV block the worker's requests in flight hold (the
    #: decodes sharing the step's batch: an engine's step time grows with the context they
    #: attend to, ``data_plane/engines/timing.py``), times the prediction's steps. None in models
    #: written before it existed (added in place, omitted when None): no decode term, and the fit
    #: behind them did not see it.
    ms_per_decode_block_step: float | None = None
    #: Extra cost of one engine step per squared prompt token the step computes, batch-wide (an
    #: engine whose step time grows faster than linearly with its tokens: the mocker profile's
    #: ``prefill_c2``). Set, the prediction forms the engine's steps (``ttft.packed_steps``: the
    #: queue ahead and the request's own tokens packed first come first served into steps of
    #: ``chunk_tokens``, the request sharing the queue's last step) and this costs each step's
    #: tokens squared; ``ms_per_token_ctx`` then prices the request's own context only. None in
    #: models written before it existed (added in place, omitted when None): the queue counted as
    #: one prompt (its tokens squared at ``ms_per_token_ctx``), in steps apart from the request's.
    ms_per_step_token_sq: float | None = None
    #: At one decision, the rate (prompt tokens per ms) the worker was seen to compute its
    #: prefills at (``TtftFit.drain_rate``: the router's own prefills there, tokens over busy
    #: time, in the fit window), which the queue ahead drains at (``queue_done_tokens``) and
    #: the engine's full steps before the request's last one go at (``ttft.rate_split``); the
    #: costs then price that last step alone. None: no prefill seen yet, or a model not bound
    #: to a decision, or written before it existed (added in place, omitted when None): the
    #: costs price every step.
    queue_tokens_per_ms: float | None = None
    #: At one decision, the engine steps already under way on the worker that the request waits
    #: to end before its own first step: 1 when this router had prefills on it not seen end or
    #: requests holding KV blocks there (decoding: every step of the worker's is theirs too),
    #: else 0 (an engine adds a request at a step boundary, so one arriving mid-step waits for
    #: the rest of that step); each costs ``step_ms`` (``ttft.features``: the steps
    #: feature). None: a model not bound to a decision, or written before it existed (added in
    #: place, omitted when None: the request's own steps only, and replay re-derives such a
    #: decision, and its fit, without it).
    busy_steps: int | None = None

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1 or min(self.base_ms, self.step_ms, self.ms_per_token, self.ms_per_token_ctx,
                                        self.ms_per_decode_block_step or 0.0, self.ms_per_step_token_sq or 0.0) < 0:
            raise ValueError(f"TtftModel: chunk_tokens must be >= 1 and the costs >= 0, got {self}")
        if self.queue_tokens_per_ms is not None and not self.queue_tokens_per_ms > 0:
            raise ValueError(f"TtftModel: queue_tokens_per_ms must be > 0, got {self.queue_tokens_per_ms}")
        if self.queue_done_tokens is not None and self.queue_done_tokens < 0:
            raise ValueError(f"TtftModel: queue_done_tokens must be >= 0, got {self.queue_done_tokens}")
        if self.busy_steps is not None and self.busy_steps < 0:
            raise ValueError(f"TtftModel: busy_steps must be >= 0, got {self.busy_steps}")

    def tokens_per_ms(self, decode_blocks: int = 0) -> float:
        """The rate a busy worker computes prompt tokens at under this model: full steps of
        ``chunk_tokens``, context aside (infinite when the model gives tokens no cost). A model
        with the engine's steps (``ms_per_step_token_sq`` set) slows each step by the
        ``decode_blocks`` decoding beside it; one without ignores them."""
        c = self.chunk_tokens
        per_step = self.step_ms + c * self.ms_per_token
        if self.ms_per_step_token_sq is not None:
            per_step += c * c * self.ms_per_step_token_sq + (self.ms_per_decode_block_step or 0.0) * decode_blocks
        return self.chunk_tokens / per_step if per_step > 0 else math.inf

    def prefill_ms(self, new_tokens: int, context_tokens: int = 0) -> float:
        """Time to compute ``new_tokens`` after ``context_tokens`` already in the KV: the sum of
        the steps' costs, in closed form (the chunks tile the ``N`` new tokens, so their
        attention terms add up to ``N * context + N^2 / 2`` whatever the chunk size)."""
        if new_tokens <= 0:
            return 0.0
        steps = -(-new_tokens // self.chunk_tokens)
        return (steps * self.step_ms + new_tokens * self.ms_per_token
                + self.ms_per_token_ctx * new_tokens * (context_tokens + new_tokens / 2))


class AdmissionTerms(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The terms of the router's TTFT budget test (``control_plane/router/admission.py``,
    ``over_budget``) as it applied them to one request, so that replay re-executes the test from
    the log instead of reading its text: refused when ``predicted_ttft_ms * max(margin, 1) +
    spent_ms + loop_lag_ms > budget_ms`` (or ``queue_ms`` in place of the product when larger),
    unless ``idle``; from ``rule`` 3 the larger of the two times ``spread`` (and, in rule 3
    alone, the loop lag twice). Milliseconds."""

    #: The request's budget: the router's ``ttft_slo_ms``, tightened by the client's own.
    budget_ms: float
    #: The predicted TTFT and worker of the row the test judged (``chosen``: the decision's
    #: choice; else the best eligible row); None when that row carried no prediction, or the
    #: test ran before any decision (a request that waited out its budget in the admission queue).
    predicted_ttft_ms: float | None = None
    worker_id: str = ""
    #: ``PromiseMargin.factor`` at the decision: how far recent predictions fell short (from
    #: rule 3, on ``worker_id``'s requests alone).
    margin: float = 1.0
    #: ``PromiseMargin.queue_ms`` at the decision: the TTFT the router's own requests waiting
    #: for their first token imply (the test takes the larger of it and the prediction x margin).
    queue_ms: float = 0.0
    #: What the request had spent in the router since it arrived (its body, its tokens, the
    #: admission queue).
    spent_ms: float = 0.0
    #: The router's own event-loop lag, smoothed.
    loop_lag_ms: float = 0.0
    #: The router had nothing in flight and a fitted model: the request is never refused.
    idle: bool = False
    #: When the test ran (unix s; the decision's ``now``, which the margin's lower bounds are
    #: taken at): replay re-derives ``margin`` from the router's ledger folded to it.
    at_s: float = 0.0
    #: True: ``predicted_ttft_ms`` is the chosen worker's row (the promise is about the request
    #: as routed). False, in terms written before the field: the best eligible row's, whichever
    #: worker the decision chose; replay re-executes each with its own rule.
    chosen: bool = False
    #: The version of the test's rule (``admission.terms_rule``): 0 in terms written before the
    #: field, whose rule ``chosen`` tells (1: the best row, the queue's waiting counted once; 2:
    #: the chosen row, counted twice); 3: as 2, the loop lag counted twice (the request meets
    #: it on its way in and its first token on its way out) and ``margin`` the judged worker's
    #: own (``PromiseMargin.factor(worker)``); 4: as 3, the loop lag once again and
    #: ``others_waiting`` in ``queue_ms``.
    rule: int = 0
    #: Rule 3: what the expected TTFT (the larger of the prediction x margin and the queue) is
    #: multiplied by: ``admission.OVERLOAD_SPREAD`` while the router is offered more than its
    #: box serves (``PromiseMargin.spread``), else 1.
    spread: float = 1.0
    #: Rule 4: the other router replicas' requests waiting for their first token, as this
    #: router last read them (shared through Redis, ``shared_gate.SharedWaiting``), counted once
    #: each in ``queue_ms``; 0 in terms written before the field, or with no shared count.
    others_waiting: int = 0


class RequestRouted(RequestEvent, frozen=True, kw_only=True, omit_defaults=True):
    """The router chose ``worker_id`` for one phase of a request, and why."""

    TYPE: ClassVar[str] = "RequestRouted"
    VERSION: ClassVar[int] = 3
    worker_id: WorkerId
    phase: RequestPhase = RequestPhase.AGGREGATED
    mode: RoutingMode
    scores: list[CandidateScore] = []
    reason: str = ""
    config_version: int
    rng_seed: int
    #: Index position the decision was made on: consumed offset per "topic:partition".
    index_position: dict[str, int] = {}
    router_id: str = ""
    attempt: int = 0
    #: Round-robin cursor the decision started from (needed to re-execute round_robin).
    rr_cursor: str | None = None
    #: Guards that narrowed the candidate set ("capacity", "imbalance").
    guards: list[str] = []
    #: Output tokens the router assumed for the decode term.
    expected_output_tokens: int = 0
    #: The router view's state when deciding: EXACT, DEGRADED or LOADING.
    view_state: str = ""
    #: Workers excluded because an earlier attempt of this request failed on them, or because
    #: their predicted TTFT broke the request's budget while another's kept it
    #: (``admission.budget_detour``).
    excluded_workers: list[str] = []
    #: The ``now`` (unix seconds) the decision and the in-flight ledger used: with it, the
    #: ledger can be rebuilt exactly from RequestRouted / PrefillCompleted / RequestCompleted.
    decided_at_s: float = 0.0
    #: Milliseconds the request waited in the router's admission queue before this decision
    #: (first attempt only; see ``control_plane/router/admission.py``).
    queued_ms: float = 0.0
    #: What the router's in-flight ledger holds for this route (the ledger is a fold of the
    #: router's own events, ``control_plane/router/ledger.py``): prompt tokens the chosen worker
    #: must still compute, every KV block the request holds there, and the entry's lifetime.
    #: Absent in logs written before the fields existed: the fold derives the first two from
    #: the chosen worker's score row, and takes the router default for the lifetime.
    inflight_prefill_tokens: int | None = None
    inflight_blocks: int | None = None
    inflight_ttl_s: float | None = None
    #: The TTFT (ms) the router predicted on the chosen worker (``control_plane/router/ttft.py``,
    #: from the chosen row); None in logs written before the field existed, and for a decode
    #: phase (not modelled yet).
    predicted_ttft_ms: float | None = None
    #: The model behind ``predicted_ttft_ms`` (the chosen worker's fit, or the prior); None in
    #: logs written before the field existed (the prior then) and for a decode phase.
    ttft_model: TtftModel | None = None
    #: Deprecated (no longer written; kept so that logs which have it still decode): the models
    #: behind the other rows' ``predicted_ttft_ms``, by worker, those that were not the prior.
    #: Up to N-1 models' bytes on every routed event for facts the log already holds: every
    #: model is a fold of the router's own events (``ttft_fit.py``), which replay's state check
    #: re-derives, and each row records its prediction, which the table check takes as recorded
    #: for a worker whose model the event does not carry (``replay/verify.py``).
    ttft_models: dict[WorkerId, TtftModel] = {}
    #: The TTFT budget test's terms at this decision (a first attempt with a budget set: it
    #: admitted the request); None without a budget, and in v1/v2 events.
    admission: AdmissionTerms | None = None
    #: P/D pairs chosen together (``RouterConfig.pd_pairs``): on a prefill decision the decode
    #: worker chosen with it, on the decode decision the pairing it honoured (or, when that
    #: worker could no longer take it, passed over). Empty without a pairing.
    paired_worker_id: WorkerId = ""
    #: A prefill decision's pairs, each with its predicted times (``PairScore``), and the decode
    #: candidates' score rows the pairs were built on (as a decode decision would record them).
    pairs: list[PairScore] = []
    decode_scores: list[CandidateScore] = []
    #: The client's session id (``x-session-id``, or the ``user`` field for a key that opts in):
    #: the session fold (``control_plane/router/sessions.py``) reads it back for the session's
    #: next turn. "" without one, and in logs written before the field existed.
    session: str = ""
    #: The worker the session's previous turn went to, as the fold gave it to this decision
    #: (within ``RouterConfig.session_ttl_s``): the affinity's input, recorded like
    #: ``rr_cursor`` so that the decision re-executes from its event. "" without one.
    session_worker: WorkerId = ""


class PrefillCompleted(RequestEvent, frozen=True, kw_only=True, omit_defaults=True):
    TYPE: ClassVar[str] = "PrefillCompleted"
    VERSION: ClassVar[int] = 2
    worker_id: WorkerId
    prompt_tokens: int
    cached_tokens: int = 0
    duration_ms: float
    #: Opaque handoff parameters for the decode side (block ids, agent, expiry).
    kv_transfer_params: dict[str, str | int | float | bool | list[int] | None] = {}


class FirstToken(RequestEvent, frozen=True, kw_only=True, omit_defaults=True):
    """In disaggregated serving, the request's first token reached the router from its decode
    worker (in aggregated serving the router's own ``PrefillCompleted`` marks that moment). It
    ends the request's wait in the TTFT budget's margin (``PromiseMargin``): until then, a
    request past its prediction is a lower bound of how far predictions fall short, the decode
    hop (the KV handoff, the decode worker's first step) included."""

    TYPE: ClassVar[str] = "FirstToken"
    VERSION: ClassVar[int] = 1
    worker_id: WorkerId
    #: From the router holding the request to its first token (ms).
    ttft_ms: float


class KvTransferEvent(RequestEvent, frozen=True, kw_only=True, omit_defaults=True):
    """What every event of one KV transfer (started, completed, failed) says about it.

    A base, not an event type (no ``TYPE``): its fields come first in each subclass, in this
    order, so each event's wire form is the one it had when it spelled them out itself.
    """

    transfer_id: str
    src_worker: WorkerId
    dst_worker: WorkerId
    blocks: int
    bytes: int
    backend: str
    #: Why the blocks moved: "handoff" (prefill -> decode) or "peer_fetch" (a worker pulled a
    #: prefix another worker holds, instead of recomputing it). Added in place (a default,
    #: omitted when unset), so every earlier payload still decodes to the same event.
    purpose: str = "handoff"


class KvTransferStarted(KvTransferEvent, frozen=True, kw_only=True, omit_defaults=True):
    TYPE: ClassVar[str] = "KvTransferStarted"
    VERSION: ClassVar[int] = 2


class KvTransferCompleted(KvTransferEvent, frozen=True, kw_only=True, omit_defaults=True):
    TYPE: ClassVar[str] = "KvTransferCompleted"
    VERSION: ClassVar[int] = 2
    duration_ms: float


class KvTransferFailed(KvTransferEvent, frozen=True, kw_only=True, omit_defaults=True):
    TYPE: ClassVar[str] = "KvTransferFailed"
    VERSION: ClassVar[int] = 2
    #: A transfer may fail before any byte moved: here the size is optional (the field keeps
    #: its place in the base's order).
    bytes: int = 0
    duration_ms: float
    reason: str
    #: What happened to the request: "recompute" on the decode side, or "failed".
    fallback: str = "failed"


class RequestCompleted(RequestEvent, frozen=True, kw_only=True, omit_defaults=True):
    TYPE: ClassVar[str] = "RequestCompleted"
    VERSION: ClassVar[int] = 2
    worker_id: WorkerId
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    ttft_ms: float
    itl_mean_ms: float = 0.0
    itl_p50_ms: float = 0.0
    itl_p99_ms: float = 0.0
    e2e_ms: float
    finish_reason: str = "length"


class RequestFailed(RequestEvent, frozen=True, kw_only=True, omit_defaults=True):
    TYPE: ClassVar[str] = "RequestFailed"
    VERSION: ClassVar[int] = 2
    worker_id: WorkerId | None = None
    reason: str
    #: Machine-readable cause: "worker_error", "worker_lost", "timeout", "transfer_failed"...
    code: str
    tokens_sent: int = 0
    #: True when the router will retry on another worker (no token reached the client yet).
    retried: bool = False


class RequestRejected(RequestEvent, frozen=True, kw_only=True, omit_defaults=True):
    TYPE: ClassVar[str] = "RequestRejected"
    VERSION: ClassVar[int] = 3
    reason: str
    code: str
    http_status: int = 400
    #: The TTFT budget test's terms when it refused the request (``code`` ``ttft_budget``);
    #: None for other refusals and in v1/v2 events.
    admission: AdmissionTerms | None = None


# --------------------------------------------------------------------------------------------
# Worker lifecycle (stream "workers", keyed by worker id)
# --------------------------------------------------------------------------------------------


class WorkerEvent(Event, frozen=True, kw_only=True, omit_defaults=True):
    STREAM: ClassVar[str] = "workers"
    worker_id: WorkerId

    def key(self) -> str:
        return self.worker_id


class TransferInfo(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How peers reach this worker's KV bytes."""

    backend: str = "UCX"
    agent_name: str = ""
    #: Serialized NIXL agent metadata (``get_agent_metadata()``).
    agent_metadata: bytes = b""
    bytes_per_block: int = 0


class WorkerRegistered(WorkerEvent, frozen=True, kw_only=True, omit_defaults=True):
    """A worker incarnation came up. The envelope's epoch is the incarnation."""

    TYPE: ClassVar[str] = "WorkerRegistered"
    VERSION: ClassVar[int] = 1
    role: WorkerRole
    pool: PoolName
    endpoint: str
    model: str = ""
    #: Capacity in blocks per tier name.
    capacity: dict[str, int] = {}
    block_size: int
    hash_algo: str
    transfer: TransferInfo | None = None


class WorkerLoadReportedV1(WorkerEvent, frozen=True, kw_only=True, omit_defaults=True):
    """v1 (superseded): one device usage fraction. Upcast to v2 on read."""

    TYPE: ClassVar[str] = "WorkerLoadReported"
    VERSION: ClassVar[int] = 1
    running: int
    waiting: int
    kv_usage: float
    queued_prefill_tokens: int = 0
    active_decode_blocks: int = 0


class WorkerLoadReported(WorkerEvent, frozen=True, kw_only=True, omit_defaults=True):
    """Periodic load snapshot of one worker.

    v2 replaced v1's single ``kv_usage`` with ``tier_usage`` so host/disk tiers are visible.
    """

    TYPE: ClassVar[str] = "WorkerLoadReported"
    VERSION: ClassVar[int] = 2
    running: int
    waiting: int
    #: Used fraction (0..1) per tier name.
    tier_usage: dict[str, float] = {}
    queued_prefill_tokens: int = 0
    active_decode_blocks: int = 0


class WorkerDraining(WorkerEvent, frozen=True, kw_only=True, omit_defaults=True):
    TYPE: ClassVar[str] = "WorkerDraining"
    VERSION: ClassVar[int] = 1
    reason: str = ""
    inflight: int = 0


class WorkerDeregistered(WorkerEvent, frozen=True, kw_only=True, omit_defaults=True):
    TYPE: ClassVar[str] = "WorkerDeregistered"
    VERSION: ClassVar[int] = 1
    reason: str = ""


# --------------------------------------------------------------------------------------------
# Planner (stream "planner", keyed by pool)
# --------------------------------------------------------------------------------------------


class PlannerEvent(Event, frozen=True, kw_only=True, omit_defaults=True):
    STREAM: ClassVar[str] = "planner"
    pool: PoolName

    def key(self) -> str:
        return self.pool


class ScalingDecision(PlannerEvent, frozen=True, kw_only=True, omit_defaults=True):
    TYPE: ClassVar[str] = "ScalingDecision"
    VERSION: ClassVar[int] = 1
    decision_id: str
    role: WorkerRole
    from_replicas: int
    to_replicas: int
    reason: str
    #: Named inputs (predictions, profile lookups, corrections) the decision used.
    inputs: dict[str, float | int | str] = {}
    predictor: str = ""
    config_version: int
    #: Leader-lease fencing token; scalers reject decisions older than the newest they saw.
    fencing_token: int = 0
    #: Added in v1 with defaults (older payloads decode unchanged): the request rate (req/s)
    #: the pool was sized for, how far ahead it was forecast (s), the headroom added on top
    #: from the forecast's measured error (fraction), the start-up time allowed for new
    #: replicas (s), and the term that bound the target: "ttft" or "itl" (that SLO's sizing),
    #: "gpu_budget", "max_replicas", "min_replicas", "pin", or "overload" (the closed loop on
    #: observed attainment and queues sized it; see docs/planner.md).
    forecast_rate: float | None = None
    forecast_horizon_s: float | None = None
    headroom: float | None = None
    startup_allowance_s: float | None = None
    binding: str = ""


class ScalingApplied(PlannerEvent, frozen=True, kw_only=True, omit_defaults=True):
    TYPE: ClassVar[str] = "ScalingApplied"
    VERSION: ClassVar[int] = 1
    decision_id: str
    replicas: int
    success: bool = True
    error: str = ""
    scaler: str = ""


# --------------------------------------------------------------------------------------------
# Operator actions and configuration (stream "admin", keyed by the entity they change)
# --------------------------------------------------------------------------------------------


class AdminEvent(Event, frozen=True, kw_only=True, omit_defaults=True):
    STREAM: ClassVar[str] = "admin"
    #: Who did it: the API token's name (never the token), or "system".
    actor: str
    actor_role: str = ""


class ConfigChanged(AdminEvent, frozen=True, kw_only=True, omit_defaults=True):
    """A new version of one component's config, whole.

    A base, not an event type: each subclass names its ``TYPE`` and ``CONFIG_KEY``, the entity
    key (see the admin stream) every version of that config shares.
    """

    CONFIG_KEY: ClassVar[str]
    config_version: int
    #: The full config as builtins (not a diff: any version can be re-applied alone).
    config: dict[str, Any] = {}

    def key(self) -> str:
        return self.CONFIG_KEY


class RouterConfigChanged(ConfigChanged, frozen=True, kw_only=True, omit_defaults=True):
    """A new router config version. Decisions name the version they used."""

    TYPE: ClassVar[str] = "RouterConfigChanged"
    VERSION: ClassVar[int] = 1
    CONFIG_KEY: ClassVar[str] = "router-config"


class PlannerConfigChanged(ConfigChanged, frozen=True, kw_only=True, omit_defaults=True):
    TYPE: ClassVar[str] = "PlannerConfigChanged"
    VERSION: ClassVar[int] = 1
    CONFIG_KEY: ClassVar[str] = "planner-config"


class PoolUpdated(AdminEvent, frozen=True, kw_only=True, omit_defaults=True):
    """SLO targets and bounds of a pool (the full new state)."""

    TYPE: ClassVar[str] = "PoolUpdated"
    VERSION: ClassVar[int] = 1
    pool: PoolName
    role: WorkerRole
    ttft_slo_ms: float | None = None
    itl_slo_ms: float | None = None
    min_replicas: int = 0
    max_replicas: int = 0
    gpus_per_replica: int = 1
    gpu_budget: int | None = None

    def key(self) -> str:
        return self.pool


class PoolPinned(AdminEvent, frozen=True, kw_only=True, omit_defaults=True):
    """Manual override of a pool's size; ``replicas=None`` unpins (the planner decides again)."""

    TYPE: ClassVar[str] = "PoolPinned"
    VERSION: ClassVar[int] = 1
    pool: PoolName
    replicas: int | None = None
    reason: str = ""

    def key(self) -> str:
        return self.pool


class WorkerDrainRequested(AdminEvent, frozen=True, kw_only=True, omit_defaults=True):
    """An operator asked a worker to drain; the scaler owning it acts, the worker then emits
    WorkerDraining / WorkerDeregistered itself."""

    TYPE: ClassVar[str] = "WorkerDrainRequested"
    VERSION: ClassVar[int] = 1
    worker_id: WorkerId
    reason: str = ""

    def key(self) -> str:
        return self.worker_id


class AdminAction(AdminEvent, frozen=True, kw_only=True, omit_defaults=True):
    """Any other mutating admin call (token created/revoked, replay job started...)."""

    TYPE: ClassVar[str] = "AdminAction"
    VERSION: ClassVar[int] = 1
    action: str
    target: str
    details: dict[str, str | int | float | bool | None] = {}

    def key(self) -> str:
        return self.target


class RouterKeyEvent(AdminEvent, frozen=True, kw_only=True, omit_defaults=True):
    """Base of the events about one router API key (not an event type): keyed by the key id."""

    key_id: str

    def key(self) -> str:
        return f"router-key:{self.key_id}"


class RouterKeyIssued(RouterKeyEvent, frozen=True, kw_only=True, omit_defaults=True):
    """A router API key was issued (the admin API, an admin's call). Routers fold it into their
    key table: a bearer ``sk-sy_<key_id>_<secret>`` whose secret hashes to ``key_hash`` with
    ``salt`` (sha256(salt || secret), :mod:`common.bearer`) may call the generation routes. The
    secret itself is never on the log: it is shown once, to the caller who issued the key."""

    TYPE: ClassVar[str] = "RouterKeyIssued"
    VERSION: ClassVar[int] = 1
    #: Who or what the key is for (unique among live keys; shown in lists and logs).
    name: str
    #: Hex salt and hex sha256(salt || secret).
    salt: str
    key_hash: str
    #: Unix ns after which the key stops authenticating; None: it does not expire.
    expires_at_ns: int | None = None
    #: Requests per second the key may start (token bucket) and the burst above that rate;
    #: None: no rate limit.
    rate_per_s: float | None = None
    burst: int | None = None
    #: Requests the key may have in flight at once; None: no limit.
    max_concurrent: int | None = None
    #: The OpenAI ``user`` field of this key's requests names their session (as an
    #: ``x-session-id`` header would; ``docs/sessions.md``). False (omitted) by default, and in
    #: keys issued before the field existed: ``user`` is then only metadata.
    session_from_user: bool = False


class RouterKeyRevoked(RouterKeyEvent, frozen=True, kw_only=True, omit_defaults=True):
    """A router API key stops authenticating (for good: a key id is never issued again)."""

    TYPE: ClassVar[str] = "RouterKeyRevoked"
    VERSION: ClassVar[int] = 1
    reason: str = ""


# --------------------------------------------------------------------------------------------
# Superseded request event versions: v1 carried the request id in the payload besides the key
# --------------------------------------------------------------------------------------------


class RequestAdmittedV1(RequestAdmitted, frozen=True, kw_only=True, omit_defaults=True):
    """v1 (superseded): ``request_id`` in the payload too. Upcast to v2 on read."""

    VERSION: ClassVar[int] = 1
    KEY_FIELD: ClassVar[str | None] = None
    request_id: RequestId


class RequestRoutedV1(RequestRouted, frozen=True, kw_only=True, omit_defaults=True):
    """v1 (superseded): ``request_id`` in the payload too. Upcast to v2 on read."""

    VERSION: ClassVar[int] = 1
    KEY_FIELD: ClassVar[str | None] = None
    request_id: RequestId


class PrefillCompletedV1(PrefillCompleted, frozen=True, kw_only=True, omit_defaults=True):
    """v1 (superseded): ``request_id`` in the payload too. Upcast to v2 on read."""

    VERSION: ClassVar[int] = 1
    KEY_FIELD: ClassVar[str | None] = None
    request_id: RequestId


class KvTransferStartedV1(KvTransferStarted, frozen=True, kw_only=True, omit_defaults=True):
    """v1 (superseded): ``request_id`` in the payload too. Upcast to v2 on read."""

    VERSION: ClassVar[int] = 1
    KEY_FIELD: ClassVar[str | None] = None
    request_id: RequestId


class KvTransferCompletedV1(KvTransferCompleted, frozen=True, kw_only=True, omit_defaults=True):
    """v1 (superseded): ``request_id`` in the payload too. Upcast to v2 on read."""

    VERSION: ClassVar[int] = 1
    KEY_FIELD: ClassVar[str | None] = None
    request_id: RequestId


class KvTransferFailedV1(KvTransferFailed, frozen=True, kw_only=True, omit_defaults=True):
    """v1 (superseded): ``request_id`` in the payload too. Upcast to v2 on read."""

    VERSION: ClassVar[int] = 1
    KEY_FIELD: ClassVar[str | None] = None
    request_id: RequestId


class RequestCompletedV1(RequestCompleted, frozen=True, kw_only=True, omit_defaults=True):
    """v1 (superseded): ``request_id`` in the payload too. Upcast to v2 on read."""

    VERSION: ClassVar[int] = 1
    KEY_FIELD: ClassVar[str | None] = None
    request_id: RequestId


class RequestFailedV1(RequestFailed, frozen=True, kw_only=True, omit_defaults=True):
    """v1 (superseded): ``request_id`` in the payload too. Upcast to v2 on read."""

    VERSION: ClassVar[int] = 1
    KEY_FIELD: ClassVar[str | None] = None
    request_id: RequestId


class RequestRoutedV2(RequestRouted, frozen=True, kw_only=True, omit_defaults=True):
    """v2 (superseded): no ``admission`` terms. Upcast to v3 on read."""

    VERSION: ClassVar[int] = 2


class RequestRejectedV2(RequestRejected, frozen=True, kw_only=True, omit_defaults=True):
    """v2 (superseded): no ``admission`` terms. Upcast to v3 on read."""

    VERSION: ClassVar[int] = 2


class RequestRejectedV1(RequestRejected, frozen=True, kw_only=True, omit_defaults=True):
    """v1 (superseded): ``request_id`` in the payload too. Upcast to v2 on read."""

    VERSION: ClassVar[int] = 1
    KEY_FIELD: ClassVar[str | None] = None
    request_id: RequestId


#: Every payload type the codec knows, current and superseded versions alike.
ALL_EVENT_TYPES: tuple[type[Event], ...] = (
    BlockStored,
    BlockRemoved,
    BlockMoved,
    AllBlocksCleared,
    RequestAdmittedV1,
    RequestAdmitted,
    RequestRoutedV1,
    RequestRoutedV2,
    RequestRouted,
    PrefillCompletedV1,
    PrefillCompleted,
    FirstToken,
    KvTransferStartedV1,
    KvTransferStarted,
    KvTransferCompletedV1,
    KvTransferCompleted,
    KvTransferFailedV1,
    KvTransferFailed,
    RequestCompletedV1,
    RequestCompleted,
    RequestFailedV1,
    RequestFailed,
    RequestRejectedV1,
    RequestRejectedV2,
    RequestRejected,
    WorkerRegistered,
    WorkerLoadReportedV1,
    WorkerLoadReported,
    WorkerDraining,
    WorkerDeregistered,
    ScalingDecision,
    ScalingApplied,
    RouterConfigChanged,
    PlannerConfigChanged,
    PoolUpdated,
    PoolPinned,
    WorkerDrainRequested,
    AdminAction,
    RouterKeyIssued,
    RouterKeyRevoked,
)
