"""The router's ports (control_plane/router/ports.py): the product's implementation of each and
its differential oracle (tests/oracles) satisfy it, and the router view folds through the port
alone, with the same result for either index."""

from __future__ import annotations

import pytest

from control_plane.index.native import NativePrefixIndex
from control_plane.router.ledger import _new_accounts
from control_plane.router.ports import InflightAccounts, KvIndex
from control_plane.router.view import RouterView
from schemas import EventCodec
from tests.oracles.ledger import Accounts
from tests.oracles.prefix_index import PrefixIndex
from tests.support.interleave import BLOCK_SIZE, HASH_ALGO, cluster_log

CODEC = EventCodec()


@pytest.mark.parametrize("cls", [NativePrefixIndex, PrefixIndex])
def test_both_indexes_are_a_kv_index(cls) -> None:
    assert isinstance(cls(HASH_ALGO, BLOCK_SIZE), KvIndex)


@pytest.mark.parametrize("make", [_new_accounts, Accounts])
def test_both_accounts_are_inflight_accounts(make) -> None:
    assert isinstance(make(), InflightAccounts)


def _fold_bytes(index_cls: type, seed: int) -> dict:
    view = RouterView(HASH_ALGO, BLOCK_SIZE, index=index_cls(HASH_ALGO, BLOCK_SIZE))
    for r in cluster_log(seed):
        if r.stream in ("kv", "workers"):
            view.apply_record(CODEC.encode(r.env), r.topic, r.partition, r.offset, 0, CODEC)
    return view.as_dict()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_view_folds_record_bytes_the_same_through_either_index(seed: int) -> None:
    """The native index takes kv records from their bytes, the oracle none (each is decoded
    and applied): the same fold, so the same state."""
    assert _fold_bytes(NativePrefixIndex, seed) == _fold_bytes(PrefixIndex, seed)


def test_the_oracle_takes_no_record_from_its_bytes() -> None:
    idx = PrefixIndex(HASH_ALGO, BLOCK_SIZE)
    assert idx.apply_bytes(b"anything") is None
    assert idx.apply_run([b"a", b"b"], 1) == (1, None)
