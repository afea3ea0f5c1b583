"""Continuous-batching scheduler (vLLM v1 semantics, Dynamo mocker details). Pure: no clock.

One call to :meth:`Scheduler.schedule` plans a step; :meth:`Scheduler.update` applies it
(samples tokens, finishes requests). Between the two the driver asks the timing model how long
the step lasts. The rules, in order:

1. **Running requests first**, in admission order, while the step's token budget
   (``max_num_batched_tokens``) lasts. Each asks for all its uncomputed tokens, capped by the
   budget (chunked prefill); a decoding request asks for exactly one. If its blocks cannot be
   allocated, the *last* running request is preempted (LIFO, recompute-style: its blocks are
   freed, ``num_computed_tokens`` goes back to 0, it keeps its generated tokens and goes to the
   *front* of the waiting queue), repeatedly, until the allocation fits or the request
   preempted itself.
2. **Then waiting requests**, FIFO, only if nothing was preempted this step, while fewer than
   ``max_num_seqs`` run and budget remains. A request's prefix-cache hits count as computed;
   it is admitted when its blocks can be allocated (``Admission.CHUNK``, vLLM) or only when its
   whole known sequence fits in the free blocks (``Admission.WHOLE_PROMPT``, Dynamo's mocker).
   The head of the queue blocks the rest (no skipping).
3. **Update**: every scheduled request whose tokens are now all computed samples one
   deterministic pseudo-token. It finishes after ``max_tokens`` tokens (its blocks are freed,
   last block first). In the prefill role a request finishes after its first token and its
   blocks are *held* (not freed) until :meth:`release`: they are the source of the KV transfer.

Roles: ``aggregated`` does both phases; ``prefill`` stops after the first token and holds the
blocks; ``decode`` receives requests whose prompt KV was already transferred: at admission the
prompt's blocks are allocated (prefix hits first) and count as computed, with no prefill work,
and the step only computes the next token. The role is each request's default phase; a request
may name its own (``EngineRequest.phase``), e.g. a decode worker recomputing a prompt whose
transfer failed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from data_plane.engines.errors import RequestRejected
from data_plane.engines.kv_manager import KVCacheManager
from data_plane.engines.profiles import Admission, HardwareProfile
from data_plane.engines.request import EngineRequest, RequestState, Status, pseudo_token
from data_plane.engines.timing import StepShape
from schemas.types import RequestId, RequestPhase, WorkerRole

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


class Scheduler:
    def __init__(self, profile: HardwareProfile, kv: KVCacheManager, role: WorkerRole) -> None:
        self.profile = profile
        self.kv = kv
        self.role = WorkerRole(role)
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
        req = RequestState(request, self._arrivals)
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
        else:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = Status.FINISHED
        return True

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

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
            n = req.prompt_len + len(req.output) - req.num_computed_tokens
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

        step.shape = self._shape(entries)
        for req, n, _ in entries:
            req.num_computed_tokens += n
        return step

    def _admit(self, step: ScheduledStep, budget: int) -> None:
        kv = self.kv
        bs = self.block_size
        waiting = self.waiting
        running = self.running
        max_seqs = self.profile.max_num_seqs
        chunked = self.profile.enable_chunked_prefill
        whole_prompt = self.profile.admission is Admission.WHOLE_PROMPT
        while waiting and len(running) < max_seqs and budget > 0:
            req = waiting[0]
            hits = kv.get_computed_blocks(req)
            hit_tokens = len(hits) * bs
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
            if not kv.allocate_slots(req, transferred + n, hits):
                break
            waiting.popleft()
            req.num_computed_tokens = hit_tokens + transferred
            req.status = Status.RUNNING
            running.append(req)
            if req.cached_tokens < 0:
                req.cached_tokens = hit_tokens
                step.admitted.append((req.request_id, hit_tokens))
            step.entries.append((req, n, self._is_decode(req, n)))
            budget -= n

    def _is_decode(self, req: RequestState, n: int) -> bool:
        """One token fed from an already computed context: a decode, not a prefill chunk."""
        return (
            n == 1
            and req.num_computed_tokens == req.prompt_len + len(req.output) - 1
            and (len(req.output) > 0 or req.transferred)
        )

    def _shape(self, entries: list[tuple[RequestState, int, bool]]) -> StepShape:
        p_tokens = p_seqs = p_kv = d_seqs = d_ctx = 0
        p_pairs = 0.0
        for req, n, is_decode in entries:
            if is_decode:
                d_seqs += 1
                d_ctx += req.prompt_len + len(req.output)
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
            out = req.output
            if req.num_computed_tokens < req.prompt_len + len(out):
                continue  # a prefill chunk that did not reach the end of the prompt
            idx = len(out)
            tok = pseudo_token(req.seed, idx, vocab)
            out.append(tok)
            done = req.hold or len(out) >= req.max_tokens
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
