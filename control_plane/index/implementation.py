"""Whether a process uses the native core (index and decision) or the reference: the one switch.

``SWITCHYARD_INDEX=native`` (the default) selects the Rust core in ``native/`` for the hot
paths: :class:`~control_plane.index.native.NativePrefixIndex` for the prefix index,
``switchyard_native.decide_kv`` for the kv terms, guards, argmin and score rows of every
routing decision (:func:`control_plane.router.decision.decide`), and
``switchyard_native.InflightAccounts`` for the in-flight ledger's accounts
(:class:`control_plane.router.ledger.InflightLedger`). ``SWITCHYARD_INDEX=reference`` selects
the pure-Python executable specifications of all three, :class:`~control_plane.index.prefix_index.PrefixIndex`,
``decision._score`` / ``decision._pick`` and ``ledger._Accounts``, for debugging. The two index
implementations fold the same events to the same state and read each other's snapshots, the
two decision paths give bit-identical score rows and choices, and the two ledgers the same
views (``tests/unit/test_native_index.py``, ``tests/unit/test_native_decide.py``,
``tests/unit/test_native_ledger.py``), so the switch can be flipped across a restart and a
replay verifies decisions made under either. It is read when an index or a ledger is created
or a decision made (never at import). Whoever holds an index or accounts uses them through the
router's ports (``control_plane/router/ports.py``: ``KvIndex``, ``InflightAccounts``), never
asking which implementation it has; the switch stays while the decision reads it for its
scoring path.
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
    """True when the native core is selected (the index, the router's decision and its ledger)."""
    return index_impl() == "native"


def index_class() -> type:
    if index_impl() == "reference":
        # lazy: start-up time: loads msgspec, switchyard_native, xxhash only when called
        from control_plane.index.prefix_index import PrefixIndex

        return PrefixIndex
    # lazy: start-up time: loads msgspec, switchyard_native, xxhash only when called
    from control_plane.index.native import NativePrefixIndex

    return NativePrefixIndex


def new_index(hash_algo: str, block_size: int):
    """An empty index of the selected implementation."""
    return index_class()(hash_algo, block_size)


def restore_index(data: bytes):
    """The selected implementation restored from snapshot bytes (either writes the same bytes)."""
    return index_class().restore(data)
