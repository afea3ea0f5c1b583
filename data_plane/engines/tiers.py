"""The KV tiers below the device, as the engine sees them: what loading a prefix back costs
against recomputing it, the port to whatever holds the tiers, and a virtual tier model for the
simulation. Pure: no clock, no I/O.

Cost rule (the one function the engine, the simulation and the router's tier weights share,
:func:`plan_onboard`): loading ``n`` blocks costs, per source tier touched, that tier's latency
once plus ``n * bytes_per_block / bandwidth``; recomputing costs the prefill time the engine's
own timing model gives for those tokens, computed alone with the rest of the request's
uncached suffix. The engine loads the leading run of lower-tier blocks for which load + the
remaining prefill is cheapest, and recomputes the rest. Only a *leading* run can be loaded:
the computed prefix must stay contiguous (the engine's block table is append-only).

Defaults (stated, overridable per :class:`TierLink`): host <-> device 25 GB/s (PCIe 5 x16,
pinned), no latency; NVMe 5 GB/s, 0.1 ms per read; object storage 1 GB/s, 30 ms to first byte.
KV bytes per token come from the model (``2 * layers * kv_heads * head_dim * dtype bytes``);
:data:`DEFAULT_KV_BYTES_PER_TOKEN` is Llama 3 8B in BF16 (128 KiB), the model behind the
shipped profiles.

Invariant of the port (:class:`LowerTiers`): ``load`` returns a prefix of what it was asked
for, each block verified; a block it could not read (missing, corrupt, I/O error) ends the
prefix there, with the reason, and the engine recomputes from that block on (a fallback, never
wrong KV).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from data_plane.engines.timing import StepShape, TimingModel
from data_plane.kvbm.offload_filter import AdmissionConfig, AdmissionFilter
from data_plane.kvbm.residency import MANAGED_TIERS, Admission, OpKind, Refusal, Residency
from schemas.events import BlockMoved, BlockRemoved, BlockStored, KvEvent
from schemas.types import TIER_ORDER, BlockHash, Tier, WorkerId

#: Llama 3 8B, BF16: 2 (K and V) * 32 layers * 8 KV heads * 128 head dim * 2 bytes.
DEFAULT_KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2


@dataclass(frozen=True, slots=True)
class TierLink:
    """How fast blocks come from one tier into device memory."""

    #: Sustained bytes per second from the tier to the device.
    bandwidth_bytes_s: float
    #: Fixed cost of one load from the tier (first byte), paid once per load, not per block.
    latency_ms: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_s > 0 or not self.latency_ms >= 0:
            raise ValueError(f"a tier link needs bandwidth > 0 and latency >= 0, got {self}")


#: host <-> device ~25 GB/s; NVMe ~5 GB/s (0.1 ms a read); object ~1 GB/s + 30 ms.
DEFAULT_LINKS: Mapping[Tier, TierLink] = {
    Tier.HOST: TierLink(25e9, 0.0),
    Tier.DISK: TierLink(5e9, 0.1),
    Tier.OBJECT: TierLink(1e9, 30.0),
}


#: A peer's host or device memory over the network into this worker's host memory (peer
#: fetch): a 400 Gb/s RDMA NIC (50 GB/s, one per GPU on current GPU nodes) and ~1 ms for the
#: hold request's round trip before the READ.
DEFAULT_PEER_LINK = TierLink(50e9, 1.0)


@dataclass(frozen=True, slots=True)
class OnboardCosts:
    """What a load from each tier costs: the links and the size of a token's KV."""

    kv_bytes_per_token: float = DEFAULT_KV_BYTES_PER_TOKEN
    links: Mapping[Tier, TierLink] = field(default_factory=lambda: dict(DEFAULT_LINKS))
    #: Fetching from a peer worker (network into host memory; the engine then onboards the
    #: blocks from host like any host hit).
    peer: TierLink = DEFAULT_PEER_LINK

    def peer_fetch_ms(self, blocks: int, block_size: int) -> float:
        """Time to pull ``blocks`` from a peer into host memory (latency once + bytes / bandwidth)."""
        if blocks <= 0:
            return 0.0
        return self.peer.latency_ms + 1e3 * blocks * self.kv_bytes_per_token * block_size / self.peer.bandwidth_bytes_s

    def load_ms(self, blocks_by_tier: Mapping[Tier, int], block_size: int) -> float:
        """Time to bring these blocks to the device: per tier, latency + bytes / bandwidth."""
        bpb = self.kv_bytes_per_token * block_size
        ms = 0.0
        for tier, n in blocks_by_tier.items():
            if n > 0:
                link = self.links.get(tier)
                if link is None:
                    return math.inf  # no link from that tier: it cannot be loaded
                ms += link.latency_ms + 1e3 * n * bpb / link.bandwidth_bytes_s
        return ms


def costs_for(timing: TimingModel, links: Mapping[Tier, TierLink] | None = None) -> OnboardCosts:
    """Default costs for an engine: KV bytes per token from its timing model's model config
    when it has one (the roofline profiles), else :data:`DEFAULT_KV_BYTES_PER_TOKEN`."""
    kv = getattr(timing, "kv_bytes_per_token", None) or DEFAULT_KV_BYTES_PER_TOKEN
    return OnboardCosts(kv_bytes_per_token=kv, links=dict(links or DEFAULT_LINKS))


def prefill_ms(timing: TimingModel, start: int, end: int, chunk: int | None = None) -> float:
    """Modelled time to compute tokens ``[start, end)`` of one request alone on its worker: in
    steps of at most ``chunk`` tokens (the engine's ``max_num_batched_tokens`` under chunked
    prefill: each step pays the step's fixed cost again, and the batch-size term of a step never
    sees more than ``chunk`` tokens), or in one step (``chunk`` None)."""
    ms = 0.0
    while start < end:
        stop = end if chunk is None else min(end, start + chunk)
        n = stop - start
        ms += timing.step_ms(StepShape(
            prefill_tokens=n, prefill_seqs=1, prefill_attention_pairs=n * (start + (n + 1) / 2),
            prefill_kv_tokens=stop, kv_capacity_tokens=max(stop, 1),
        ))
        start = stop
    return ms


@dataclass(frozen=True, slots=True)
class OnboardPlan:
    """The decision for one admission: load the first ``load_blocks`` lower-tier blocks."""

    load_blocks: int
    #: Blocks found below the device (the most that could have been loaded).
    available: int
    #: Source tier of each block to load, in prefix order.
    sources: tuple[Tier, ...]
    load_ms: float
    #: Prefill time of what is left to compute after the load.
    prefill_ms: float
    #: Prefill time if nothing were loaded (the whole uncached suffix recomputed).
    recompute_ms: float

    @property
    def saved_ms(self) -> float:
        return self.recompute_ms - self.load_ms - self.prefill_ms

    @property
    def reason(self) -> str:
        if self.available == 0:
            return "nothing below the device"
        if self.load_blocks == self.available:
            return f"load all {self.available} blocks: {self.load_ms:.3f} ms vs recompute"
        return (f"load {self.load_blocks} of {self.available} blocks: loading more costs more "
                f"than recomputing them")


def plan_onboard(found: Sequence[Tier], *, cached_blocks: int, num_tokens: int, block_size: int,
                 costs: OnboardCosts, timing: TimingModel, chunk: int | None = None) -> OnboardPlan:
    """Which leading run of ``found`` (the fastest tier of each block after the ``cached_blocks``
    device hits, in prefix order) to load rather than recompute, for a request of ``num_tokens``
    whose prefill runs in steps of at most ``chunk`` tokens (see :func:`prefill_ms`).

    Minimises ``load_ms(first n) + prefill_ms(rest of the request)`` over ``n``; ties go to the
    longer load (the same time, less compute). Worked example, mocker timing (prefill
    ``16.5 + 0.0152 T + 4.2e-7 T^2`` ms per step, chunks of 8,192 tokens), 64-token blocks of
    8 MiB: a host block loads in 0.34 ms and saves 1.0 to 1.4 ms of prefill (a block's share of
    a step, ``64 * (0.0152 + 2 * 4.2e-7 * T)``), so it is loaded; a disk block loads in 1.78 ms
    and is loaded only where the load saves a whole step (16.5 ms of fixed cost: a suffix just
    over a multiple of the chunk). Timed as one step, a long suffix's ``T^2`` term made every
    block look dearer than it is (80,000 tokens: 3.9 s instead of the 1.65 s of ten chunks).
    """
    base = cached_blocks * block_size
    recompute = prefill_ms(timing, base, num_tokens, chunk)
    best_n, best_cost, best_load = 0, recompute, 0.0
    counts: Counter[Tier] = Counter()
    for i, tier in enumerate(found):
        counts[tier] += 1
        start = base + (i + 1) * block_size
        if start > num_tokens:
            break
        load = costs.load_ms(counts, block_size)
        cost = load + prefill_ms(timing, start, num_tokens, chunk)
        if cost <= best_cost:
            best_n, best_cost, best_load = i + 1, cost, load
    return OnboardPlan(best_n, len(found), tuple(found[:best_n]), best_load,
                       best_cost - best_load, recompute)


def tier_weights(costs: OnboardCosts, timing: TimingModel, block_size: int, *,
                 prompt_tokens: int = 4096) -> dict[Tier, float]:
    """The fraction of a block's prefill one hit in each tier saves, from the same cost model:
    ``1 - load_ms(one block) / recompute_ms(one block)``, clamped to [0, 1] and made
    non-increasing down the tiers (the router's ``TierWeights`` invariants). The recompute cost
    is the marginal prefill time of the last block of a ``prompt_tokens`` prompt."""
    recompute = (prefill_ms(timing, 0, prompt_tokens)
                 - prefill_ms(timing, 0, prompt_tokens - block_size))
    out: dict[Tier, float] = {}
    previous = 1.0
    for tier in TIER_ORDER:
        if tier is Tier.DEVICE:
            w = 1.0
        else:
            load = costs.load_ms({tier: 1}, block_size)
            w = 1.0 - load / recompute if recompute > 0 and math.isfinite(load) else 0.0
        w = min(max(w, 0.0), previous)
        out[tier] = w
        previous = w
    return out


def peer_weight(costs: OnboardCosts, timing: TimingModel, block_size: int, *,
                prompt_tokens: int = 4096) -> float:
    """``TierWeights.peer`` from the same cost model: the fraction of a block's prefill a block
    pulled from a peer saves, for a run of a ``prompt_tokens`` prompt's blocks (the round trip
    shared over the run), after the fetch into host and the host -> device load; clamped to
    [0, 1]."""
    n = max(prompt_tokens // block_size, 1)
    recompute = prefill_ms(timing, 0, prompt_tokens) - prefill_ms(timing, 0, prompt_tokens - block_size)
    if recompute <= 0:
        return 0.0
    per_block = costs.peer_fetch_ms(n, block_size) / n + costs.load_ms({Tier.HOST: 1}, block_size)
    return min(max(1.0 - per_block / recompute, 0.0), 1.0)


# -- the port -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LoadResult:
    """What a load brought to the device: the source tier of each block of the leading run
    loaded (a prefix of what was asked), and why it stopped ("complete" when it did not)."""

    sources: tuple[Tier, ...]
    stop_reason: str = "complete"


class LowerTiers(Protocol):
    """Tiers below one engine's device pool (the KVBM of a worker, or :class:`VirtualTiers`)."""

    def lookup(self, block_hashes: Sequence[BlockHash]) -> Sequence[Tier]:
        """Fastest tier below the device of each block of the longest prefix of
        ``block_hashes`` held there. No state change."""
        ...

    def load(self, block_hashes: Sequence[BlockHash]) -> LoadResult:
        """Bring these blocks' KV to the device (verified), as far as possible; see the module
        docstring for the invariant."""
        ...


def load_in_chunks(block_hashes: Sequence[BlockHash], chunk: int,
                   load_chunk: Callable[[Sequence[BlockHash], list[Tier]], str]) -> LoadResult:
    """A load through host memory, at most ``chunk`` blocks (a host pool's worth) at a time: an
    onboard pins (protects) its blocks there until their bytes are copied out, so a prefix longer
    than the pool goes in chunks (a later chunk may then push an earlier one, already copied, down
    a tier). ``load_chunk`` loads one chunk, appends the source tier of each block it loaded to
    its list, and returns why it stopped ("complete" when it did not)."""
    chunk = max(chunk, 1)
    sources: list[Tier] = []
    for i in range(0, len(block_hashes), chunk):
        stop = load_chunk(block_hashes[i:i + chunk], sources)
        if stop != "complete":
            return LoadResult(tuple(sources), stop)
    return LoadResult(tuple(sources))


# -- the virtual tiers of the simulation ----------------------------------------------------


class VirtualTiers:
    """Host, disk and object tiers of one simulated worker, without bytes: the KVBM's own
    residency core (:class:`~data_plane.kvbm.residency.Residency`, LRU) decides every placement,
    victim and cascade, exactly as it does for a worker's :class:`~data_plane.kvbm.manager.
    KvBlockManager`; this class carries the decisions out with no I/O:

    * a device eviction goes to the first tier (already there: touched, no write);
    * a full tier's least recently used block cascades one tier down, unless a lower tier already
      holds it (then the copy is dropped), there is no lower tier (gone), or the lower tier's
      admission filter refuses it (gone, counted in ``admission_refused``): the KVBM's own
      :class:`~data_plane.kvbm.offload_filter.AdmissionFilter`, fed the same uses (every device
      eviction, every block loaded), when ``admission`` is given;
    * making room never evicts the block being placed (not even its copy in a lower tier), nor,
      during a load, any other block of the prefix being loaded: a load that cannot make room in
      the first tier for its next block stops there (``"host_full"``), as the KVBM's onboard does;
    * a load keeps the source copy (touched) and, from below the first tier, also places a copy
      in the first tier, as the KVBM's onboard does through host memory.

    Every change is queued through ``emit`` in the KVBM's vocabulary with
    ``device_eviction_events=False`` (the engine says ``BlockRemoved(device)`` itself):
    ``BlockStored(first tier)``, ``BlockMoved(a -> b)``, ``BlockRemoved(tier)``. ``fail`` maps a
    hash to a reason to make its load fail (tests of the fallback: a corrupt or missing copy,
    which the KVBM would drop with ``BlockRemoved``; here too).
    """

    def __init__(self, capacities: Mapping[Tier, int], *, worker_id: WorkerId, block_size: int,
                 hash_algo: str, emit: Callable[[KvEvent], None] | None = None,
                 admission: AdmissionConfig | None = None) -> None:
        self.res = Residency({t: capacities.get(t, 0) for t in MANAGED_TIERS}, "lru", admission)
        self.tiers: tuple[Tier, ...] = self.res.tiers
        self.worker_id = worker_id
        self.block_size = block_size
        self.hash_algo = hash_algo
        self.emit = emit
        self.fail: dict[BlockHash, str] = {}
        #: Blocks moved, by (from tier, to tier) value names: offloads and loads.
        self.moves: Counter[tuple[str, str]] = Counter()
        self._name = {t: t.value for t in Tier}  # an enum's .value is a slow property
        #: Demotions the admission filter refused, by the refusing tier's value name.
        self.admission_refused: Counter[str] = Counter()

    @property
    def admission(self) -> AdmissionFilter | None:
        return self.res.admission

    def _emit(self, ev: KvEvent) -> None:
        if self.emit is not None:
            self.emit(ev)

    def _stored(self, tier: Tier, h: BlockHash) -> None:
        self._emit(BlockStored(worker_id=self.worker_id, tier=tier, block_hashes=[h],
                               parent_hash=self.res.parent_of(h), block_size=self.block_size,
                               hash_algo=self.hash_algo))

    def lookup(self, block_hashes: Sequence[BlockHash]) -> list[Tier]:
        return self.res.held_prefix(block_hashes, device=False)

    def count(self, tier: Tier) -> int:
        return self.res.count(tier)

    def members(self, tier: Tier) -> list[BlockHash]:
        """The blocks of a tier, next victim first."""
        return self.res.members(tier)

    def _admit(self, adm: Admission) -> None:
        """Carry out an admission: its evictions (deepest first), then its write."""
        res = self.res
        for op in adm.evictions:
            h, src = op.block_hash, op.src
            res.discard(h, src)
            if op.kind is OpKind.DROP:
                if op.refused is not None:
                    self.admission_refused[self._name[op.refused]] += 1
                self._emit(BlockRemoved(worker_id=self.worker_id, tier=src, block_hashes=[h]))
            else:
                assert op.dst is not None
                res.add(h, op.dst)
                self.moves[(self._name[src], self._name[op.dst])] += 1
                self._emit(BlockMoved(worker_id=self.worker_id, from_tier=src, to_tier=op.dst,
                                      block_hashes=[h]))
        res.add(adm.write.block_hash, adm.tier)

    def on_device_evicted(self, block_hash: BlockHash, parent_hash: BlockHash | None) -> None:
        if not self.tiers:
            return
        res = self.res
        h = block_hash
        res.set_parent(h, parent_hash)
        res.note_use(h)
        first = self.tiers[0]
        if res.holds(h, first):
            res.touch(h, first)
            return
        adm = res.plan_placement(h, source=Tier.DEVICE, start=first)
        if isinstance(adm, Refusal):
            self.admission_refused[adm.tier.value] += 1
        elif adm is not None:
            self._admit(adm)
            self.moves[("device", self._name[adm.tier])] += 1
            self._stored(adm.tier, h)

    def holds_fast(self, block_hash: BlockHash) -> bool:
        """In the first tier (host memory): what a peer can serve (a peer does not serve disk)."""
        return bool(self.tiers) and self.tiers[0] is Tier.HOST and self.res.holds(block_hash, Tier.HOST)

    def store_fetched(self, block_hashes: Sequence[BlockHash], parent: BlockHash | None) -> int:
        """Blocks pulled from a peer, a chain after ``parent``: into the first tier (the KVBM's
        ``store_fetched``), reported ``BlockStored``; returns how many of the leading ones are
        there afterwards (making room never evicts another of them)."""
        if not self.tiers or self.tiers[0] is not Tier.HOST:
            return 0
        res = self.res
        protect = frozenset(block_hashes)
        n = 0
        for h in block_hashes:
            res.set_parent(h, parent)
            res.note_use(h)
            parent = h
            if res.holds(h, Tier.HOST):
                res.touch(h, Tier.HOST)
                n += 1
                continue
            adm = res.plan_admission(h, Tier.HOST, source=Tier.HOST, keep_source=True, protect=protect)
            if adm is None:
                break
            self._admit(adm)
            self.moves[("peer", Tier.HOST.value)] += 1
            self._stored(Tier.HOST, h)
            n += 1
        return n

    def load(self, block_hashes: Sequence[BlockHash]) -> LoadResult:
        first = self.tiers[0] if self.tiers else None
        chunk = self.res.capacity(first) if first is Tier.HOST else len(block_hashes)
        return load_in_chunks(block_hashes, chunk, self._load_chunk)

    def _load_chunk(self, block_hashes: Sequence[BlockHash], sources: list[Tier]) -> str:
        """One onboard call of the KVBM: the chunk's blocks are protected from eviction while it
        makes room for them."""
        res = self.res
        protect = frozenset(block_hashes)
        first = self.tiers[0] if self.tiers else None
        for h in block_hashes:
            tier = self.res.fastest_managed(h)
            if tier is None:
                return "miss"
            reason = self.fail.pop(h, None)
            if reason is not None:
                res.discard(h, tier)  # the KVBM drops an unreadable copy
                self._emit(BlockRemoved(worker_id=self.worker_id, tier=tier, block_hashes=[h]))
                return reason
            if tier is not first:
                assert first is not None
                adm = res.plan_admission(h, first, source=tier, keep_source=True, protect=protect)
                if adm is None:
                    return "host_full"
                self._admit(adm)
                self._stored(first, h)
            res.touch(h, tier)
            res.note_use(h)
            self.moves[(self._name[tier], "device")] += 1
            sources.append(tier)
        return "complete"
