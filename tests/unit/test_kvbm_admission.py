"""Admission to the slower KV tiers (issue 17 item 4): the pure frequency filter, its settings,
and the one filter used by the worker's KVBM (``Residency``/``KvBlockManager``) and the
simulation's ``VirtualTiers``. No mocks: real manager over the real host pool and in-memory
stores, real virtual tiers, real simulation."""

from __future__ import annotations

import logging
import random

import pytest

from data_plane.engines.tiers import VirtualTiers
from data_plane.kvbm import (
    ADMIT_ALL,
    AdmissionConfig,
    AdmissionFilter,
    KvBlockManager,
    KvbmConfigError,
    KvbmSettings,
    fold_residency,
)
from data_plane.kvbm.offload_filter import MAX_MIN_USES
from data_plane.kvbm.stores import HostStore, MemoryStore
from data_plane.workers.metrics import WorkerMetrics
from common.log.sink import MemorySink
from schemas.events import BlockRemoved
from tests.support.kvbm import BPB, DEVICE, DISK, HOST, OBJECT, WORKER, KvbmKit, compact, kvbm_settings



def _filter(**overrides) -> AdmissionFilter:
    return AdmissionFilter(AdmissionConfig(**overrides))


# -- the pure filter ------------------------------------------------------------------------


def test_first_use_is_refused_and_the_second_admitted():
    """min uses 2 needs a count of 2 ** (2 - 1) = 2: first use sets 1, the second doubles it."""
    f = _filter()
    assert f.record_use(7) == 1
    v = f.check(7, DISK)
    assert not v.admitted and (v.count, v.needed) == (1, 2)
    assert v.reason == "disk admission refused: count 1, needs 2"
    assert f.record_use(7) == 2
    assert f.check(7, DISK).admitted
    assert not f.check(8, DISK).admitted  # never seen: count 0


def test_min_uses_three_needs_three_uses_and_counts_saturate():
    """Counts 1, 2, 4 after three uses; min uses 3 needs 4. The count saturates one doubling
    above the highest threshold (8), so a block hot long ago decays within two half-lives."""
    f = _filter(disk_min_uses=3)
    assert [f.record_use(1) for _ in range(3)] == [1, 2, 4]
    assert f.check(1, DISK).admitted
    assert [f.record_use(1) for _ in range(3)] == [8, 8, 8]


def test_min_uses_one_admits_every_block_even_unseen():
    f = _filter(disk_min_uses=1)
    assert f.check(99, DISK).admitted and not f.filters(DISK)
    # The object tier's default is 1: whatever passed the disk's filter goes on down.
    assert _filter().check(99, OBJECT).admitted
    assert not ADMIT_ALL.enabled and AdmissionConfig().enabled


def test_decay_makes_an_old_single_use_block_need_two_uses_again():
    """Half-life 4 uses. Block 1 used at clock 1 (count 1); four other uses later (clock 5) one
    halving has passed: 1 >> 1 = 0, forgotten. Its next use is a first use again (count 1,
    refused); one more (count 2) admits it. A block used twice decays 2 -> 1 in one half-life
    and is refused until used again."""
    f = _filter(half_life_uses=4)
    f.record_use(1)
    for h in (10, 11, 12, 13):
        f.record_use(h)
    assert f.clock == 5 and f.count(1) == 0
    assert f.record_use(1) == 1 and not f.check(1, DISK).admitted
    assert f.record_use(1) == 2 and f.check(1, DISK).admitted
    # Uses closer together than the half-life keep counting up.
    g = _filter(half_life_uses=4)
    g.record_use(2)
    g.record_use(20)
    g.record_use(21)
    assert g.record_use(2) == 2  # 3 uses apart: no halving yet
    for h in (30, 31, 32, 33):
        g.record_use(h)
    assert g.count(2) == 1 and not g.check(2, DISK).admitted


def test_the_table_is_capped_oldest_dropped_first():
    f = _filter(max_entries=3)
    for h in (1, 2, 3):
        f.record_use(h)
    f.record_use(1)  # 1 is now the most recently used (count 2)
    f.record_use(4)  # the table is full: 2, the least recently used, goes
    assert len(f) == 3 and 2 not in f and {1, 3, 4} <= {h for h in (1, 2, 3, 4) if h in f}
    assert f.check(1, DISK).admitted
    assert f.record_use(2) == 1  # forgotten: a first use again


def test_decayed_entries_leave_the_table_without_the_cap():
    """A burst of one-off blocks does not stay in memory: once decayed to nothing they are
    dropped from the front as new uses come in."""
    f = _filter(half_life_uses=10, max_entries=1000)
    for h in range(100):
        f.record_use(h)
    assert len(f) < 25


def test_same_calls_same_decisions():
    """No clock but the calls: two filters fed the same uses and asked the same questions answer
    the same, whatever the host machine or the time it runs at."""
    rng = random.Random(5)
    script = [(rng.random() < 0.6, rng.randrange(40)) for _ in range(3000)]

    def run() -> list[tuple[bool, int]]:
        f = _filter(half_life_uses=64, max_entries=32, disk_min_uses=2, object_min_uses=3)
        out = []
        for use, h in script:
            if use:
                f.record_use(h)
            else:
                out.append((f.check(h, DISK).admitted, f.check(h, OBJECT).count))
        return out

    first = run()
    assert first == run()
    assert {a for a, _ in first} == {True, False}  # both answers occur: not vacuous


# -- settings -------------------------------------------------------------------------------


def _settings(**overrides) -> KvbmSettings:
    return kvbm_settings(**(dict(host_capacity=1, disk_capacity=4, object_capacity=8) | overrides))


def test_defaults_are_dynamos_rule():
    s = _settings()
    assert s.admission == AdmissionConfig(disk_min_uses=2, object_min_uses=1,
                                          half_life_uses=65_536, max_entries=131_072)


@pytest.mark.parametrize("field,value,match", [
    ("disk_min_uses", 0, "disk_min_uses must be an integer in 1..16"),
    ("object_min_uses", MAX_MIN_USES + 1, "object_min_uses must be an integer in 1..16"),
    ("disk_min_uses", 2.0, "disk_min_uses must be an integer"),
    ("half_life_uses", 0, "half_life_uses must be an integer >= 1"),
    ("max_entries", -1, "max_entries must be an integer >= 1"),
])
def test_bad_admission_settings_say_why(field, value, match):
    with pytest.raises(KvbmConfigError, match=match):
        AdmissionConfig(**{field: value})


def test_a_filter_that_would_refuse_everything_is_refused():
    """A victim of host was last used at least a host's worth of uses ago: a table or a
    half-life smaller than that forgets or decays every block before it is asked."""
    with pytest.raises(KvbmConfigError, match=r"max_entries \(100\) is below the 1000 blocks"):
        _settings(host_capacity=1000, admission=AdmissionConfig(max_entries=100))
    with pytest.raises(KvbmConfigError, match=r"half_life_uses \(10\).*set disk_min_uses to 1"):
        _settings(host_capacity=1000, admission=AdmissionConfig(half_life_uses=10))
    # Object filtered: the tiers above it are host and disk (1 + 4 blocks).
    with pytest.raises(KvbmConfigError, match="below the 5 blocks of the tiers above object"):
        _settings(admission=AdmissionConfig(object_min_uses=2, half_life_uses=4))
    # Off, or a first tier (no host: disk takes every device eviction), checks nothing.
    _settings(host_capacity=1000, admission=AdmissionConfig(disk_min_uses=1, max_entries=1))
    _settings(host_capacity=0, admission=AdmissionConfig(max_entries=1, half_life_uses=1))
    with pytest.raises(KvbmConfigError, match="must be an AdmissionConfig"):
        _settings(admission={"disk_min_uses": 2})


def test_tier_sizes_not_growing_down_are_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="data_plane.kvbm.settings"):
        _settings(host_capacity=8, disk_capacity=8, object_capacity=100)
    assert [r.getMessage() for r in caplog.records] == [
        "KV tier sizes: disk holds 8 blocks, not more than the 8 of host above it; each tier "
        "should be larger than the one above, or it churns (writes for almost no hits)"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="data_plane.kvbm.settings"):
        _settings(host_capacity=8, disk_capacity=0, object_capacity=100)
    assert caplog.records == []


# -- the worker's KVBM ----------------------------------------------------------------------


class Kit(KvbmKit):
    """:class:`KvbmKit` with the default admission unless overridden; keyword overrides go to
    the settings."""

    def __init__(self, **overrides) -> None:
        super().__init__(_settings(**overrides))


def test_a_block_evicted_once_from_host_is_not_written_to_disk():
    """Host holds 1. Block 1 offloaded (1 use), then 2 pushes it out of host: disk refuses it,
    so it is dropped from host (BlockRemoved, as a victim with no slower tier) and counted."""
    k = Kit()
    k.kvbm.on_device_evicted(1)
    k.kvbm.on_device_evicted(2)
    assert k.events() == [("moved", "device", "host", [1]),
                          ("removed", "host", [1]), ("moved", "device", "host", [2])]
    assert k.kvbm.tiers_of(1) == () and k.stores[DISK].scan() == {}
    assert k.kvbm.stats()["disk_admission_refused"] == 1


def test_a_reused_block_is_written_to_disk():
    """Reuse either way the KVBM can see it: 1 onboarded back from host (a hit), 3 offloaded from
    the device a second time (the engine had it again). Both go to disk when pushed out."""
    k = Kit()
    k.kvbm.on_device_evicted(1)
    assert k.kvbm.onboard([1], pin=False).found_by_tier() == {HOST: 1}
    k.kvbm.on_device_evicted(2)  # 1 (2 uses) host -> disk
    assert k.kvbm.tiers_of(1) == (DISK,)
    k.kvbm.on_device_evicted(3)  # 2 (1 use) refused
    k.kvbm.on_device_stored([3])
    k.kvbm.on_device_evicted(3)  # already in host: a second use of 3
    k.kvbm.on_device_evicted(4)  # 3 host -> disk
    assert k.kvbm.residency()[DISK] == [1, 3]
    assert k.kvbm.stats()["disk_admission_refused"] == 1
    assert k.kvbm.stats()["demoted_host_disk"] == 2
    # The events still fold to exactly what the stores hold.
    replayed = fold_residency(k.sink.events, WORKER)
    assert set(replayed[DISK]) == set(k.stores[DISK].scan()) == {1, 3}


def test_a_block_onboarded_from_disk_counts_a_use_for_the_object_tier():
    """Object filtered at 3 uses: 1 used twice reaches disk; onboarded from disk (third use) and
    pushed down again, disk's victim goes on to object. 5, used twice, stops at disk's end."""
    k = Kit(disk_capacity=1, object_capacity=4,
            admission=AdmissionConfig(object_min_uses=3, half_life_uses=64, max_entries=64))
    k.kvbm.on_device_evicted(1)
    k.kvbm.on_device_evicted(1)
    k.kvbm.on_device_evicted(2)  # 1: host -> disk
    assert k.kvbm.onboard([1], pin=False).found_by_tier() == {DISK: 1}  # use 3; copy kept in disk
    k.kvbm.on_device_evicted(5)
    k.kvbm.on_device_evicted(5)
    k.kvbm.on_device_evicted(6)  # 5: host -> disk, so disk's victim 1 goes to object
    assert k.kvbm.tiers_of(1) == (OBJECT,) and k.kvbm.tiers_of(5) == (DISK,)
    k.kvbm.on_device_evicted(7)
    k.kvbm.on_device_evicted(7)
    k.kvbm.on_device_evicted(8)  # 7: host -> disk; 5 (2 uses) refused by object
    assert k.kvbm.tiers_of(5) == () and k.kvbm.stats()["object_admission_refused"] == 1


def test_a_device_eviction_past_a_pinned_host_is_filtered_too():
    """Every host slot pinned: the eviction would go straight to disk, which refuses a block used
    once. It is reported gone from the device and written nowhere."""
    k = Kit()
    k.kvbm.on_device_evicted(1)
    k.kvbm.onboard([1], pin=True)  # pins host's only slot
    k.sink.clear()
    assert k.kvbm.on_device_evicted(2) is None
    assert k.events() == [("removed", "device", [2])]
    assert k.kvbm.stats()["disk_admission_refused"] == 1 and k.kvbm.stats()["offload_dropped"] == 1
    k.kvbm.on_device_evicted(3)
    k.kvbm.on_device_evicted(3)  # second use: now admitted past the pinned host
    assert k.kvbm.tiers_of(3) == (DISK,)


def test_without_a_host_tier_disk_takes_every_device_eviction():
    """The first managed tier is the device's victim cache and is never filtered."""
    k = Kit(host_capacity=0)
    assert k.kvbm.on_device_evicted(1) is DISK
    assert "disk_admission_refused" not in k.kvbm.stats()


def test_admit_all_is_the_behaviour_before_the_filter():
    k = Kit(admission=ADMIT_ALL)
    k.kvbm.on_device_evicted(1)
    k.kvbm.on_device_evicted(2)
    assert k.kvbm.tiers_of(1) == (DISK,)


def test_worker_metrics_export_the_refusals_per_tier():
    m = WorkerMetrics("m", "w1")
    m.set_kv_moves({"disk_admission_refused": 5, "object_admission_refused": 1}, {}, {})
    m.set_kv_moves({"disk_admission_refused": 7}, {}, {})  # totals, not increments
    text = m.render().decode()
    assert ('switchyard_worker_kvbm_admission_refused_total{engine="w1",model_name="m",'
            'tier="disk"} 7.0') in text
    assert 'tier="object"} 1.0' in text


# -- the simulation's tiers: the same filter ------------------------------------------------


def _vt(events: list, admission: AdmissionConfig | None = AdmissionConfig(), host=1, disk=4):
    return VirtualTiers({HOST: host, DISK: disk}, worker_id=WORKER, block_size=16,
                        hash_algo="xxh3_64:1", emit=events.append, admission=admission)


def test_virtual_tiers_refuse_a_block_used_once_and_demote_a_reused_one():
    events: list = []
    vt = _vt(events)
    vt.on_device_evicted(1, None)
    vt.on_device_evicted(1, None)  # already in host: second use
    vt.on_device_evicted(2, None)  # 1 host -> disk
    vt.on_device_evicted(3, None)  # 2 (one use) refused
    assert [compact(e) for e in events] == [
        ("stored", "host", [1]),
        ("moved", "host", "disk", [1]), ("stored", "host", [2]),
        ("removed", "host", [2]), ("stored", "host", [3])]
    assert vt.admission_refused == {"disk": 1} and vt.moves[("host", "disk")] == 1
    assert vt.load([1]).sources == (DISK,)  # a load is a use too
    assert vt.admission.count(1) == 4


@pytest.mark.parametrize("seed", range(6))
def test_virtual_tiers_and_the_kvbm_decide_alike(seed):
    """Same calls into both, the KVBM through the worker's own engine port (``KvbmTiers``):
    device evictions, and loads of prefixes of up to 6 blocks of what is held (longer than the
    3-slot host: they go in chunks). Step by step: the same residency per tier, in the same
    eviction order, the same loads (sources and stop reasons) and the same refusals, since both
    run the one ``Residency`` with the one ``AdmissionFilter``, with a disk small enough to fill
    (the incoming block's own copy below is never a victim; a load's other blocks are not
    either)."""
    from data_plane.workers.onboard import KvbmTiers

    rng = random.Random(seed)
    adm = AdmissionConfig(half_life_uses=20, max_entries=40) if seed % 2 else ADMIT_ALL
    k = Kit(host_capacity=3, disk_capacity=6, object_capacity=0, admission=adm,
            device_eviction_events=False)
    port = KvbmTiers(k.kvbm)
    events: list = []
    vt = _vt(events, adm, host=3, disk=6)
    loads = 0
    for _ in range(400):
        if rng.random() < 0.6:
            h = rng.randrange(1, 16)
            k.kvbm.on_device_evicted(h)
            vt.on_device_evicted(h, None)
        else:
            prefix = [rng.randrange(1, 16) for _ in range(rng.randrange(1, 7))]
            held = vt.lookup(prefix)
            assert port.lookup(prefix) == held
            if held:
                assert port.load(prefix[:len(held)]) == vt.load(prefix[:len(held)])
                loads += len(held) > 3
        res = k.kvbm.residency()
        assert (res[HOST], res[DISK]) == (vt.members(HOST), vt.members(DISK))
        assert k.kvbm.stats().get("disk_admission_refused", 0) == vt.admission_refused["disk"]
    assert loads > 0 and k.kvbm.stats()["demoted_host_disk"] > 0
    assert (vt.admission_refused["disk"] > 0) == adm.enabled


def test_virtual_tiers_keep_the_incoming_blocks_own_copy_below():
    """Host [2], disk [1] (full). The device evicts 1 again: 1 goes to host, whose victim 2
    needs room in disk, where the only block is 1 itself, the block being placed: it is not a
    victim, so 2 is dropped (no room below) and 1 stays in disk too."""
    events: list = []
    vt = _vt(events, ADMIT_ALL, host=1, disk=1)
    vt.on_device_evicted(1, None)
    vt.on_device_evicted(2, None)  # 1: host -> disk
    events.clear()
    vt.on_device_evicted(1, None)
    assert [compact(e) for e in events] == [("removed", "host", [2]), ("stored", "host", [1])]
    assert (vt.members(HOST), vt.members(DISK)) == ([1], [1])


def test_virtual_tiers_protect_the_rest_of_a_loaded_prefix():
    """Host [b, c] (b least recent), disk [a] full with room for nothing else. Loading [a, b]
    copies a into host, which must evict one block: not b (the next block of the load), so c,
    which cascades to disk... full of a, which is being loaded: c is dropped. Both blocks load,
    b from host."""
    events: list = []
    vt = _vt(events, ADMIT_ALL, host=2, disk=1)
    for h in (10, 11, 12):  # 10: host -> disk
        vt.on_device_evicted(h, None)
    assert (vt.members(HOST), vt.members(DISK)) == ([11, 12], [10])
    events.clear()
    assert vt.load([10, 11]).sources == (DISK, HOST)
    assert [compact(e) for e in events] == [("removed", "host", [12]), ("stored", "host", [10])]
    assert (vt.members(HOST), vt.members(DISK)) == ([10, 11], [10])


def test_simulation_with_the_filter_writes_less_to_disk():
    """The simulation's tiers take ``tier_admission`` (off by default: the tiers bench's
    published numbers are without it). On, over the driver property test's random clusters:
    fewer host -> disk writes, refusals counted; the same cluster run twice decides the same."""
    from data_plane.engines.cluster import Cluster
    from tests.unit.test_cluster_driver import _run
    from tests.unit.test_engine_tiers import _tiered_case

    totals = {}
    for name, adm in (("off", None), ("on", AdmissionConfig()), ("again", AdmissionConfig())):
        moves = refused = 0
        for seed in range(10):
            prof, workers, reqs, opts, hooks_kw = _tiered_case(seed)
            _, cluster, _ = _run(Cluster, prof, workers, reqs, opts, hooks_kw,
                                 tiers={HOST: 4, DISK: 8}, tier_admission=adm)
            for vt in cluster.virtual_tiers.values():
                moves += vt.moves[("host", "disk")]
                refused += vt.admission_refused["disk"]
        totals[name] = (moves, refused)
    assert totals["on"][0] < totals["off"][0]
    assert totals["on"][1] > 0 and totals["off"][1] == 0
    assert totals["again"] == totals["on"]


# -- an unavailable object store: a clear error, nothing claimed that is not there ----------


def test_s3_errors_that_mean_not_now_are_unavailable():
    from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

    from data_plane.kvbm.stores.s3 import unavailable

    def reply(code: str, status: int) -> ClientError:
        return ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
                           "PutObject")

    assert unavailable(EndpointConnectionError(endpoint_url="http://127.0.0.1:9"))
    assert unavailable(ReadTimeoutError(endpoint_url="http://127.0.0.1:9"))
    assert unavailable(reply("SlowDown", 503)) and unavailable(reply("Whatever", 500))
    assert not unavailable(reply("AccessDenied", 403)) and not unavailable(reply("NoSuchKey", 404))


def test_an_unreachable_object_store_drops_demotions_with_a_clear_error(caplog):
    """A real boto3 client against a port nobody listens on. Disk's victims cannot be written to
    object: each is dropped from disk (BlockRemoved), never claimed in object, and counted as
    write_errors_object_unavailable; the outage is logged once, not once per block."""
    from data_plane.kvbm.settings import S3Settings
    from data_plane.kvbm.stores.s3 import S3Store

    dead = S3Settings(bucket="nowhere", endpoint_url="http://127.0.0.1:9", access_key_id="x",
                      secret_access_key="x", max_attempts=1, connect_timeout_s=0.5)
    s = _settings(host_capacity=1, disk_capacity=1, object_capacity=4, admission=ADMIT_ALL)
    sink = MemorySink()
    kvbm = KvBlockManager(s, sink, {HOST: HostStore(1, BPB), DISK: MemoryStore(DISK, BPB),
                                    OBJECT: S3Store.from_settings(dead, "w1/", BPB)})
    with caplog.at_level(logging.WARNING, logger="data_plane.kvbm.manager"):
        for h in (1, 2, 3, 4):
            kvbm.on_device_evicted(h)
    events = [compact(e) for e in sink.events]
    assert ("removed", "disk", [1]) in events and ("removed", "disk", [2]) in events
    assert not any(e[0] == "moved" and e[2] == "object" for e in events)
    assert fold_residency(sink.events, WORKER)[OBJECT] == [] and kvbm.residency()[OBJECT] == []
    st = kvbm.stats()
    assert st["write_errors_object_unavailable"] == 2 and st["unavailable_object"] == 1
    outages = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(outages) == 1 and "KV tier object unavailable" in outages[0].getMessage()
    m = WorkerMetrics("m", "w1")
    m.set_kv_moves(st, {}, {})
    text = m.render().decode()
    assert 'reason="unavailable",tier="object"} 2.0' in text
    assert 'switchyard_worker_kvbm_tier_outages_total{engine="w1",model_name="m",tier="object"} 1.0' in text


def test_an_unavailable_tier_is_skipped_for_its_backoff_then_probed(caplog):
    """The object store goes down at t=0 (an in-memory store whose every call fails with
    TierUnavailable while down, counted in ``calls``). With one host and one disk slot, each
    device eviction (1, 2, ...) demotes the block evicted two before it disk -> object:

    * t=0, evicting 1 demotes 100: the call fails; the outage starts (logged once, counted),
      backoff 1 s;
    * t=0, 2 demotes 101: not called (skipped), dropped from disk at once;
    * t=1, 3 demotes 1: the backoff is over: one probe, fails; the backoff doubles to 2 s;
    * t=2, 4 demotes 2: skipped;
    * t=3, the store is back; 5 demotes 3: the probe is answered, the breaker closes;
    * t=3, 6 demotes 4: called as usual.

    So 4 calls reach the store for 6 demotions; every demotion that did not land is dropped
    from disk with BlockRemoved, never claimed in object."""
    from data_plane.kvbm.breaker import BreakerConfig

    now = [0.0]
    obj = MemoryStore(OBJECT, BPB)
    s = _settings(host_capacity=1, disk_capacity=1, object_capacity=8, admission=ADMIT_ALL,
                  outage_breaker=BreakerConfig(backoff_s=1.0, max_backoff_s=4.0))
    sink = MemorySink()
    kvbm = KvBlockManager(s, sink, {HOST: HostStore(1, BPB), DISK: MemoryStore(DISK, BPB), OBJECT: obj},
                          clock=lambda: now[0])
    for h in (100, 101):
        kvbm.on_device_evicted(h)  # 100 in disk, 101 in host: the next eviction demotes 100
    obj.down = True
    with caplog.at_level(logging.INFO, logger="data_plane.kvbm.manager"):
        for t, h in ((0.0, 1), (0.0, 2), (1.0, 3), (2.0, 4), (3.0, 5), (3.0, 6)):
            now[0] = t
            if t == 3.0:
                obj.down = False
            kvbm.on_device_evicted(h)
    st = kvbm.stats()
    assert obj.calls == 4
    assert (st["unavailable_object"], st["skipped_object"], st["probes_object"]) == (1, 2, 2)
    assert st["write_errors_object_unavailable"] == 4
    removed = [e.block_hashes for e in sink.events if isinstance(e, BlockRemoved) and e.tier is DISK]
    assert removed == [[100], [101], [1], [2]]
    assert kvbm.residency()[OBJECT] == [3, 4] == fold_residency(sink.events, WORKER)[OBJECT]
    logged = [r.getMessage() for r in caplog.records if r.name == "data_plane.kvbm.manager"]
    assert sum("unavailable" in m for m in logged) == 1 and "not called for 1.0 s" in logged[0]
    assert logged[-1] == "KV tier object answers again"
    m = WorkerMetrics("m", "w1")
    m.set_kv_moves(st, {}, {})
    text = m.render().decode()
    assert 'switchyard_worker_kvbm_tier_skipped_calls_total{engine="w1",model_name="m",tier="object"} 2.0' in text
    assert 'switchyard_worker_kvbm_tier_probes_total{engine="w1",model_name="m",tier="object"} 2.0' in text


def test_breaker_backoff_doubles_to_its_maximum_and_settings_validate():
    from data_plane.kvbm.breaker import BreakerConfig, TierBreaker, Verdict

    b = TierBreaker(BreakerConfig(backoff_s=1.0, max_backoff_s=3.0))
    assert b.verdict(OBJECT, 0.0) is Verdict.CALL
    assert [b.failed(OBJECT, t) for t in (0.0, 1.0, 3.0, 6.0)] == [1.0, 2.0, 3.0, 3.0]
    assert b.verdict(OBJECT, 8.9) is Verdict.SKIP and b.verdict(OBJECT, 9.0) is Verdict.PROBE
    assert b.verdict(DISK, 8.9) is Verdict.CALL  # one breaker per tier
    assert b.answered(OBJECT) and not b.answered(OBJECT)
    assert b.verdict(OBJECT, 9.0) is Verdict.CALL
    with pytest.raises(KvbmConfigError, match="backoff"):
        BreakerConfig(backoff_s=0.0)
    with pytest.raises(KvbmConfigError, match="backoff"):
        BreakerConfig(backoff_s=2.0, max_backoff_s=1.0)


def test_the_worker_passes_its_disk_admission_setting_to_the_kvbm():
    from data_plane.workers.settings import WorkerConfigError, WorkerSettings

    s = WorkerSettings(worker_id="w", host_blocks=4, disk_blocks=8)
    assert s.kvbm_settings(block_size=16, hash_algo="sha256").admission == AdmissionConfig()
    assert WorkerSettings(worker_id="w", disk_admission_min_uses=1).kvbm_settings(
        block_size=16, hash_algo="sha256").admission.disk_min_uses == 1
    with pytest.raises(WorkerConfigError, match="disk_admission_min_uses must be in 1..16"):
        WorkerSettings(worker_id="w", disk_admission_min_uses=0)


def test_the_workers_filter_covers_a_host_tier_larger_than_its_defaults():
    """A host tier of 200,000 blocks is above the default half-life (65,536) and table (131,072):
    the KVBM alone refuses that config, the worker's filter is sized to cover it instead."""
    from data_plane.workers.settings import WorkerSettings

    with pytest.raises(KvbmConfigError, match="below the 200000 blocks of the tiers above disk"):
        KvbmSettings(worker_id="w", bytes_per_block=BPB, block_size=16, hash_algo="xxh3_64:1",
                     host_capacity=200_000, disk_capacity=400_000)
    adm = WorkerSettings(worker_id="w", host_blocks=200_000, disk_blocks=400_000).kvbm_settings(
        block_size=16, hash_algo="sha256").admission
    assert (adm.disk_min_uses, adm.half_life_uses, adm.max_entries) == (2, 200_000, 200_000)
    small = WorkerSettings(worker_id="w", host_blocks=4, disk_blocks=8).kvbm_settings(
        block_size=16, hash_algo="sha256").admission
    assert small == AdmissionConfig()
