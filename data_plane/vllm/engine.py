"""vLLM as a Switchyard engine: an AsyncLLM wrapper and a KV connector skeleton.

UNTESTED HERE. vLLM needs CUDA and cannot be installed on the development machine, so nothing
in this module has run against a real vLLM. What is tested (``tests/unit/test_vllm_engine.py``):
that the module imports without vLLM, that every entry point that needs vLLM fails with
:data:`VLLM_MISSING`, the ``kv_transfer_params`` parser, ``generate``'s request mapping against a
stand-in ``AsyncLLM``, and the connector's decisions against a stand-in for vLLM's base class.
The vLLM calls themselves follow vLLM's published API (``vllm/v1/engine/async_llm.py``,
``vllm/distributed/kv_transfer/kv_connector/v1/base.py``) as read, not as run.

Nothing imports vLLM at module import time: :class:`VllmEngine` imports it on first use, and
:data:`SwitchyardKVConnector` is assembled on first attribute access (module ``__getattr__``),
which is exactly what vLLM does when it loads a connector from
``--kv-transfer-config '{"kv_connector": "SwitchyardKVConnector",
"kv_connector_module_path": "data_plane.vllm.engine", "kv_role": "kv_both"}'``.

The connector is honest about its scope: it is a correct *pass-through* connector (no external
KV: every request computes or hits vLLM's own prefix cache) and it raises
``NotImplementedError`` at the exact points where a disaggregated prefill -> decode handoff
would need our NIXL transfer layer (``data_plane.transfer``) to move GPU blocks. It never
pretends a transfer happened. Until that exists, use vLLM's own ``NixlConnector`` for
disaggregated serving; Switchyard's router speaks its ``kv_transfer_params`` (see
:func:`parse_kv_transfer_params`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol

logger = logging.getLogger(__name__)

VLLM_MISSING = "vLLM is not installed; pip install switchyard[vllm] on a CUDA machine"


class VllmNotInstalled(ImportError):
    """vLLM (an optional, CUDA-only extra) is needed for this and is not importable."""

    def __init__(self, detail: str | None = None) -> None:
        super().__init__(VLLM_MISSING if detail is None else f"{VLLM_MISSING} ({detail})")


def vllm_available() -> bool:
    """Whether ``import vllm`` would find a package (does not import it)."""
    return importlib.util.find_spec("vllm") is not None


def require_vllm(submodule: str = "vllm") -> ModuleType:
    """Import ``submodule`` of vLLM, or raise :class:`VllmNotInstalled`."""
    try:
        return importlib.import_module(submodule)
    except ImportError as e:
        # Only a missing vLLM is "not installed"; a vLLM that fails to import for another
        # reason (wrong torch, no CUDA) must surface as itself.
        if e.name is not None and (e.name == "vllm" or e.name.startswith("vllm.")) \
                and not vllm_available():
            raise VllmNotInstalled() from e
        raise


# --------------------------------------------------------------------------------------------
# Engine surface: generate(request) -> async stream of token chunks
# --------------------------------------------------------------------------------------------


class GenerateRequestLike(Protocol):
    """What :meth:`VllmEngine.generate` reads from a request: the fields it shares with the
    simulated engine's ``data_plane.engines.request.EngineRequest`` (which satisfies it).
    Optional extras, read when present: ``output_prefix``, ``temperature``, ``top_p``,
    ``seed``, ``priority``, ``kv_transfer_params``."""

    request_id: str
    prompt: Any  # Sequence[int]
    max_tokens: int


@dataclass(frozen=True)
class GenerateRequest:
    """A token-level generation request, as the worker hands it to an engine."""

    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    #: Tokens already produced elsewhere (a decode worker continuing a prefill's first token);
    #: they are fed as prompt and count against ``max_tokens``, as in the simulated engine.
    output_prefix: tuple[int, ...] = ()
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    priority: int = 0
    #: NixlConnector-style handoff parameters (``do_remote_decode`` on the prefill side,
    #: ``do_remote_prefill`` plus ``remote_*`` on the decode side); None when aggregated.
    kv_transfer_params: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class TokenChunk:
    """Tokens produced since the previous chunk of one request (vLLM streams deltas; one step
    can produce several tokens, e.g. with speculative decoding, and the final chunk can be
    empty)."""

    request_id: str
    #: Output index of ``token_ids[0]`` (0 = the request's first generated token, counting
    #: ``output_prefix``).
    index: int
    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: str | None = None
    #: Prompt tokens served from the engine's prefix cache (reported by vLLM).
    num_cached_tokens: int | None = None
    #: Handoff parameters vLLM's connector returned (prefill side of a disaggregated request).
    kv_transfer_params: Mapping[str, Any] | None = None


class VllmEngine:
    """Drives one vLLM ``AsyncLLM`` (UNTESTED HERE; see the module docstring).

    ``generate`` submits the prompt as token ids (the router already tokenised and hashed it,
    so vLLM must see the same tokens) and streams deltas as :class:`TokenChunk`.
    """

    def __init__(self, async_llm: Any) -> None:
        self._llm = async_llm

    @classmethod
    def from_engine_args(cls, **engine_args: Any) -> VllmEngine:
        """Start an engine: ``VllmEngine.from_engine_args(model="...", block_size=16,
        enable_prefix_caching=True, kv_events_config=...)``; arguments are vLLM's
        ``AsyncEngineArgs``."""
        arg_utils = require_vllm("vllm.engine.arg_utils")
        async_llm = require_vllm("vllm.v1.engine.async_llm")
        args = arg_utils.AsyncEngineArgs(**engine_args)
        return cls(async_llm.AsyncLLM.from_engine_args(args))

    async def generate(self, request: GenerateRequestLike) -> AsyncIterator[TokenChunk]:
        vllm = require_vllm("vllm")
        sampling = require_vllm("vllm.sampling_params")
        extra: dict[str, Any] = {}
        kv_params = getattr(request, "kv_transfer_params", None)
        if kv_params:
            # Where vLLM's OpenAI server puts them too: the connector reads
            # request.kv_transfer_params, which vLLM fills from extra_args.
            extra["kv_transfer_params"] = dict(kv_params)
        prefix = tuple(getattr(request, "output_prefix", ()))
        params = vllm.SamplingParams(
            max_tokens=request.max_tokens - len(prefix),
            temperature=getattr(request, "temperature", 0.0),
            top_p=getattr(request, "top_p", 1.0),
            seed=getattr(request, "seed", None),
            output_kind=sampling.RequestOutputKind.DELTA,
            extra_args=extra or None,
        )
        prompt = vllm.TokensPrompt(prompt_token_ids=[*request.prompt, *prefix])
        index = len(prefix)
        async for out in self._llm.generate(prompt, params, request.request_id,
                                            priority=getattr(request, "priority", 0)):
            comp = out.outputs[0] if out.outputs else None
            tokens = tuple(comp.token_ids) if comp is not None else ()
            yield TokenChunk(
                request_id=request.request_id,
                index=index,
                token_ids=tokens,
                finished=bool(out.finished),
                finish_reason=comp.finish_reason if comp is not None else None,
                num_cached_tokens=getattr(out, "num_cached_tokens", None),
                kv_transfer_params=getattr(out, "kv_transfer_params", None),
            )
            index += len(tokens)

    async def abort(self, request_id: str) -> None:
        await self._llm.abort(request_id)

    def shutdown(self) -> None:
        self._llm.shutdown()


# --------------------------------------------------------------------------------------------
# kv_transfer_params (vLLM NixlConnector's handoff contract); pure, tested
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KvHandoff:
    """One side of a prefill -> decode handoff, parsed from ``kv_transfer_params``.

    ``role`` is ``"producer"`` on the prefill side (``do_remote_decode``: keep the blocks for a
    remote reader) and ``"consumer"`` on the decode side (``do_remote_prefill``: pull them from
    ``remote_*``).
    """

    role: str
    remote_block_ids: tuple[int, ...] = ()
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    tp_size: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


_KNOWN_KEYS = frozenset({"do_remote_decode", "do_remote_prefill", "remote_block_ids",
                         "remote_engine_id", "remote_request_id", "remote_host", "remote_port",
                         "tp_size"})


def parse_kv_transfer_params(params: Mapping[str, Any] | None) -> KvHandoff | None:
    """The handoff a request asks for, or None for an ordinary (aggregated) request.

    A consumer must name the blocks and where they are; anything half-specified raises
    ``ValueError`` (a request that silently recomputed would hide a broken router).
    """
    if not params:
        return None
    extra = {k: v for k, v in params.items() if k not in _KNOWN_KEYS}
    if params.get("do_remote_prefill"):
        if params.get("do_remote_decode"):
            raise ValueError("kv_transfer_params asks for both do_remote_prefill and "
                             "do_remote_decode")
        missing = [k for k in ("remote_block_ids", "remote_engine_id", "remote_host",
                               "remote_port") if params.get(k) in (None, "", [])]
        if missing:
            raise ValueError(f"do_remote_prefill without {', '.join(missing)}")
        block_ids = params["remote_block_ids"]
        # Hybrid models send one list per KV cache group; keep the first (full attention).
        if block_ids and isinstance(block_ids[0], (list, tuple)):
            block_ids = block_ids[0]
        return KvHandoff(
            role="consumer",
            remote_block_ids=tuple(int(b) for b in block_ids),
            remote_engine_id=str(params["remote_engine_id"]),
            remote_request_id=params.get("remote_request_id"),
            remote_host=str(params["remote_host"]),
            remote_port=int(params["remote_port"]),
            tp_size=None if params.get("tp_size") is None else int(params["tp_size"]),
            extra=extra,
        )
    if params.get("do_remote_decode"):
        return KvHandoff(role="producer", extra=extra)
    return None


# --------------------------------------------------------------------------------------------
# KV connector (vLLM KV connector v1 interface)
# --------------------------------------------------------------------------------------------

_NOT_BUILT = (
    "needs data_plane.transfer's NIXL agent registered over this engine's GPU KV tensors, "
    "which the Switchyard connector does not implement yet; run vLLM's NixlConnector for "
    "disaggregated serving"
)


class ConnectorMetadataCore:
    """What the scheduler-side connector tells the worker side each step. The pass-through
    connector never schedules a load or a save, so it is always empty; the fields exist so the
    worker side can check rather than assume."""

    def __init__(self, loads: Mapping[str, Any] | None = None,
                 saves: Mapping[str, Any] | None = None) -> None:
        self.loads = dict(loads or {})
        self.saves = dict(saves or {})

    @property
    def has_work(self) -> bool:
        return bool(self.loads or self.saves)


class SwitchyardConnectorCore:
    """The connector's behaviour, without vLLM's base class (combined with it lazily by
    :func:`build_connector_class`). Method names and signatures follow
    ``KVConnectorBase_V1``."""

    #: Set by build_connector_class: the KVConnectorMetadata subclass to return.
    metadata_cls: type = ConnectorMetadataCore

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[call-arg]
        transfer_config = getattr(vllm_config, "kv_transfer_config", None)
        self.extra_config: dict[str, Any] = dict(
            getattr(transfer_config, "kv_connector_extra_config", None) or {})
        self.kv_caches: dict[str, Any] = {}
        #: vLLM KVCacheEvents this connector produced, drained by take_events().
        self._events: list[Any] = []

    # -- scheduler side --------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        handoff = parse_kv_transfer_params(getattr(request, "kv_transfer_params", None))
        if handoff is not None and handoff.role == "consumer":
            raise NotImplementedError(
                f"request {request.request_id}: pulling {len(handoff.remote_block_ids)} blocks "
                f"from engine {handoff.remote_engine_id} {_NOT_BUILT}")
        # No external KV: everything beyond vLLM's own prefix-cache hit is computed.
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        if num_external_tokens:
            raise NotImplementedError(
                f"request {request.request_id}: loading {num_external_tokens} external tokens "
                f"{_NOT_BUILT}")

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return self.metadata_cls()

    def request_finished(self, request: Any,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        handoff = parse_kv_transfer_params(getattr(request, "kv_transfer_params", None))
        if handoff is not None and handoff.role == "producer":
            raise NotImplementedError(
                f"request {request.request_id}: holding {len(block_ids)} blocks for a remote "
                f"decode worker {_NOT_BUILT}")
        # Blocks are freed now, as vLLM would without a connector.
        return False, None

    def take_events(self) -> Iterable[Any]:
        events, self._events = self._events, []
        return events

    # -- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        # Kept for the transfer layer; registering them with NIXL happens with the first
        # transfer, which is the part not implemented.
        self.kv_caches = dict(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()  # type: ignore[attr-defined]
        if getattr(meta, "has_work", False):
            raise NotImplementedError(f"start_load_kv: {_NOT_BUILT}")

    def wait_for_layer_load(self, layer_name: str) -> None:
        # start_load_kv never starts a load, so there is nothing to wait for.
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        # Pull model (like NixlConnector): a consumer reads the producer's blocks in place;
        # nothing is pushed per layer.
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # No asynchronous send or receive is ever started.
        return None, None


def build_connector_class(base: type, metadata_base: type) -> type:
    """``SwitchyardKVConnector``: :class:`SwitchyardConnectorCore` on top of ``base`` (vLLM's
    ``KVConnectorBase_V1``), returning metadata that subclasses ``metadata_base``."""
    meta_cls = type("SwitchyardConnectorMetadata", (ConnectorMetadataCore, metadata_base), {})
    return type("SwitchyardKVConnector", (SwitchyardConnectorCore, base),
                {"metadata_cls": meta_cls, "__module__": __name__})


@functools.cache
def _vllm_connector_class() -> type:
    base_mod = require_vllm("vllm.distributed.kv_transfer.kv_connector.v1.base")
    return build_connector_class(base_mod.KVConnectorBase_V1, base_mod.KVConnectorMetadata)


def __getattr__(name: str) -> Any:
    # Assembled on first access so that importing this module never imports vLLM.
    if name == "SwitchyardKVConnector":
        return _vllm_connector_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
