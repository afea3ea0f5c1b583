"""vLLM helpers: import guards, the ``kv_transfer_params`` parser, and a token-level AsyncLLM
wrapper.

The engine the worker runs is :mod:`data_plane.vllm.serving` (tested against real vLLM in
``tests/vllm/``); :class:`VllmEngine` below is the earlier thin wrapper, kept for its unit
tests. The KV connector (the worker's KVBM tiers as vLLM's tier backend) is
:mod:`data_plane.vllm.connector` (``"kv_connector_module_path": "data_plane.vllm.connector"``).

Nothing imports vLLM at module import time: :class:`VllmEngine` imports it on first use.
For disaggregated serving use vLLM's own ``NixlConnector``; Switchyard's router speaks its
``kv_transfer_params`` (see :func:`parse_kv_transfer_params`).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol

logger = logging.getLogger(__name__)

VLLM_MISSING = ("vLLM is not installed in this environment; the vLLM environment is made by "
                "scripts/vllm-env.sh (.venv-vllm; see docs/vllm.md)")


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
