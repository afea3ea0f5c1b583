"""A real vLLM (in-process ``AsyncLLM``) behind the worker's engine interface.

The worker (``data_plane.workers``) drives one engine through ``start / submit / abort /
release / stats / validate / cached_hashes / stop``; :class:`data_plane.engines.AsyncEngine` is
the simulated one, :class:`VllmServingEngine` is this one. Everything else of the worker
(registration with its epoch, the OpenAI API, load reports, drain, the log) is shared.

Why in-process ``AsyncLLM`` and not ``vllm.entrypoints.openai.api_server`` as a child: the
worker keeps *one* HTTP contract (ours, which the router and the tests already speak), and it
gets per request what it must record straight from ``RequestOutput`` (``num_cached_tokens``,
``kv_transfer_params``) and per step what it must report straight from the scheduler
(a ``StatLoggerBase`` receives ``SchedulerStats``), instead of scraping ``/metrics`` of a
second server and matching requests by id over HTTP. vLLM still isolates its model in its own
engine-core process (``AsyncLLM`` spawns it), so a crash there surfaces as a failed request,
not a hung worker.

Invariants:

* The KV event bridge is bound **before** the engine starts: vLLM's PUB socket *connects* to a
  ``tcp://host:port`` endpoint, and a batch published while no subscriber is connected is
  gone. Started first, the bridge sees batch 0; a gap later (a bridge restart, an overflow) is
  filled from vLLM's replay endpoint, or, when that is exhausted, resynced as
  ``AllBlocksCleared`` (see :mod:`data_plane.vllm.bridge`).
* Device residency published to ``sy.kv`` is exactly what vLLM's own events said, translated
  by :class:`~data_plane.vllm.kv_events.KvEventTranslator`; the engine never invents a store.
* ``moves_kv`` is True with vLLM's NixlConnector: then ``kv_transfer_params`` go to vLLM
  unchanged (its protocol) and the worker's own NIXL handoff is not used.
* ``uses_tiers`` is True with ``SwitchyardKVConnector`` (``kv_connector="switchyard"``): the
  worker's KVBM is vLLM's tier backend. The KVBM stays in this process (its events go through
  the worker's producer); the connector in vLLM's engine core reaches it through a
  :class:`~data_plane.vllm.tier_server.TierServer` and reads the host pool from shared memory
  (:mod:`data_plane.vllm.connector`). The shared file is unlinked as soon as the engine core
  has mapped it.

Nothing here imports vLLM at module import: :meth:`VllmServingEngine.start` does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from data_plane.engines.async_engine import StreamedToken
from data_plane.engines.core import EngineStats
from data_plane.engines.errors import RequestRejected
from data_plane.engines.request import EngineRequest
from data_plane.vllm.bridge import BridgeSettings, KvEventBridge
from data_plane.vllm.engine import require_vllm
from data_plane.vllm.kv_events import VllmSource
from data_plane.vllm.tier_server import SharedRegion, TierServer, TierService
from common.hashing import HashConfig, hash_blocks
from common.log.sink import EventSink
from common.net import free_port
from common.processes import remove_dead_owned
from schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, Event
from schemas.types import Tier, WorkerId

log = logging.getLogger(__name__)

#: The tiny Llama shipped with the repo (config only: ``load_format="dummy"``).
TINY_MODEL_DIR = Path(__file__).resolve().parent / "models" / "tiny-llama"

#: Prefix of a worker's private temporary directory (see :class:`_PrivateTmp`).
PRIVATE_TMP_PREFIX = "switchyard-vllm-"


class _PrivateTmp:
    """The temporary directory of one engine's vLLM processes, removed at stop.

    vLLM names its ZMQ IPC sockets after ``VLLM_RPC_BASE_PATH`` and its file-store rendezvous
    (``vllm_dist_*``, in the engine-core process) after ``tempfile.gettempdir()``, both the
    machine's temporary directory by default, and removes neither: every start left files in
    /tmp. While the engine runs, both point at ``<tmp>/switchyard-vllm-<pid>-<random>`` (short:
    a unix socket path ends at 107 bytes). The engine core is forked (or spawned) inside
    ``AsyncLLM`` construction, so it inherits ``TMPDIR`` and ``tempfile.tempdir`` from then.
    Directories of processes that are gone (a kill -9) are removed by the next start.
    """

    def __init__(self) -> None:
        self.path: Path | None = None
        self._saved: dict[str, str | None] = {}
        self._saved_tempdir: str | None = None

    def enter(self) -> Path:
        base = Path(tempfile.gettempdir())
        remove_dead_owned(base, PRIVATE_TMP_PREFIX)
        self.path = Path(tempfile.mkdtemp(prefix=f"{PRIVATE_TMP_PREFIX}{os.getpid()}-", dir=base))
        self._saved_tempdir = tempfile.tempdir
        for name in ("TMPDIR", "VLLM_RPC_BASE_PATH"):
            self._saved[name] = os.environ.get(name)
            os.environ[name] = str(self.path)
        tempfile.tempdir = str(self.path)
        return self.path

    def exit(self) -> None:
        if self.path is None:
            return
        for name, value in self._saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        tempfile.tempdir = self._saved_tempdir
        shutil.rmtree(self.path, ignore_errors=True)
        self.path = None


@dataclass(frozen=True)
class VllmEngineSettings:
    """How one worker starts its vLLM. Every GPU-only difference is a value here, not code."""

    #: HF model directory (``config.json`` is enough with ``load_format="dummy"``).
    model: str = str(TINY_MODEL_DIR)
    #: ``dummy`` (random, seeded weights: no download) or ``auto`` for real weights.
    load_format: str = "dummy"
    dtype: str = "float32"
    #: Tokens per KV block. The CPU attention backend needs multiples of 32.
    block_size: int = 32
    max_model_len: int = 2048
    #: vLLM's ``--prefix-caching-hash-algo``; the router must hash prompts the same way.
    hash_algo: str = "sha256"
    seed: int = 0
    #: GiB of KV cache on the CPU build (``VLLM_CPU_KVCACHE_SPACE``); ignored on GPU hosts.
    cpu_kvcache_gib: int = 1
    #: GPU hosts: fraction of device memory vLLM may use (None: vLLM's default).
    gpu_memory_utilization: float | None = None
    #: KV event PUB endpoint (the bridge binds it) and vLLM's replay ROUTER endpoint (vLLM
    #: binds it). Ports 0 are picked at start.
    kv_events_port: int = 0
    kv_replay_port: int = 0
    #: Replay buffer of vLLM's publisher, in batches.
    kv_buffer_steps: int = 10_000
    #: ``nixl`` for prefill/decode disaggregation over vLLM's NixlConnector, ``switchyard`` for
    #: the worker's KVBM tiers (host, disk, object) as vLLM's tier backend, or None.
    kv_connector: str | None = None
    #: ``kv_producer`` (prefill), ``kv_consumer`` (decode) or ``kv_both``.
    kv_role: str = "kv_both"
    #: ``cpu`` on the CPU build; ``cuda`` on GPU hosts (NIXL reads device memory directly).
    kv_buffer_device: str = "cpu"
    #: NIXL side channel (handshake) port; 0 picks one. Bound on 127.0.0.1 unless
    #: ``side_channel_host`` says otherwise.
    side_channel_port: int = 0
    side_channel_host: str = "127.0.0.1"
    #: UCX network devices (``UCX_NET_DEVICES``); ``lo`` keeps every transfer on loopback.
    ucx_net_devices: str | None = "lo"
    #: vLLM's ``distributed_executor_backend``: ``uni`` runs the model inside the engine-core
    #: process (one process and one vLLM import fewer per engine than ``mp``); GPU hosts with
    #: tensor parallelism set ``mp``.
    executor: str = "uni"
    #: Skip torch.compile / CUDA graphs. On the CPU build compiling the tiny model costs minutes
    #: of start-up on a loaded 2-core box for nothing measurable; GPU hosts turn it off.
    enforce_eager: bool = True
    #: Generate exactly ``max_tokens`` (the worker contract; dummy weights emit EOS at random).
    ignore_eos: bool = True
    #: How long the connector's scheduler side waits for the KVBM to onboard a prompt's blocks
    #: before it computes them instead (``switchyard`` connector).
    tier_timeout_s: float = 10.0
    #: Extra ``AsyncEngineArgs`` (JSON object), for anything not named here.
    extra_args: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.max_model_len <= 0:
            raise ValueError("block_size and max_model_len must be positive")
        if self.kv_connector not in (None, "nixl", "switchyard"):
            raise ValueError(f"kv_connector {self.kv_connector!r}: 'nixl' (vLLM's NixlConnector, "
                             "prefill/decode) or 'switchyard' (the worker's KVBM tiers)")
        if self.kv_connector == "switchyard" and self.kv_role != "kv_both":
            raise ValueError("the switchyard connector serves an aggregated worker's own tiers; "
                             "prefill/decode handoffs go through --vllm-kv-connector nixl")

    def hash_config(self) -> HashConfig:
        return HashConfig.from_engine_env(self.hash_algo, self.block_size, os.environ)


def predict_bytes_per_block(model: str, dtype: str, block_size: int) -> int:
    """Bytes of one KV block over all layers (K and V), from the model's ``config.json``,
    before vLLM starts: the KVBM's tiers are sized in these blocks and the connector's worker
    side checks vLLM's real KV tensors against it (a mismatch fails the engine start)."""
    path = Path(model) / "config.json"
    if path.exists():
        cfg = json.loads(path.read_text())
    else:
        from transformers import AutoConfig  # vLLM's dependency

        cfg = AutoConfig.from_pretrained(model).to_dict()
    cfg = cfg.get("text_config", cfg)
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    layers = int(cfg["num_hidden_layers"])
    name = (cfg.get("torch_dtype") or cfg.get("dtype") or "float32") if dtype == "auto" else dtype
    elt = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}.get(str(name).removeprefix("torch."))
    if elt is None:
        raise ValueError(f"dtype {name!r}: cannot size a KV block")
    return 2 * layers * block_size * kv_heads * head_dim * elt


class _ResidencySink:
    """Forwards the bridge's events to the worker's producer and keeps the device residency
    they state (for ``/debug/state``: what the worker says it holds, to compare with the
    index)."""

    def __init__(self, sink: EventSink) -> None:
        self._sink = sink
        self._lock = threading.Lock()
        self.device: set[int] = set()
        self.published = 0

    def publish(self, payload: Event, *, correlation_id: str | None = None,
                causation_id: str | None = None) -> None:
        self._sink.publish(payload, correlation_id=correlation_id, causation_id=causation_id)
        with self._lock:
            self.published += 1
            if isinstance(payload, BlockStored) and payload.tier is Tier.DEVICE:
                self.device.update(int(h) for h in payload.block_hashes)
            elif isinstance(payload, BlockRemoved) and payload.tier is Tier.DEVICE:
                self.device.difference_update(int(h) for h in payload.block_hashes)
            elif isinstance(payload, AllBlocksCleared) and payload.tier in (None, Tier.DEVICE):
                self.device.clear()

    def snapshot(self) -> set[int]:
        with self._lock:
            return set(self.device)


@dataclass
class TransferWindow:
    """NIXL telemetry vLLM reported (connector stats) since a mark: what one pull moved."""

    transfers: int = 0
    bytes: int = 0
    duration_s: float = 0.0
    failures: int = 0


class _Stats:
    """Latest scheduler statistics and running NIXL totals, fed by the stat logger (on the
    AsyncLLM output loop) and read by the worker."""

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.preemptions = 0
        self.nixl = TransferWindow()
        #: vLLM's connector prefix-cache stats (switchyard connector): tokens asked of the
        #: connector, tokens it served, and those by tier (vLLM's CacheHitSource names).
        self.connector_queries = 0
        self.connector_hits = 0
        self.connector_hits_by_source: dict[str, int] = {}

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if scheduler_stats is not None:
            self.running = scheduler_stats.num_running_reqs
            self.waiting = scheduler_stats.num_waiting_reqs
            self.kv_usage = float(scheduler_stats.kv_cache_usage)
            pc = scheduler_stats.prefix_cache_stats
            if pc is not None:
                self.prefix_queries += int(getattr(pc, "queries", 0))
                self.prefix_hits += int(getattr(pc, "hits", 0))
            cpc = getattr(scheduler_stats, "connector_prefix_cache_stats", None)
            if cpc is not None:
                self.connector_queries += int(getattr(cpc, "queries", 0))
                self.connector_hits += int(getattr(cpc, "hits", 0))
                for src, n in (getattr(cpc, "hits_by_source", None) or {}).items():
                    key = getattr(src, "value", str(src))
                    self.connector_hits_by_source[key] = self.connector_hits_by_source.get(key, 0) + int(n)
            kvs = scheduler_stats.kv_connector_stats
            if kvs:
                self._nixl(kvs)
        if iteration_stats is not None:
            self.preemptions += int(getattr(iteration_stats, "num_preempted_reqs", 0))

    def _nixl(self, data: Mapping[str, Any]) -> None:
        # vLLM nests the connector's data dict under the connector name (MultiConnector) or
        # passes it flat; take the lists wherever they are.
        if "transfer_duration" not in data:
            for v in data.values():
                if isinstance(v, Mapping):
                    self._nixl(v)
            return
        n = self.nixl
        n.transfers += len(data.get("transfer_duration", ()))
        n.duration_s += float(sum(data.get("transfer_duration", ())))
        n.bytes += int(sum(data.get("bytes_transferred", ())))
        n.failures += sum(len(data.get(k, ())) for k in ("num_failed_transfers",
                                                          "num_failed_handshakes"))


def _stat_logger_factory(stats: _Stats):  # noqa: ANN202 - vLLM's StatLoggerFactory
    loggers = require_vllm("vllm.v1.metrics.loggers")

    class SwitchyardStatLogger(loggers.StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            stats.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            return None

    return SwitchyardStatLogger


class VllmTokenStream:
    """One request's tokens (as :class:`StreamedToken`), flattened from vLLM's deltas.

    ``cached_tokens`` is vLLM's ``num_cached_tokens`` once the first output arrived;
    ``kv_transfer_params`` what its connector returned (prefill side of a handoff)."""

    def __init__(self, engine: VllmServingEngine, request_id: str, gen: AsyncIterator[Any],
                 prefix_len: int) -> None:
        self.request_id = request_id
        self.cached_tokens: int | None = None
        self.kv_transfer_params: dict[str, Any] | None = None
        self.first_output_at: float | None = None
        self._engine = engine
        self._gen = gen
        self._index = prefix_len
        self._pending: list[StreamedToken] = []
        self._done = False

    def __aiter__(self) -> VllmTokenStream:
        return self

    async def __anext__(self) -> StreamedToken:
        while not self._pending:
            if self._done:
                raise StopAsyncIteration
            try:
                out = await self._gen.__anext__()
            except StopAsyncIteration:
                self._done = True
                self._engine._finished(self.request_id)
                raise
            except asyncio.CancelledError:
                raise
            except Exception as e:  # engine dead or request errored: end it as an abort
                log.warning("vLLM request %s ended with %s: %s", self.request_id, type(e).__name__, e)
                self._done = True
                self._engine._finished(self.request_id)
                return StreamedToken(self.request_id, -1, -1, True, 0.0, "abort")
            self._absorb(out)
        return self._pending.pop(0)

    def _absorb(self, out: Any) -> None:
        if self.first_output_at is None:
            self.first_output_at = time.monotonic()
            self._engine._started(self.request_id)
        if self.cached_tokens is None and out.num_cached_tokens is not None:
            self.cached_tokens = int(out.num_cached_tokens)
        if out.kv_transfer_params is not None:
            self.kv_transfer_params = dict(out.kv_transfer_params)
        comp = out.outputs[0] if out.outputs else None
        toks = list(comp.token_ids) if comp is not None else []
        finished = bool(out.finished)
        reason = None
        if finished and comp is not None:
            reason = "abort" if comp.finish_reason == "abort" else ("length" if comp.finish_reason in (None, "length")
                                                                     else comp.finish_reason)
        for i, t in enumerate(toks):
            last = finished and i == len(toks) - 1
            self._pending.append(StreamedToken(self.request_id, self._index, int(t), last, 0.0,
                                               reason if last else None))
            self._index += 1
        if finished:
            self._done = True
            self._engine._finished(self.request_id)
            if not toks and reason == "abort":
                self._pending.append(StreamedToken(self.request_id, -1, -1, True, 0.0, "abort"))
            # Any other empty final delta just ends the stream (the next __anext__ stops).

    async def collect(self) -> list[StreamedToken]:
        return [t async for t in self]


class VllmServingEngine:
    """vLLM behind the worker's engine interface (see the module docstring)."""

    #: Real KV (the worker must not run its synthetic NIXL handoff over it).
    real_kv = True

    def __init__(self, settings: VllmEngineSettings, *, worker_id: WorkerId, sink: EventSink) -> None:
        self.settings = settings
        self.worker_id = worker_id
        self.hash_config = settings.hash_config()
        self.block_size = settings.block_size
        self.moves_kv = settings.kv_connector == "nixl"
        self.uses_tiers = settings.kv_connector == "switchyard"
        #: The KVBM's block size under the switchyard connector (predicted from the model).
        self.kv_bytes_per_block = (predict_bytes_per_block(settings.model, settings.dtype, settings.block_size)
                                   if self.uses_tiers else 0)
        self._region: Any = None
        self._tier_server: Any = None
        self._host_slots = 0
        self._sink = _ResidencySink(sink)
        self._stats = _Stats()
        self._llm: Any = None
        self._bridge: KvEventBridge | None = None
        self._bridges = 0
        self._tmp = _PrivateTmp()
        #: Prompt tokens of requests submitted but not yet producing output (queued prefill).
        self._queued: dict[str, int] = {}
        self._live: set[str] = set()
        self.num_blocks = 0
        #: Bytes of one block over all layers (K and V), from the model config.
        self.bytes_per_block = 0
        self.engine_id: str | None = None
        self.side_channel_port = settings.side_channel_port or (free_port() if self.moves_kv else 0)
        self.name = f"vllm:{Path(settings.model).name}"
        # Now, not at start(): the worker's own NIXL agent is created before the engine starts
        # and must be pinned to loopback as well.
        self._environment()

    # ------------------------------------------------------------------------------ lifecycle

    def _environment(self) -> None:
        s = self.settings
        # Read by vLLM in this process and inherited by its engine-core process.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(s.cpu_kvcache_gib))
        if s.ucx_net_devices:
            os.environ["UCX_NET_DEVICES"] = s.ucx_net_devices
        if self.moves_kv:
            os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = s.side_channel_host
            os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.side_channel_port)
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

    def allocate_region(self, nbytes: int) -> Any:
        """The worker's NIXL region (host pool at its head): shared memory under the switchyard
        connector, so vLLM's engine core can read the pool; private memory otherwise."""
        import numpy as np

        if not self.uses_tiers:
            return np.zeros(nbytes, dtype=np.uint8)

        self._region = SharedRegion(nbytes, tag=f"kvbm-{self.worker_id}")
        return self._region.array

    def attach_kvbm(self, manager: Any, host_slots: int) -> None:
        """Serve the worker's KVBM (its host pool the head of :meth:`allocate_region`'s region)
        to the connector; called before :meth:`start`. A no-op without the switchyard connector."""
        if not self.uses_tiers:
            return
        if self._region is None or host_slots <= 0:
            raise RuntimeError("the switchyard connector needs a host tier in the shared region")
        if manager.settings.bytes_per_block != self.kv_bytes_per_block:
            raise RuntimeError(f"KVBM blocks are {manager.settings.bytes_per_block} bytes, vLLM's "
                               f"{self.kv_bytes_per_block}")

        self._tier_server = TierServer(TierService(manager, self._sink))
        self._tier_server.start()
        self._host_slots = host_slots

    def engine_args(self, events_port: int, replay_port: int) -> dict[str, Any]:
        s = self.settings
        args: dict[str, Any] = dict(
            model=s.model, load_format=s.load_format, dtype=s.dtype, block_size=s.block_size,
            max_model_len=s.max_model_len, enable_prefix_caching=True,
            prefix_caching_hash_algo=s.hash_algo, skip_tokenizer_init=True, seed=s.seed,
            disable_log_stats=False, distributed_executor_backend=s.executor, enforce_eager=s.enforce_eager,
            kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                              "endpoint": f"tcp://127.0.0.1:{events_port}",
                              "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
                              "buffer_steps": s.kv_buffer_steps},
        )
        if s.gpu_memory_utilization is not None:
            args["gpu_memory_utilization"] = s.gpu_memory_utilization
        if self.moves_kv:
            args["kv_transfer_config"] = {"kv_connector": "NixlConnector", "kv_role": s.kv_role,
                                          "kv_buffer_device": s.kv_buffer_device,
                                          "kv_load_failure_policy": "recompute"}
        if self.uses_tiers:
            if self._tier_server is None:
                raise RuntimeError("attach_kvbm before starting vLLM with the switchyard connector")
            args["kv_transfer_config"] = {
                "kv_connector": "SwitchyardKVConnector", "kv_connector_module_path": "data_plane.vllm.connector",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {
                    "endpoint": self._tier_server.endpoint, "host_region": self._region.path,
                    "host_region_bytes": self._host_slots * self.kv_bytes_per_block,
                    "host_slots": self._host_slots, "bytes_per_block": self.kv_bytes_per_block,
                    "timeout_s": s.tier_timeout_s}}
        args.update(s.extra_args)
        return args

    @property
    def running(self) -> bool:
        return self._llm is not None

    async def start(self) -> None:
        if self._llm is not None:
            return
        s = self.settings
        events_port = s.kv_events_port or free_port()
        replay_port = s.kv_replay_port or free_port()
        source = VllmSource(worker_id=self.worker_id, hash_algo=self.hash_config.hash_algo,
                            block_size=s.block_size)
        self._bridge = KvEventBridge(source, BridgeSettings(
            endpoint=f"tcp://127.0.0.1:{events_port}", bind=True,
            replay_endpoint=f"tcp://127.0.0.1:{replay_port}"), self._sink)
        self._bridge.start()
        self._bridges = 1
        args = self.engine_args(events_port, replay_port)
        log.info("starting vLLM: %s", json.dumps(args, default=str))
        t0 = time.monotonic()
        self._tmp.enter()
        try:
            self._llm = await asyncio.to_thread(self._build, args)
        except BaseException:
            self._tmp.exit()
            raise
        cfg = self._llm.vllm_config
        self.num_blocks = int(cfg.cache_config.num_gpu_blocks or 0)
        mc = cfg.model_config
        head = mc.get_head_size()
        layers = mc.get_num_layers(cfg.parallel_config)
        kv_heads = mc.get_num_kv_heads(cfg.parallel_config)
        import torch  # vLLM's dependency: present whenever vLLM is

        elt = torch.tensor([], dtype=mc.dtype).element_size()
        self.bytes_per_block = 2 * layers * s.block_size * kv_heads * head * elt
        if self.moves_kv:
            self.engine_id = cfg.kv_transfer_config.engine_id
        if self.uses_tiers:
            # The engine core mapped the pool when its connector was built: nothing needs the
            # name any more, and an unlinked file cannot outlive a killed worker.
            self._region.unlink()
            if self.bytes_per_block != self.kv_bytes_per_block:
                raise RuntimeError(f"vLLM's KV blocks are {self.bytes_per_block} bytes, the KVBM's "
                                   f"{self.kv_bytes_per_block} (predicted from {s.model}/config.json)")
        log.info("vLLM %s up in %.1f s: %d KV blocks of %d tokens (%d bytes each)", s.model,
                 time.monotonic() - t0, self.num_blocks, s.block_size, self.bytes_per_block)

    def _build(self, args: dict[str, Any]) -> Any:
        arg_utils = require_vllm("vllm.engine.arg_utils")
        async_llm = require_vllm("vllm.v1.engine.async_llm")
        return async_llm.AsyncLLM.from_engine_args(arg_utils.AsyncEngineArgs(**args),
                                                   stat_loggers=[_stat_logger_factory(self._stats)])

    async def stop(self) -> None:
        if self._llm is not None:
            llm, self._llm = self._llm, None
            await asyncio.to_thread(llm.shutdown)
        if self._tier_server is not None:
            await asyncio.to_thread(self._tier_server.stop)
        if self._region is not None:
            self._region.unlink()
        if self._bridge is not None:
            # Let the last batches (the engine's final removals) arrive before the bridge goes.
            await asyncio.to_thread(self._bridge.stop)
            if self._bridge.error is not None:
                log.error("KV event bridge failed: %r", self._bridge.error)
        self._tmp.exit()

    # ------------------------------------------------------------------------------- requests

    def validate(self, request: EngineRequest) -> None:
        n = len(request.prompt) + request.max_tokens
        if n > self.settings.max_model_len:
            raise RequestRejected(f"request {request.request_id}: {len(request.prompt)} prompt + "
                                  f"{request.max_tokens} output tokens exceed max_model_len "
                                  f"{self.settings.max_model_len}")

    def submit(self, request: EngineRequest, kv_transfer_params: Mapping[str, Any] | None = None) -> VllmTokenStream:
        if self._llm is None:
            raise RequestRejected("the vLLM engine is not running")
        rid = request.request_id
        if rid in self._live:
            raise RequestRejected(f"request {rid} is already in the engine")
        self.validate(request)
        vllm = require_vllm("vllm")
        sampling = require_vllm("vllm.sampling_params")
        prefix = tuple(request.output_prefix)
        extra: dict[str, Any] = {}
        if kv_transfer_params:
            extra["kv_transfer_params"] = dict(kv_transfer_params)
        if self.uses_tiers:
            # vLLM suffixes the id it was given; the connector records fallbacks under ours.
            extra["switchyard_request_id"] = rid
        params = vllm.SamplingParams(
            max_tokens=request.max_tokens - len(prefix), temperature=0.0, seed=self.settings.seed,
            ignore_eos=self.settings.ignore_eos, detokenize=False,
            output_kind=sampling.RequestOutputKind.DELTA, extra_args=extra or None)
        prompt = vllm.TokensPrompt(prompt_token_ids=[*request.prompt, *prefix])
        gen = self._llm.generate(prompt, params, rid)
        self._live.add(rid)
        self._queued[rid] = len(request.prompt)
        return VllmTokenStream(self, rid, gen, len(prefix))

    def _started(self, rid: str) -> None:
        self._queued.pop(rid, None)

    def _finished(self, rid: str) -> None:
        self._queued.pop(rid, None)
        self._live.discard(rid)

    def abort(self, request_id: str) -> bool:
        if request_id not in self._live or self._llm is None:
            return False
        self._finished(request_id)
        asyncio.get_running_loop().create_task(self._llm.abort(request_id))
        return True

    async def stop_bridge(self) -> int:
        """Stop the KV event bridge (operators, and the gap test): vLLM's batches published
        while it is down are lost on the PUB socket but kept in vLLM's replay buffer. Returns
        the next seq the bridge would have applied."""
        b = self._bridge
        if b is None or not b.running:
            raise RuntimeError("the KV event bridge is not running")
        await asyncio.to_thread(b.stop)
        return b.expected_seq

    async def start_bridge(self, from_seq: int | None = None) -> int:
        """A new bridge on the same endpoint, expecting ``from_seq`` next (default: where the
        old one stopped). vLLM's PUB socket *connects* to the bridge, so ZMQ queues what it
        publishes while the bridge is down and delivers it on reconnection (checked: a stop,
        a request, a start loses nothing). A bridge that does not know where its predecessor
        stopped (``from_seq=0``) sees a gap at the first batch and fills it from vLLM's replay
        endpoint; if vLLM's buffer no longer reaches back, it resyncs with AllBlocksCleared."""
        from dataclasses import replace

        old = self._bridge
        if old is None or old.running:
            raise RuntimeError("stop the KV event bridge first")
        start = old.expected_seq if from_seq is None else from_seq
        new = KvEventBridge(old.source, replace(old.settings, start_seq=start), self._sink)
        new.start()
        self._bridge = new
        self._bridges += 1
        return new.expected_seq

    async def reset_prefix_cache(self) -> bool:
        """Empty vLLM's prefix cache (benchmarks between runs) and say so in the log."""
        if self._llm is None:
            return False
        ok = bool(await self._llm.reset_prefix_cache())
        if ok:
            # vLLM 0.32 publishes no KV event for a reset (checked: the index kept the old
            # blocks and predicted hits vLLM no longer had), so the worker states the fact.
            self._sink.publish(AllBlocksCleared(worker_id=self.worker_id, tier=Tier.DEVICE))
        return ok

    def release(self, request_id: str) -> bool:
        # vLLM's connector frees held blocks itself (done notification or its own lease).
        return False

    # -------------------------------------------------------------------------------- queries

    def stats(self) -> EngineStats:
        st = self._stats
        used = round(st.kv_usage * self.num_blocks)
        return EngineStats(running=st.running, waiting=st.waiting, held=0, kv_usage=st.kv_usage,
                           free_blocks=self.num_blocks - used, cached_blocks=len(self._sink.device),
                           queued_prefill_tokens=sum(self._queued.values()), active_blocks=used,
                           preemptions=st.preemptions)

    def transfer_mark(self) -> TransferWindow:
        n = self._stats.nixl
        return TransferWindow(n.transfers, n.bytes, n.duration_s, n.failures)

    def transfer_since(self, mark: TransferWindow) -> TransferWindow:
        n = self._stats.nixl
        return TransferWindow(n.transfers - mark.transfers, n.bytes - mark.bytes,
                              n.duration_s - mark.duration_s, n.failures - mark.failures)

    async def settle(self, prompt: list[int], timeout_s: float = 0.5) -> bool:
        """Wait until vLLM's stores of ``prompt``'s full blocks have come through the bridge
        and been handed to the log (flushed), at most ``timeout_s``. The worker calls it
        before a request's last token, so a client that sends its next request after this
        one finished meets an index that already knows this prompt (no event lag between
        "done" and "routable"). False if the stores did not all arrive in time (a block
        evicted at once, or a slow bridge): the answer is then not delayed further."""
        n = len(prompt) // self.block_size
        if n == 0:
            return True

        want = {int(h) for h in hash_blocks(prompt[: n * self.block_size], self.hash_config)}
        deadline = time.monotonic() + timeout_s
        while not want <= self._sink.snapshot():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.002)
        flush = getattr(self._sink._sink, "flush", None)
        if flush is not None:
            await asyncio.to_thread(flush, max(0.05, deadline - time.monotonic()))
        return True

    def cached_hashes(self) -> set[int]:
        return self._sink.snapshot()

    def model_info(self) -> dict[str, Any]:
        return {"root": self.name, "max_model_len": self.settings.max_model_len}

    def debug(self) -> dict[str, Any]:
        b = self._bridge
        st = self._stats
        return {"engine": "vllm", "engine_id": self.engine_id, "num_blocks": self.num_blocks,
                "bytes_per_block": self.bytes_per_block,
                "bridge": None if b is None else {**b.stats().__dict__, "expected_seq": b.expected_seq,
                                                  "running": b.running, "incarnations": self._bridges,
                                                  "error": repr(b.error) if b.error else None},
                "prefix_cache": {"queries": st.prefix_queries, "hits": st.prefix_hits},
                "nixl": st.nixl.__dict__,
                "connector_prefix_cache": {"queries": st.connector_queries, "hits": st.connector_hits,
                                           "hits_by_source": dict(st.connector_hits_by_source)},
                "tiers": None if self._tier_server is None else {
                    **self._tier_server.service.stats.as_dict(), "leases": self._tier_server.service.leases,
                    "error": repr(self._tier_server.error) if self._tier_server.error else None}}
