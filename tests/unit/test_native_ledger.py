"""The native in-flight accounts (``native/src/inflight.rs``) against their differential oracle
(``tests/oracles/ledger.py``), through the whole :class:`InflightLedger`.

Random operation sequences (routing to workers with chains that share prefixes, re-adds of a
retried attempt, prefill done, completions of one worker or all, expiry, dropped workers) run
through the product's ledger and one over the oracle's accounts; after every operation both must
give the same view of random queries (load and speculative overlap per worker, in the same
order), the same loads, the same expiries and the same entries. Inputs the native accounts cannot
hold exactly (hashes that are not ``u64``, counters beyond ``i64``) are refused with
:class:`InvalidRoutingInput`, and nothing changes.
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from control_plane.router.errors import InvalidRoutingInput
from control_plane.router.ledger import NO_INFLIGHT, InflightLedger, InflightLoad
from schemas.types import BlockHash, RequestId, WorkerId
from tests.oracles.ledger import Accounts

WORKERS = [WorkerId(f"w{i}") for i in range(5)]
#: Roots of the chains: a chain is its root's blocks cut at some depth, so chains of one root
#: share a prefix (as chained hashes of prompts with a common prefix do).
ROOTS = 4
DEPTH = 12


def _chain(root: int, depth: int) -> tuple[BlockHash, ...]:
    return tuple(BlockHash(root * 1_000 + i + 1) for i in range(depth))


def _odd(chain: tuple[BlockHash, ...], which: int) -> tuple:
    """The chain with one hash the native accounts cannot hold (beyond u64, negative, a float)."""
    if not chain:
        return (2**64,)
    odd = (2**64 + 5, -3, float(chain[0]))[which % 3]
    return (*chain[:-1], odd)


_chains = st.tuples(st.integers(0, ROOTS - 1), st.integers(0, DEPTH))

_ops = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 7), st.sampled_from(WORKERS), _chains, st.integers(0, 4096),
              st.integers(0, 40), st.floats(0.0, 50.0), st.sampled_from([1.0, 5.0, 30.0])),
    st.tuples(st.just("prefill_done"), st.integers(0, 7), st.one_of(st.none(), st.sampled_from(WORKERS))),
    st.tuples(st.just("complete"), st.integers(0, 7), st.one_of(st.none(), st.sampled_from(WORKERS))),
    st.tuples(st.just("expire"), st.floats(0.0, 80.0)),
    st.tuples(st.just("drop_worker"), st.sampled_from(WORKERS)),
    st.tuples(st.just("odd_add"), st.integers(0, 7), st.sampled_from(WORKERS), _chains, st.integers(0, 2)),
    st.tuples(st.just("huge_add"), st.integers(0, 7), st.sampled_from(WORKERS), _chains),
)


def _apply(ledger: InflightLedger, op: tuple):
    kind = op[0]
    if kind == "add":
        _, r, w, (root, depth), prefill, extra, now, ttl = op
        chain = _chain(root, depth)
        return ledger.add(RequestId(f"r{r}"), w, chain, prefill, len(chain) + extra, now, ttl)
    # Refused inputs use ids no accepted add uses: a refused re-add has no earlier entry to drop.
    if kind == "odd_add":
        _, r, w, (root, depth), which = op
        chain = _odd(_chain(root, depth), which)
        return ledger.add(RequestId(f"odd{r}"), w, chain, 16, len(chain), 0.0, 60.0)
    if kind == "huge_add":
        _, r, w, (root, depth) = op
        chain = _chain(root, depth)
        return ledger.add(RequestId(f"odd{r}"), w, chain, 2**63 - 1, len(chain) + 2**63, 0.0, 60.0)
    if kind == "prefill_done":
        return ledger.prefill_done(RequestId(f"r{op[1]}"), op[2])
    if kind == "complete":
        return ledger.complete(RequestId(f"r{op[1]}"), op[2])
    if kind == "expire":
        return ledger.expire(op[1])
    return ledger.drop_worker(op[1])


def _queries() -> list[tuple]:
    qs: list[tuple] = [(), _chain(0, DEPTH), _chain(1, 3), (BlockHash(7),)]
    qs += [_chain(r, d) + (BlockHash(999_999),) for r in range(ROOTS) for d in (1, 5, DEPTH)]
    return qs


def _state(ledger: InflightLedger) -> list:
    views = [list(ledger.view(q).items()) for q in _queries()]
    loads = [ledger.load_for(w) for w in WORKERS]
    overlaps = [ledger.speculative_overlap(w, _chain(r, DEPTH)) for w in WORKERS for r in range(ROOTS)]
    return [views, loads, overlaps, len(ledger), [RequestId(f"r{i}") in ledger for i in range(8)]]


def _oracle_ledger() -> InflightLedger:
    return InflightLedger(accounts=Accounts())


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_ops, max_size=40))
def test_native_accounts_fold_like_the_oracle(ops):
    """The two ledgers fold every accepted operation alike; the product refuses what its accounts
    cannot hold exactly (the oracle, in unbounded Python ints, would take it) and is unchanged."""
    native, oracle = InflightLedger(), _oracle_ledger()
    for op in ops:
        if op[0] in ("odd_add", "huge_add"):
            with pytest.raises(InvalidRoutingInput, match="not a u64|beyond i64"):
                _apply(native, op)
        else:
            outcomes = []
            for ledger in (native, oracle):
                try:
                    outcomes.append(("ok", _apply(ledger, op)))
                except Exception as e:  # noqa: BLE001 - both must raise the same
                    outcomes.append((type(e).__name__, str(e)))
            assert outcomes[0] == outcomes[1], op
        assert _state(native) == _state(oracle), op


def test_a_hash_beyond_u64_is_refused_and_changes_nothing():
    """The native accounts decline it and change nothing; the ledger says which hash."""
    ledger = InflightLedger()
    ledger.add(RequestId("a"), WorkerId("w"), _chain(0, 4), 64, 6, 0.0, 60.0)
    with pytest.raises(InvalidRoutingInput, match=f"block hash {2**64} is not a u64"):
        ledger.add(RequestId("b"), WorkerId("w"), (*_chain(0, 2), 2**64), 48, 3, 0.0, 60.0)
    assert "b" not in ledger and len(ledger) == 1
    assert ledger.view(_chain(0, 4)) == {WorkerId("w"): InflightLoad(64, 6, 1, 4)}
    ledger.complete(RequestId("a"))
    assert ledger.load_for(WorkerId("w")) is NO_INFLIGHT and len(ledger) == 0


@pytest.mark.parametrize("oracle", [False, True])
def test_view_reports_workers_in_the_order_their_accounts_opened(oracle):
    ledger = _oracle_ledger() if oracle else InflightLedger()
    for rid, w in (("a", "w2"), ("b", "w0"), ("c", "w1")):
        ledger.add(RequestId(rid), WorkerId(w), _chain(0, 3), 0, 3, 0.0, 60.0)
    ledger.complete(RequestId("b"))
    ledger.add(RequestId("d"), WorkerId("w0"), _chain(1, 2), 0, 2, 0.0, 60.0)
    assert list(ledger.view(_chain(0, 3))) == ["w2", "w1", "w0"]
    assert [x.shared_blocks for x in ledger.view(_chain(0, 3)).values()] == [3, 3, 0]


def test_the_native_view_reads_like_the_oracles_dict():
    """``InflightView`` is a read-only ``Mapping`` with a dict's reads and equality."""
    native, reference = InflightLedger(), _oracle_ledger()
    for ledger in (native, reference):
        ledger.add(RequestId("a"), WorkerId("w1"), _chain(0, 5), 80, 7, 0.0, 60.0)
        ledger.add(RequestId("b"), WorkerId("w0"), _chain(0, 2), 32, 2, 0.0, 60.0)
    view, spec = native.view(_chain(0, 4)), reference.view(_chain(0, 4))
    assert isinstance(view, Mapping) and type(view) is not dict
    assert view == spec and spec == view and not (view != spec)
    assert view != {**spec, WorkerId("w9"): NO_INFLIGHT} and view != [1]
    assert list(view) == list(spec) == ["w1", "w0"]
    assert view.keys() == list(spec.keys()) and view.values() == list(spec.values())
    assert view.items() == list(spec.items()) and len(view) == 2
    assert view["w1"] == InflightLoad(80, 7, 1, 4) and view.get("w0") == InflightLoad(32, 2, 1, 2)
    assert view.get("w9") is None and view.get("w9", NO_INFLIGHT) is NO_INFLIGHT
    assert "w0" in view and "w9" not in view and 3 not in view
    with pytest.raises(KeyError):
        view["w9"]
    assert dict(view) == spec and repr(view).startswith("InflightView(")
    native.complete(RequestId("a"))  # a view is a snapshot: later changes do not reach it
    assert view == spec and list(native.view(_chain(0, 4))) == ["w0"]
