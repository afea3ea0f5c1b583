"""Simulated inference engine: vLLM-style paged KV cache with prefix caching, continuous batching
with chunked prefill and preemption, timing from hardware profiles, and two drivers over the same
pure core (a discrete-event simulation and a real-time asyncio engine).

Layers (dependencies point down): drivers (:mod:`.cluster` and its engine-only entry :mod:`.engine_only`, :mod:`.async_engine`) ->
:class:`~.core.EngineCore` -> :mod:`.scheduler` -> :mod:`.kv_manager` -> :mod:`.block_pool`;
:mod:`.timing` and :mod:`.profiles` describe the hardware; :mod:`.trace` turns Mooncake traces
into requests.
"""

from data_plane.engines.async_engine import AsyncEngine, StreamedToken, TokenStream
from data_plane.engines.block_pool import BlockPool, EvictHook, KVCacheBlock
from data_plane.engines.core import EngineCore, EngineStats, StepResult, default_hash_config
from data_plane.engines.errors import (
    EngineError,
    ProfileError,
    RequestRejected,
    TraceFormatError,
    UnknownRequest,
)
from data_plane.engines.records import RequestRecord, SimulationResult
from data_plane.engines.profiles import Admission, HardwareProfile, available_profiles, load_profile
from data_plane.engines.request import EngineRequest, pseudo_token, request_seed
from data_plane.engines.scheduler import TokenOutput
from data_plane.engines.engine_only import round_robin, simulate
from data_plane.engines.timing import PolynomialTiming, RooflineTiming, StepShape, TimingModel
from data_plane.engines.trace import (
    MooncakeTrace,
    SyntheticPrompt,
    TraceRecord,
    load_mooncake_requests,
    read_mooncake,
)

__all__ = [
    "Admission",
    "AsyncEngine",
    "BlockPool",
    "EngineCore",
    "EngineError",
    "EngineRequest",
    "EngineStats",
    "EvictHook",
    "HardwareProfile",
    "KVCacheBlock",
    "MooncakeTrace",
    "PolynomialTiming",
    "ProfileError",
    "RequestRecord",
    "RequestRejected",
    "RooflineTiming",
    "SimulationResult",
    "StepResult",
    "StepShape",
    "StreamedToken",
    "SyntheticPrompt",
    "TimingModel",
    "TokenOutput",
    "TokenStream",
    "TraceFormatError",
    "TraceRecord",
    "UnknownRequest",
    "available_profiles",
    "default_hash_config",
    "load_mooncake_requests",
    "load_profile",
    "pseudo_token",
    "read_mooncake",
    "request_seed",
    "round_robin",
    "simulate",
]
