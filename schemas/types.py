"""Identifier and enum types shared by every event.

Ids are ``NewType`` wrappers so signatures say what they carry; on the wire they are plain
strings and integers.
"""

from __future__ import annotations

from enum import Enum
from typing import NewType

WorkerId = NewType("WorkerId", str)
#: The longest worker id a reader accepts (the admin store's ``worker_id`` columns). The codec
#: refuses an event naming a longer one as malformed, so it is dead-lettered as poison by every
#: consumer alike instead of failing somewhere downstream (an SQL insert) in one of them.
MAX_WORKER_ID_LEN = 256
#: Payload fields that hold a worker id.
WORKER_ID_FIELDS = frozenset({"worker_id", "src_worker", "dst_worker"})
RequestId = NewType("RequestId", str)
PoolName = NewType("PoolName", str)
#: A chained block hash as an unsigned 64-bit integer (vLLM's wire form: the last 8 bytes of
#: the digest, big-endian). Engine hashes are opaque ids to the control plane.
BlockHash = NewType("BlockHash", int)


class Tier(str, Enum):
    """Where a KV block lives. Ordered fastest first (G1..G4)."""

    DEVICE = "device"  # G1: accelerator memory (the engine's block pool)
    HOST = "host"  # G2: host DRAM
    DISK = "disk"  # G3: local disk
    OBJECT = "object"  # G4: object storage (S3 API)


#: Tiers in cascade order, fastest first. Eviction moves a block one step down this list.
TIER_ORDER: tuple[Tier, ...] = (Tier.DEVICE, Tier.HOST, Tier.DISK, Tier.OBJECT)
#: A tier's position in ``TIER_ORDER`` (tier-count vectors are laid out in that order).
TIER_INDEX: dict[Tier, int] = {t: i for i, t in enumerate(TIER_ORDER)}
#: Tiers whose content survives a worker process restart.
PERSISTENT_TIERS: frozenset[Tier] = frozenset({Tier.DISK, Tier.OBJECT})


class WorkerRole(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    AGGREGATED = "aggregated"


class CacheGroup(str, Enum):
    """Kind of attention cache a block belongs to.

    Only ``full_attention`` blocks form a reusable prefix; sliding-window and other hybrid groups
    must never be mixed into the prefix index (they would claim residency that is not there).
    """

    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    MAMBA = "mamba"
    OTHER = "other"


class RoutingMode(str, Enum):
    KV = "kv"
    ROUND_ROBIN = "round_robin"
    RANDOM = "random"
    LEAST_LOADED = "least_loaded"


class RequestPhase(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    AGGREGATED = "aggregated"
