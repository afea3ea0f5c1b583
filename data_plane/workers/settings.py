"""Typed settings of one worker process, built once at start-up from the command line.

Nothing here reads the environment or touches I/O; the bus settings (Kafka, topic prefix) come
from :class:`common.settings.BusSettings` as for every other process. Validators explain
the design when a combination cannot work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from data_plane.kvbm import AdmissionConfig, KvbmSettings, S3Settings
from data_plane.kvbm.offload_filter import MAX_MIN_USES
from data_plane.vllm.serving import VllmEngineSettings
from common.request_limits import RequestLimits
from schemas.types import MAX_WORKER_ID_LEN, PoolName, Tier, WorkerId, WorkerRole

#: Object-tier quota when a bucket is given without one.
DEFAULT_OBJECT_BLOCKS = 1_000_000


class WorkerConfigError(ValueError):
    """The worker cannot start with these settings."""


@dataclass(frozen=True)
class WorkerSettings:
    """One worker incarnation: its identity, engine, KV tiers, transfer region and timings."""

    #: Stable id across restarts: the producer id of every event, the key of its kv/workers
    #: history, and (with the epoch) its NIXL agent name.
    worker_id: WorkerId
    #: What the router sends it: prefill (holds KV for a decode peer), decode (pulls it) or
    #: aggregated (both). Every role can run every kind of request; the role is what it
    #: registers as.
    role: WorkerRole = WorkerRole.AGGREGATED
    #: Pool the planner scales it in.
    pool: PoolName = PoolName("default")
    #: Address the HTTP server binds; published as ``http://<host>:<port>``.
    host: str = "127.0.0.1"
    #: HTTP port; 0 picks a free one (printed on stdout and published in WorkerRegistered).
    port: int = 8100
    #: Engine hardware profile: a shipped name (``mocker``, ``h100_llama3_8b``) or a TOML path.
    profile: str = "mocker"
    #: Engine time runs this many times faster than the profiled hardware.
    speedup: float = 1.0
    #: Overrides of the profile (tests and experiments): tokens per block, device blocks.
    block_size: int | None = None
    device_blocks: int | None = None
    #: Model name served on ``/v1/models`` and stamped in WorkerRegistered.
    model: str = "switchyard-sim"
    #: Worker-owned directory: the disk tier lives under ``<data_dir>/kvbm/g3``.
    data_dir: Path = field(default_factory=lambda: Path("worker-data"))
    #: KV tier capacities in blocks (0: no such tier). The object tier's is a logical quota;
    #: None means 1,000,000 when a bucket is given, else 0.
    host_blocks: int = 0
    disk_blocks: int = 0
    object_blocks: int | None = None
    #: Uses a block needs before the KVBM writes it to disk (its admission filter, Dynamo's rule:
    #: see data_plane/kvbm/README.md; ``--disk-admission-min-uses``); 1 admits every block.
    disk_admission_min_uses: int = 2
    #: S3-compatible endpoint and bucket of the object tier (needed when object_blocks > 0).
    s3_endpoint: str | None = None
    s3_bucket: str | None = None
    #: The object tier's credentials (``--s3-credentials-file``); None: boto3's usual chain.
    s3_access_key_id: str | None = None
    s3_secret_access_key: str | None = field(default=None, repr=False)
    #: Bytes of one KV block in every tier and on the wire (simulated content, derived from the
    #: block hash so every reader can verify it).
    bytes_per_block: int = 16 * 1024
    #: Staging slots of the NIXL region for handoffs (prefill: blocks held for a decode peer;
    #: decode: blocks being read). A handoff needs one slot per full prompt block. 0 sizes it
    #: from the pool: as many slots as the engine has device blocks, so whatever the device
    #: can hold can be handed off (a fixed 1,024 made 74% of a burst's handoffs recompute).
    transfer_blocks: int = 0
    #: How long a handoff waits for staging slots held by other handoffs before it gives up
    #: (prefill: the decode side recomputes; decode: it recomputes), recorded either way.
    staging_wait_s: float = 10.0
    #: How long a prefill holds a handoff's blocks for its decode peer (vLLM: 30 s).
    lease_s: float = 30.0
    #: A READ must be able to finish this long before the lease ends, else it is not started.
    lease_margin_s: float = 1.0
    #: Deadline of one NIXL READ and of the metadata side-channel request.
    transfer_timeout_s: float = 10.0
    #: Bounds on one request on ``/v1/completions``: the router's defaults (the simulated
    #: model's context and vocabulary), so a caller that reaches the worker directly gets no
    #: more than the router would give it.
    limits: RequestLimits = RequestLimits()
    #: ``--open-generation``: ``/v1/completions`` and ``/v1/models`` answer without this worker's
    #: bearer. Only for a benchmark where a third-party router (nginx, smg, vllm-router), which
    #: cannot send a per-worker bearer, fronts the worker (``bench peers``); every other route
    #: still needs it, and nothing of ours starts a worker this way.
    open_generation: bool = False
    #: How long a response waits for the broker to acknowledge the event it reveals
    #: (PrefillCompleted, KvTransferCompleted/Failed) before answering 503.
    ack_timeout_s: float = 10.0
    #: Seconds between two WorkerLoadReported events.
    load_interval_s: float = 1.0
    #: SIGTERM: how long to wait for in-flight requests and held blocks before deregistering.
    drain_timeout_s: float = 30.0
    #: Read this worker's own kv/workers history at start-up (epoch, persistent residency).
    read_history: bool = True
    #: ``sim`` (the simulated engine, default) or ``vllm`` (a real vLLM in this process,
    #: configured by ``vllm``; ``profile``/``speedup``/``block_size``/``device_blocks`` are
    #: then unused: vLLM's own configuration says them).
    engine: str = "sim"
    vllm: VllmEngineSettings = field(default_factory=VllmEngineSettings)

    def __post_init__(self) -> None:
        if not self.worker_id or ":" in self.worker_id:
            raise WorkerConfigError(f"worker id {self.worker_id!r}: must be non-empty and must "
                                    "not contain ':' (the NIXL agent name is '<id>:<epoch>')")
        if len(self.worker_id) > MAX_WORKER_ID_LEN:
            raise WorkerConfigError(f"worker id of {len(self.worker_id)} characters: at most {MAX_WORKER_ID_LEN} "
                                    "(readers refuse events naming a longer one as malformed)")
        object.__setattr__(self, "role", WorkerRole(self.role))
        if self.speedup <= 0:
            raise WorkerConfigError("speedup must be > 0")
        if not 0 <= self.port < 65536:
            raise WorkerConfigError(f"port {self.port} out of range")
        if self.bytes_per_block <= 0:
            raise WorkerConfigError("bytes_per_block must be > 0")
        if self.transfer_blocks < 0:
            raise WorkerConfigError("transfer_blocks must be >= 0 (0: as many as the device blocks)")
        if self.staging_wait_s < 0:
            raise WorkerConfigError("staging_wait_s must be >= 0")
        if self.object_blocks is None:
            object.__setattr__(self, "object_blocks", DEFAULT_OBJECT_BLOCKS if self.s3_bucket else 0)
        for name in ("host_blocks", "disk_blocks", "object_blocks"):
            if getattr(self, name) < 0:
                raise WorkerConfigError(f"{name} must be >= 0")
        if self.object_blocks and not self.s3_bucket:
            raise WorkerConfigError("object_blocks > 0 needs --s3-bucket (and usually "
                                    "--s3-endpoint): the object tier has nowhere else to live")
        if (self.s3_access_key_id is None) != (self.s3_secret_access_key is None):
            raise WorkerConfigError("S3 credentials need both the access key id and the secret key")
        if self.lease_s <= self.lease_margin_s:
            raise WorkerConfigError(f"lease_s ({self.lease_s}) must exceed lease_margin_s "
                                    f"({self.lease_margin_s}), else no READ could ever start")
        if self.engine not in ("sim", "vllm"):
            raise WorkerConfigError(f"engine {self.engine!r}: 'sim' or 'vllm'")
        tiers = bool(self.host_blocks or self.disk_blocks or self.object_blocks)
        if self.engine == "vllm" and tiers and self.vllm.kv_connector != "switchyard":
            raise WorkerConfigError("KV tiers under vLLM are served to it by SwitchyardKVConnector: "
                                    "add --vllm-kv-connector switchyard")
        if self.engine == "vllm" and self.vllm.kv_connector == "switchyard" and not self.host_blocks:
            raise WorkerConfigError("--vllm-kv-connector switchyard needs --host-blocks > 0: vLLM "
                                    "loads every tier hit from the host pool")
        if self.load_interval_s <= 0:
            raise WorkerConfigError("load_interval_s must be > 0")
        if not 1 <= self.disk_admission_min_uses <= MAX_MIN_USES:
            raise WorkerConfigError(f"disk_admission_min_uses must be in 1..{MAX_MIN_USES} (1: every "
                                    f"block is written to disk), got {self.disk_admission_min_uses}")

    def staging_blocks(self, device_blocks: int) -> int:
        """Staging slots for an engine with ``device_blocks`` device blocks."""
        return self.transfer_blocks or device_blocks

    def region_blocks(self, device_blocks: int) -> int:
        """Blocks of the NIXL-registered region: the host pool, then the staging slots."""
        return self.host_blocks + self.staging_blocks(device_blocks)

    def kvbm_settings(self, *, block_size: int, hash_algo: str,
                      bytes_per_block: int | None = None) -> KvbmSettings:
        """``bytes_per_block``: the engine's real block size when it has one (vLLM), else
        ``self.bytes_per_block`` (the simulated engine's synthetic blocks)."""
        s3 = None
        if self.object_blocks:
            assert self.s3_bucket is not None
            s3 = S3Settings(bucket=self.s3_bucket, endpoint_url=self.s3_endpoint,
                            access_key_id=self.s3_access_key_id, secret_access_key=self.s3_secret_access_key,
                            create_bucket=self.s3_endpoint is not None)
        return KvbmSettings(
            worker_id=self.worker_id,
            bytes_per_block=bytes_per_block or self.bytes_per_block,
            block_size=block_size,
            hash_algo=hash_algo,
            host_capacity=self.host_blocks,
            disk_capacity=self.disk_blocks,
            object_capacity=self.object_blocks or 0,
            data_dir=self.data_dir,
            s3=s3,
            # The engine publishes BlockRemoved(device) for every eviction itself; an offload
            # is then reported as BlockStored(host) (see the KVBM README).
            device_eviction_events=False,
            # Synthetic content is the simulated engine's; vLLM's real bytes are checked by
            # the frame checksum alone.
            verify_synthetic_content=self.engine == "sim",
            # Its table and half-life cover a host tier of any size.
            admission=AdmissionConfig(disk_min_uses=self.disk_admission_min_uses).covering(
                {Tier.HOST: self.host_blocks, Tier.DISK: self.disk_blocks,
                 Tier.OBJECT: self.object_blocks or 0}),
        )
