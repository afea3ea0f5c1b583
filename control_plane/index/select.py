"""Which prefix index implementation a process uses: the one switch.

``SWITCHYARD_INDEX=native`` (the default) selects :class:`~control_plane.index.native.NativePrefixIndex`,
the Rust core; ``SWITCHYARD_INDEX=reference`` selects the pure-Python
:class:`~control_plane.index.prefix_index.PrefixIndex`, the executable specification, for
debugging. Both fold the same events to the same state and read each other's snapshots, so the
switch can be flipped across a restart. It is read when an index is created (never at import).
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
