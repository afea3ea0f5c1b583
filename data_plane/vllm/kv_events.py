"""vLLM KV cache event batches: decoding every wire form we know of, and translation into our
payloads. Pure: no I/O, no vLLM import.

What vLLM puts on the wire (``vllm/distributed/kv_events.py``): one MessagePack value per ZMQ message, an ``EventBatch``
``[ts, events, data_parallel_rank]`` whose ``events`` are ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``. The details moved between releases, so the decoder accepts each form it
has evidence for and records which one it saw (:class:`EventForm`):

* **Batch**: an array (``array_like=True``; vLLM 0.33 and the early releases, which had no
  ``data_parallel_rank`` element), or a map (vLLM main at commit 0181ea31, where ``EventBatch``
  is a plain struct). Trailing elements we do not know are ignored.
* **Events**: tagged maps ``{"type": "BlockStored", ...}`` (0.33: ``KVCacheEvent(tag=True)``,
  not array_like), or tagged arrays ``["BlockStored", hashes, parent, tokens, block_size,
  lora_id]`` (early releases: array_like). Unknown keys are ignored, unknown event *types* are
  skipped and reported (:attr:`VllmEventBatch.unknown_types`), a malformed known event fails the
  whole batch (:class:`VllmDecodeError`): the bridge then resyncs rather than guess.
* **Hashes**: ints (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the default) or raw digest bytes
  (``=0``). Both become our :data:`~schemas.types.BlockHash`: the last 8 bytes of the digest,
  big-endian, which is exactly what vLLM's int form is, so both settings index identically.
  Negative ints (early releases hashed with Python's builtin ``hash()``) are taken modulo 2**64.
* **Medium**: ``"GPU"`` / ``"CPU"`` / ``"STORAGE"`` / absent map to device / host / disk.
* **Cache groups**: hybrid models (sliding window, Mamba...) have several KV cache groups, each
  emitting its own events with the *same* block hashes. ``group_idx`` names the group and store
  events may carry ``kv_cache_spec_kind``; see :meth:`KvEventTranslator.cache_group` for how a
  group is classified. Only full-attention groups form a reusable prefix.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Union

import msgspec

from schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from schemas.types import BlockHash, CacheGroup, Tier, WorkerId

logger = logging.getLogger(__name__)

_U64 = (1 << 64) - 1

#: vLLM's medium names (``BlockStored.medium`` / ``BlockRemoved.medium``) -> our tiers. An
#: absent medium is the GPU block pool: releases before offloading had no field at all.
MEDIUM_TO_TIER: Mapping[str | None, Tier] = {
    None: Tier.DEVICE,
    "GPU": Tier.DEVICE,
    "CPU": Tier.HOST,
    "STORAGE": Tier.DISK,
}

#: vLLM's ``KVCacheSpecKind`` values (``vllm/v1/kv_cache_interface.py``) -> our cache groups.
#: MLA and sink attention are full attention (vLLM's ``is_full_attention_spec`` says so);
#: chunked-local, encoder-only and cross attention do not form a causal prefix either, but they
#: are not sliding windows, so they are ``other``.
SPEC_KIND_TO_GROUP: Mapping[str, CacheGroup] = {
    "full_attention": CacheGroup.FULL_ATTENTION,
    "mla_attention": CacheGroup.FULL_ATTENTION,
    "sink_full_attention": CacheGroup.FULL_ATTENTION,
    "sliding_window": CacheGroup.SLIDING_WINDOW,
    "sliding_window_mla": CacheGroup.SLIDING_WINDOW,
    "mamba": CacheGroup.MAMBA,
    "chunked_local_attention": CacheGroup.OTHER,
    "encoder_only_attention": CacheGroup.OTHER,
    "cross_attention": CacheGroup.OTHER,
    "unknown": CacheGroup.OTHER,
}


class VllmDecodeError(ValueError):
    """A payload is not a vLLM KV event batch we can read (or a known event in it is malformed)."""


class EventForm(str, Enum):
    """How a batch was laid out on the wire, for diagnostics and format tracking."""

    #: Array batch, events as tagged maps: vLLM 0.33 (and every release since events lost
    #: ``array_like``).
    ARRAY_BATCH_MAP_EVENTS = "array_batch/map_events"
    #: Array batch, events as tagged arrays: early releases (``KVCacheEvent(array_like=True)``).
    ARRAY_BATCH_ARRAY_EVENTS = "array_batch/array_events"
    #: Map batch (``EventBatch`` not array_like), events as tagged maps.
    MAP_BATCH_MAP_EVENTS = "map_batch/map_events"
    #: Anything else: mixed event forms, or a batch without events (nothing to tell them apart).
    OTHER = "other"


# --------------------------------------------------------------------------------------------
# Normalised view of one batch (what the translator consumes; the wire forms collapse into it)
# --------------------------------------------------------------------------------------------


class VllmBlockStored(msgspec.Struct, frozen=True, kw_only=True):
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()
    #: 0 when the producer did not say (never seen from vLLM; the translator then uses config).
    block_size: int = 0
    lora_id: int | None = None
    lora_name: str | None = None
    medium: str | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None


class VllmBlockRemoved(msgspec.Struct, frozen=True, kw_only=True):
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None


class VllmAllBlocksCleared(msgspec.Struct, frozen=True, kw_only=True):
    pass


VllmEvent = Union[VllmBlockStored, VllmBlockRemoved, VllmAllBlocksCleared]


class VllmEventBatch(msgspec.Struct, frozen=True, kw_only=True):
    ts: float
    events: tuple[VllmEvent, ...]
    data_parallel_rank: int | None = None
    form: EventForm = EventForm.OTHER
    #: Type tags of events this decoder does not know (a newer vLLM); they were skipped.
    unknown_types: tuple[str, ...] = ()


# --------------------------------------------------------------------------------------------
# Wire structs. Everything but the hashes has a default so that a field vLLM stops sending, or
# one it sends as nil, never fails a batch; unknown keys and trailing elements are ignored.
# --------------------------------------------------------------------------------------------

_Hash = Union[int, bytes]


class _MapStored(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None


class _MapRemoved(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[_Hash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None


class _MapCleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


# Early releases' positional layout. vLLM only ever appended fields, so a position past
# ``lora_id`` is read as the next field in vLLM's declaration order (``medium``, ``lora_name``).
class _ArrStored(msgspec.Struct, tag="BlockStored", array_like=True):
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class _ArrRemoved(msgspec.Struct, tag="BlockRemoved", array_like=True):
    block_hashes: list[_Hash]
    medium: str | None = None


class _ArrCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True):
    pass


class _ArrayBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _MapBatch(msgspec.Struct):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _MapTag(msgspec.Struct):
    type: str


_ARRAY_BATCH = msgspec.msgpack.Decoder(_ArrayBatch)
_MAP_BATCH = msgspec.msgpack.Decoder(_MapBatch)
_MAP_EVENT = msgspec.msgpack.Decoder(Union[_MapStored, _MapRemoved, _MapCleared])
_ARR_EVENT = msgspec.msgpack.Decoder(Union[_ArrStored, _ArrRemoved, _ArrCleared])
_MAP_TAG = msgspec.msgpack.Decoder(_MapTag)
_ARR_HEAD = msgspec.msgpack.Decoder(tuple)
_KNOWN_TAGS = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


def _is_map(first: int) -> bool:
    return 0x80 <= first <= 0x8F or first in (0xDE, 0xDF)


def _is_array(first: int) -> bool:
    return 0x90 <= first <= 0x9F or first in (0xDC, 0xDD)


def wire_hash(h: int | bytes) -> BlockHash:
    """Our u64 form of a vLLM block hash: an int as is (mod 2**64), a digest's last 8 bytes
    big-endian (what vLLM itself sends when int hashes are on)."""
    if isinstance(h, bytes):
        return BlockHash(int.from_bytes(h[-8:], "big"))
    return BlockHash(h & _U64)


def _hashes(hs: list[_Hash]) -> tuple[BlockHash, ...]:
    return tuple(wire_hash(h) for h in hs)


def _normalise(ev: _MapStored | _MapRemoved | _MapCleared | _ArrStored | _ArrRemoved | _ArrCleared,
               ) -> VllmEvent:
    if isinstance(ev, (_MapStored, _ArrStored)):
        parent = ev.parent_block_hash
        m = isinstance(ev, _MapStored)
        return VllmBlockStored(
            block_hashes=_hashes(ev.block_hashes),
            parent_block_hash=None if parent is None else wire_hash(parent),
            token_ids=tuple(ev.token_ids),
            block_size=ev.block_size,
            lora_id=ev.lora_id,
            lora_name=ev.lora_name,
            medium=ev.medium,
            group_idx=ev.group_idx if m else None,  # type: ignore[union-attr]
            kv_cache_spec_kind=ev.kv_cache_spec_kind if m else None,  # type: ignore[union-attr]
            kv_cache_spec_sliding_window=(
                ev.kv_cache_spec_sliding_window if m else None  # type: ignore[union-attr]
            ),
            locality=ev.locality if m else None,  # type: ignore[union-attr]
        )
    if isinstance(ev, (_MapRemoved, _ArrRemoved)):
        m = isinstance(ev, _MapRemoved)
        return VllmBlockRemoved(
            block_hashes=_hashes(ev.block_hashes),
            medium=ev.medium,
            group_idx=ev.group_idx if m else None,  # type: ignore[union-attr]
            locality=ev.locality if m else None,  # type: ignore[union-attr]
        )
    return VllmAllBlocksCleared()


def _event_tag(raw: bytes, is_map: bool) -> str | None:
    try:
        if is_map:
            return _MAP_TAG.decode(raw).type
        head = _ARR_HEAD.decode(raw)
        return head[0] if head and isinstance(head[0], str) else None
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def decode_batch(payload: bytes) -> VllmEventBatch:
    """Decode one ZMQ payload (the third frame of vLLM's PUB message) into a normalised batch.

    Raises :class:`VllmDecodeError` if the payload is not a batch or a known event in it is
    malformed; events of unknown types are skipped and listed in ``unknown_types``.
    """
    if not payload:
        raise VllmDecodeError("empty payload")
    first = payload[0]
    try:
        if _is_array(first):
            batch: _ArrayBatch | _MapBatch = _ARRAY_BATCH.decode(payload)
            batch_is_map = False
        elif _is_map(first):
            batch = _MAP_BATCH.decode(payload)
            batch_is_map = True
        else:
            raise VllmDecodeError(f"payload starts with 0x{first:02x}: not a msgpack array/map")
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise VllmDecodeError(f"not a vLLM EventBatch: {e}") from None

    events: list[VllmEvent] = []
    unknown: list[str] = []
    seen_map = seen_array = False
    for i, raw in enumerate(batch.events):
        buf = bytes(raw)
        if not buf:
            raise VllmDecodeError(f"event {i} is empty")
        is_map = _is_map(buf[0])
        if not is_map and not _is_array(buf[0]):
            raise VllmDecodeError(f"event {i} is neither a tagged map nor a tagged array")
        seen_map |= is_map
        seen_array |= not is_map
        try:
            wire = (_MAP_EVENT if is_map else _ARR_EVENT).decode(buf)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            tag = _event_tag(buf, is_map)
            if tag is not None and tag not in _KNOWN_TAGS:
                unknown.append(tag)
                continue
            raise VllmDecodeError(f"event {i} ({tag or 'untagged'}) is malformed: {e}") from None
        events.append(_normalise(wire))

    if seen_map and seen_array or not (seen_map or seen_array):
        form = EventForm.OTHER
    elif batch_is_map:
        form = EventForm.MAP_BATCH_MAP_EVENTS if seen_map else EventForm.OTHER
    else:
        form = EventForm.ARRAY_BATCH_MAP_EVENTS if seen_map else EventForm.ARRAY_BATCH_ARRAY_EVENTS
    return VllmEventBatch(
        ts=batch.ts,
        events=tuple(events),
        data_parallel_rank=batch.data_parallel_rank,
        form=form,
        unknown_types=tuple(unknown),
    )


# --------------------------------------------------------------------------------------------
# Translation into our payloads
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VllmSource:
    """Who produced a stream of vLLM KV events, and how its blocks are hashed.

    One per vLLM publisher (one per data-parallel rank: vLLM offsets the port by the rank).
    """

    #: Our id of the worker running this engine; the key of every event.
    worker_id: WorkerId
    #: The engine's prefix-hash algorithm in our wire form
    #: (``common.hashing.HashConfig.hash_algo``, e.g. ``"sha256"``). vLLM's events
    #: do not say it, so it must come from how the engine was started.
    hash_algo: str
    #: The engine's ``--block-size``. vLLM's stores carry their own block size; this is used
    #: when one does not, and a store that disagrees is logged (the index will refuse it).
    block_size: int
    #: DP rank for events whose batch does not carry one (early releases) and for resyncs
    #: before the first batch.
    dp_rank: int = 0
    #: Operator-declared kind of each KV cache group, for engines whose events carry
    #: ``group_idx`` but not ``kv_cache_spec_kind``.
    group_kinds: Mapping[int, CacheGroup] = field(default_factory=dict)
    #: Drop events of groups that are not full attention instead of publishing them. The prefix
    #: index rejects (dead-letters) such stores and ignores such removes, so publishing them only
    #: fills the dead-letter topic; turn this off for consumers that want every group.
    prefix_groups_only: bool = True

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("worker_id must be non-empty")
        if not self.hash_algo:
            raise ValueError("hash_algo must be non-empty: vLLM events do not carry it, and the "
                             "index refuses events whose algorithm differs from its own")
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")


class KvEventTranslator:
    """Turns decoded vLLM batches into our ``BlockStored`` / ``BlockRemoved`` /
    ``AllBlocksCleared`` payloads for one :class:`VllmSource`.

    Stateful only in what it learns about cache groups (a store's ``kv_cache_spec_kind`` names
    its group's kind; removes carry only ``group_idx``) and in which warnings it already gave.
    Events it cannot place (unknown medium, a block not local to this worker) are dropped with a
    warning, stores and removes alike, so the two sides stay consistent.
    """

    def __init__(self, source: VllmSource) -> None:
        self.source = source
        self._learned: dict[int, CacheGroup] = {}
        self._last_dp_rank = source.dp_rank
        self._warned: set[tuple] = set()
        #: Events dropped, by reason (for stats and tests).
        self.dropped: dict[str, int] = {}

    @property
    def learned_groups(self) -> dict[int, CacheGroup]:
        return dict(self._learned)

    def _warn_once(self, key: tuple, msg: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(msg, *args)

    def _drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def cache_group(self, group_idx: int | None, kind: str | None = None,
                    sliding_window: int | None = None) -> CacheGroup:
        """Classify one event's cache group. First match wins:

        1. the event's own ``kv_cache_spec_kind`` (and remember it for ``group_idx``);
        2. what an earlier store of the same ``group_idx`` said;
        3. the operator's :attr:`VllmSource.group_kinds`;
        4. a ``kv_cache_spec_sliding_window`` on the event: sliding window;
        5. no group, or group 0: full attention (single-group engines, and every release before
           hybrid groups existed);
        6. otherwise ``other``: an unidentified group never enters the prefix index.
        """
        if kind is not None:
            group = SPEC_KIND_TO_GROUP.get(kind)
            if group is None:
                self._warn_once(("kind", kind), "unknown kv_cache_spec_kind %r from worker %s: "
                                "treated as 'other' (kept out of the prefix index)",
                                kind, self.source.worker_id)
                group = CacheGroup.OTHER
            if group_idx is not None:
                self._learned[group_idx] = group
            return group
        if group_idx is not None:
            if group_idx in self._learned:
                return self._learned[group_idx]
            if group_idx in self.source.group_kinds:
                return CacheGroup(self.source.group_kinds[group_idx])
        if sliding_window is not None:
            return CacheGroup.SLIDING_WINDOW
        if group_idx is None or group_idx == 0:
            return CacheGroup.FULL_ATTENTION
        self._warn_once(("group", group_idx), "worker %s: KV cache group %d has no known kind "
                        "(no kv_cache_spec_kind seen, none configured): treated as 'other'",
                        self.source.worker_id, group_idx)
        return CacheGroup.OTHER

    def _tier(self, medium: str | None) -> Tier | None:
        tier = MEDIUM_TO_TIER.get(medium if medium is None else medium.upper())
        if tier is None:
            self._warn_once(("medium", medium), "worker %s: unknown vLLM medium %r: its events "
                            "are dropped", self.source.worker_id, medium)
        return tier

    def _local(self, locality: str | None) -> bool:
        # Only blocks held by this engine are residency we can route to.
        if locality is None or locality.upper() == "LOCAL":
            return True
        self._warn_once(("locality", locality), "worker %s: events with locality %r are "
                        "dropped (not resident on this worker)", self.source.worker_id, locality)
        return False

    def translate(self, batch: VllmEventBatch) -> list[KvEvent]:
        """Our payloads for one batch, in the batch's order."""
        src = self.source
        dp_rank = src.dp_rank if batch.data_parallel_rank is None else batch.data_parallel_rank
        self._last_dp_rank = dp_rank
        for tag in batch.unknown_types:
            self._warn_once(("type", tag), "worker %s: skipping vLLM event type %r (unknown to "
                            "this decoder)", src.worker_id, tag)
            self._drop("unknown_type")
        out: list[KvEvent] = []
        for ev in batch.events:
            if isinstance(ev, VllmAllBlocksCleared):
                # vLLM's event has no medium; clearing every tier errs towards under-reporting.
                out.append(AllBlocksCleared(worker_id=src.worker_id, tier=None, dp_rank=dp_rank))
                continue
            if not ev.block_hashes:
                continue
            if not self._local(ev.locality):
                self._drop("not_local")
                continue
            tier = self._tier(ev.medium)
            if tier is None:
                self._drop("unknown_medium")
                continue
            if isinstance(ev, VllmBlockStored):
                group = self.cache_group(ev.group_idx, ev.kv_cache_spec_kind,
                                         ev.kv_cache_spec_sliding_window)
            else:
                group = self.cache_group(ev.group_idx)
            if group is not CacheGroup.FULL_ATTENTION and src.prefix_groups_only:
                self._drop("non_prefix_group")
                continue
            if isinstance(ev, VllmBlockStored):
                block_size = ev.block_size or src.block_size
                if block_size != src.block_size and group is CacheGroup.FULL_ATTENTION:
                    self._warn_once(("block_size", block_size), "worker %s: vLLM stores blocks "
                                    "of %d tokens but the source is configured for %d; the "
                                    "prefix index will refuse them", src.worker_id, block_size,
                                    src.block_size)
                out.append(BlockStored(
                    worker_id=src.worker_id,
                    tier=tier,
                    block_hashes=list(ev.block_hashes),
                    parent_hash=ev.parent_block_hash,
                    block_size=block_size,
                    hash_algo=src.hash_algo,
                    cache_group=group,
                    lora_id=ev.lora_id,
                    lora_name=ev.lora_name,
                    token_ids=list(ev.token_ids),
                    dp_rank=dp_rank,
                ))
            else:
                out.append(BlockRemoved(
                    worker_id=src.worker_id,
                    tier=tier,
                    block_hashes=list(ev.block_hashes),
                    cache_group=group,
                    dp_rank=dp_rank,
                ))
        return out

    def resync(self) -> AllBlocksCleared:
        """The resync point published when events were lost beyond recovery: everything this
        worker (at the last DP rank seen) held is forgotten, and what follows is exact again."""
        return AllBlocksCleared(worker_id=self.source.worker_id, tier=None,
                                dp_rank=self._last_dp_rank)
