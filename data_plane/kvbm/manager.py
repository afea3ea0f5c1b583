"""The tiered KV block manager: executes the decisions of :mod:`.residency` against the stores
and reports every residency change to the event sink.

Ordering rule (the one invariant the index relies on): a block is reported in a tier only after
its bytes are durably there, and reported gone from a tier only once it is no longer served from
it. Concretely, every change is recorded in :class:`Residency` and queued as an event *after* the
store call that makes it true returned; the queued events are published, in order, before the
public call returns. Adjacent events of the same kind are merged into one (a batch of hashes), so
one onboard of 100 blocks is one ``BlockStored``, not 100 (:mod:`.event_batch`). What the public
calls return: :mod:`.results`.

Failure handling: a block that cannot be read (missing, corrupt, I/O error) or written while it is
being demoted is dropped from its tier with ``BlockRemoved`` (so the space the decision counted
on is freed and no one is sent to bytes that are not there); a corrupt block is deleted. A failed
onboard stops the prefix there and says why. A block the admission filter (:mod:`.admission`)
refuses is not written to that tier: a demotion victim is dropped from its tier with
``BlockRemoved``, exactly as a victim with no slower tier, and counted
(``<tier>_admission_refused``); the filter counts a use at every offload from the device and
every onboard served from a KVBM tier.

Threading: every public method is blocking (disk and S3 I/O happen inline) and takes one
re-entrant lock for its whole duration, so calls from several threads are serialised and their
events are published in the order the changes happened. From asyncio, use
:class:`data_plane.kvbm.aio.AsyncKvbm`, which runs them on a dedicated thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TypeVar

from data_plane.kvbm import content, frame
from data_plane.kvbm.breaker import TierBreaker, Verdict
from data_plane.kvbm.errors import (
    BlockMissing,
    CorruptBlock,
    KvbmConfigError,
    KvbmError,
    StorageError,
    TierUnavailable,
)
from data_plane.kvbm.event_batch import EventBatch
from data_plane.kvbm.policy import EvictionPolicy
from data_plane.kvbm.rebuild import TierPlan, plan_tier
from data_plane.kvbm.residency import Admission, Op, OpKind, Refusal, Residency
from data_plane.kvbm.results import OnboardedBlock, OnboardResult, RebuildReport
from data_plane.kvbm.settings import KvbmSettings
from data_plane.kvbm.stores.base import BlockStore, Buffer
from data_plane.kvbm.stores.host import HostStore
from common.log.sink import EventSink
from schemas.types import PERSISTENT_TIERS, TIER_ORDER, BlockHash, Tier

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class KvBlockManager:
    """Tiers G2 (host), G3 (disk), G4 (object) of one worker, below the engine's G1 pool."""

    def __init__(self, settings: KvbmSettings, sink: EventSink, stores: Mapping[Tier, BlockStore],
                 *, policy: str | type[EvictionPolicy] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``clock`` (seconds) times an unavailable tier's backoff (:mod:`.breaker`), nothing
        else."""
        self.settings = settings
        self._sink = sink
        self._res = Residency(settings.capacities, policy or settings.policy,  # type: ignore[arg-type]
                              admission=settings.admission)
        for t in self._res.tiers:
            store = stores.get(t)
            if store is None:
                raise KvbmConfigError(f"tier {t.value} has capacity but no store")
            if store.bytes_per_block != settings.bytes_per_block:
                raise KvbmConfigError(f"{t.value} store holds {store.bytes_per_block}-byte blocks"
                                      f", settings say {settings.bytes_per_block}")
        self._stores = {t: stores[t] for t in self._res.tiers}
        host = self._stores.get(Tier.HOST)
        if host is not None and not isinstance(host, HostStore):
            raise KvbmConfigError("the host tier must be a HostStore (slots are addressed by "
                                  "offset for transfers)")
        self._host: HostStore | None = host
        if host is not None and host.capacity != settings.host_capacity:
            raise KvbmConfigError(f"host pool has {host.capacity} slots, settings say "
                                  f"{settings.host_capacity}")
        self._lock = threading.RLock()
        self._batch: EventBatch | None = None
        self._stats: Counter[str] = Counter()
        #: Tiers that stopped answering: skipped until their backoff is over, then probed.
        self._breaker = TierBreaker(settings.outage_breaker)
        self._clock = clock

    # -- plumbing -------------------------------------------------------------------------

    @contextmanager
    def _call(self, correlation_id: str | None = None) -> Iterator[EventBatch]:
        """Hold the lock for one public call; publish its events on the way out, also when it
        failed half-way (the changes made so far are real and must be reported)."""
        with self._lock:
            if self._batch is not None:  # re-entrant call: join the outer batch
                yield self._batch
                return
            batch = self._batch = EventBatch(self.settings)
            try:
                yield batch
            finally:
                self._batch = None
                for ev in batch.events():
                    self._sink.publish(ev, correlation_id=correlation_id)

    def _read(self, h: BlockHash, tier: Tier) -> Buffer:
        data = self._answered(tier, self._stores[tier].get, h)
        if (self.settings.verify_synthetic_content and tier is not Tier.HOST
                and not content.verify(h, data)):
            raise CorruptBlock(f"block {h:016x} in {tier.value}: not the content of its hash")
        return data

    def _delete(self, h: BlockHash, tier: Tier) -> None:
        try:
            self._answered(tier, self._stores[tier].delete, h)
        except StorageError as e:
            # The block is no longer served from this tier either way; leftover bytes are an
            # orphan that the next rebuild deletes.
            self._stats["delete_errors"] += 1
            if not isinstance(e, TierUnavailable):  # an outage is logged once, when it starts
                logger.warning("could not delete block %016x from %s: %s", h, tier.value, e)

    def _drop(self, batch: EventBatch, h: BlockHash, tier: Tier, why: str) -> None:
        self._delete(h, tier)
        self._res.discard(h, tier)
        batch.removed(tier, h)
        self._stats[f"dropped_{tier.value}"] += 1
        logger.debug("dropped block %016x from %s: %s", h, tier.value, why)

    def _run_eviction(self, batch: EventBatch, op: Op) -> None:
        """Carry out one eviction of an admission. Whatever fails, the source tier ends up
        without the block, which is what the admission counted on."""
        h, src = op.block_hash, op.src
        if op.kind is OpKind.DROP:
            if op.refused is not None:
                self._stats[f"{op.refused.value}_admission_refused"] += 1
            self._drop(batch, h, src, op.reason)
            return
        assert op.kind is OpKind.MOVE and op.dst is not None
        try:
            data = self._read(h, src)
        except (BlockMissing, CorruptBlock, StorageError) as e:
            self._note_read_failure(src, e)
            self._drop(batch, h, src, f"{op.reason}; unreadable: {e}")
            return
        try:
            self._answered(op.dst, self._stores[op.dst].put, h, data)
        except StorageError as e:
            self._note_write_failure(op.dst, e)
            if not isinstance(e, TierUnavailable):  # an outage is logged once, when it starts
                logger.warning("demoting block %016x to %s failed: %s", h, op.dst.value, e)
            self._drop(batch, h, src, f"{op.reason}; write failed")
            return
        self._res.add(h, op.dst)
        self._delete(h, src)
        self._res.discard(h, src)
        batch.moved(src, op.dst, h)
        self._stats[f"demoted_{src.value}_{op.dst.value}"] += 1

    def _note_write_failure(self, tier: Tier, e: StorageError) -> None:
        """All write failures, and per tier and reason (``write_errors_disk_full``: the
        filesystem under the disk tier is full), for the worker's metrics."""
        self._stats["write_errors"] += 1
        self._stats[f"write_errors_{tier.value}_{e.reason}"] += 1

    def _note_read_failure(self, tier: Tier, e: Exception) -> None:
        if isinstance(e, CorruptBlock):
            self._stats["corrupt"] += 1
            logger.warning("corrupt block: %s", e)
        elif isinstance(e, BlockMissing):
            self._stats["missing"] += 1
            logger.warning("block missing from its store: %s", e)
        else:
            self._stats["read_errors"] += 1
            reason = e.reason if isinstance(e, StorageError) else "storage"
            self._stats[f"read_errors_{tier.value}_{reason}"] += 1
            if not isinstance(e, TierUnavailable):  # an outage is logged once, when it starts
                logger.warning("read failed: %s", e)

    def _answered(self, tier: Tier, call: Callable[..., _T], *args: object) -> _T:
        """``call(*args)`` against ``tier``'s store, through the tier's breaker (:mod:`.breaker`):
        the first :class:`TierUnavailable` of an outage is logged as a warning (what is dropped
        and what recomputes meanwhile) and counted in ``unavailable_<tier>``; until the backoff
        is over, calls are not made and raise :class:`TierUnavailable` at once (counted in
        ``skipped_<tier>``); then one call probes the tier (``probes_<tier>``), and the first
        answer is logged. Errors propagate to the caller, which handles them as always."""
        breaker = self._breaker
        verdict = breaker.verdict(tier, self._clock())
        if verdict is Verdict.SKIP:
            self._stats[f"skipped_{tier.value}"] += 1
            raise TierUnavailable(f"{tier.value} tier unavailable: not called until its next probe")
        if verdict is Verdict.PROBE:
            self._stats[f"probes_{tier.value}"] += 1
        try:
            out = call(*args)
        except TierUnavailable as e:
            backoff = breaker.failed(tier, self._clock())
            if verdict is Verdict.CALL:
                self._stats[f"unavailable_{tier.value}"] += 1
                logger.warning("KV tier %s unavailable (%s): blocks it would take are dropped "
                               "from the tier above and its hits recompute until it answers; "
                               "not called for %.1f s, then probed", tier.value, e, backoff)
            raise
        if breaker.answered(tier):
            logger.info("KV tier %s answers again", tier.value)
        return out

    def _admit(self, batch: EventBatch, adm: Admission, data: Buffer) -> bool:
        """Evictions, then the write of ``adm``. True once the block is in ``adm.tier``."""
        for op in adm.evictions:
            self._run_eviction(batch, op)
        try:
            self._answered(adm.tier, self._stores[adm.tier].put, adm.write.block_hash, data)
        except StorageError as e:
            self._note_write_failure(adm.tier, e)
            if not isinstance(e, TierUnavailable):
                logger.warning("writing block %016x to %s failed: %s", adm.write.block_hash,
                               adm.tier.value, e)
            return False
        self._res.add(adm.write.block_hash, adm.tier)
        return True

    # -- G1: what the engine tells us -----------------------------------------------------

    def on_device_stored(self, block_hashes: Sequence[BlockHash],
                         parent_hash: BlockHash | None = None) -> None:
        """The engine cached these blocks (a chain after ``parent_hash``) on the device. The
        engine reports that itself (``BlockStored(device)``); the KVBM only records it, so a
        lookup knows and a later eviction of a block already in host costs no write."""
        with self._lock:
            parent = parent_hash
            for h in block_hashes:
                self._res.add(h, Tier.DEVICE)
                self._res.set_parent(h, parent)
                parent = h

    def on_device_evicted(self, block_hash: BlockHash, parent_hash: BlockHash | None = None,
                          data: Buffer | None = None, *,
                          correlation_id: str | None = None) -> Tier | None:
        """The engine evicted a cached block from the device: offload it to G2 (or lower when
        every host slot is pinned). Usable directly as the engine's ``on_evict`` hook.

        ``data`` is the block's bytes, copied out of the device before its slot is reused; None
        means the engine is simulated and the bytes are the synthetic content of the hash.
        Returns the fastest managed tier holding the block afterwards (None: it is gone).
        Reports ``BlockMoved(device->tier)`` when it wrote the block, else ``BlockRemoved
        (device)`` (see ``KvbmSettings.device_eviction_events``).
        """
        h = block_hash
        s = self.settings
        if data is not None and memoryview(data).nbytes != s.bytes_per_block:
            raise ValueError(f"block {h:016x}: {memoryview(data).nbytes} bytes, expected "
                             f"{s.bytes_per_block}")
        with self._call(correlation_id) as batch:
            parent = parent_hash if parent_hash is not None else self._res.parent_of(h)
            self._res.discard(h, Tier.DEVICE)
            self._res.set_parent(h, parent)
            self._res.note_use(h)
            if self._res.holds(h, Tier.HOST):
                self._res.touch(h, Tier.HOST)
                if s.device_eviction_events:
                    batch.removed(Tier.DEVICE, h)
                self._stats["offload_already_in_host"] += 1
                return Tier.HOST
            adm = None
            if self._res.tiers:
                adm = self._res.plan_placement(h, source=Tier.DEVICE, start=self._res.tiers[0])
            if isinstance(adm, Refusal):
                self._stats[f"{adm.tier.value}_admission_refused"] += 1
                logger.debug("offload of block %016x: %s", h, adm.reason)
                adm = None
            if adm is not None:
                payload = data if data is not None else content.expected_bytes(h, s.bytes_per_block)
                if self._admit(batch, adm, payload):
                    if s.device_eviction_events:
                        batch.moved(Tier.DEVICE, adm.tier, h)
                    else:
                        batch.stored(adm.tier, h, self._res.parent_of(h))
                    self._stats[f"offloaded_{adm.tier.value}"] += 1
                    return adm.tier
            if s.device_eviction_events:
                batch.removed(Tier.DEVICE, h)
            where = self._res.fastest(h)
            if where is None:
                self._stats["offload_dropped"] += 1
            return where

    def on_device_evicted_many(self, evicted: Sequence[tuple[BlockHash, BlockHash | None]
                                                       | tuple[BlockHash, BlockHash | None, Buffer]],
                               *, correlation_id: str | None = None) -> list[Tier | None]:
        """:meth:`on_device_evicted` for every ``(hash, parent)`` (or ``(hash, parent, data)``
        when the engine has real bytes, as vLLM's connector does) of one engine step, as one
        call: their events are merged (one ``BlockStored``/``BlockMoved`` per tier pair, not one
        per block), which is most of the event volume a busy worker writes."""
        with self._call(correlation_id):
            return [self.on_device_evicted(*e) for e in evicted]

    def on_device_cleared(self) -> None:
        """The engine dropped its whole cache (reset); it reports that itself."""
        with self._lock:
            self._res.clear_device()

    # -- lookup and onboarding -------------------------------------------------------------

    def lookup(self, block_hashes: Sequence[BlockHash]) -> list[Tier]:
        """Fastest tier of each block of the longest held prefix (no I/O, no state change)."""
        with self._lock:
            return self._res.held_prefix(block_hashes)

    def onboard(self, block_hashes: Sequence[BlockHash], *, pin: bool = True,
                correlation_id: str | None = None) -> OnboardResult:
        """Bring the longest available prefix of ``block_hashes`` into G2, reading lower tiers
        (verified) as needed, and say where each block was found.

        Blocks already on the device are reported as such and not copied (the engine has them);
        blocks in host are served from there. With ``pin`` the host copies of the returned blocks
        stay put until :meth:`release` (so the worker can copy them to the device from
        ``host_offset``); without, they are only guaranteed until the next call.
        Making room never evicts another block of ``block_hashes`` from any tier.
        A copy that fails verification is deleted and reported removed, and the next lower copy
        is tried. Reports ``BlockStored(host)`` (or ``BlockMoved(tier->host)`` when onboarding
        does not keep the source).
        """
        keep = self.settings.onboard_keeps_source
        blocks: list[OnboardedBlock] = []
        pinned: list[BlockHash] = []
        stop = "complete"
        protect = frozenset(block_hashes)
        with self._call(correlation_id) as batch:
            try:
                for h in block_hashes:
                    found = self._res.fastest(h)
                    if found is None:
                        stop = "miss"
                        break
                    if self._res.holds(h, Tier.HOST):
                        self._res.touch(h, Tier.HOST)
                        self._res.note_use(h)
                        self._res.pin(h)
                        pinned.append(h)
                        blocks.append(OnboardedBlock(h, found, self._host.slot_of(h)))  # type: ignore[union-attr]
                        self._stats[f"hit_{found.value}"] += 1
                        continue
                    if found is Tier.DEVICE:
                        blocks.append(OnboardedBlock(h, found, None))
                        self._stats["hit_device"] += 1
                        continue
                    if self._host is None:
                        stop = "no_host_tier"
                        break
                    stop = self._onboard_one(batch, h, keep, protect)
                    if stop != "ok":
                        break
                    stop = "complete"
                    self._res.note_use(h)
                    self._res.pin(h)
                    pinned.append(h)
                    blocks.append(OnboardedBlock(h, found, self._host.slot_of(h)))
            finally:
                if not pin:
                    for h in pinned:
                        self._res.unpin(h)
            return OnboardResult(tuple(blocks), len(block_hashes), stop,
                                 tuple(pinned) if pin else ())

    def _onboard_one(self, batch: EventBatch, h: BlockHash, keep: bool,
                     protect: frozenset[BlockHash]) -> str:
        """Copy (or move) ``h`` from its fastest readable lower tier into host."""
        outcome = "miss"
        for src in [t for t in self._res.below(Tier.HOST) if self._res.holds(h, t)]:
            try:
                data = self._read(h, src)
            except (CorruptBlock, BlockMissing) as e:
                self._note_read_failure(src, e)
                self._drop(batch, h, src, f"onboard read failed: {e}")
                outcome = "corrupt" if isinstance(e, CorruptBlock) else "miss"
                continue
            except StorageError as e:
                # Kept claimed: the bytes are most likely still there (an unavailable object
                # store), and the caller recomputes this time.
                self._note_read_failure(src, e)
                outcome = "error"
                continue
            adm = self._res.plan_admission(h, Tier.HOST, source=src, keep_source=keep,
                                           protect=protect)
            if adm is None:
                return "host_full"
            if not self._admit(batch, adm, data):
                return "error"
            if keep:
                self._res.touch(h, src)
                batch.stored(Tier.HOST, h, self._res.parent_of(h))
            else:
                self._delete(h, src)
                self._res.discard(h, src)
                batch.moved(src, Tier.HOST, h)
            self._stats[f"onboarded_{src.value}"] += 1
            return "ok"
        return outcome

    def copy_for_peer(self, block_hashes: Sequence[BlockHash], dest: Sequence[Buffer],
                      on_device: Collection[BlockHash] = ()) -> list[Tier]:
        """Copy the leading run of ``block_hashes`` this worker holds in host or on the device
        into ``dest`` (one writable buffer of ``bytes_per_block`` per block), for a peer to
        READ; returns the tier each copied block came from. Host copies are the host slot's
        bytes, copied under the lock (no eviction reuses the slot meanwhile); a block only on
        the (simulated) device gets its synthetic content, as the prefill handoff's copy-out
        does. ``on_device``: the engine's cached blocks, when it does not report them here.
        No state change, no events."""
        out: list[Tier] = []
        with self._lock:
            for h, row in zip(block_hashes, dest, strict=False):
                if self._host is not None and self._res.holds(h, Tier.HOST):
                    memoryview(row).cast("B")[:] = memoryview(self._host.get(h)).cast("B")
                    out.append(Tier.HOST)
                elif h in on_device or self._res.holds(h, Tier.DEVICE):
                    content.fill(h, row)
                    out.append(Tier.DEVICE)
                else:
                    break
        return out

    def store_fetched(self, blocks: Sequence[tuple[BlockHash, BlockHash | None, Buffer]], *,
                      correlation_id: str | None = None) -> int:
        """Blocks a peer sent (``(hash, parent, bytes)``, a chain from the root, each already
        verified by the caller): written to host, reported ``BlockStored(host)``, so the engine's
        next lookup onboards them to the device like any host hit. Returns how many of the
        leading blocks are in host afterwards; it stops at the first that cannot be placed (no
        host tier, every slot pinned, a write that failed). Making room never evicts another
        block of ``blocks``."""
        s = self.settings
        protect = frozenset(h for h, _, _ in blocks)
        n = 0
        with self._call(correlation_id) as batch:
            if self._host is None:
                return 0
            for h, parent, data in blocks:
                if memoryview(data).nbytes != s.bytes_per_block:
                    raise ValueError(f"block {h:016x}: {memoryview(data).nbytes} bytes, expected "
                                     f"{s.bytes_per_block}")
                self._res.set_parent(h, parent)
                self._res.note_use(h)
                if self._res.holds(h, Tier.HOST):
                    self._res.touch(h, Tier.HOST)
                    n += 1
                    continue
                adm = self._res.plan_admission(h, Tier.HOST, source=Tier.HOST, keep_source=True,
                                               protect=protect)
                if adm is None or not self._admit(batch, adm, data):
                    break
                batch.stored(Tier.HOST, h, parent)
                self._stats["fetched_from_peer"] += 1
                n += 1
        return n

    def release(self, block_hashes: Iterable[BlockHash]) -> None:
        """Unpin host copies pinned by :meth:`onboard` (once per pin)."""
        with self._lock:
            for h in block_hashes:
                self._res.unpin(h)

    @contextmanager
    def onboarded(self, block_hashes: Sequence[BlockHash], *,
                  correlation_id: str | None = None) -> Iterator[OnboardResult]:
        """``onboard`` with the pins released on exit."""
        result = self.onboard(block_hashes, pin=True, correlation_id=correlation_id)
        try:
            yield result
        finally:
            self.release(result.pinned)

    # -- host pool access (for transfers to the device or to peers) ------------------------

    @property
    def host_pool(self) -> HostStore | None:
        """The G2 pool: ``base_address``/``region_size`` to register with NIXL, ``offset_of``."""
        return self._host

    def read_host(self, block_hash: BlockHash) -> memoryview:
        """Read-only view of a host copy; pin the block (``onboard``) while using it."""
        if self._host is None:
            raise KvbmConfigError("no host tier")
        with self._lock:
            return self._host.get(block_hash)

    # -- restart ---------------------------------------------------------------------------

    def scan_persistent(self) -> dict[Tier, list[BlockHash]]:
        """Blocks physically present in this worker's disk and object stores (sorted), whether
        or not the log ever reported them. No verification, no events."""
        with self._lock:
            return {t: sorted(self._stores[t].scan()) for t in self._res.tiers
                    if t in PERSISTENT_TIERS}

    def rebuild(self, claimed: Mapping[Tier, Iterable[BlockHash]], *, deep: bool = True,
                adopt_orphans: bool = False, correlation_id: str | None = None) -> RebuildReport:
        """Take back the persistent tiers after a restart.

        ``claimed``: per tier, the blocks the log says this worker holds there, least recent
        first (:func:`data_plane.kvbm.projection.claimed_persistent` folds them from the
        worker's past events). Each claim is checked against the store: present with the right
        size, and with ``deep`` read back and verified (checksum, and synthetic content when
        configured). Verified blocks become resident again in the claimed order (recency);
        missing and corrupt ones are reported ``BlockRemoved`` (corrupt ones deleted). Volatile
        tiers in ``claimed`` are ignored: a new process starts with empty device and host memory.
        A storage error while checking is raised (the worker retries its start-up) rather than
        reported as loss. Call once, on a manager whose persistent tiers are still empty.
        """
        report = RebuildReport()
        size = frame.framed_size(self.settings.bytes_per_block)
        with self._call(correlation_id) as batch:
            for tier in self._res.tiers:
                if tier in PERSISTENT_TIERS and self._res.count(tier):
                    raise KvbmError(f"rebuild on a non-empty {tier.value} tier")
            # Check everything first, change nothing: a storage error raised here leaves the
            # manager empty, so the worker can simply retry.
            plans: list[TierPlan] = []
            for tier in TIER_ORDER:
                if tier not in PERSISTENT_TIERS:
                    continue
                claims = list(dict.fromkeys(claimed.get(tier, ())))
                managed = tier in self._res.tiers
                plans.append(plan_tier(
                    tier, claims, self._stores[tier].scan() if managed else None, size,
                    self._res.capacity(tier) if managed else 0,
                    lambda h, tier=tier: self._check(h, tier, deep), adopt_orphans))

            for p in plans:
                tier = p.tier
                if tier in self._res.tiers:
                    for h in p.corrupt + p.excess + p.orphans:
                        self._delete(h, tier)
                for h in p.missing + p.corrupt + p.excess:
                    batch.removed(tier, h)
                for h in p.ok:
                    self._res.add(h, tier)
                for h in p.adopt:
                    self._res.add(h, tier)
                    batch.stored(tier, h, None)
                self._stats["rebuild_corrupt"] += len(p.corrupt)
                self._stats["rebuild_missing"] += len(p.missing)
                if tier in self._res.tiers:
                    report.verified[tier] = p.ok + p.adopt
                for name, vals in (("missing", p.missing), ("corrupt", p.corrupt),
                                   ("over_capacity", p.excess), ("orphans_deleted", p.orphans),
                                   ("orphans_adopted", p.adopt)):
                    if vals:
                        getattr(report, name)[tier] = vals
                logger.info("rebuilt %s: %d verified, %d missing, %d corrupt, %d over capacity, "
                            "%d orphans deleted, %d adopted", tier.value, len(p.ok), len(p.missing),
                            len(p.corrupt), len(p.excess), len(p.orphans), len(p.adopt))
        return report

    def _check(self, h: BlockHash, tier: Tier, deep: bool) -> str:
        """"ok", "missing" or "corrupt"; storage errors propagate."""
        if not deep:
            return "ok"
        try:
            self._read(h, tier)
        except CorruptBlock:
            return "corrupt"
        except BlockMissing:
            return "missing"
        return "ok"

    # -- administration and reporting ------------------------------------------------------

    def clear(self, tier: Tier | None = None, *, correlation_id: str | None = None) -> None:
        """Delete every block of one managed tier (all of them when None), pins included, and
        report ``AllBlocksCleared`` per tier."""
        tiers = self._res.tiers if tier is None else (tier,)
        with self._call(correlation_id) as batch:
            for t in tiers:
                if t not in self._res.tiers:
                    continue
                for h in self._res.members(t):
                    self._delete(h, t)
                    self._res.discard(h, t)
                batch.cleared(t)

    def residency(self) -> dict[Tier, list[BlockHash]]:
        """Blocks per tier (every tier, empty when not configured), next victim first; device
        as reported by the engine, sorted."""
        with self._lock:
            out = {t: self._res.members(t) for t in TIER_ORDER}
            out[Tier.DEVICE] = sorted(self._res.device_blocks())
            return out

    def tiers_of(self, block_hash: BlockHash) -> tuple[Tier, ...]:
        with self._lock:
            return self._res.tiers_of(block_hash)

    def capacity(self) -> dict[str, int]:
        """Capacity in blocks per managed tier name (for ``WorkerRegistered.capacity``)."""
        return {t.value: self._res.capacity(t) for t in self._res.tiers}

    def usage(self) -> dict[str, float]:
        """Used fraction per managed tier name (for ``WorkerLoadReported.tier_usage``)."""
        with self._lock:
            return {t.value: self._res.count(t) / self._res.capacity(t) for t in self._res.tiers}

    def counts(self) -> dict[Tier, int]:
        with self._lock:
            return {t: self._res.count(t) for t in self._res.tiers}

    def stats(self) -> dict[str, int]:
        """Counters since start: hits, offloads, onboards, demotions, drops, errors."""
        with self._lock:
            return dict(self._stats)

    def close(self) -> None:
        with self._lock:
            for store in self._stores.values():
                store.close()
