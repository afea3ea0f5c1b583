"""Whether a process uses the native core (index and scoring) or the reference: the one switch.

``SWITCHYARD_INDEX=native`` (the default) selects the Rust core in ``native/`` for both hot
paths: :class:`~control_plane.index.native.NativePrefixIndex` for the prefix index, and
``switchyard_native.decide_kv`` for the kv terms, guards and argmin of every routing decision
(:func:`control_plane.router.decision.decide`). ``SWITCHYARD_INDEX=reference`` selects the
pure-Python executable specifications of both, :class:`~control_plane.index.prefix_index.PrefixIndex`
and ``decision._score``, for debugging. The two index implementations fold the same events to
the same state and read each other's snapshots, and the two scorers give bit-identical score
rows and choices (``tests/unit/test_native_index.py``, ``tests/unit/test_native_decide.py``), so
the switch can be flipped across a restart and a replay verifies decisions made under either.
It is read when an index is created or a decision made (never at import).
"""

from __future__ import annotations

import os

from control_plane.index.errors import IndexPackageError

INDEX_ENV = "SWITCHYARD_INDEX"
IMPLEMENTATIONS = ("native", "reference")


class UnknownIndexImplementation(IndexPackageError, ValueError):
    reason = "index_impl"


def index_impl() -> str:
    """The selected implementation's name."""
    value = os.environ.get(INDEX_ENV, "native").strip().lower() or "native"
    if value not in IMPLEMENTATIONS:
        raise UnknownIndexImplementation(
            f"{INDEX_ENV}={value!r}: choose one of {', '.join(IMPLEMENTATIONS)}")
    return value


def native_core() -> bool:
    """True when the native core is selected (the index *and* the router's kv scoring)."""
    return index_impl() == "native"


def index_class() -> type:
    if index_impl() == "reference":
        from control_plane.index.prefix_index import PrefixIndex

        return PrefixIndex
    from control_plane.index.native import NativePrefixIndex

    return NativePrefixIndex


def new_index(hash_algo: str, block_size: int):
    """An empty index of the selected implementation."""
    return index_class()(hash_algo, block_size)


def restore_index(data: bytes):
    """The selected implementation restored from snapshot bytes (either writes the same bytes)."""
    return index_class().restore(data)
