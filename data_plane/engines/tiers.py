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
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from data_plane.engines.timing import StepShape, TimingModel
from data_plane.kvbm.admission import AdmissionConfig, AdmissionFilter
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


def prefill_ms(timing: TimingModel, start: int, end: int) -> float:
    """Modelled time to compute tokens ``[start, end)`` of one request, alone in a step."""
    n = end - start
    if n <= 0:
        return 0.0
    return timing.step_ms(StepShape(
        prefill_tokens=n, prefill_seqs=1, prefill_attention_pairs=n * (start + (n + 1) / 2),
        prefill_kv_tokens=end, kv_capacity_tokens=max(end, 1),
    ))


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
                 costs: OnboardCosts, timing: TimingModel) -> OnboardPlan:
    """Which leading run of ``found`` (the fastest tier of each block after the ``cached_blocks``
    device hits, in prefix order) to load rather than recompute, for a request of ``num_tokens``.

    Minimises ``load_ms(first n) + prefill_ms(rest of the request)`` over ``n``; ties go to the
    longer load (the same time, less compute). Worked example, mocker timing (prefill
    ``16.5 + 0.0152 T + 4.2e-7 T^2`` ms), 64-token blocks of 8 MiB: a host block loads in
    0.34 ms and saves about 1 ms of prefill, so it is loaded; a disk block loads in 1.7 ms and is
    loaded only where the prefill it saves is dearer (long suffixes, where the T^2 term bites).
    """
    base = cached_blocks * block_size
    recompute = prefill_ms(timing, base, num_tokens)
    best_n, best_cost, best_load = 0, recompute, 0.0
    counts: Counter[Tier] = Counter()
    for i, tier in enumerate(found):
        counts[tier] += 1
        start = base + (i + 1) * block_size
        if start > num_tokens:
            break
        load = costs.load_ms(counts, block_size)
        cost = load + prefill_ms(timing, start, num_tokens)
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


# -- the virtual tiers of the simulation ----------------------------------------------------


class VirtualTiers:
    """Host, disk and object tiers of one simulated worker, without bytes: an ordered vector of
    LRU tiers with the KVBM's rules (see ``data_plane/kvbm/residency.py``):

    * a device eviction goes to the first tier (already there: touched, no write);
    * a full tier's least recently used block cascades one tier down, unless a lower tier already
      holds it (then the copy is dropped), there is no lower tier (gone), or the lower tier's
      admission filter refuses it (gone, counted in ``admission_refused``): the KVBM's own
      :class:`~data_plane.kvbm.admission.AdmissionFilter`, fed the same uses (every device
      eviction, every block loaded), when ``admission`` is given;
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
        self.tiers: tuple[Tier, ...] = tuple(t for t in TIER_ORDER
                                             if t is not Tier.DEVICE and capacities.get(t, 0) > 0)
        self._cap = {t: capacities[t] for t in self.tiers}
        self._lru: dict[Tier, OrderedDict[BlockHash, BlockHash | None]] = {
            t: OrderedDict() for t in self.tiers}
        self.worker_id = worker_id
        self.block_size = block_size
        self.hash_algo = hash_algo
        self.emit = emit
        self.fail: dict[BlockHash, str] = {}
        #: Blocks moved, by (from tier, to tier) value names: offloads and loads.
        self.moves: Counter[tuple[str, str]] = Counter()
        #: Demotions the admission filter refused, by the refusing tier's value name.
        self.admission_refused: Counter[str] = Counter()
        self.admission: AdmissionFilter | None = None
        if admission is not None and admission.enabled:
            admission.check_capacities(self._cap)
            self.admission = AdmissionFilter(admission)

    def _emit(self, ev: KvEvent) -> None:
        if self.emit is not None:
            self.emit(ev)

    def lookup(self, block_hashes: Sequence[BlockHash]) -> list[Tier]:
        out: list[Tier] = []
        lrus = [(t, self._lru[t]) for t in self.tiers]
        for h in block_hashes:
            for t, lru in lrus:
                if h in lru:
                    out.append(t)
                    break
            else:
                break
        return out

    def count(self, tier: Tier) -> int:
        lru = self._lru.get(tier)
        return len(lru) if lru is not None else 0

    def on_device_evicted(self, block_hash: BlockHash, parent_hash: BlockHash | None) -> None:
        if not self.tiers:
            return
        if self.admission is not None:
            self.admission.record_use(block_hash)
        first = self.tiers[0]
        lru = self._lru[first]
        if block_hash in lru:
            lru.move_to_end(block_hash)
            return
        self._place(0, block_hash, parent_hash)
        self.moves[(Tier.DEVICE.value, first.value)] += 1
        self._emit(BlockStored(worker_id=self.worker_id, tier=first, block_hashes=[block_hash],
                               parent_hash=parent_hash, block_size=self.block_size,
                               hash_algo=self.hash_algo))

    def _place(self, i: int, h: BlockHash, parent: BlockHash | None) -> None:
        """Put ``h`` in tier ``i``, making room by cascading its victim down."""
        tier = self.tiers[i]
        lru = self._lru[tier]
        if len(lru) >= self._cap[tier]:
            victim, vparent = lru.popitem(last=False)
            lower = next((j for j in range(i + 1, len(self.tiers))
                          if victim in self._lru[self.tiers[j]]), None)
            if (lower is None and i + 1 < len(self.tiers) and self.admission is not None
                    and not self.admission.check(victim, self.tiers[i + 1]).admitted):
                self.admission_refused[self.tiers[i + 1].value] += 1
                self._emit(BlockRemoved(worker_id=self.worker_id, tier=tier, block_hashes=[victim]))
            elif lower is None and i + 1 < len(self.tiers):
                self._place(i + 1, victim, vparent)
                self.moves[(tier.value, self.tiers[i + 1].value)] += 1
                self._emit(BlockMoved(worker_id=self.worker_id, from_tier=tier,
                                      to_tier=self.tiers[i + 1], block_hashes=[victim]))
            else:
                self._emit(BlockRemoved(worker_id=self.worker_id, tier=tier, block_hashes=[victim]))
        lru[h] = parent

    def holds_fast(self, block_hash: BlockHash) -> bool:
        """In the first tier (host memory): what a peer can serve (a peer does not serve disk)."""
        return bool(self.tiers) and self.tiers[0] is Tier.HOST and block_hash in self._lru[Tier.HOST]

    def store_fetched(self, block_hashes: Sequence[BlockHash], parent: BlockHash | None) -> int:
        """Blocks pulled from a peer, a chain after ``parent``: into the first tier (the KVBM's
        ``store_fetched``), reported ``BlockStored``; returns how many are there afterwards."""
        if not self.tiers or self.tiers[0] is not Tier.HOST:
            return 0
        lru = self._lru[Tier.HOST]
        for h in block_hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                self._place(0, h, parent)
                self.moves[("peer", Tier.HOST.value)] += 1
                self._emit(BlockStored(worker_id=self.worker_id, tier=Tier.HOST, block_hashes=[h],
                                       parent_hash=parent, block_size=self.block_size, hash_algo=self.hash_algo))
            parent = h
        return len(block_hashes)

    def load(self, block_hashes: Sequence[BlockHash]) -> LoadResult:
        sources: list[Tier] = []
        for h in block_hashes:
            tier = next((t for t in self.tiers if h in self._lru[t]), None)
            if tier is None:
                return LoadResult(tuple(sources), "miss")
            reason = self.fail.pop(h, None)
            if reason is not None:
                del self._lru[tier][h]  # the KVBM drops an unreadable copy
                self._emit(BlockRemoved(worker_id=self.worker_id, tier=tier, block_hashes=[h]))
                return LoadResult(tuple(sources), reason)
            self._lru[tier].move_to_end(h)
            if self.admission is not None:
                self.admission.record_use(h)
            first = self.tiers[0]
            if tier is not first:
                parent = self._lru[tier][h]
                self._place(0, h, parent)
                self._emit(BlockStored(worker_id=self.worker_id, tier=first, block_hashes=[h],
                                       parent_hash=parent, block_size=self.block_size,
                                       hash_algo=self.hash_algo))
            self.moves[(tier.value, Tier.DEVICE.value)] += 1
            sources.append(tier)
        return LoadResult(tuple(sources))
