"""Chained block hashing, bit-compatible with vLLM's prefix caching. Pure (no I/O).

What vLLM does (``vllm/v1/core/kv_cache_utils.py`` and ``vllm/utils/hashing.py``, read from
vllm-project/vllm):

* ``hash_block_tokens(H, parent, tokens, extra_keys) = H((parent or NONE_HASH, tuple(tokens),
  extra_keys))``, where ``parent`` is the previous block's *full digest* (32 bytes for the sha256
  variants, 16 for xxh3_128) and ``extra_keys`` is ``None`` when the block has none, else a
  tuple (LoRA name, multimodal ``(identifier, offset)``, ``cache_salt`` on the first block only,
  prompt-embeds digest; the exact shape depends on the vLLM version, so callers pass it in).
* Only full blocks are hashed; a trailing partial block has no hash.
* ``H`` is one of ``sha256`` (``sha256(pickle.dumps(x, HIGHEST_PROTOCOL))``, vLLM's default),
  ``sha256_cbor`` (``sha256(cbor2.dumps(x, canonical=True))``, portable across languages),
  ``xxhash`` / ``xxhash_cbor`` (``xxh3_128`` over pickle / canonical CBOR).
* ``NONE_HASH = H(seed)`` with ``seed`` a *str*: ``$PYTHONHASHSEED`` if set, else the fixed
  ``"vllm-none-hash"`` for the cryptographic (sha256) variants. For the xxhash variants vLLM draws
  a random per-process seed unless ``PYTHONHASHSEED`` is set (a predictable seed would let an
  attacker precompute collisions), so their hashes can only be reproduced with an explicit seed.
  Older vLLM releases (before ``DEFAULT_NONE_HASH_SEED``) used ``os.urandom(32)`` for every
  algorithm when ``PYTHONHASHSEED`` was unset: run such engines with a shared PYTHONHASHSEED.
* On the wire (KV events, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the default) a hash is the
  last 8 bytes of the digest read big-endian: an unsigned 64-bit int. That is :data:`BlockHash`.

Speed: the router hashes every prompt. In Python one block costs one C-level serialisation plus
one digest and no other per-block work (timings: docs/benchmarks.md, "Measurements behind
defaults"). vLLM's default, sha256 without extra keys, has a native path (``switchyard_native``,
``native/src/blockhash.rs``: it writes the bytes CPython's pickler writes for the block's tuple
and hashes them): :func:`hash_blocks` takes it for a list or tuple of plain ints, and
:func:`hash_json_ids` reads a prompt's ids straight from the JSON array a client sent. The same
hashes bit for bit (``tests/unit/test_hashing.py`` holds them equal to
:func:`hash_block_digests`, the specification).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from typing import Any

import xxhash

from common.errors import HashConfigError
from schemas.types import BlockHash

try:  # the native crate is a project dependency; a build without it hashes in Python
    from switchyard_native import sha256_ids_chain as _native_ids
    from switchyard_native import sha256_json_ids_chain as _native_json_ids
except ImportError:  # pragma: no cover - exercised only without the native build
    _native_ids = None
    _native_json_ids = None

#: Seed vLLM derives NONE_HASH from when PYTHONHASHSEED is unset and the algorithm is
#: cryptographic (``kv_cache_utils.DEFAULT_NONE_HASH_SEED``).
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"

#: vLLM's default ``--block-size``.
DEFAULT_BLOCK_SIZE = 16


class HashAlgo(str, Enum):
    """vLLM's ``--prefix-caching-hash-algo`` values."""

    SHA256 = "sha256"
    SHA256_CBOR = "sha256_cbor"
    XXHASH = "xxhash"
    XXHASH_CBOR = "xxhash_cbor"

    @property
    def cryptographic(self) -> bool:
        """Whether vLLM gives it the fixed default seed (True) or a random one (False)."""
        return self in (HashAlgo.SHA256, HashAlgo.SHA256_CBOR)


@dataclass(frozen=True, slots=True)
class HashConfig:
    """How a producer hashes blocks: algorithm, block size and NONE_HASH seed.

    ``seed`` is the engine's ``PYTHONHASHSEED`` as a string, or None when it is unset (allowed
    only for the sha256 variants, which then use ``"vllm-none-hash"``).

    Events carry :attr:`hash_algo` (the algorithm plus, for a non-default seed, a fingerprint of
    NONE_HASH) and the block size separately, so the index can refuse a producer whose hashes
    would never match its own. The fingerprint, not the seed, goes on the wire: for xxhash the
    seed is what keeps collisions unpredictable.
    """

    algo: HashAlgo = HashAlgo.SHA256
    block_size: int = DEFAULT_BLOCK_SIZE
    seed: str | None = None

    def __post_init__(self) -> None:
        try:
            algo = HashAlgo(self.algo)
        except ValueError:
            known = ", ".join(a.value for a in HashAlgo)
            raise HashConfigError(
                f"unknown prefix-caching hash algorithm {self.algo!r} (known: {known})"
            ) from None
        object.__setattr__(self, "algo", algo)
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise HashConfigError(f"block_size must be a positive int, got {self.block_size!r}")
        if self.seed is not None and not isinstance(self.seed, str):
            raise HashConfigError(
                f"seed must be the PYTHONHASHSEED string (or None), got {type(self.seed).__name__}"
            )
        if self.seed == DEFAULT_NONE_HASH_SEED and algo.cryptographic:
            # Same NONE_HASH as "unset": one canonical form, so equal configs compare equal.
            object.__setattr__(self, "seed", None)
        if self.seed is None and not algo.cryptographic:
            raise HashConfigError(
                f"{algo.value} needs an explicit seed: vLLM draws a random per-process NONE_HASH "
                "seed for xxhash variants unless PYTHONHASHSEED is set, so nobody else can "
                "reproduce its hashes. Set PYTHONHASHSEED on the engines and pass it as seed."
            )

    @classmethod
    def from_engine_env(
        cls, algo: HashAlgo | str, block_size: int, env: Mapping[str, str]
    ) -> HashConfig:
        """Config of an engine started with environment ``env`` (reads PYTHONHASHSEED only)."""
        return cls(HashAlgo(algo), block_size, env.get("PYTHONHASHSEED"))

    @property
    def none_hash(self) -> bytes:
        """The full NONE_HASH digest the first block of every sequence chains from."""
        return _resolve(self.algo, self.seed)[1]

    @property
    def hash_algo(self) -> str:
        """Stable wire form for events' ``hash_algo``: ``"sha256_cbor"`` for the default seed,
        ``"<algo>:<8 hex of a NONE_HASH fingerprint>"`` otherwise (block size travels apart)."""
        if self.seed is None:
            return self.algo.value
        fp = hashlib.sha256(b"switchyard/none-hash-fingerprint\x00" + self.none_hash)
        return f"{self.algo.value}:{fp.hexdigest()[:8]}"


def to_wire(digest: bytes) -> BlockHash:
    """vLLM's int form of a digest: its last 8 bytes, big-endian, unsigned."""
    return BlockHash(int.from_bytes(digest[-8:], "big"))


def _pickle_bytes(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor_bytes(obj: Any) -> bytes:
    import cbor2  # only the cbor algorithms need it (a router imports this module at start-up)

    return cbor2.dumps(obj, canonical=True)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_SERIALIZERS: dict[HashAlgo, tuple[Callable[[Any], bytes], Callable[[bytes], bytes]]] = {
    HashAlgo.SHA256: (_pickle_bytes, _sha256),
    HashAlgo.SHA256_CBOR: (_cbor_bytes, _sha256),
    HashAlgo.XXHASH: (_pickle_bytes, xxhash.xxh3_128_digest),
    HashAlgo.XXHASH_CBOR: (_cbor_bytes, xxhash.xxh3_128_digest),
}


@lru_cache(maxsize=32)
def _resolve(algo: HashAlgo, seed: str | None) -> tuple[Callable[[Any], bytes], bytes]:
    """(object -> digest function, NONE_HASH). Memoised: a pure function of its arguments."""
    ser, dig = _SERIALIZERS[algo]

    def hash_fn(obj: Any) -> bytes:
        return dig(ser(obj))

    return hash_fn, hash_fn(DEFAULT_NONE_HASH_SEED if seed is None else seed)


def hash_object(obj: Any, config: HashConfig) -> bytes:
    """vLLM's ``H(obj)`` under ``config``'s algorithm (the full digest)."""
    return _resolve(config.algo, config.seed)[0](obj)


def _token_tuple(token_ids: Sequence[int]) -> tuple[int, ...]:
    # vLLM hashes a tuple of Python ints; numpy scalars would pickle differently.
    if isinstance(token_ids, tuple):
        return token_ids
    if isinstance(token_ids, list):
        return tuple(token_ids)
    tolist = getattr(token_ids, "tolist", None)
    return tuple(tolist() if tolist is not None else token_ids)


def hash_block_digests(
    token_ids: Sequence[int],
    config: HashConfig,
    extra_keys: Sequence[tuple[Any, ...] | None] | None = None,
    *,
    parent: bytes | None = None,
) -> list[bytes]:
    """Full digests of every full block of ``token_ids``, chained from ``parent``.

    ``parent`` is the full digest of the block before ``token_ids[0]`` (None: start of a
    sequence, i.e. NONE_HASH). ``extra_keys``, when given, has one entry per full block (None
    for a block without extra keys), passed to the hash exactly as vLLM would.
    """
    toks = _token_tuple(token_ids)
    bs = config.block_size
    n = len(toks) // bs
    none_hash = _resolve(config.algo, config.seed)[1]
    ser, dig = _SERIALIZERS[config.algo]
    if extra_keys is not None and len(extra_keys) != n:
        raise ValueError(f"extra_keys has {len(extra_keys)} entries for {n} full blocks")
    p = parent or none_hash
    out: list[bytes] = []
    append = out.append
    if extra_keys is None:
        for i in range(0, n * bs, bs):
            p = dig(ser((p, toks[i : i + bs], None)))
            append(p)
    else:
        for b, i in enumerate(range(0, n * bs, bs)):
            p = dig(ser((p, toks[i : i + bs], extra_keys[b])))
            append(p)
    return out


def hash_blocks(
    token_ids: Sequence[int],
    config: HashConfig,
    extra_keys: Sequence[tuple[Any, ...] | None] | None = None,
    *,
    parent: bytes | None = None,
) -> list[BlockHash]:
    """Wire-form (u64) hashes of every full block of ``token_ids``; see
    :func:`hash_block_digests` for the arguments. This is what KV events and the prefix index
    carry, and what :meth:`NativePrefixIndex.find_matches` takes. Natively for sha256 without extra
    keys when ``token_ids`` is a list or tuple of plain ints (module docstring)."""
    if (_native_ids is not None and extra_keys is None and config.algo is HashAlgo.SHA256
            and (parent is None or len(parent) == 32)):
        out = _native_ids(parent or _resolve(config.algo, config.seed)[1], token_ids, config.block_size)
        if out is not None:
            return out
    from_bytes = int.from_bytes
    return [from_bytes(d[-8:], "big")  # type: ignore[misc]
            for d in hash_block_digests(token_ids, config, extra_keys, parent=parent)]


def hash_json_ids(json: bytes, vocab_size: int, config: HashConfig) -> tuple[int, list[BlockHash]] | None:
    """A prompt of token ids read from ``json``, the bytes of the JSON array a client sent:
    (how many ids, :func:`hash_blocks` of them), in one native call that makes no Python int
    per id. None unless ``json`` is an array of plain integers ``0 <= id < vocab_size`` (digits
    only: no sign, fraction, exponent or leading zero) and ``config`` is sha256 with the native
    build present; the caller then decodes the prompt the general way, which words any error."""
    if _native_json_ids is None or config.algo is not HashAlgo.SHA256:
        return None
    return _native_json_ids(_resolve(config.algo, config.seed)[1], json, vocab_size, config.block_size)
