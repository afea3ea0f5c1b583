"""Which managed tier holds which block, and the decisions that change it. Pure: no I/O.

The manager (:mod:`.manager`) asks this core *what* to do (an :class:`Admission`: evictions, then
one write), performs the I/O, and only then records each change here and reports it. Keeping the
decision apart from the I/O lets the unit tests and a replay check the cascade with no disk, no
bucket and no mocks.

Model
-----
* Managed tiers are G2 host, G3 disk, G4 object, those with a capacity > 0, in ``TIER_ORDER``.
  G1 (device) belongs to the engine's block pool: here it is only a set of hashes the engine said
  it holds, with no capacity.
* A block may sit in several managed tiers at once (an onboarded copy in host above its disk
  copy). Each tier counts each block once against its capacity, and ``add`` refuses to exceed it.
* Admitting a block into a full tier evicts that tier's victim (policy order; pinned host blocks
  and the block being admitted are never victims). The victim *cascades* one tier down unless a
  lower tier already holds it (then the copy is just dropped: no write is needed for the block to
  stay reachable), or there is no lower tier (then it is gone). Making room below works the same
  way, so one admission is at most one eviction per tier, executed bottom-up: every write lands in
  a tier that already has room, so no capacity is ever exceeded, not even transiently.
* A write into any tier but the first (a demotion, or a device eviction falling through a full
  host) also needs the :mod:`.admission` filter's yes: a victim it refuses is dropped (``DROP``
  with ``refused`` set), and a refused fall-through is a :class:`Refusal`. Uses are recorded by
  the caller (:meth:`Residency.note_use`), so the decisions stay a function of the calls.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from data_plane.kvbm.offload_filter import AdmissionConfig, AdmissionFilter
from data_plane.kvbm.errors import CapacityExceeded, KvbmConfigError
from data_plane.kvbm.policy import EvictionPolicy, make_policy
from schemas.types import TIER_ORDER, BlockHash, Tier

#: Tiers the KVBM itself stores bytes in, fastest first.
MANAGED_TIERS: tuple[Tier, ...] = tuple(t for t in TIER_ORDER if t is not Tier.DEVICE)
#: Each tier's name (an enum's ``.value`` is a property lookup; the simulation asks millions).
_NAME: dict[Tier, str] = {t: t.value for t in Tier}


class OpKind(str, Enum):
    #: Delete the block from ``src``; it leaves that tier for good.
    DROP = "drop"
    #: Write the block to ``dst``, then delete it from ``src`` (from device: the engine frees it).
    MOVE = "move"
    #: Write the block to ``dst`` and keep it in ``src``.
    COPY = "copy"


@dataclass(frozen=True)
class Op:
    """One residency change, with the reason it was decided."""

    kind: OpKind
    block_hash: BlockHash
    src: Tier
    dst: Tier | None
    reason: str
    #: For a DROP: the tier below whose admission filter refused the block (else None).
    refused: Tier | None = None


@dataclass(frozen=True)
class Refusal:
    """A device eviction that would have gone to ``tier`` (the tiers above it full of pinned
    blocks) and that the tier's admission filter refused: the block is not written."""

    block_hash: BlockHash
    tier: Tier
    reason: str


@dataclass(frozen=True)
class Admission:
    """Place one block in ``write.dst``: first ``evictions`` (in execution order, deepest tier
    first), then ``write``."""

    evictions: tuple[Op, ...]
    write: Op

    @property
    def tier(self) -> Tier:
        assert self.write.dst is not None
        return self.write.dst


class Residency:
    """Residency of blocks in the managed tiers plus the engine-reported device set."""

    def __init__(self, capacities: Mapping[Tier, int],
                 policy: str | Callable[[], EvictionPolicy] = "lru",
                 admission: AdmissionConfig | None = None) -> None:
        if Tier.DEVICE in capacities and capacities[Tier.DEVICE]:
            raise KvbmConfigError("the device tier belongs to the engine's block pool; the KVBM "
                                  "manages host, disk and object capacity only")
        for t, c in capacities.items():
            if c < 0:
                raise KvbmConfigError(f"negative capacity {c} for tier {t.value}")
        factory = (lambda: make_policy(policy)) if isinstance(policy, str) else policy
        self.tiers: tuple[Tier, ...] = tuple(t for t in MANAGED_TIERS if capacities.get(t, 0) > 0)
        self._cap = {t: capacities.get(t, 0) for t in MANAGED_TIERS}
        self._pol: dict[Tier, EvictionPolicy] = {t: factory() for t in self.tiers}
        #: Per tier (device included), the configured tiers slower than it, fastest first.
        self._below: dict[Tier, tuple[Tier, ...]] = {
            tier: tuple(t for t in self.tiers if TIER_ORDER.index(t) > TIER_ORDER.index(tier))
            for tier in TIER_ORDER}
        self.policy_name = next(iter(self._pol.values())).name if self._pol else str(policy)
        self._device: set[BlockHash] = set()
        self._pins: dict[BlockHash, int] = {}
        self._parent: dict[BlockHash, BlockHash | None] = {}
        #: None when every tier admits every block (no table is kept then).
        self.admission: AdmissionFilter | None = None
        if admission is not None and admission.enabled:
            admission.check_capacities(capacities)
            self.admission = AdmissionFilter(admission)

    # -- queries ----------------------------------------------------------------------------

    def capacity(self, tier: Tier) -> int:
        return self._cap.get(tier, 0)

    def count(self, tier: Tier) -> int:
        pol = self._pol.get(tier)
        return len(pol) if pol is not None else 0

    def holds(self, block_hash: BlockHash, tier: Tier) -> bool:
        if tier is Tier.DEVICE:
            return block_hash in self._device
        pol = self._pol.get(tier)
        return pol is not None and block_hash in pol

    def tiers_of(self, block_hash: BlockHash) -> tuple[Tier, ...]:
        """Every tier holding the block, device included, fastest first."""
        return tuple(t for t in TIER_ORDER if self.holds(block_hash, t))

    def fastest(self, block_hash: BlockHash) -> Tier | None:
        if block_hash in self._device:
            return Tier.DEVICE
        return self.fastest_managed(block_hash)

    def fastest_managed(self, block_hash: BlockHash) -> Tier | None:
        """The fastest managed tier (host, disk, object) holding the block."""
        for t, pol in self._pol.items():  # in tier order
            if block_hash in pol:
                return t
        return None

    def held_prefix(self, block_hashes: Sequence[BlockHash], *, device: bool = True) -> list[Tier]:
        """The fastest tier of each block of the longest prefix of ``block_hashes`` held
        somewhere (``device=False``: in a managed tier only, the device set not asked)."""
        fastest = self.fastest if device else self.fastest_managed
        out: list[Tier] = []
        for h in block_hashes:
            t = fastest(h)
            if t is None:
                break
            out.append(t)
        return out

    def members(self, tier: Tier) -> list[BlockHash]:
        """Blocks of a managed tier, next victim first."""
        pol = self._pol.get(tier)
        return list(pol.order()) if pol is not None else []

    def device_blocks(self) -> set[BlockHash]:
        return set(self._device)

    def below(self, tier: Tier) -> tuple[Tier, ...]:
        """Managed tiers slower than ``tier`` (device: all of them)."""
        return self._below[tier]

    def pinned(self, block_hash: BlockHash) -> bool:
        return block_hash in self._pins

    def parent_of(self, block_hash: BlockHash) -> BlockHash | None:
        return self._parent.get(block_hash)

    # -- changes (called once the bytes are where they are said to be) ---------------------

    def add(self, block_hash: BlockHash, tier: Tier) -> None:
        if tier is Tier.DEVICE:
            self._device.add(block_hash)
            return
        pol = self._pol.get(tier)
        if pol is None:
            raise KvbmConfigError(f"tier {tier.value} is not configured")
        if block_hash in pol:
            pol.touch(block_hash)
            return
        if len(pol) >= self._cap[tier]:
            raise CapacityExceeded(f"tier {tier.value} is full ({self._cap[tier]} blocks)")
        pol.insert(block_hash)

    def discard(self, block_hash: BlockHash, tier: Tier) -> None:
        if tier is Tier.DEVICE:
            self._device.discard(block_hash)
        elif (pol := self._pol.get(tier)) is not None:
            pol.remove(block_hash)
        if self.fastest(block_hash) is None:
            self._parent.pop(block_hash, None)

    def touch(self, block_hash: BlockHash, tier: Tier) -> None:
        if (pol := self._pol.get(tier)) is not None:
            pol.touch(block_hash)

    def clear_device(self) -> None:
        for h in list(self._device):
            self.discard(h, Tier.DEVICE)

    def note_use(self, block_hash: BlockHash) -> None:
        """A request used the block (offloaded from the device, or onboarded): it counts towards
        its admission to the filtered tiers."""
        if self.admission is not None:
            self.admission.record_use(block_hash)

    def _refuses(self, block_hash: BlockHash, tier: Tier) -> str | None:
        """Why ``tier``'s admission filter refuses the block; None when it admits it."""
        if self.admission is None or tier is self.tiers[0]:
            return None
        verdict = self.admission.check(block_hash, tier)
        return None if verdict.admitted else verdict.reason

    def set_parent(self, block_hash: BlockHash, parent: BlockHash | None) -> None:
        if parent is not None or block_hash not in self._parent:
            self._parent[block_hash] = parent

    def pin(self, block_hash: BlockHash) -> None:
        """Keep the block's host copy from being evicted (while someone reads it)."""
        self._pins[block_hash] = self._pins.get(block_hash, 0) + 1

    def unpin(self, block_hash: BlockHash) -> None:
        n = self._pins.get(block_hash, 0)
        if n <= 1:
            self._pins.pop(block_hash, None)
        else:
            self._pins[block_hash] = n - 1

    # -- decisions ---------------------------------------------------------------------------

    def plan_admission(self, block_hash: BlockHash, tier: Tier, *, source: Tier,
                       keep_source: bool = False,
                       protect: frozenset[BlockHash] = frozenset()) -> Admission | None:
        """How to put ``block_hash`` (now in ``source``) into ``tier``; None if no room can be
        made (every candidate victim is pinned or protected).

        ``protect``: blocks no tier may evict for this admission, e.g. the rest of the prefix
        being onboarded (making room for its first block must not throw away its next one)."""
        if tier not in self._pol:
            return None
        evictions = self._make_room(tier, exclude=frozenset({block_hash}) | protect)
        if evictions is None:
            return None
        kind = OpKind.COPY if keep_source else OpKind.MOVE
        verb = "onboard" if TIER_ORDER.index(source) > TIER_ORDER.index(tier) else "offload"
        write = Op(kind, block_hash, source, tier, f"{verb} {_NAME[source]}->{_NAME[tier]}")
        return Admission(tuple(evictions), write)

    def plan_placement(self, block_hash: BlockHash, *, source: Tier, start: Tier,
                       keep_source: bool = False) -> Admission | Refusal | None:
        """Admission into ``start`` or, when it cannot make room, the first slower tier that can.

        None when no tier can take it, or when a tier on the way already holds the block (it stays
        reachable there; writing it lower still would only cost I/O). A :class:`Refusal` when the
        tier it would go to refuses it (admission filter); it is not tried lower still."""
        for t in (start, *self._below[start]):
            if self.holds(block_hash, t):
                return None
            if (why := self._refuses(block_hash, t)) is not None:
                return Refusal(block_hash, t, why)
            adm = self.plan_admission(block_hash, t, source=source, keep_source=keep_source)
            if adm is not None:
                return adm
        return None

    def _make_room(self, tier: Tier, exclude: frozenset[BlockHash]) -> list[Op] | None:
        pol = self._pol[tier]
        if len(pol) < self._cap[tier]:
            return []
        pins = self._pins if tier is Tier.HOST else None
        victim = pol.victim(lambda h: h in exclude or (pins is not None and h in pins))
        if victim is None:
            return None
        lower = self._below[tier]
        why = f"{pol.name} victim of full {_NAME[tier]}"
        if not lower:
            return [Op(OpKind.DROP, victim, tier, None, f"{why}; no slower tier")]
        held_below = next((t for t in lower if victim in self._pol[t]), None)
        if held_below is not None:
            return [Op(OpKind.DROP, victim, tier, None, f"{why}; already in {_NAME[held_below]}")]
        if (refused := self._refuses(victim, lower[0])) is not None:
            return [Op(OpKind.DROP, victim, tier, None, f"{why}; {refused}", refused=lower[0])]
        sub = self._make_room(lower[0], exclude | {victim})
        if sub is None:
            return [Op(OpKind.DROP, victim, tier, None, f"{why}; no room in {_NAME[lower[0]]}")]
        return [*sub, Op(OpKind.MOVE, victim, tier, lower[0], f"{why}; demoted")]
