"""``EngineCore``: one simulated worker (block pool + scheduler + timing). Pure and deterministic.

The core never reads a clock. ``step()`` plans and applies one engine step and says how long it
*would* take on the profiled hardware; a driver decides what time it is:

* :class:`data_plane.engines.cluster.Cluster` advances a virtual clock by that duration
  (discrete-event simulation, as fast as Python runs);
* :class:`data_plane.engines.async_engine.AsyncEngine` sleeps that long (divided by a speed-up)
  and streams the tokens.

Both call the same methods in the same order for the same input, so they produce the same
tokens and the same KV events. The simulation may also call ``run_decode``, which applies a run
of pure decode steps at once with exactly the effects of calling ``step()`` that many times.
"""

from __future__ import annotations

from dataclasses import dataclass

from data_plane.engines.block_pool import BlockPool, EvictHook
from data_plane.engines.errors import ProfileError
from data_plane.engines.kv_manager import KVCacheManager
from data_plane.engines.profiles import HardwareProfile, load_profile
from data_plane.engines.request import EngineRequest, Status
from data_plane.engines.scheduler import OnboardStats, ScheduledStep, Scheduler, TokenOutput
from data_plane.engines.tiers import LowerTiers, OnboardCosts, costs_for
from data_plane.engines.timing import StepShape, decode_run_starts
from common.hashing import HashAlgo, HashConfig
from schemas.events import KvEvent
from schemas.types import RequestId, WorkerId, WorkerRole


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one step did. ``duration_ms`` is 0 and ``num_scheduled`` 0 for an idle step."""

    duration_ms: float
    tokens: list[TokenOutput]
    #: Requests that produced their last token (prefill role: now held for the transfer).
    finished: list[RequestId]
    #: First admissions in this step: (request id, prompt tokens served from the prefix cache).
    admitted: list[tuple[RequestId, int]]
    preempted: list[RequestId]
    #: Requests the step computed for; for a *stall* (nothing to compute while prefixes load
    #: from the tiers below), the requests whose loads it waited for.
    num_scheduled: int
    shape: StepShape
    #: Of ``admitted``, requests that load part of their prefix from a tier below the device:
    #: (request id, tokens loaded, ms until loaded). Included in ``admitted``'s cached tokens.
    onboarded: tuple[tuple[RequestId, int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class DecodeRun:
    """``num_steps`` consecutive pure decode steps applied at once (:meth:`EngineCore.run_decode`),
    possibly followed by one normal step (``final``).

    Step ``j`` started at ``starts[j]`` and ended at ``starts[j + 1]``; every request of
    ``request_ids`` got one token per step, delivered at the step's end, none finished, and
    nothing was admitted or preempted. ``events`` are the KV events of those steps as
    ``(step index, events)``: what ``take_kv_events()`` would have returned at that step's end.
    ``final`` is what ``step()`` would have returned for the step that starts at
    ``starts[num_steps]`` (its events stay queued), or None.
    """

    request_ids: list[RequestId]
    num_steps: int
    #: ``num_steps + 1`` boundaries: ``starts[0]`` is the time the run started.
    starts: list[float]
    events: list[tuple[int, list[KvEvent]]]
    final: StepResult | None


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Load snapshot (what a ``WorkerLoadReported`` carries)."""

    running: int
    waiting: int
    held: int
    kv_usage: float
    free_blocks: int
    cached_blocks: int
    #: Prompt tokens still to prefill, over waiting and running requests.
    queued_prefill_tokens: int
    #: Blocks referenced by running and held requests.
    active_blocks: int
    preemptions: int


#: Worker id of an engine built without one (tests, single-worker tools).
DEFAULT_WORKER_ID = WorkerId("worker-0")


def default_hash_config(block_size: int) -> HashConfig:
    """vLLM's default prefix-caching hash (sha256 over pickle, fixed NONE_HASH seed)."""
    return HashConfig(HashAlgo.SHA256, block_size, None)


class EngineCore:
    """One worker's engine. Not thread-safe: drive it from one thread or one event loop."""

    def __init__(
        self,
        profile: HardwareProfile | str = "mocker",
        *,
        worker_id: WorkerId = DEFAULT_WORKER_ID,
        role: WorkerRole = WorkerRole.AGGREGATED,
        hash_config: HashConfig | None = None,
        on_evict: EvictHook | None = None,
        emit_token_ids: bool = False,
        tiers: LowerTiers | None = None,
        onboard_costs: OnboardCosts | None = None,
    ) -> None:
        """``tiers``: the tiers below the device pool to onboard prefixes from (the worker's
        KVBM, or the simulation's :class:`~data_plane.engines.tiers.VirtualTiers`), at
        ``onboard_costs`` (defaults: :mod:`data_plane.engines.tiers`). ``on_evict`` is how the
        device's evictions reach them; without tiers the engine recomputes every miss."""
        self.profile = load_profile(profile) if isinstance(profile, str) else profile
        self.worker_id = worker_id
        self.role = WorkerRole(role)
        self.hash_config = hash_config or default_hash_config(self.profile.block_size)
        if self.hash_config.block_size != self.profile.block_size:
            raise ProfileError(
                f"hash_config.block_size={self.hash_config.block_size} but profile "
                f"{self.profile.name!r} has block_size={self.profile.block_size}"
            )
        self.pool = BlockPool(
            self.profile.num_device_blocks,
            self.profile.block_size,
            worker_id=worker_id,
            hash_algo=self.hash_config.hash_algo,
            enable_caching=self.profile.enable_prefix_caching,
            on_evict=on_evict,
            reuse_uncached_first=self.profile.reuse_uncached_first,
        )
        self.kv = KVCacheManager(self.pool, self.hash_config, emit_token_ids=emit_token_ids)
        self.scheduler = Scheduler(self.profile, self.kv, self.role, tiers=tiers,
                                   onboard_costs=onboard_costs or costs_for(self.profile.timing))
        self.timing = self.profile.timing

    # ------------------------------------------------------------------------------ commands

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request (raises :class:`RequestRejected` if it can never fit)."""
        self.scheduler.add_request(request)

    def validate_request(self, request: EngineRequest) -> None:
        """Raise :class:`RequestRejected` now if ``request`` could never run on this worker."""
        self.scheduler.validate(request)

    def release(self, request_id: RequestId) -> bool:
        """Prefill role: the transfer is done, free the held blocks. False if not held."""
        return self.scheduler.release(request_id)

    def abort(self, request_id: RequestId) -> bool:
        """Drop a request (waiting, running or held). False if unknown."""
        return self.scheduler.abort(request_id)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks if none is in use (queues ``AllBlocksCleared``)."""
        return self.pool.reset_prefix_cache()

    def step(self) -> StepResult:
        """Plan and apply one engine step; return its tokens and its modelled duration."""
        sched = self.scheduler
        plan = sched.schedule()
        preempted = plan.preempted
        # A step that only preempted (the running request could not grow, even alone) admits
        # nothing by rule; plan again at once so the freed blocks are not left idle.
        while not plan.entries and plan.preempted:
            plan = sched.schedule()
            preempted = preempted + plan.preempted
        if not plan.entries:
            wait = sched.next_load_ms()
            if wait is None:
                return StepResult(0.0, [], [], plan.admitted, preempted, 0, plan.shape)
            # Nothing to compute until a load is in: the step is that wait.
            loading = len(sched.loading)
            sched.advance_loads(wait)
            return StepResult(wait, [], [], plan.admitted, preempted, loading, plan.shape,
                              tuple(plan.onboarded))
        return self._apply(plan, preempted)

    def _apply(self, plan: ScheduledStep, preempted: list[RequestId]) -> StepResult:
        """Time a sealed plan and apply it (sample tokens, finish requests)."""
        duration = self.timing.step_ms(plan.shape)
        tokens, finished = self.scheduler.update(plan)
        self.scheduler.advance_loads(duration)
        return StepResult(
            duration, tokens, finished, plan.admitted, preempted, len(plan.entries), plan.shape,
            tuple(plan.onboarded),
        )

    #: The most steps one decode run takes (a run may stop anywhere: the next one goes on).
    _RUN_MAX = 4096

    def run_decode(self, t0: float, t_limit: float) -> DecodeRun | None:
        """Apply, at once, the pure decode steps ``step()`` would run back to back from virtual
        time ``t0``: those starting before ``t_limit``, up to the first step that would admit,
        finish or preempt a request (a finishing or admitting step is included, as ``final``;
        a preempting one is left to ``step()``). None when the next step is not a pure decode
        step (call ``step()``). Same state, tokens, KV events and step times as calling
        ``step()`` that many times, with a step of duration ``d`` started at ``t`` ending at
        ``t + d`` (the simulator's clock rule).
        """
        sched = self.scheduler
        batch = sched.decode_batch()
        if batch is None:
            return None
        reqs, first_finish = batch
        if first_finish == 0:
            return None  # the very next step finishes a request: nothing to coalesce
        nreq = len(reqs)
        ctx0 = 0
        for r in reqs:
            ctx0 += r.prompt_len + r.num_output
        # Start times of steps 0..first_finish, until one starts at or after t_limit. A step's
        # decode context grows by one token per request per step; the start times are the
        # running sum t0 + d0 + d1 + ..., added left to right as the step-by-step clock adds.
        starts = decode_run_starts(
            self.timing, t0, t_limit, nreq, ctx0, self.profile.kv_capacity_tokens,
            min(first_finish + 1, self._RUN_MAX),
        )
        n_ok = len(starts) - 1  # steps that start before t_limit
        finish_at = first_finish if first_finish < n_ok else None
        k, plan, events = sched.decode_steps(reqs, n_ok, finish_at)
        final = None
        if plan is not None:
            sched.seal(plan)
            final = self._apply(plan, [])
        elif k == 0:
            return None  # the first step would preempt: nothing applied, step() does it
        return DecodeRun([r.request_id for r in reqs], k, starts[: k + 1], events, final)

    def take_kv_events(self) -> list[KvEvent]:
        """Drain the KV events queued since the last call (publishing is the caller's job)."""
        return self.pool.take_events()

    # ------------------------------------------------------------------------------- queries

    def has_work(self) -> bool:
        """Whether a step could do anything (requests waiting or running)."""
        return self.scheduler.has_work()

    def is_held(self, request_id: RequestId) -> bool:
        return request_id in self.scheduler.held

    def held_block_ids(self, request_id: RequestId) -> list[int]:
        """Block ids a held request occupies (what a KV transfer reads)."""
        req = self.scheduler.held.get(request_id)
        return [b.block_id for b in req.blocks] if req is not None else []

    def cached_tokens(self, request_id: RequestId) -> int | None:
        """Prompt tokens served from the prefix cache at first admission (None if not admitted)."""
        req = self.scheduler.requests.get(request_id) or self.scheduler.held.get(request_id)
        if req is None or req.cached_tokens < 0:
            return None
        return req.cached_tokens

    def onboarded_tokens(self, request_id: RequestId) -> int:
        """Of :meth:`cached_tokens`, those loaded from a tier below the device (0 if unknown)."""
        req = self.scheduler.requests.get(request_id) or self.scheduler.held.get(request_id)
        return req.onboarded_tokens if req is not None else 0

    def onboard_stats(self) -> OnboardStats:
        """Blocks loaded from the tiers below (by tier), skipped as dearer than recompute, and
        fallen back to recompute (by reason), since the engine started."""
        return self.scheduler.onboard_stats()

    def stats(self) -> EngineStats:
        s = self.scheduler
        queued = 0
        for r in s.waiting:
            queued += max(r.prompt_len - r.num_computed_tokens, 0) if not r.transferred else 0
        for r in s.running:
            if r.status is Status.RUNNING and r.num_computed_tokens < r.prompt_len:
                queued += r.prompt_len - r.num_computed_tokens
        for r, _ in s.loading:  # admitted, their prefix loading: the rest still to compute
            queued += max(r.prompt_len - r.num_computed_tokens, 0)
        return EngineStats(
            running=len(s.running) + len(s.loading),
            waiting=len(s.waiting),
            held=len(s.held),
            kv_usage=self.pool.usage,
            free_blocks=self.pool.num_free_blocks,
            cached_blocks=self.pool.num_cached_blocks,
            queued_prefill_tokens=queued,
            active_blocks=self.pool.num_active_blocks,
            preemptions=s.num_preemptions,
        )
