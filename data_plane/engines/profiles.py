"""Hardware profiles: engine limits plus a timing model, loaded from TOML data files.

Profiles live in ``data_plane/engines/profiles/<name>.toml``; each file documents where its
numbers come from. Two ship with the engine:

* ``mocker`` reproduces Dynamo's mocker exactly (block size 64, 16,384 blocks, 256 sequences,
  8,192 batched tokens, polynomial timing). Use it to compare with Dynamo like for like.
* ``h100_llama3_8b`` is a roofline model of Llama 3 8B BF16 on one H100 SXM5, where decode time
  grows with batch size and context length (published datasheet and model numbers; the
  efficiency factors are stated assumptions).

``load_profile("mocker")`` or ``load_profile(Path("my.toml"))``; override fields for an
experiment with ``profile.replace(num_device_blocks=4096)``.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from data_plane.engines.errors import ProfileError
from data_plane.engines.request import DEFAULT_VOCAB_SIZE
from data_plane.engines.timing import PolynomialTiming, RooflineTiming, TimingModel

PROFILE_DIR = Path(__file__).with_name("profiles")


class Admission(str, Enum):
    """When a waiting request may start.

    ``chunk`` is vLLM: when the blocks for its first scheduled chunk can be allocated.
    ``whole_prompt`` is Dynamo's mocker: only when blocks for its whole known sequence (minus
    prefix hits on blocks already in use) are free.
    """

    CHUNK = "chunk"
    WHOLE_PROMPT = "whole_prompt"


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """Everything the engine needs to know about the hardware and model it simulates."""

    name: str
    #: Tokens per KV block.
    block_size: int
    #: Device KV blocks per worker.
    num_device_blocks: int
    #: Max requests running at once (vLLM ``max_num_seqs``).
    max_num_seqs: int
    #: Token budget of one step across the batch (vLLM ``max_num_batched_tokens``).
    max_num_batched_tokens: int
    timing: TimingModel
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    admission: Admission = Admission.CHUNK
    #: Freed blocks without a hash are reused before cached ones are evicted (Dynamo's mocker)
    #: instead of queueing at the LRU tail (vLLM). See :mod:`data_plane.engines.block_pool`.
    reuse_uncached_first: bool = False
    #: Output pseudo-tokens are drawn below this id.
    vocab_size: int = DEFAULT_VOCAB_SIZE
    description: str = ""
    sources: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        for name in ("block_size", "num_device_blocks", "max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ProfileError(f"profile {self.name!r}: {name} must be a positive int, got {v!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.block_size:
            raise ProfileError(
                f"profile {self.name!r}: without chunked prefill every prompt must fit one step; "
                f"max_num_batched_tokens={self.max_num_batched_tokens} cannot hold even one block"
            )

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_device_blocks * self.block_size

    def replace(self, **changes: Any) -> HardwareProfile:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def available_profiles() -> list[str]:
    """Names of the profiles shipped in ``profiles/``."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """Load a shipped profile by name, or any profile file by path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILE_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        raise ProfileError(
            f"no profile {name_or_path!r} (shipped: {', '.join(available_profiles())})"
        )
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"profile {path}: {e}") from e
    return profile_from_dict(data, default_name=path.stem)


def profile_from_dict(data: dict[str, Any], *, default_name: str = "custom") -> HardwareProfile:
    name = data.get("name", default_name)
    engine = dict(data.get("engine", {}))
    try:
        timing = _timing_from_dict(data.get("timing", {}))
        admission = Admission(engine.pop("admission", Admission.CHUNK.value))
        return HardwareProfile(
            name=name,
            timing=timing,
            admission=admission,
            description=data.get("description", ""),
            sources=tuple(data.get("sources", ())),
            **engine,
        )
    except (TypeError, ValueError, KeyError) as e:
        if isinstance(e, ProfileError):
            raise
        raise ProfileError(f"profile {name!r}: {e}") from e


def _timing_from_dict(t: dict[str, Any]) -> TimingModel:
    model = t.get("model")
    if model == "polynomial":
        fields = {k: float(v) for k, v in t.items() if k != "model"}
        return PolynomialTiming(**fields)
    if model == "roofline":
        hw, arch, eff = t["hardware"], t["model_arch"], t["efficiency"]
        bpp = float(arch["bytes_per_param"])
        layers = int(arch["num_layers"])
        head_dim = int(arch["head_dim"])
        return RooflineTiming(
            params=float(arch["params"]),
            weight_bytes=float(arch["params"]) * bpp,
            kv_bytes_per_token=2.0 * layers * int(arch["num_kv_heads"]) * head_dim * bpp,
            attn_flops_per_pair=4.0 * layers * int(arch["num_attention_heads"]) * head_dim,
            peak_flops=float(hw["peak_flops"]),
            mem_bandwidth=float(hw["mem_bandwidth"]),
            mfu=float(eff["mfu"]),
            mbu=float(eff["mbu"]),
            fixed_overhead_ms=float(eff.get("fixed_overhead_ms", 0.0)),
            per_seq_overhead_ms=float(eff.get("per_seq_overhead_ms", 0.0)),
        )
    raise ProfileError(f"unknown timing model {model!r} (known: polynomial, roofline)")
