"""The KVBM manager over in-memory persistent stores and the real host pool: cascade, event
sequences, onboarding, corruption, failures, restart rebuild, and a property test that the
events always replay to the manager's residency and capacity is never exceeded."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data_plane.kvbm import (
    ADMIT_ALL,
    AdmissionConfig,
    AsyncKvbm,
    KvBlockManager,
    KvbmError,
    KvbmSettings,
    claimed_persistent,
    expected_bytes,
    fold_residency,
)
from schemas.events import BlockStored
from schemas.types import PERSISTENT_TIERS
from tests.support.kvbm import BPB, DEVICE, DISK, HOST, OBJECT, WORKER, KvbmKit, kvbm_settings


def _settings(**overrides) -> KvbmSettings:
    # The cascade with every block admitted everywhere; the admission filter (on by default) has
    # its own tests in test_kvbm_admission.py.
    return kvbm_settings(**(dict(host_capacity=1, disk_capacity=1, object_capacity=1,
                                 admission=ADMIT_ALL) | overrides))


class Kit(KvbmKit):
    """:class:`KvbmKit` with every block admitted everywhere; keyword overrides go to the
    settings."""

    def __init__(self, **overrides) -> None:
        super().__init__(_settings(**overrides))


# -- offload cascade ------------------------------------------------------------------------


def test_offload_writes_the_block_then_reports_the_move():
    k = Kit(host_capacity=2)
    assert k.evict(7) == [HOST]
    assert k.events() == [("moved", "device", "host", [7])]
    assert bytes(k.kvbm.read_host(7)) == expected_bytes(7, BPB)


def test_cascade_through_every_tier_one_block_per_tier():
    """Capacities 1/1/1. Each eviction pushes the previous blocks one tier down, deepest first,
    and the fourth one pushes block 1 out of G4 for good."""
    k = Kit()
    k.evict(1)
    assert k.events() == [("moved", "device", "host", [1])]
    k.evict(2)
    assert k.events() == [("moved", "host", "disk", [1]), ("moved", "device", "host", [2])]
    k.evict(3)
    assert k.events() == [("moved", "disk", "object", [1]), ("moved", "host", "disk", [2]),
                          ("moved", "device", "host", [3])]
    k.evict(4)
    assert k.events() == [("removed", "object", [1]), ("moved", "disk", "object", [2]),
                          ("moved", "host", "disk", [3]), ("moved", "device", "host", [4])]
    assert k.kvbm.residency() == {HOST: [4], DISK: [3], OBJECT: [2], DEVICE: []}
    assert k.stores[DISK].scan().keys() == {3} and k.stores[OBJECT].scan().keys() == {2}


def test_evicting_a_block_already_in_host_only_reports_it_leaving_the_device():
    k = Kit(host_capacity=2)
    k.evict(1)
    k.kvbm.onboard([1], pin=False)
    k.kvbm.on_device_stored([1])
    k.events()
    assert k.evict(1) == [HOST]
    assert k.events() == [("removed", "device", [1])]


def test_engine_reporting_its_own_removals_gets_stores_instead_of_moves():
    k = Kit(device_eviction_events=False)
    k.kvbm.on_device_stored([1, 2], parent_hash=None)
    k.evict(1, 2)
    assert k.events() == [("stored", "host", [1]), ("moved", "host", "disk", [1]),
                          ("stored", "host", [2])]
    assert k.sink.events == []


def test_one_steps_offloads_are_one_store_per_chain_whatever_the_eviction_order():
    """An engine step evicts a request's blocks tail first, mixed with another chain: the
    offloads come out as one BlockStored per chain, each in chain order with its parent."""
    k = Kit(device_eviction_events=False, host_capacity=16, disk_capacity=0, object_capacity=0)
    k.kvbm.on_device_stored([1, 2, 3], parent_hash=None)
    k.kvbm.on_device_stored([11, 12], parent_hash=10)
    k.events()
    k.kvbm.on_device_evicted_many([(3, 2), (12, 11), (2, 1), (11, 10), (1, None)])
    events = [e for e in k.sink.events if isinstance(e, BlockStored)]
    assert [(e.tier, e.block_hashes, e.parent_hash) for e in events] == [(HOST, [11, 12], 10), (HOST, [1, 2, 3], None)]
    assert sorted(k.kvbm.residency()[HOST]) == [1, 2, 3, 11, 12]


def test_chains_cut_branches_after_their_parent():
    from data_plane.kvbm.event_batch import chains

    # 1 -> 2 -> 3, 2 -> 4 (a branch), 7 (parent 6 outside), given in any order.
    parents = {3: 2, 4: 2, 2: 1, 1: None, 7: 6}
    out = chains([3, 4, 7, 2, 1], parents)
    assert sorted(h for _, c in out for h in c) == [1, 2, 3, 4, 7]
    where = {h: i for i, (_, c) in enumerate(out) for h in c}
    for parent, chain in out:
        for a, b in zip(chain, chain[1:]):
            assert parents[b] == a
        if parent in where:
            assert where[parent] < where[chain[0]]
    assert (6, [7]) in out and len(out) == 3


def test_stored_events_carry_the_chain_and_the_schema_fields():
    k = Kit(host_capacity=3, disk_capacity=6, object_capacity=0)
    k.kvbm.on_device_stored([10, 11, 12], parent_hash=9)
    k.evict(10, 11, 12, 13, 14, 15)  # host [13, 14, 15], disk [10, 11, 12]
    k.kvbm.clear(HOST)
    k.sink.clear()
    k.kvbm.onboard([10, 11, 12], pin=False)
    [ev] = k.sink.events
    assert isinstance(ev, BlockStored)
    assert (ev.tier, ev.block_hashes, ev.parent_hash) == (HOST, [10, 11, 12], 9)
    assert (ev.worker_id, ev.block_size, ev.hash_algo) == (WORKER, 16, "xxh3_64:1")


def test_with_no_tier_at_all_an_eviction_is_a_removal():
    k = Kit(host_capacity=0, disk_capacity=0, object_capacity=0)
    assert k.evict(1) == [None]
    assert k.events() == [("removed", "device", [1])]


# -- onboarding -----------------------------------------------------------------------------


def _filled(**overrides) -> Kit:
    """Blocks 1..4 evicted in order into capacities 1/1/1: host [4], disk [3], object [2]."""
    k = Kit(**overrides)
    k.evict(1, 2, 3, 4)
    k.events()
    return k


def test_lookup_reports_the_fastest_tier_of_the_held_prefix():
    k = _filled()
    k.kvbm.on_device_stored([5])
    assert k.kvbm.lookup([5, 4, 3, 2, 1, 6]) == [DEVICE, HOST, DISK, OBJECT]
    assert k.events() == []


def test_onboard_from_object_copies_up_and_says_where_it_was():
    """Onboarding 2 (only in object) into the full host: 4 is demoted host->disk, which first
    pushes 3 disk->object; object must make room too, but its only other member is 2 (being
    onboarded) so 3's move drops... no: object holds just 2 at capacity 1, so 3 cannot go
    there and is dropped from disk. Then 2 is copied into host and stays in object."""
    k = _filled()
    res = k.kvbm.onboard([2], pin=False)
    assert [(b.block_hash, b.found_in) for b in res.blocks] == [(2, OBJECT)]
    assert res.stop_reason == "complete" and res.found_by_tier() == {OBJECT: 1}
    assert k.events() == [("removed", "disk", [3]), ("moved", "host", "disk", [4]),
                          ("stored", "host", [2])]
    assert k.kvbm.tiers_of(2) == (HOST, OBJECT)
    assert bytes(k.kvbm.read_host(2)) == expected_bytes(2, BPB)


def test_onboard_move_mode_frees_the_lower_copy():
    """Capacities 1/2/1 after evicting 1..4: host [4], disk [2, 3], object [1]. Moving 3 up
    needs a host slot: 4 goes to disk, whose victim (not 3, being onboarded) is 2, which goes
    to object, whose victim 1 is gone. Then 3 moves disk->host."""
    k = _filled(onboard_keeps_source=False, disk_capacity=2)
    res = k.kvbm.onboard([3], pin=False)
    assert res.found_by_tier() == {DISK: 1}
    assert k.events() == [("removed", "object", [1]), ("moved", "disk", "object", [2]),
                          ("moved", "host", "disk", [4]), ("moved", "disk", "host", [3])]
    assert k.kvbm.tiers_of(3) == (HOST,)
    assert 3 not in k.stores[DISK].scan()


def test_evicting_an_onboarded_copy_costs_no_write():
    """host [2, 3], disk [1]. Onboarding 1 copies it up (disk keeps it); when 1 becomes the host
    victim later it is simply dropped from host: no write."""
    k = Kit(host_capacity=2, disk_capacity=3, object_capacity=0)
    k.evict(1, 2, 3)
    k.kvbm.onboard([1], pin=False)
    k.evict(5)
    assert k.events()[-2:] == [("moved", "host", "disk", [3]), ("moved", "device", "host", [5])]
    puts_before = len(k.stores[DISK].journal)
    k.evict(6)
    assert k.events() == [("removed", "host", [1]), ("moved", "device", "host", [6])]
    assert len(k.stores[DISK].journal) == puts_before


def test_onboard_stops_at_the_first_miss_and_pins_what_it_returns():
    """host [3, 4], disk [1, 2] (capacity 2, no object). Onboarding [1, 9, 2] brings 1 up and
    stops at 9. Host victim 3 cannot go to disk without evicting 1 or 2, which belong to the
    prefix being onboarded, so 3 is dropped instead."""
    k = Kit(host_capacity=2, disk_capacity=2, object_capacity=0)
    k.evict(1, 2, 3, 4)
    k.events()
    res = k.kvbm.onboard([1, 9, 2])
    assert res.hashes == [1] and res.stop_reason == "miss" and res.pinned == (1,)
    assert k.events() == [("removed", "host", [3]), ("stored", "host", [1])]
    # Disk is [2, 1] (1 was touched by the onboard). Host LRU order is [4, 1] then [1, 5]:
    # the second eviction skips pinned 1 and takes 5.
    k.evict(5, 6)
    assert k.events() == [("removed", "disk", [2]), ("moved", "host", "disk", [4]),
                          ("moved", "device", "host", [5]),
                          ("removed", "disk", [1]), ("moved", "host", "disk", [5]),
                          ("moved", "device", "host", [6])]
    assert k.kvbm.residency()[HOST] == [1, 6]
    k.kvbm.release(res.pinned)
    k.evict(7)  # unpinned, 1 is the victim again
    assert k.events() == [("removed", "disk", [4]), ("moved", "host", "disk", [1]),
                          ("moved", "device", "host", [7])]


def test_all_pinned_host_sends_offloads_straight_to_disk():
    k = Kit(host_capacity=1, disk_capacity=2)
    k.evict(1)
    with k.kvbm.onboarded([1]) as res:
        assert res.pinned == (1,)
        k.events()
        assert k.evict(2) == [DISK]
        assert k.events() == [("moved", "device", "disk", [2])]
    assert k.evict(3) == [HOST]  # released: 1 can be demoted again
    assert k.events() == [("moved", "host", "disk", [1]), ("moved", "device", "host", [3])]


def test_onboard_on_device_blocks_copies_nothing():
    k = Kit()
    k.kvbm.on_device_stored([1, 2])
    res = k.kvbm.onboard([1, 2])
    assert [(b.found_in, b.host_slot) for b in res.blocks] == [(DEVICE, None)] * 2
    assert res.pinned == () and k.events() == []


def test_host_slot_addresses_the_bytes_in_the_one_registered_region():
    k = Kit(host_capacity=4)
    k.evict(5, 6)
    res = k.kvbm.onboard([6])
    pool = k.kvbm.host_pool
    off = res.blocks[0].host_slot * BPB
    assert off == pool.offset_of(6) and pool.region_size == 4 * BPB
    assert bytes(pool.buffer[off:off + BPB]) == expected_bytes(6, BPB)
    assert pool.base_address == pool.buffer.ctypes.data


# -- corruption and failures ----------------------------------------------------------------


def test_a_corrupt_copy_is_removed_with_an_event_and_not_served():
    k = _filled()
    k.stores[DISK].corrupt(3)
    res = k.kvbm.onboard([3])
    assert res.blocks == () and res.stop_reason == "corrupt"
    assert k.events() == [("removed", "disk", [3])]
    assert 3 not in k.stores[DISK].scan() and k.kvbm.lookup([3]) == []
    assert k.kvbm.stats()["corrupt"] == 1


def test_a_corrupt_copy_falls_back_to_the_next_lower_copy():
    k = Kit(host_capacity=1, disk_capacity=1, object_capacity=1)
    for t in (DISK, OBJECT):
        k.stores[t].put(5, expected_bytes(5, BPB))
    k.kvbm.rebuild({DISK: [5], OBJECT: [5]})  # e.g. a crash between a PUT and the delete
    k.stores[DISK].corrupt(5)
    res = k.kvbm.onboard([5], pin=False)
    assert res.found_by_tier() == {DISK: 1}  # the hit was in disk, served from below it
    assert k.events() == [("removed", "disk", [5]), ("stored", "host", [5])]
    assert k.kvbm.tiers_of(5) == (HOST, OBJECT)


def test_demotion_write_failure_drops_the_victim_and_still_admits():
    k = _filled(object_capacity=0, disk_capacity=1)
    k.stores[DISK].fail_next("put")
    assert k.evict(5) == [HOST]
    # host victim 4 could not be written to disk: it is dropped, the new block still lands.
    assert k.events() == [("removed", "disk", [3]), ("removed", "host", [4]),
                          ("moved", "device", "host", [5])]
    assert k.kvbm.stats()["write_errors"] == 1


def test_unreadable_victim_is_dropped_and_reported():
    k = _filled()
    k.stores[DISK].corrupt(3)
    k.evict(5)
    assert k.events() == [("removed", "object", [2]), ("removed", "disk", [3]),
                          ("moved", "host", "disk", [4]), ("moved", "device", "host", [5])]


def test_read_error_on_onboard_keeps_the_block_and_says_error():
    k = _filled()
    k.stores[OBJECT].fail_next("get")
    res = k.kvbm.onboard([2])
    assert res.stop_reason == "error" and k.events() == []
    assert OBJECT in k.kvbm.tiers_of(2)


def test_content_check_catches_wrong_bytes_with_a_valid_frame():
    k = _filled()
    k.stores[DISK].put(3, expected_bytes(99, BPB))  # well-framed, wrong block content
    assert k.kvbm.onboard([3]).stop_reason == "corrupt"
    assert k.events() == [("removed", "disk", [3])]


def test_data_of_the_wrong_size_is_refused():
    k = Kit()
    with pytest.raises(ValueError, match="expected 64"):
        k.kvbm.on_device_evicted(1, None, b"short")


# -- restart --------------------------------------------------------------------------------


def _restart(k: Kit, **overrides) -> Kit:
    """A new manager over the same persistent stores (host memory is gone)."""
    k2 = Kit(**{**dict(host_capacity=k.settings.host_capacity,
                        disk_capacity=k.settings.disk_capacity,
                        object_capacity=k.settings.object_capacity), **overrides})
    for t in PERSISTENT_TIERS:
        if t in k.stores and t in k2.stores:
            k2.stores[t] = k.stores[t]
    k2.kvbm = KvBlockManager(k2.settings, k2.sink, k2.stores)
    return k2


def test_rebuild_keeps_verified_claims_and_reports_the_rest_removed():
    k = Kit(host_capacity=1, disk_capacity=3, object_capacity=2)
    k.evict(1, 2, 3, 4, 5, 6)  # host [6], disk [3, 4, 5], object [1, 2]
    log = list(k.sink.events)
    k.stores[DISK].corrupt(4)
    k.stores[OBJECT].delete(1)
    k.stores[DISK].put(77, expected_bytes(77, BPB))  # written, never reported (crash)
    claimed = claimed_persistent(log, WORKER)
    assert claimed == {DISK: [3, 4, 5], OBJECT: [1, 2]}

    k2 = _restart(k)
    rep = k2.kvbm.rebuild(claimed)
    assert rep.verified == {DISK: [3, 5], OBJECT: [2]}
    assert rep.corrupt == {DISK: [4]} and rep.missing == {OBJECT: [1]}
    assert rep.orphans_deleted == {DISK: [77]}
    assert k2.events() == [("removed", "disk", [4]), ("removed", "object", [1])]
    assert k2.stores[DISK].scan().keys() == {3, 5}
    assert k2.kvbm.residency()[DISK] == [3, 5]  # claimed order is recency order
    assert k2.kvbm.onboard([5], pin=False).found_by_tier() == {DISK: 1}


def test_rebuild_trims_to_a_smaller_capacity_and_can_adopt_orphans():
    k = Kit(host_capacity=1, disk_capacity=3, object_capacity=0)
    k.evict(1, 2, 3, 4)  # disk [1, 2, 3]
    claimed = claimed_persistent(k.sink.events, WORKER)
    k.stores[DISK].put(50, expected_bytes(50, BPB))
    k2 = _restart(k, disk_capacity=2)
    rep = k2.kvbm.rebuild(claimed, adopt_orphans=True)
    assert rep.over_capacity == {DISK: [1]} and rep.verified == {DISK: [2, 3]}
    assert rep.orphans_deleted == {DISK: [50]}  # no room left to adopt it
    assert k2.events() == [("removed", "disk", [1])]

    k3 = _restart(k2, disk_capacity=4, object_capacity=1)
    k3.stores[DISK].put(50, expected_bytes(50, BPB))
    rep = k3.kvbm.rebuild({DISK: [2, 3], OBJECT: [8]}, adopt_orphans=True)
    assert rep.orphans_adopted == {DISK: [50]} and rep.missing == {OBJECT: [8]}
    assert k3.events() == [("stored", "disk", [50]), ("removed", "object", [8])]


def test_rebuild_reports_claims_in_tiers_no_longer_configured():
    k = Kit(object_capacity=0)
    rep = k.kvbm.rebuild({OBJECT: [1, 2], HOST: [3]})
    assert rep.missing == {OBJECT: [1, 2]}
    assert k.events() == [("removed", "object", [1, 2])]


def test_rebuild_refuses_a_manager_already_in_use():
    k = _filled()
    with pytest.raises(KvbmError, match="non-empty"):
        k.kvbm.rebuild({DISK: [3]})


def test_storage_error_during_rebuild_changes_nothing():
    k = _filled()
    k2 = _restart(k)
    k2.stores[OBJECT].fail_next("get")
    with pytest.raises(KvbmError):
        k2.kvbm.rebuild({DISK: [3], OBJECT: [2]})
    assert k2.events() == [] and k2.kvbm.counts() == {HOST: 0, DISK: 0, OBJECT: 0}
    assert k2.kvbm.rebuild({DISK: [3], OBJECT: [2]}).verified == {DISK: [3], OBJECT: [2]}


# -- threads and asyncio --------------------------------------------------------------------


def test_concurrent_callers_are_serialised_and_events_stay_consistent():
    import threading

    k = Kit(host_capacity=3, disk_capacity=3, object_capacity=3)
    errors: list = []

    def worker(seed: int) -> None:
        try:
            for i in range(200):
                h = (seed * 7 + i * 13) % 17 + 1
                if i % 3:
                    k.kvbm.on_device_evicted(h)
                else:
                    with k.kvbm.onboarded([h, h + 1]):
                        pass
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    replayed = fold_residency(k.sink.events, WORKER)
    for t in (HOST, DISK, OBJECT):
        assert set(replayed[t]) == set(k.kvbm.residency()[t]) == set(k.stores[t].scan())


def test_async_wrapper_keeps_submission_order():
    async def run():
        k = Kit(host_capacity=1, disk_capacity=1, object_capacity=0)
        a = AsyncKvbm(k.kvbm)
        futs = [a.submit_device_evicted(h) for h in (1, 2, 3)]
        await a.drain()
        assert all(f.done() for f in futs)
        res = await a.onboard([1, 2])
        assert res.stop_reason == "miss"  # 1 fell out of disk, 2 is in disk
        assert await a.lookup([2, 3]) == [DISK, HOST]
        await a.aclose()
        return k.events()

    assert asyncio.run(run()) == [
        ("moved", "device", "host", [1]),
        ("moved", "host", "disk", [1]), ("moved", "device", "host", [2]),
        ("removed", "disk", [1]), ("moved", "host", "disk", [2]), ("moved", "device", "host", [3]),
    ]


# -- property: events replay to the residency; capacity holds -------------------------------

_H = st.integers(1, 8)
# Evictions and onboards dominate, so the lower tiers fill up and get read back.
_KINDS = ["evict"] * 6 + ["onboard"] * 4 + ["stored", "release", "corrupt", "fail_put", "clear"]
_OPS = st.lists(st.tuples(st.sampled_from(_KINDS), _H, st.lists(_H, min_size=1, max_size=3),
                          st.sampled_from([HOST, DISK, OBJECT])), min_size=5, max_size=60)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_OPS, caps=st.tuples(st.integers(0, 4), st.integers(0, 3), st.integers(0, 3)),
       policy=st.sampled_from(["lru", "lfu"]), keep=st.booleans(),
       admission=st.sampled_from([ADMIT_ALL, AdmissionConfig(
           disk_min_uses=2, object_min_uses=2, half_life_uses=8, max_entries=8)]))
def test_events_always_replay_to_the_residency_and_capacity_holds(ops, caps, policy, keep,
                                                                   admission):
    k = Kit(host_capacity=caps[0], disk_capacity=caps[1], object_capacity=caps[2],
            policy=policy, onboard_keeps_source=keep, admission=admission)
    pins: list = []
    for op in ops:
        kind, h, prefix, tier = op
        if kind == "evict":
            k.kvbm.on_device_evicted(h)
        elif kind == "stored":
            k.kvbm.on_device_stored([h])
        elif kind == "onboard":
            pins.extend(k.kvbm.onboard(prefix).pinned)
        elif kind == "release":
            k.kvbm.release(pins)
            pins.clear()
        elif kind == "corrupt" and tier in PERSISTENT_TIERS and tier in k.stores:
            if h in k.stores[tier].scan():
                k.stores[tier].corrupt(h)
        elif kind == "fail_put" and tier in PERSISTENT_TIERS and tier in k.stores:
            k.stores[tier].fail_next("put")
        elif kind == "clear" and tier in k.stores:
            k.kvbm.clear(tier)

        residency = k.kvbm.residency()
        replayed = fold_residency(k.sink.events, WORKER)
        for t, store in k.stores.items():
            assert len(residency[t]) <= k.settings.capacities[t]
            assert set(residency[t]) == set(replayed[t]), (t, op)
            assert store.scan().keys() == set(residency[t]), (t, op)
        for t in (HOST, DISK, OBJECT):
            if t not in k.stores:
                assert replayed[t] == []
        # Every block reported into a persistent tier was written there before the report.
        for ev in k.sink.events:
            dst = getattr(ev, "to_tier", None) or (ev.tier if isinstance(ev, BlockStored) else None)
            if dst in (DISK, OBJECT):
                puts = {h for op_, h in k.stores[dst].journal if op_ == "put"}
                assert set(ev.block_hashes) <= puts
    for b in k.kvbm.residency()[HOST]:
        assert bytes(k.kvbm.read_host(b)) == expected_bytes(b, BPB)
