"""Typed settings of the KV block manager, built once by the worker at start-up.

Nothing here reads the environment: the worker's own settings object carries these fields and
builds :class:`KvbmSettings` from them. Validators explain the design when a combination cannot
work.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from data_plane.kvbm.offload_filter import AdmissionConfig
from data_plane.kvbm.breaker import BreakerConfig
from data_plane.kvbm.errors import KvbmConfigError
from data_plane.kvbm.policy import POLICIES
from schemas.types import Tier, WorkerId

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class S3Settings:
    """Where G4 lives: any S3-compatible endpoint."""

    #: Bucket holding the blocks (shared by workers; each writes under its own prefix).
    bucket: str
    #: Endpoint URL, e.g. ``http://127.0.0.1:9000``; None means AWS's default for ``region``.
    endpoint_url: str | None = None
    #: Prefix of every key; the worker id and a slash are appended per worker.
    key_prefix: str = "switchyard/kvbm/"
    #: Region name sent to the endpoint (most S3-compatible servers accept any).
    region: str = "us-east-1"
    #: Explicit credentials; None uses boto3's usual chain (env, profile, instance role).
    access_key_id: str | None = None
    secret_access_key: str | None = field(default=None, repr=False)
    #: Create the bucket at start-up if missing (local endpoints; production buckets are
    #: provisioned outside the worker).
    create_bucket: bool = False
    #: "path" works with every S3-compatible server; "virtual" is AWS's preferred style.
    addressing_style: str = "path"
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 10.0
    #: Attempts per request including the first (botocore "standard" retry mode).
    max_attempts: int = 3
    #: Connection pool size of the client (one per concurrent request).
    max_pool_connections: int = 10

    def __post_init__(self) -> None:
        if not self.bucket:
            raise KvbmConfigError("S3Settings.bucket is empty")
        if self.addressing_style not in ("path", "virtual", "auto"):
            raise KvbmConfigError(f"addressing_style must be path, virtual or auto, got "
                                  f"{self.addressing_style!r}")


@dataclass(frozen=True)
class KvbmSettings:
    """One worker's tiered KV block manager."""

    #: The worker whose blocks these are; every event carries it.
    worker_id: WorkerId
    #: Payload bytes of one block in every tier (one block of all layers' K and V).
    bytes_per_block: int
    #: Tokens per block, as in the engine (``BlockStored.block_size``).
    block_size: int
    #: Prefix-hash algorithm of the engine (``BlockStored.hash_algo``).
    hash_algo: str
    #: G2 capacity in blocks (0: no host tier).
    host_capacity: int = 0
    #: G3 capacity in blocks (0: no disk tier).
    disk_capacity: int = 0
    #: G4 capacity in blocks (0: no object tier). A logical quota: the bucket itself is unbounded.
    object_capacity: int = 0
    #: The worker's data directory; G3 files go under ``<data_dir>/kvbm/g3`` (needed by
    #: ``build_kvbm`` when ``disk_capacity`` > 0).
    data_dir: Path | None = None
    #: Object store of G4 (needed by ``build_kvbm`` when ``object_capacity`` > 0).
    s3: S3Settings | None = None
    #: Eviction policy of every managed tier: "lru" or "lfu" (frequency-aware).
    policy: str = "lru"
    #: Onboarding (lower tier -> host) copies the block and keeps the lower copy (reported as
    #: ``BlockStored(host)``); False moves it (``BlockMoved``) and frees the lower copy. Keeping
    #: it makes a later eviction of the host copy free of I/O.
    onboard_keeps_source: bool = True
    #: The KVBM reports blocks leaving the device: ``BlockMoved(device->host)`` for an offload,
    #: ``BlockRemoved(device)`` otherwise. Set False when the engine already publishes its own
    #: ``BlockRemoved(device)`` for every eviction; offloads are then ``BlockStored(host)``.
    device_eviction_events: bool = True
    #: Check that every block read from disk/object is the synthetic content of its hash
    #: (:mod:`data_plane.kvbm.content`), on top of the frame checksum. Only for the simulated
    #: engine: real KV bytes would all fail it.
    verify_synthetic_content: bool = False
    #: fsync each G3 file and the directory before reporting the block. Off by default: the
    #: disk tier is a cache whose every block carries a checksum (:mod:`.frame`), every read
    #: verifies it and a restart verifies every file before re-announcing it, so a block lost
    #: or torn by a power cut (a process kill loses nothing: the page cache survives it) is
    #: found and reported removed, never served. Two fsyncs per 16 KiB block cost more CPU and
    #: latency than the rest of an offload together (measured on the demo's workers).
    fsync: bool = False
    #: Data-parallel rank carried by the events.
    dp_rank: int = 0
    #: Which blocks the slower tiers take (:mod:`.admission`): by default a block is written to
    #: disk only once it has been used twice (Dynamo's disk filter); ``ADMIT_ALL`` turns it off.
    admission: AdmissionConfig = AdmissionConfig()
    #: How long a tier that stopped answering (an object store outage) is skipped before it is
    #: probed again (:mod:`.breaker`): its calls fail at once meanwhile instead of each waiting
    #: for the client's timeouts under the KVBM's lock.
    outage_breaker: BreakerConfig = BreakerConfig()

    def __post_init__(self) -> None:
        if self.bytes_per_block <= 0:
            raise KvbmConfigError("bytes_per_block must be > 0")
        if self.block_size <= 0:
            raise KvbmConfigError("block_size (tokens per block) must be > 0")
        if not self.hash_algo:
            raise KvbmConfigError("hash_algo is required: the index refuses stores without it")
        for name in ("host_capacity", "disk_capacity", "object_capacity"):
            if getattr(self, name) < 0:
                raise KvbmConfigError(f"{name} must be >= 0")
        if self.policy not in POLICIES:
            raise KvbmConfigError(f"unknown policy {self.policy!r}; known: {sorted(POLICIES)}")
        if not isinstance(self.admission, AdmissionConfig):
            raise KvbmConfigError(f"admission must be an AdmissionConfig, got {self.admission!r}")
        if not isinstance(self.outage_breaker, BreakerConfig):
            raise KvbmConfigError(f"outage_breaker must be a BreakerConfig, got {self.outage_breaker!r}")
        self.admission.check_capacities(self.capacities)
        sizes = [(t, c) for t, c in self.capacities.items() if c > 0]
        for (upper, up), (lower, low) in zip(sizes, sizes[1:]):
            if low <= up:
                # Allowed (tests and small demos use equal sizes), but it churns: every block the
                # upper tier evicts is written below and pushes out one that is as recent.
                logger.warning("KV tier sizes: %s holds %d blocks, not more than the %d of %s "
                               "above it; each tier should be larger than the one above, or it "
                               "churns (writes for almost no hits)", lower.value, low, up,
                               upper.value)

    def check_backends(self) -> None:
        """Refuse tiers that have a capacity but nowhere to keep their bytes (called by
        ``build_kvbm``; a manager given its stores directly, as in the simulation, skips it)."""
        if self.disk_capacity > 0 and self.data_dir is None:
            raise KvbmConfigError("disk_capacity > 0 needs data_dir: G3 files live in the "
                                  "worker's data directory so a restart finds them again")
        if self.object_capacity > 0 and self.s3 is None:
            raise KvbmConfigError("object_capacity > 0 needs s3 settings (endpoint, bucket)")

    @property
    def capacities(self) -> dict[Tier, int]:
        return {Tier.HOST: self.host_capacity, Tier.DISK: self.disk_capacity,
                Tier.OBJECT: self.object_capacity}

    @property
    def disk_root(self) -> Path | None:
        return None if self.data_dir is None else Path(self.data_dir) / "kvbm" / "g3"

    @property
    def object_prefix(self) -> str | None:
        return None if self.s3 is None else f"{self.s3.key_prefix}{self.worker_id}/"
