"""The engine's block hashing: :func:`common.hashing.hash_block_digests`, with a
native fast path for vLLM's default algorithm. Same digests, bit for bit.

For ``HashAlgo.SHA256`` without extra keys a block's digest is
``sha256(pickle.dumps((parent, tuple(tokens), None), 5))``. The native crate
(``switchyard_native.sha256_block_chain``, ``native/src/blockhash.rs``) writes exactly the bytes
CPython's pickler writes for that tuple and hashes them (SHA-NI where the CPU has it): about
0.3 us a 64-token block instead of 3 us, which matters to trace replay (1.4M prompt blocks) and
to the blocks the engine generates. Any other algorithm, tokens that are not plain ``int``
(a numpy scalar or a bool pickles differently), an int beyond 64 bits, or a missing native
module takes the Python path, so the result never depends on which path ran.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

from common.hashing import HashAlgo, HashConfig, hash_block_digests

try:  # the native crate is a project dependency; a stale build without it still works
    from switchyard_native import MooncakeHasher as _NativeMooncakeHasher
    from switchyard_native import mooncake_block_chain as _native_mooncake
    from switchyard_native import sha256_block_chain as _native_chain
    from switchyard_native import sha256_generated_chain as _native_generated
except ImportError:  # pragma: no cover - exercised only without the native build
    _native_chain = None
    _native_generated = None
    _native_mooncake = None
    _NativeMooncakeHasher = None


_INT_ONLY = {int}


def native_available() -> bool:
    return _native_chain is not None


def split_digests(buf: bytes) -> list[bytes]:
    """Concatenated 32-byte digests -> list of digests."""
    return [buf[i : i + 32] for i in range(0, len(buf), 32)]


class DigestChain(Sequence[bytes]):
    """A sequence of 32-byte digests kept as one ``bytes`` (what the native hasher returns),
    plus a list of digests appended later: a trace prompt's 190 digests are one object, cut
    into ``bytes`` only when read (the engine reads one: the parent of its first generated
    block). Reads like a ``list[bytes]``; only :meth:`extend` mutates it."""

    __slots__ = ("_blob", "_n", "_more")

    def __init__(self, blob: bytes = b"", more: list[bytes] | None = None) -> None:
        if len(blob) % 32:
            raise ValueError("a digest chain is a multiple of 32 bytes")
        self._blob = blob
        self._n = len(blob) // 32
        self._more = more if more is not None else []

    def copy(self) -> DigestChain:
        """Same digests; extending the copy leaves this one alone (the bytes are shared)."""
        return DigestChain(self._blob, list(self._more))

    def extend(self, digests: Sequence[bytes]) -> None:
        self._more.extend(digests)

    def __len__(self) -> int:
        return self._n + len(self._more)

    @overload
    def __getitem__(self, i: int) -> bytes: ...
    @overload
    def __getitem__(self, i: slice) -> list[bytes]: ...
    def __getitem__(self, i: int | slice) -> bytes | list[bytes]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        if i < self._n:
            return self._blob[32 * i : 32 * i + 32]
        return self._more[i - self._n]

    def __iter__(self) -> Iterator[bytes]:
        blob = self._blob
        for i in range(0, 32 * self._n, 32):
            yield blob[i : i + 32]
        yield from self._more

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (DigestChain, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment] - mutable

    def __repr__(self) -> str:
        return f"DigestChain({len(self)} digests)"


def wire_hashes(digests: Sequence[bytes]) -> list[int]:
    """:func:`common.hashing.to_wire` of each digest."""
    from_bytes = int.from_bytes
    return [from_bytes(d[-8:], "big") for d in digests]


def block_digests(
    token_ids: Sequence[int], config: HashConfig, *, parent: bytes | None = None
) -> tuple[list[bytes], list[int]]:
    """``hash_block_digests(token_ids, config, parent=parent)`` and the digests' wire forms."""
    if _native_chain is not None and config.algo is HashAlgo.SHA256:
        toks = token_ids if isinstance(token_ids, list) else list(token_ids)
        # type() rather than isinstance: a bool is an int but pickles as NEWTRUE/NEWFALSE.
        if not toks or set(map(type, toks)) == _INT_ONLY:
            try:
                out = _native_chain(parent or config.none_hash, toks, config.block_size)
            except OverflowError:  # an int beyond 64 bits: pickle's LONG1 of any size
                out = None
            if out is not None:
                return split_digests(out[0]), out[1]
    ds = hash_block_digests(token_ids, config, parent=parent)
    return ds, wire_hashes(ds)


def generated_digests(
    head: list[int], seed: int, start: int, stop: int, vocab_size: int, config: HashConfig,
    *, parent: bytes | None = None,
) -> tuple[list[bytes], list[int]] | None:
    """``block_digests(head + pseudo_tokens(seed, start, stop, vocab_size), config, parent)``
    in one native call (the tokens an engine request generates never reach Python); None when
    that is not the native sha256 path (the caller builds the tokens and calls
    :func:`block_digests`)."""
    if _native_generated is None or config.algo is not HashAlgo.SHA256:
        return None
    if head and set(map(type, head)) != _INT_ONLY:
        return None
    try:
        out = _native_generated(
            parent or config.none_hash, head, seed, start, stop, vocab_size, config.block_size
        )
    except OverflowError:
        return None
    if out is None:
        return None
    return split_digests(out[0]), out[1]


def mooncake_chain(
    parent: bytes,
    hash_ids: Sequence[int],
    blocks: Sequence[int],
    config: HashConfig,
    trace_block_size: int,
    vocab_size: int,
) -> tuple[bytes, list[int]] | None:
    """Natively, the chained digests (concatenated) and wire hashes of the first ``blocks[k]``
    engine blocks of trace block ``hash_ids[k]`` for each ``k``, chained from ``parent``; the
    tokens are :func:`data_plane.engines.trace.trace_token`'s. None when there is no native
    path for this config (the caller hashes the synthesized tokens in Python)."""
    if _native_mooncake is None or config.algo is not HashAlgo.SHA256:
        return None
    try:
        return _native_mooncake(
            parent, list(hash_ids), list(blocks), config.block_size, trace_block_size, vocab_size
        )
    except OverflowError:  # a hash id beyond 64 bits
        return None


def mooncake_hasher(config: HashConfig, trace_block_size: int, vocab_size: int):  # noqa: ANN201
    """A native memoising hasher of Mooncake prompts (``hasher.digests(hash_ids, length)`` ->
    (concatenated digests, wire hashes), or None), or None without a native path for this
    config. See ``native/src/blockhash.rs::MooncakeHasher``."""
    if _NativeMooncakeHasher is None or config.algo is not HashAlgo.SHA256:
        return None
    if trace_block_size % config.block_size:
        return None
    return _NativeMooncakeHasher(config.none_hash, config.block_size, trace_block_size, vocab_size)
