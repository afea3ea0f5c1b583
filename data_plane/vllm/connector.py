"""``SwitchyardKVConnector``: the worker's tiered KV block manager (host DRAM, disk, object
store) as vLLM's KV connector (``KVConnectorBase_V1``), in the role Dynamo's KVBM and LMCache
play for vLLM. vLLM loads it with::

    --kv-transfer-config '{"kv_connector": "SwitchyardKVConnector",
                           "kv_connector_module_path": "data_plane.vllm.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {...}}'

which ``switchyard worker --engine vllm --vllm-kv-connector switchyard --host-blocks N
[--disk-blocks M] [--s3-bucket B]`` writes (:mod:`data_plane.vllm.serving`).

What it does (save write-through, load by onboarding, end-to-end digests, fallbacks to
recompute), why its two halves are clients of the KVBM in the worker process (over
:mod:`data_plane.vllm.tier_protocol`, to :mod:`data_plane.vllm.tier_server`), why
``get_num_new_matched_tokens`` onboards, and what is not supported: ``docs/vllm-connector.md``.

Nothing here imports vLLM or torch at module import: the connector class is assembled on first
attribute access (module ``__getattr__``), which is what vLLM's loader does.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from data_plane.vllm import tier_protocol as proto
from data_plane.vllm.engine import require_vllm
from data_plane.vllm.kv_events import wire_hash
from data_plane.vllm.tier_server import map_region

# Under vLLM's logger hierarchy: in the engine-core and worker processes vLLM configures "vllm.*"
# (format, level), not the root logger.
logger = logging.getLogger("vllm.switchyard.connector")

#: ``kv_connector_extra_config`` keys the worker writes (all required).
EXTRA_KEYS = ("endpoint", "host_region", "host_region_bytes", "host_slots", "bytes_per_block")


# -- metadata (scheduler side -> worker side, once per step) -----------------------------------


@dataclass(frozen=True)
class LoadSpec:
    """Copy host slot ``slots[i]`` into vLLM block ``block_ids[i]``; then release ``lease``."""

    lease: str
    request_id: str
    block_ids: tuple[int, ...]
    slots: tuple[int, ...]
    hashes: tuple[int, ...] = ()


@dataclass(frozen=True)
class SaveSpec:
    """Copy vLLM block ``block_ids[i]`` out as the block ``hashes[i]`` (chain parent
    ``parents[i]``) and hand it to the KVBM."""

    block_ids: tuple[int, ...]
    hashes: tuple[int, ...]
    parents: tuple[int | None, ...]


@dataclass(frozen=True)
class TierStepMeta:
    loads: tuple[LoadSpec, ...] = ()
    saves: tuple[SaveSpec, ...] = ()

    @property
    def has_work(self) -> bool:
        return bool(self.loads or self.saves)


# -- the socket client ---------------------------------------------------------------------------


class TierPort(Protocol):
    """How a connector half reaches the KVBM: :class:`TierClient` over ZMQ, or an in-process
    stand-in over a real :class:`~data_plane.vllm.tier_server.TierService` in the unit tests."""

    def call(self, msg: proto.Onboard, timeout_s: float) -> proto.Onboarded | None: ...

    def send(self, msg: proto.Message, frames: Sequence[Any] = ()) -> None: ...


class TierClient:
    """A DEALER connected to the worker's tier server. One per connector half (ZMQ sockets are
    single-threaded). ``call`` waits for the reply with the same call id, dropping stale replies
    of calls that timed out; ``send`` is one way."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self._zmq = zmq
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.connect(endpoint)
        self.endpoint = endpoint

    def call(self, msg: proto.Onboard, timeout_s: float) -> proto.Onboarded | None:
        self._sock.send_multipart([b"", proto.encode(msg)])
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(max(1, int(left * 1000))):
                return None
            parts = self._sock.recv_multipart()
            reply = proto.decode(parts[-1])
            if isinstance(reply, proto.Onboarded) and reply.call == msg.call:
                return reply

    def send(self, msg: proto.Message, frames: Sequence[Any] = ()) -> None:
        self._sock.send_multipart([b"", proto.encode(msg), *frames], copy=False)

    def close(self) -> None:
        self._sock.close()


# -- scheduler side (no vLLM import: driven through duck-typed vLLM objects) ---------------------


def request_key(request: Any) -> str:
    """The worker's id of a vLLM request: vLLM appends a random suffix to the id it was given,
    so the worker passes its own in ``SamplingParams.extra_args`` (see ``serving.submit``)."""
    extra = getattr(getattr(request, "sampling_params", None), "extra_args", None) or {}
    return str(extra.get("switchyard_request_id") or request.request_id)


@dataclass
class _ReqState:
    request: Any
    rid: str
    #: Leases taken for this request (released at the latest when it finishes).
    leases: list[str] = field(default_factory=list)
    #: The last onboard not yet turned into a load: (first block index, reply).
    plan: tuple[int, proto.Onboarded] | None = None
    #: Blocks [0, saved) are held by vLLM's cache or by us already: not saved again.
    saved: int = 0
    #: Tokens loaded by tier, for vLLM's connector prefix-cache stats.
    hit_sources: dict[str, int] = field(default_factory=dict)


@dataclass
class SchedulerStats:
    lookups: int = 0
    lookup_timeouts: int = 0
    tokens_matched: int = 0
    loads_planned: int = 0
    blocks_planned_for_save: int = 0


class SchedulerSide:
    """The scheduler half's decisions. ``block_ids_of(request_id)`` gives a request's vLLM
    block ids (the scheduler's KV cache manager)."""

    def __init__(self, port: TierPort, block_size: int, block_ids_of: Callable[[str], Sequence[int]],
                 *, timeout_s: float = 10.0) -> None:
        self.port = port
        self.block_size = block_size
        self.block_ids_of = block_ids_of
        self.timeout_s = timeout_s
        self._reqs: dict[str, _ReqState] = {}
        self._pending: list[LoadSpec] = []
        self._calls = itertools.count(1)
        self.stats = SchedulerStats()

    def _state(self, request: Any) -> _ReqState:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _ReqState(request, request_key(request))
        return st

    def on_new_request(self, request: Any) -> None:
        self._state(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        st = self._state(request)
        bs = self.block_size
        if getattr(request, "skip_reading_prefix_cache", False):
            return 0, False
        # vLLM must compute at least the last token (to sample from it): never offer it.
        limit = (request.num_tokens - 1) // bs
        start = num_computed_tokens // bs
        hashes = [int(wire_hash(h)) for h in list(request.block_hashes)[start:limit]]
        replaces = [st.plan[1].lease] if st.plan is not None else []
        st.plan = None
        if not hashes:
            self._release(st, replaces)
            return 0, False
        call = next(self._calls)
        lease = f"{request.request_id}#{call}"
        st.leases.append(lease)
        self.stats.lookups += 1
        reply = self.port.call(proto.Onboard(call=call, lease=lease, request_id=st.rid, hashes=hashes,
                                             replaces=replaces), self.timeout_s)
        st.leases = [x for x in st.leases if x not in replaces]  # the onboard released them
        if reply is None:
            # The KVBM did not answer in time: compute instead. A late onboard's pins go with
            # the lease when the request finishes.
            self.stats.lookup_timeouts += 1
            logger.warning("request %s: the KVBM did not answer its onboard within %.1f s; "
                           "computing %d blocks", st.rid, self.timeout_s, len(hashes))
            return 0, False
        if not reply.blocks:
            self._release(st, [lease])
            return 0, False
        st.plan = (start, reply)
        self.stats.tokens_matched += len(reply.blocks) * bs
        return len(reply.blocks) * bs, False

    def update_state_after_alloc(self, request: Any, num_external_tokens: int) -> None:
        st = self._state(request)
        plan, st.plan = st.plan, None
        if plan is None:
            return
        start, reply = plan
        n = num_external_tokens // self.block_size
        if n <= 0:
            # vLLM scheduled it without our tokens (its own hit went further): nothing to load.
            self._release(st, [reply.lease])
            return
        if n > len(reply.blocks):
            raise RuntimeError(f"request {st.rid}: vLLM allocated {num_external_tokens} external "
                               f"tokens, the KVBM pinned {len(reply.blocks)} blocks")
        block_ids = list(self.block_ids_of(request.request_id))[start:start + n]
        if len(block_ids) != n:
            raise RuntimeError(f"request {st.rid}: {len(block_ids)} vLLM blocks for {n} loaded ones")
        self._pending.append(LoadSpec(reply.lease, st.rid, tuple(block_ids),
                                      tuple(b.slot for b in reply.blocks[:n]),
                                      tuple(b.block_hash for b in reply.blocks[:n])))
        tokens: Counter[str] = Counter()
        for b in reply.blocks[:n]:
            tokens[b.tier] += self.block_size
        st.hit_sources = dict(tokens)
        self.stats.loads_planned += 1

    def hit_sources(self, request: Any) -> dict[str, int]:
        st = self._reqs.get(request.request_id)
        return dict(st.hit_sources) if st is not None else {}

    def build_meta(self, scheduled: Sequence[tuple[str, int, int, bool]]) -> TierStepMeta:
        """``scheduled``: ``(vLLM request id, tokens computed before this step, tokens scheduled
        now, newly scheduled)`` per request in the step."""
        loads, self._pending = tuple(self._pending), []
        saves: list[SaveSpec] = []
        bs = self.block_size
        for req_id, computed, now, new in scheduled:
            st = self._reqs.get(req_id)
            if st is None:
                continue
            if new:
                # What vLLM had (its cache) or got (our load) before this step is held already.
                st.saved = max(st.saved, computed // bs)
            hashes = list(st.request.block_hashes)
            full = min(len(hashes), (computed + now) // bs)
            if full <= st.saved:
                continue
            ids = list(self.block_ids_of(req_id))
            if len(ids) < full:
                continue  # not allocated (cannot happen for scheduled tokens); save nothing
            first = st.saved
            mine = tuple(int(wire_hash(hashes[i])) for i in range(first, full))
            parents = tuple(int(wire_hash(hashes[i - 1])) if i > 0 else None for i in range(first, full))
            saves.append(SaveSpec(tuple(ids[first:full]), mine, parents))
            self.stats.blocks_planned_for_save += full - first
            st.saved = full
        return TierStepMeta(loads, tuple(saves))

    def request_finished(self, request: Any) -> None:
        st = self._reqs.pop(request.request_id, None)
        if st is not None and st.leases:
            self._release(st, list(st.leases))

    def _release(self, st: _ReqState, leases: list[str]) -> None:
        if not leases:
            return
        self.port.send(proto.Release(leases=leases))
        st.leases = [x for x in st.leases if x not in leases]


# -- worker side (torch, imported lazily) --------------------------------------------------------


@dataclass(frozen=True)
class _Layer:
    name: str
    tensor: Any
    #: Dimension indexing vLLM's blocks.
    block_dim: int
    #: Bytes of one block of this layer, and its shape without the block dimension.
    nbytes: int
    shape: tuple[int, ...]


def _digest(row: np.ndarray) -> int:
    import xxhash

    return xxhash.xxh3_64_intdigest(memoryview(np.ascontiguousarray(row)))


def _flatten(kv_caches: Mapping[str, Any]) -> list[tuple[str, Any]]:
    out = []
    for name, t in kv_caches.items():
        if isinstance(t, (list, tuple)):
            out.extend((f"{name}[{i}]", x) for i, x in enumerate(t))
        else:
            out.append((name, t))
    return out


class WorkerSide:
    """The worker half: copies between vLLM's KV tensors and the KVBM. A block's bytes in our
    tiers are its slice of every layer's tensor, in the order vLLM lists the layers, each
    slice contiguous in that tensor's own layout without its block dimension."""

    def __init__(self, port: TierPort, region: np.ndarray, bytes_per_block: int, host_slots: int) -> None:
        self.port = port
        self.region = region
        self.bytes_per_block = bytes_per_block
        self.host_slots = host_slots
        self.layers: list[_Layer] = []
        self._errors: set[int] = set()
        self.stats = Counter()

    def register(self, kv_caches: Mapping[str, Any], num_blocks: int) -> list[_Layer]:
        layers = []
        for name, t in _flatten(kv_caches):
            dims = [d for d, n in enumerate(t.shape) if n == num_blocks]
            if len(dims) != 1:
                raise ValueError(f"KV cache {name} has shape {tuple(t.shape)}: cannot tell which "
                                 f"dimension indexes the {num_blocks} blocks")
            d = dims[0]
            shape = tuple(n for i, n in enumerate(t.shape) if i != d)
            nbytes = int(np.prod(shape)) * t.element_size()
            layers.append(_Layer(name, t, d, nbytes, shape))
        total = sum(x.nbytes for x in layers)
        if total != self.bytes_per_block:
            raise ValueError(f"vLLM's KV caches hold {total} bytes per block over {len(layers)} "
                             f"tensors, the KVBM's blocks are {self.bytes_per_block} bytes: the "
                             "worker's predicted block size does not match this model's layout")
        self.layers = layers
        logger.info("SwitchyardKVConnector: %d KV tensors, e.g. %s %s (blocks on dim %d), %d bytes "
                    "per block", len(layers), layers[0].name, tuple(layers[0].tensor.shape),
                    layers[0].block_dim, total)
        return layers

    def load(self, specs: Sequence[LoadSpec]) -> None:
        import torch

        bpb = self.bytes_per_block
        for spec in specs:
            try:
                if any(not 0 <= s < self.host_slots for s in spec.slots):
                    raise ValueError(f"host slot out of range 0..{self.host_slots - 1}: {spec.slots}")
                src = np.stack([self.region[s * bpb:(s + 1) * bpb] for s in spec.slots])
                self._scatter(torch.from_numpy(src), torch.tensor(spec.block_ids, dtype=torch.long))
                # Read back from vLLM's tensors: what attention will really see.
                back = self.gather(spec.block_ids)
                if not np.array_equal(back, src):
                    raise ValueError("the blocks read back from vLLM's KV tensors differ from the host slots")
                self.port.send(proto.Loaded(lease=spec.lease, request_id=spec.request_id, hashes=list(spec.hashes),
                                            digests=[_digest(b) for b in back]))
                self.stats["blocks_loaded"] += len(spec.block_ids)
            except Exception as e:  # noqa: BLE001 - reported to vLLM, which recomputes
                logger.exception("loading %d blocks of %s failed", len(spec.block_ids), spec.request_id)
                self._errors.update(spec.block_ids)
                self.stats["load_failures"] += 1
                self.port.send(proto.LoadFailed(lease=spec.lease, request_id=spec.request_id,
                                                blocks=len(spec.block_ids), reason=f"{type(e).__name__}: {e}"))
            finally:
                self.port.send(proto.Release(leases=[spec.lease]))

    def _scatter(self, data: Any, idx: Any) -> None:
        n = idx.numel()
        off = 0
        for layer in self.layers:
            t = layer.tensor
            chunk = data[:, off:off + layer.nbytes].contiguous().view(t.dtype).reshape(n, *layer.shape)
            t.index_copy_(layer.block_dim, idx, chunk.movedim(0, layer.block_dim).to(t.device))
            off += layer.nbytes

    def gather(self, block_ids: Sequence[int]) -> np.ndarray:
        """``(len(block_ids), bytes_per_block)`` uint8 copies of vLLM blocks."""
        import torch

        idx = torch.tensor(list(block_ids), dtype=torch.long)
        parts = [layer.tensor.index_select(layer.block_dim, idx.to(layer.tensor.device))
                 .movedim(layer.block_dim, 0).contiguous().cpu().view(torch.uint8).reshape(len(block_ids), -1)
                 for layer in self.layers]
        return torch.cat(parts, dim=1).numpy()

    def save(self, specs: Sequence[SaveSpec]) -> None:
        if not specs:
            return
        ids = [b for s in specs for b in s.block_ids]
        blob = self.gather(ids)
        hashes = [h for s in specs for h in s.hashes]
        parents = [p for s in specs for p in s.parents]
        rows = [blob[i] for i in range(len(ids))]
        self.port.send(proto.Store(hashes=hashes, parents=parents, digests=[_digest(r) for r in rows]), rows)
        self.stats["blocks_saved"] += len(ids)

    def take_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors


# -- the vLLM class ------------------------------------------------------------------------------


def build_connector_class(base: type, metadata_base: type, roles: Any, hit_source: Any = None) -> type:
    """``SwitchyardKVConnector`` on vLLM's ``KVConnectorBase_V1`` (``base``), its metadata
    subclassing ``metadata_base``; ``roles`` is vLLM's ``KVConnectorRole``, ``hit_source``
    its ``CacheHitSource`` (None: hits are not attributed to tiers)."""

    class SwitchyardConnectorMetadata(metadata_base):  # type: ignore[misc, valid-type]
        def __init__(self, step: TierStepMeta) -> None:
            self.step = step

    class SwitchyardKVConnector(base):  # type: ignore[misc, valid-type]
        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            super().__init__(vllm_config, role, kv_cache_config)
            extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
            missing = [k for k in EXTRA_KEYS if k not in extra]
            if missing:
                raise ValueError(f"SwitchyardKVConnector needs kv_connector_extra_config "
                                 f"{', '.join(missing)} (the worker writes them: switchyard worker "
                                 "--engine vllm --vllm-kv-connector switchyard)")
            self.extra = extra
            self.block_size = vllm_config.cache_config.block_size
            self._num_blocks = getattr(kv_cache_config, "num_blocks", None)
            client = TierClient(extra["endpoint"])
            self.sched: SchedulerSide | None = None
            self.worker: WorkerSide | None = None
            if role == roles.SCHEDULER:
                self.sched = SchedulerSide(client, self.block_size, self._block_ids,
                                           timeout_s=float(extra.get("timeout_s", 10.0)))
            else:
                region = map_region(extra["host_region"], int(extra["host_region_bytes"]))
                self.worker = WorkerSide(client, region, int(extra["bytes_per_block"]),
                                         int(extra["host_slots"]))

        # A dropped save is a later cache miss, never a wrong answer.
        @property
        def requires_kv_delivery(self) -> bool:
            return False

        # -- scheduler side --

        def _block_ids(self, request_id: str) -> list[int]:
            (ids, *_rest) = self._kv_cache_manager.get_block_ids(request_id)
            return list(ids)

        def on_new_request(self, request: Any) -> None:
            self.sched.on_new_request(request)

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
            return self.sched.get_num_new_matched_tokens(request, num_computed_tokens)

        def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
            self.sched.update_state_after_alloc(request, num_external_tokens)

        def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict:
            if not num_external_tokens:
                return {}
            by_tier = self.sched.hit_sources(request)
            if hit_source is None or sum(by_tier.values()) != num_external_tokens:
                return super().get_external_cache_hit_sources(request, num_external_tokens)
            names = {"host": "HOST", "disk": "DISK"}
            out: dict = {}
            for tier, n in by_tier.items():
                src = getattr(hit_source, names.get(tier, "EXTERNAL_UNSPECIFIED"))
                out[src] = out.get(src, 0) + n
            return out

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            sched = []
            n_sched = scheduler_output.num_scheduled_tokens
            spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
            for r in scheduler_output.scheduled_new_reqs:
                sched.append((r.req_id, r.num_computed_tokens,
                              n_sched.get(r.req_id, 0) - len(spec.get(r.req_id, ())), True))
            cached = scheduler_output.scheduled_cached_reqs
            for i, rid in enumerate(cached.req_ids):
                sched.append((rid, cached.num_computed_tokens[i],
                              n_sched.get(rid, 0) - len(spec.get(rid, ())), rid in cached.resumed_req_ids))
            return SwitchyardConnectorMetadata(self.sched.build_meta(sched))

        def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
            self.sched.request_finished(request)
            return False, None

        # -- worker side --

        def register_kv_caches(self, kv_caches: dict) -> None:
            n = self._num_blocks
            if n is None:
                raise ValueError("SwitchyardKVConnector needs kv_cache_config.num_blocks")
            self.worker.register(kv_caches, int(n))

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            meta = self._get_connector_metadata()
            if meta.step.loads:
                self.worker.load(meta.step.loads)

        def wait_for_layer_load(self, layer_name: str) -> None:
            # start_load_kv copied every layer before the forward pass.
            return None

        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
            # Saved once per step in wait_for_save, all layers together, after the forward wrote them.
            return None

        def wait_for_save(self) -> None:
            if self.has_connector_metadata():
                self.worker.save(self._get_connector_metadata().step.saves)

        def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
            # Loads and saves are synchronous: nothing finishes later.
            return None, None

        def get_block_ids_with_load_errors(self) -> set[int]:
            return self.worker.take_errors() if self.worker is not None else set()

        @classmethod
        def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
            return None

    # The metadata crosses process boundaries (vLLM pickles it to its worker process): both
    # classes must resolve by name, through this module's __getattr__.
    for cls, name in ((SwitchyardKVConnector, "SwitchyardKVConnector"),
                      (SwitchyardConnectorMetadata, "SwitchyardConnectorMetadata")):
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__ = name
    SwitchyardKVConnector.metadata_cls = SwitchyardConnectorMetadata
    return SwitchyardKVConnector


@functools.cache
def _vllm_connector_class() -> type:
    base = require_vllm("vllm.distributed.kv_transfer.kv_connector.v1.base")
    try:
        hit_source = require_vllm("vllm.v1.metrics.cache_hit_source").CacheHitSource
    except ImportError:  # older vLLM: hits are not attributed to tiers
        hit_source = None
    return build_connector_class(base.KVConnectorBase_V1, base.KVConnectorMetadata,
                                 base.KVConnectorRole, hit_source)


def __getattr__(name: str) -> Any:
    # Assembled on first access so that importing this module never imports vLLM.
    if name == "SwitchyardKVConnector":
        return _vllm_connector_class()
    if name == "SwitchyardConnectorMetadata":
        return _vllm_connector_class().metadata_cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
