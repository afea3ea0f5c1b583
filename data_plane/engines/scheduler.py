"""Continuous-batching scheduler (vLLM v1 semantics, Dynamo mocker details). Pure: no clock.

One call to :meth:`Scheduler.schedule` plans a step; :meth:`Scheduler.update` applies it
(samples tokens, finishes requests). Between the two the driver asks the timing model how long
the step lasts.

The rules (running first, then waiting; preemption; admission; loads beside the steps; roles):
``docs/engine.md``, "The scheduler".
"""

from __future__ import annotations

import heapq
import logging
from collections import Counter, deque
from dataclasses import dataclass, field

from data_plane.engines.errors import RequestRejected
from data_plane.engines.kv_manager import KVCacheManager
from data_plane.engines.profiles import Admission, HardwareProfile
from data_plane.engines.request import EngineRequest, RequestState, Status, pseudo_token
from data_plane.engines.tiers import LowerTiers, OnboardCosts, OnboardPlan, plan_onboard
from data_plane.engines.timing import StepShape
from schemas.events import KvEvent
from schemas.types import RequestId, RequestPhase, Tier, WorkerRole

logger = logging.getLogger(__name__)

_ROLE_PHASE = {
    WorkerRole.PREFILL: RequestPhase.PREFILL,
    WorkerRole.DECODE: RequestPhase.DECODE,
    WorkerRole.AGGREGATED: RequestPhase.AGGREGATED,
}


@dataclass(frozen=True, slots=True)
class TokenOutput:
    """One generated token. ``index`` 0 is the request's first output token."""

    request_id: RequestId
    index: int
    token_id: int
    #: The request produced its last token (for the prefill role: it is now held).
    finished: bool = False


@dataclass(slots=True)
class ScheduledStep:
    """A planned step: who computes how many tokens, and what that costs (its shape)."""

    #: (request, tokens computed this step, is a decode token)
    entries: list[tuple[RequestState, int, bool]] = field(default_factory=list)
    shape: StepShape = field(default_factory=StepShape)
    #: Requests admitted for the first time, with the prompt tokens served from the cache.
    admitted: list[tuple[RequestId, int]] = field(default_factory=list)
    preempted: list[RequestId] = field(default_factory=list)
    #: First admissions that load tokens from a tier below: (request id, tokens loaded, ms until
    #: they are in: the load, behind those already on the link). The load runs beside the steps;
    #: the request computes from the first step that starts after it.
    onboarded: list[tuple[RequestId, int, float]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class OnboardStats:
    """What the engine did with prefixes found below the device, since it started."""

    #: Blocks loaded to the device instead of recomputed, by source tier.
    loaded: dict[Tier, int]
    #: Blocks found below that were recomputed because loading them cost more (counted at
    #: each admission that found them).
    skipped: int
    #: Blocks planned for a load that failed (missing, corrupt, I/O error) and were recomputed,
    #: by the reason the tiers gave.
    fallbacks: dict[str, int]
    #: Modelled time spent loading.
    load_ms: float


class Scheduler:
    def __init__(self, profile: HardwareProfile, kv: KVCacheManager, role: WorkerRole, *,
                 tiers: LowerTiers | None = None, onboard_costs: OnboardCosts | None = None) -> None:
        self.profile = profile
        self.kv = kv
        self.role = WorkerRole(role)
        #: The tiers below the device pool, when the engine onboards from them.
        self.tiers = tiers
        self.onboard_costs = onboard_costs or OnboardCosts()
        self._loaded: Counter[Tier] = Counter()
        self._skipped = 0
        self._fallbacks: Counter[str] = Counter()
        self._load_ms = 0.0
        #: Requests whose prefix is being loaded from the tiers: [request, ms until it is in].
        self.loading: list[list] = []
        #: Backlog of the host -> device link (ms until the last load on it is done).
        self._link_ms = 0.0
        self.block_size = profile.block_size
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.held: dict[RequestId, RequestState] = {}
        self.requests: dict[RequestId, RequestState] = {}
        self._arrivals = 0
        self.num_preemptions = 0

    # ------------------------------------------------------------------------------ requests

    def phase_of(self, request: EngineRequest) -> RequestPhase:
        """The phase the engine runs ``request`` in: its own, else the role's."""
        return RequestPhase(request.phase) if request.phase is not None else _ROLE_PHASE[self.role]

    def validate(self, request: EngineRequest) -> None:
        """Raise :class:`RequestRejected` if ``request`` could never run here (its id is in use,
        or prompt plus output would not fit in the whole KV cache even alone)."""
        if request.request_id in self.requests or request.request_id in self.held:
            raise RequestRejected(f"request {request.request_id} is already in the engine")
        bs = self.block_size
        prefill_only = self.phase_of(request) is RequestPhase.PREFILL
        longest = len(request.prompt) + (1 if prefill_only else request.max_tokens)
        if -(-longest // bs) > self.profile.num_device_blocks:
            raise RequestRejected(
                f"request {request.request_id}: {longest} tokens need {-(-longest // bs)} blocks, "
                f"the worker has {self.profile.num_device_blocks}"
            )

    def add_request(self, request: EngineRequest) -> RequestState:
        self.validate(request)
        req = RequestState(request, self._arrivals, self.profile.vocab_size)
        self._arrivals += 1
        phase = self.phase_of(request)
        req.transferred = phase is RequestPhase.DECODE
        req.hold = phase is RequestPhase.PREFILL
        self.requests[req.request_id] = req
        self.waiting.append(req)
        return req

    def release(self, request_id: RequestId) -> bool:
        """Free a held (prefill role) request's blocks. False if it is not held."""
        req = self.held.pop(request_id, None)
        if req is None:
            return False
        self.kv.free(req)
        return True

    def abort(self, request_id: RequestId) -> bool:
        """Drop a request wherever it is, freeing its blocks. False if unknown."""
        if self.release(request_id):
            return True
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.LOADING:
            self.loading = [e for e in self.loading if e[0] is not req]
        else:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = Status.FINISHED
        return True

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.loading)

    def onboard_stats(self) -> OnboardStats:
        return OnboardStats(dict(self._loaded), self._skipped, dict(self._fallbacks), self._load_ms)

    # ------------------------------------------------------------------------------ schedule

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        entries = step.entries
        kv = self.kv
        budget = self.profile.max_num_batched_tokens
        running = self.running

        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = req.prompt_len + req.num_output - req.num_computed_tokens
            if n > budget:
                n = budget
            scheduled = True
            while not kv.allocate_slots(req, n):
                victim = running.pop()
                self._preempt(victim)
                step.preempted.append(victim.request_id)
                if victim is req:
                    scheduled = False
                    break
            if not scheduled:
                break
            entries.append((req, n, self._is_decode(req, n)))
            budget -= n
            i += 1

        if not step.preempted:
            self._admit(step, budget)

        self.seal(step)
        return step

    def seal(self, step: ScheduledStep) -> None:
        """Close a plan: its shape (from the counters before the step), then count its tokens
        as computed."""
        step.shape = self._shape(step.entries)
        for req, n, _ in step.entries:
            req.num_computed_tokens += n

    def _admit(self, step: ScheduledStep, budget: int) -> None:
        kv = self.kv
        bs = self.block_size
        waiting = self.waiting
        running = self.running
        max_seqs = self.profile.max_num_seqs
        chunked = self.profile.enable_chunked_prefill
        whole_prompt = self.profile.admission is Admission.WHOLE_PROMPT
        while waiting and len(running) + len(self.loading) < max_seqs and budget > 0:
            req = waiting[0]
            hits = kv.get_computed_blocks(req)
            hit_tokens = len(hits) * bs
            plan = None
            if self.tiers is not None and not req.transferred and kv.pool.enable_caching:
                plan = self._plan_onboard(req, len(hits))
                hit_tokens += plan.load_blocks * bs  # planned: computed once loaded
            if req.transferred:
                # Decode role: the KV up to the last known token arrived by transfer; only that
                # token is fed. The transferred tokens need blocks but no compute.
                transferred = req.num_tokens - 1 - hit_tokens
                n = 1
            else:
                transferred = 0
                n = req.num_tokens - hit_tokens
                if not chunked and n > budget:
                    break
                if n > budget:
                    n = budget
            if whole_prompt:
                active_hits = sum(1 for b in hits if b.ref_cnt > 0)
                needed = -(-req.num_tokens // bs) - active_hits
                if needed > kv.pool.free_queue.num_free:
                    break
            sources: tuple[Tier, ...] = ()
            if plan is not None and plan.load_blocks:
                loaded = plan.load_blocks * bs
                if not kv.can_allocate(req, loaded + n, hits):
                    break  # decided before any I/O: a refused admission loads nothing
                sources = self._load(req, len(hits), plan)
                if len(sources) < plan.load_blocks:
                    # Fallback: recompute from the first block that did not load.
                    short = (plan.load_blocks - len(sources)) * bs
                    hit_tokens -= short
                    n = min(n + short, budget) if chunked else n + short
                    if not chunked and n > budget:
                        break
            # A loading request gets the blocks of its loaded prefix now (its compute's come
            # when it runs, like any running request's); the others their whole first chunk.
            new_tokens = len(sources) * bs if sources else transferred + n
            if not kv.allocate_slots(req, new_tokens, hits, sources):
                break
            waiting.popleft()
            req.num_computed_tokens = hit_tokens + transferred
            if plan is not None:
                self._skipped += plan.available - plan.load_blocks
            wait_ms = 0.0
            if sources:
                # The copy runs beside the steps (vLLM's offloading connector loads
                # asynchronously; Dynamo's mocker models it so): only this request waits for
                # it, on the worker's one host -> device link, behind the loads already on it.
                self._link_ms += self.onboard_costs.load_ms(Counter(sources), bs)
                wait_ms = self._link_ms
                req.status = Status.LOADING
                self.loading.append([req, wait_ms])
            else:
                req.status = Status.RUNNING
                running.append(req)
            if req.cached_tokens < 0:
                req.cached_tokens = hit_tokens
                req.onboarded_tokens = len(sources) * bs
                step.admitted.append((req.request_id, hit_tokens))
                if sources:
                    step.onboarded.append((req.request_id, len(sources) * bs, wait_ms))
            if sources:
                continue
            step.entries.append((req, n, self._is_decode(req, n)))
            budget -= n

    def advance_loads(self, ms: float) -> None:
        """``ms`` of engine time went by (a step): the link's backlog and every load in progress
        advance; a finished load's request runs from the next step on (after those running)."""
        if not self.loading:
            return
        self._link_ms = max(self._link_ms - ms, 0.0)
        still = []
        for entry in self.loading:
            entry[1] -= ms
            if entry[1] <= 1e-9:
                req = entry[0]
                req.status = Status.RUNNING
                self.running.append(req)
            else:
                still.append(entry)
        self.loading = still

    def next_load_ms(self) -> float | None:
        """Time until the first load in progress finishes (None: none is)."""
        return min(e[1] for e in self.loading) if self.loading else None

    def _plan_onboard(self, req: RequestState, device_hits: int) -> OnboardPlan:
        """The cost-aware choice of which blocks after the device hits to load (no I/O)."""
        max_blocks = (req.num_tokens - 1) // self.block_size  # get_computed_blocks hashed these
        found = self.tiers.lookup(req.hashes[device_hits:max_blocks]) if max_blocks > device_hits else ()
        prof = self.profile
        return plan_onboard(found, cached_blocks=device_hits, num_tokens=req.num_tokens,
                            block_size=self.block_size, costs=self.onboard_costs, timing=prof.timing,
                            chunk=prof.max_num_batched_tokens if prof.enable_chunked_prefill else None)

    def _load(self, req: RequestState, device_hits: int, plan: OnboardPlan) -> tuple[Tier, ...]:
        """Load the planned blocks; count what loaded, what was skipped and what fell back."""
        res = self.tiers.load(req.hashes[device_hits:device_hits + plan.load_blocks])
        sources = tuple(res.sources[: plan.load_blocks])
        self._loaded.update(sources)
        self._load_ms += self.onboard_costs.load_ms(Counter(sources), self.block_size)
        short = plan.load_blocks - len(sources)
        if short:
            self._fallbacks[res.stop_reason] += short
            logger.warning("request %s: %d of %d planned blocks did not load (%s); recomputing "
                           "them", req.request_id, short, plan.load_blocks, res.stop_reason)
        return sources

    def _is_decode(self, req: RequestState, n: int) -> bool:
        """One token fed from an already computed context: a decode, not a prefill chunk."""
        return (
            n == 1
            and req.num_computed_tokens == req.prompt_len + req.num_output - 1
            and (req.num_output > 0 or req.transferred)
        )

    def _shape(self, entries: list[tuple[RequestState, int, bool]]) -> StepShape:
        p_tokens = p_seqs = p_kv = d_seqs = d_ctx = 0
        p_pairs = 0.0
        for req, n, is_decode in entries:
            if is_decode:
                d_seqs += 1
                d_ctx += req.prompt_len + req.num_output
            else:
                ctx = req.num_computed_tokens
                p_tokens += n
                p_seqs += 1
                p_pairs += n * (ctx + (n + 1) / 2)
                p_kv += ctx + n
        return StepShape(
            prefill_tokens=p_tokens,
            prefill_seqs=p_seqs,
            prefill_attention_pairs=p_pairs,
            prefill_kv_tokens=p_kv,
            decode_seqs=d_seqs,
            decode_context_tokens=d_ctx,
            kv_capacity_tokens=self.profile.kv_capacity_tokens,
        )

    def _preempt(self, req: RequestState) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.transferred = False  # recompute-style: the KV will be recomputed, not transferred
        req.status = Status.PREEMPTED
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    # ----------------------------------------------------------------- coalesced decode steps
    #
    # Between events, an engine that only decodes runs identical steps: every running request
    # feeds one token, nothing is admitted, nobody finishes, and the step's shape (hence its
    # duration) is a closed-form function of the step number. ``decode_batch`` says whether the
    # next step is such a step; ``decode_steps`` applies up to ``n`` of them at once with exactly
    # the effects ``schedule`` + ``update`` would have had step by step. Per step, those effects
    # are only: each request's counters advance by one, and ``allocate_slots(req, 1)`` does
    # something only at a block boundary (a new block, or a block becoming full and cached).
    # So the run visits just the steps where some request crosses a boundary, calls the very
    # same ``allocate_slots`` there with the request's counters set to that step, and stops
    # early wherever the step-by-step engine would have done something else:
    #
    # * an allocation would not fit (the engine would preempt): stop *before* that step;
    # * a waiting request can be admitted (checked with the real ``_admit`` at the first step
    #   and after every step that changed the pool; on other steps the pool, the waiting head,
    #   the budget and the running count are all unchanged, so ``_admit`` would again admit
    #   nothing), or a request finishes: that step is planned by the normal code from here
    #   (returned as a ``ScheduledStep`` for the caller to finish like ``step()`` does).

    def decode_batch(self) -> tuple[list[RequestState], int] | None:
        """If the next step is a pure decode step of every running request: the batch (schedule
        order) and the index of the first step in which one of them finishes. Else None."""
        running = self.running
        if not running or self.loading or len(running) > self.profile.max_num_batched_tokens:
            return None  # (a load finishing changes the batch: step by step until it has)
        first_finish = 1 << 62
        for req in running:
            no = req.num_output
            if req.num_computed_tokens != req.prompt_len + no - 1 or not (no or req.transferred):
                return None  # a prefill chunk (or a prompt's last token) is still to compute
            left = 1 if req.hold else req.max_tokens - no
            if left < first_finish:
                first_finish = left
        return list(running), first_finish - 1

    def decode_steps(
        self, batch: list[RequestState], n: int, finish_at: int | None
    ) -> tuple[int, ScheduledStep | None, list[tuple[int, list[KvEvent]]]]:
        """Apply up to ``n`` pure decode steps of ``batch`` (from :meth:`decode_batch`, nothing
        changed since). ``finish_at`` is the step (< n) in which a request finishes, if any.

        Returns ``(k, final, events)``: ``k`` steps were applied; ``final``, when not None, is
        step ``k`` planned (running part and admissions, ``num_computed_tokens`` not yet
        advanced) for the caller to finish as a normal step; ``events`` are the KV events each
        applied step queued, as ``(step index, events)`` in order (the pool's queue keeps those
        of ``final``, and any queued before step 0 count as step 0's, as they would).
        """
        kv = self.kv
        pool = kv.pool
        bs = self.block_size
        caching = pool.enable_caching
        nreq = len(batch)
        c0 = [r.num_computed_tokens for r in batch]
        o0 = [r.num_output for r in batch]
        never = 1 << 62

        def next_event(i: int, req: RequestState) -> int:
            # First step j at which allocate_slots(req, 1) would act: the step feeding the first
            # token past the allocated blocks, or the one filling the first uncached block.
            j = len(req.blocks) * bs - c0[i]
            if caching:
                jc = (req.num_cached_blocks + 1) * bs - c0[i] - 1
                if jc < j:
                    j = jc
            return j

        heap = []
        for i, req in enumerate(batch):
            j = next_event(i, req)
            if j < n:
                heap.append((j, i))
        heapq.heapify(heap)
        waiting = self.waiting
        budget = self.profile.max_num_batched_tokens - nreq
        events: list[tuple[int, list[KvEvent]]] = []
        queued_by = 0  # the step the pool's queued events belong to (leftovers: step 0's)
        final: ScheduledStep | None = None
        k = n
        free_queue = pool.free_queue
        # Steps where something may happen: boundaries (heap), step 0 (admission), the finish.
        check0 = bool(waiting)
        while True:
            j = heap[0][0] if heap else never
            if check0:
                j = 0
            if finish_at is not None and finish_at < j:
                j = finish_at
            if j >= n:
                break
            movers: list[int] = []
            while heap and heap[0][0] == j:
                movers.append(heapq.heappop(heap)[1])
            movers.sort()  # schedule order
            need = 0
            for i in movers:
                if c0[i] + j + 1 > len(batch[i].blocks) * bs:
                    need += 1
            if need > free_queue.num_free:
                k = j  # the step-by-step engine preempts in step j: plan it normally
                break
            if pool._events and queued_by != j:
                events.append((queued_by, pool.take_events()))
            for i in movers:
                req = batch[i]
                req.num_computed_tokens = c0[i] + j
                req.num_output = o0[i] + j
                if not kv.allocate_slots(req, 1):  # pragma: no cover - counted above
                    raise AssertionError("decode allocation failed after the free-block check")
                nj = next_event(i, req)
                if nj < n:
                    heapq.heappush(heap, (nj, i))
            if pool._events:
                queued_by = j
            if waiting and (check0 or movers) or j == finish_at:
                check0 = False
                step = ScheduledStep()
                step.entries = [(req, 1, True) for req in batch]
                if waiting:
                    self._admit(step, budget)
                if j == finish_at or len(step.entries) > nreq or self.loading:
                    final = step
                    k = j
                    break
        if final is None and pool._events and queued_by < k:
            events.append((queued_by, pool.take_events()))
        for i, req in enumerate(batch):
            req.num_computed_tokens = c0[i] + k
            req.num_output = o0[i] + k
        return k, final, events

    # -------------------------------------------------------------------------------- update

    def update(self, step: ScheduledStep) -> tuple[list[TokenOutput], list[RequestId]]:
        """Sample a token for every request that caught up; finish those that are done.

        Returns the tokens (in schedule order) and the ids of requests that finished (in the
        prefill role: that are now held).
        """
        tokens: list[TokenOutput] = []
        finished: list[RequestId] = []
        vocab = self.profile.vocab_size
        for req, _, _ in step.entries:
            idx = req.num_output
            if req.num_computed_tokens < req.prompt_len + idx:
                continue  # a prefill chunk that did not reach the end of the prompt
            tok = pseudo_token(req.seed, idx, vocab)
            req.num_output = idx + 1
            done = req.hold or idx + 1 >= req.max_tokens
            tokens.append(TokenOutput(req.request_id, idx, tok, done))
            if done:
                finished.append(req.request_id)
                del self.requests[req.request_id]
                if req.hold:
                    req.status = Status.HELD
                    self.held[req.request_id] = req
                else:
                    req.status = Status.FINISHED
                    self.kv.free(req)
        if finished:
            self.running = [r for r in self.running if r.status is Status.RUNNING]
        return tokens, finished
