"""The KVBM against real storage: G3 files in a temporary directory, G4 in the stack's SeaweedFS
(its S3 gateway on 127.0.0.1, spoken to over HTTP by a real boto3 client with the stack's key),
in a bucket of each test's own.

Covers the cascade through all four tiers and back, the exact event sequence, that every event
follows the durable write it reports, corruption on disk and in the bucket, capacity under a long
random sequence, restart rebuild from the log's claims, and the asyncio wrapper.
"""

from __future__ import annotations

import asyncio
import os
import random
import uuid
from pathlib import Path

import pytest

from data_plane.kvbm import (
    ADMIT_ALL,
    AsyncKvbm,
    KvBlockManager,
    KvbmSettings,
    S3Settings,
    build_kvbm,
    claimed_persistent,
    expected_bytes,
    fold_residency,
    verify,
)
from ops.chaos.diskfill import DiskFaultUnavailable, SmallDisk
from common.stack_settings import SEAWEEDFS_PORTS, StackSettings
from ops.stack.seaweedfs import SeaweedService
from data_plane.kvbm.breaker import BreakerConfig
from data_plane.kvbm.errors import StorageError
from data_plane.kvbm.stores import DiskStore, HostStore
from data_plane.kvbm.stores.s3 import S3Store, make_client
from common.log.sink import MemorySink
from common.net import free_port
from common.settings import default_secrets_dir
from schemas.events import BlockMoved, BlockRemoved, BlockStored
from schemas.types import Tier
from tests.support.waits import wait_for
from tests.unit.test_kvbm_stores import BPB, PersistentStoreContract

DEVICE, HOST, DISK, OBJECT = Tier.DEVICE, Tier.HOST, Tier.DISK, Tier.OBJECT
WORKER = "w-int"


def _drop_bucket(s3: S3Settings) -> None:
    """Delete a test's bucket with what is in it (SeaweedFS deletes a non-empty bucket)."""
    client = make_client(s3)
    try:
        client.delete_bucket(Bucket=s3.bucket)
    except Exception as e:  # noqa: BLE001 - a test that failed early may have made no bucket
        if "NoSuchBucket" not in str(e):
            raise
    finally:
        client.close()


@pytest.fixture
def s3(seaweedfs: SeaweedService):
    """S3 settings of the stack's store with a bucket unique to the test, dropped after it."""
    settings = seaweedfs.s3_settings(f"kvbm-{uuid.uuid4().hex[:12]}", create_bucket=True, max_attempts=2)
    yield settings
    _drop_bucket(settings)


def _settings(tmp_path: Path, s3: S3Settings, **overrides) -> KvbmSettings:
    # The cascade with every block admitted everywhere (the admission filter, on by default,
    # has its own tests in tests/unit/test_kvbm_admission.py).
    fields = dict(worker_id=WORKER, bytes_per_block=BPB, block_size=16, hash_algo="xxh3_64:1",
                  host_capacity=2, disk_capacity=2, object_capacity=2, data_dir=tmp_path,
                  s3=s3, verify_synthetic_content=True, admission=ADMIT_ALL)
    fields.update(overrides)
    return KvbmSettings(**fields)


class Journaled:
    """Decorates a real store: records each *completed* put, so a test can check that an event
    came after the write it reports."""

    def __init__(self, inner, journal: list) -> None:
        self.inner = inner
        self.tier = inner.tier
        self.bytes_per_block = inner.bytes_per_block
        self.journal = journal

    def put(self, block_hash, data):
        self.inner.put(block_hash, data)
        self.journal.append(("put", self.tier, block_hash))

    def __getattr__(self, name):
        return getattr(self.inner, name)


class CheckingSink(MemorySink):
    """Fails the publish of any event naming a block in a tier it was not yet written to."""

    def __init__(self, journal: list) -> None:
        super().__init__()
        self.journal = journal

    def publish(self, payload, *, correlation_id=None, causation_id=None):
        if isinstance(payload, BlockMoved):
            dst = payload.to_tier
        elif isinstance(payload, BlockStored):
            dst = payload.tier
        else:
            dst = None
        if dst is not None and dst is not DEVICE:
            written = {h for _, t, h in self.journal if t is dst}
            missing = set(payload.block_hashes) - written
            assert not missing, f"{payload} reported before the write of {missing}"
        self.journal.append(("event", None, payload))
        super().publish(payload, correlation_id=correlation_id, causation_id=causation_id)


def _kit(tmp_path: Path, s3: S3Settings, **overrides):
    """Manager over real stores wrapped in a shared journal, and the checking sink."""
    s = _settings(tmp_path, s3, **overrides)
    journal: list = []
    stores = {HOST: HostStore(s.host_capacity, BPB)}  # journaled through the events check below
    stores[DISK] = Journaled(DiskStore(s.disk_root, BPB), journal)
    stores[OBJECT] = Journaled(S3Store.from_settings(s3, s.object_prefix, BPB), journal)
    host = stores[HOST]
    orig_put = host.put

    def host_put(h, data):
        orig_put(h, data)
        journal.append(("put", HOST, h))

    host.put = host_put  # the real pool, with its completed puts recorded
    sink = CheckingSink(journal)
    return KvBlockManager(s, sink, stores), sink, stores


def _compact(events):
    out = []
    for e in events:
        if isinstance(e, BlockMoved):
            out.append(("moved", e.from_tier.value, e.to_tier.value, e.block_hashes))
        elif isinstance(e, BlockRemoved):
            out.append(("removed", e.tier.value, e.block_hashes))
        elif isinstance(e, BlockStored):
            out.append(("stored", e.tier.value, e.block_hashes))
    return out


def _take(sink):
    out = _compact(sink.events)
    sink.clear()
    return out


def _files(settings: KvbmSettings) -> set[str]:
    return {p.name for p in settings.disk_root.iterdir()}


def _keys(s3: S3Settings, prefix: str) -> list[str]:
    client = make_client(s3)
    resp = client.list_objects_v2(Bucket=s3.bucket, Prefix=prefix)
    return sorted(o["Key"] for o in resp.get("Contents", []))


# -- store contract against the real backends -----------------------------------------------


class TestDiskStore(PersistentStoreContract):
    @pytest.fixture
    def store(self, tmp_path):
        return DiskStore(tmp_path / "g3", BPB)

    def corrupt(self, store, block_hash):
        path = store.path_of(block_hash)
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(bytes(raw))

    def test_leftover_temporaries_are_removed_on_open(self, tmp_path):
        root = tmp_path / "g3"
        root.mkdir()
        (root / ".0000000000000001.dead.tmp").write_bytes(b"half a block")
        store = DiskStore(root, BPB)
        assert os.listdir(root) == [] and store.scan() == {}


class TestS3Store(PersistentStoreContract):
    @pytest.fixture
    def store(self, s3):
        return S3Store.from_settings(s3, "switchyard/kvbm/w-contract/", BPB)

    def corrupt(self, store, block_hash):
        key = store.key_of(block_hash)
        body = bytearray(store.client.get_object(Bucket=store.bucket, Key=key)["Body"].read())
        body[-1] ^= 0xFF
        store.client.put_object(Bucket=store.bucket, Key=key, Body=bytes(body))

    def test_unreachable_endpoint_is_a_storage_error(self):
        dead = S3Settings(bucket="nowhere", endpoint_url="http://127.0.0.1:9",
                          access_key_id="x", secret_access_key="x", max_attempts=1,
                          connect_timeout_s=0.5)
        store = S3Store.from_settings(dead, "p/", BPB)
        with pytest.raises(StorageError):
            store.put(1, expected_bytes(1, BPB))


# -- scenarios ------------------------------------------------------------------------------


def test_cascade_through_all_four_tiers_and_onboarding_back(tmp_path, s3):
    """Capacities 2/2/2. Evicting 1..7 from the device fills host, disk, object in turn (the
    oldest blocks deepest); 1 falls out of G4. Onboarding 2, 4 brings them back from object and
    disk into host; the files and keys on the backends follow the events exactly."""
    kvbm, sink, _ = _kit(tmp_path, s3)
    s = kvbm.settings
    kvbm.on_device_stored([1, 2, 3, 4, 5, 6, 7])
    for h in range(1, 8):
        kvbm.on_device_evicted(h, h - 1 if h > 1 else None)
    assert _take(sink) == [
        ("moved", "device", "host", [1]),
        ("moved", "device", "host", [2]),
        ("moved", "host", "disk", [1]), ("moved", "device", "host", [3]),
        ("moved", "host", "disk", [2]), ("moved", "device", "host", [4]),
        ("moved", "disk", "object", [1]), ("moved", "host", "disk", [3]),
        ("moved", "device", "host", [5]),
        ("moved", "disk", "object", [2]), ("moved", "host", "disk", [4]),
        ("moved", "device", "host", [6]),
        ("removed", "object", [1]), ("moved", "disk", "object", [3]),
        ("moved", "host", "disk", [5]), ("moved", "device", "host", [7]),
    ]
    assert kvbm.residency() == {DEVICE: [], HOST: [6, 7], DISK: [4, 5], OBJECT: [2, 3]}
    assert _files(s) == {"0000000000000004.kvb", "0000000000000005.kvb"}
    assert _keys(s3, s.object_prefix) == [f"{s.object_prefix}{h:016x}.kvb" for h in (2, 3)]
    assert kvbm.lookup([7, 5, 3, 1]) == [HOST, DISK, OBJECT]

    # Onboarding [2, 3] from object. No tier may evict 2 or 3 meanwhile, so the disk victims
    # that cannot go down into object (full of 2 and 3) are dropped.
    res = kvbm.onboard([2, 3], pin=True)
    assert [(b.block_hash, b.found_in) for b in res.blocks] == [(2, OBJECT), (3, OBJECT)]
    # One call, so its events are merged by kind (each block's own events keep their order).
    assert _take(sink) == [
        ("removed", "disk", [4, 5]), ("moved", "host", "disk", [6, 7]), ("stored", "host", [2, 3]),
    ]
    for b in res.blocks:
        off = b.host_slot * BPB
        assert verify(b.block_hash, kvbm.host_pool.buffer[off:off + BPB])
    kvbm.release(res.pinned)
    assert kvbm.residency() == {DEVICE: [], HOST: [2, 3], DISK: [6, 7], OBJECT: [2, 3]}
    _check_backends_match(kvbm, s3)

    res = kvbm.onboard([6], pin=False)
    assert res.found_by_tier() == {DISK: 1} and verify(6, kvbm.read_host(6))
    assert _take(sink) == [("removed", "host", [2]), ("stored", "host", [6])]
    _check_backends_match(kvbm, s3)


def _check_backends_match(kvbm: KvBlockManager, s3: S3Settings) -> None:
    s = kvbm.settings
    res = kvbm.residency()
    assert _files(s) == {f"{h:016x}.kvb" for h in res[DISK]}
    assert _keys(s3, s.object_prefix) == sorted(f"{s.object_prefix}{h:016x}.kvb"
                                               for h in res[OBJECT])
    for t in (HOST, DISK, OBJECT):
        assert len(res[t]) <= s.capacities[t]


def test_events_replay_to_the_backends_and_capacity_holds_under_random_load(tmp_path, s3):
    rng = random.Random(1234)
    kvbm, sink, _ = _kit(tmp_path, s3, host_capacity=3, disk_capacity=4, object_capacity=3,
                         policy="lfu")
    pins: list = []
    for step in range(150):
        r = rng.random()
        if r < 0.55:
            kvbm.on_device_evicted(rng.randint(1, 20))
        elif r < 0.85:
            pins.extend(kvbm.onboard([rng.randint(1, 20) for _ in range(rng.randint(1, 3))]).pinned)
        else:
            kvbm.release(pins)
            pins.clear()
        if step % 10 == 0 or step == 149:
            _check_backends_match(kvbm, s3)
            replayed = fold_residency(sink.events, WORKER)
            res = kvbm.residency()
            for t in (HOST, DISK, OBJECT):
                assert set(replayed[t]) == set(res[t])
    stats = kvbm.stats()
    assert stats.get("onboarded_disk", 0) + stats.get("onboarded_object", 0) > 0


@pytest.mark.parametrize("tier", [DISK, OBJECT])
def test_corruption_is_detected_removed_and_never_served(tmp_path, s3, tier):
    kvbm, sink, stores = _kit(tmp_path, s3, host_capacity=1, disk_capacity=1, object_capacity=1)
    for h in (1, 2, 3):
        kvbm.on_device_evicted(h)  # host [3], disk [2], object [1]
    sink.clear()
    victim = 2 if tier is DISK else 1
    (TestDiskStore() if tier is DISK else TestS3Store()).corrupt(stores[tier].inner, victim)

    res = kvbm.onboard([victim])
    assert res.blocks == () and res.stop_reason == "corrupt"
    assert _take(sink) == [("removed", tier.value, [victim])]
    assert victim not in stores[tier].scan()
    assert kvbm.lookup([victim]) == [] and kvbm.stats()["corrupt"] == 1


def test_restart_rebuilds_from_the_logs_claims(tmp_path, s3):
    """Run, stop, damage the stores (a deleted file, a corrupt object, an unreported file and a
    half-written temporary), restart over the same directory and bucket, rebuild from the folded
    log: damaged claims are reported removed, the rest is served again."""
    s = _settings(tmp_path, s3, host_capacity=1, disk_capacity=3, object_capacity=3)
    sink1 = MemorySink()
    first = build_kvbm(s, sink1)
    for h in range(1, 8):
        first.on_device_evicted(h)  # host [7], disk [4, 5, 6], object [1, 2, 3]
    first.close()
    log = list(sink1.events)
    claimed = claimed_persistent(log, WORKER)
    assert claimed == {DISK: [4, 5, 6], OBJECT: [1, 2, 3]}

    (s.disk_root / f"{5:016x}.kvb").unlink()
    TestS3Store().corrupt(S3Store.from_settings(s3, s.object_prefix, BPB), 2)
    DiskStore(s.disk_root, BPB).put(40, expected_bytes(40, BPB))  # written, crash before event
    (s.disk_root / ".0000000000000041.ab.tmp").write_bytes(b"torn")

    sink2 = MemorySink()
    second = build_kvbm(s, sink2)
    assert second.scan_persistent() == {DISK: [4, 6, 40], OBJECT: [1, 2, 3]}
    report = second.rebuild(claimed)
    assert report.verified == {DISK: [4, 6], OBJECT: [1, 3]}
    assert report.missing == {DISK: [5]} and report.corrupt == {OBJECT: [2]}
    assert report.orphans_deleted == {DISK: [40]}
    assert _compact(sink2.events) == [("removed", "disk", [5]), ("removed", "object", [2])]
    assert all(isinstance(e.worker_id, str) and e.worker_id == WORKER for e in sink2.events)
    assert second.scan_persistent() == {DISK: [4, 6], OBJECT: [1, 3]}
    # The log, with the rebuild's reports appended, now folds to exactly what is served.
    assert claimed_persistent([*log, *sink2.events], WORKER) == {DISK: [4, 6], OBJECT: [1, 3]}
    for h, tier in ((6, DISK), (3, OBJECT)):
        res = second.onboard([h], pin=False)
        assert res.found_by_tier() == {tier: 1} and verify(h, second.read_host(h))
    second.close()


def test_object_store_outage_drops_demotions_instead_of_reporting_them(tmp_path):
    dead = S3Settings(bucket="nowhere", endpoint_url="http://127.0.0.1:9", access_key_id="x",
                      secret_access_key="x", max_attempts=1, connect_timeout_s=0.5)
    s = _settings(tmp_path, dead, host_capacity=1, disk_capacity=1, object_capacity=1)
    sink = MemorySink()
    kvbm = build_kvbm(s, sink)
    for h in (1, 2, 3):
        kvbm.on_device_evicted(h)
    # 1 should have gone disk -> object; the PUT failed, so it left disk for good instead.
    assert _compact(sink.events)[-3:] == [("removed", "disk", [1]), ("moved", "host", "disk", [2]),
                                          ("moved", "device", "host", [3])]
    assert kvbm.stats()["write_errors"] == 1


def test_async_wrapper_offloads_off_the_event_loop_in_order(tmp_path, s3):
    async def run():
        sink = MemorySink()
        kvbm = build_kvbm(_settings(tmp_path, s3, host_capacity=1, disk_capacity=1,
                                    object_capacity=1), sink)
        a = AsyncKvbm(kvbm)
        for h in (1, 2, 3):
            a.submit_device_evicted(h)  # what a synchronous engine hook does
        res = await a.onboard([1], pin=False)
        await a.aclose()
        return res, _compact(sink.events)

    res, events = asyncio.run(run())
    assert res.found_by_tier() == {OBJECT: 1}
    assert events[:6] == [
        ("moved", "device", "host", [1]),
        ("moved", "host", "disk", [1]), ("moved", "device", "host", [2]),
        ("moved", "disk", "object", [1]), ("moved", "host", "disk", [2]),
        ("moved", "device", "host", [3]),
    ]


def test_a_full_filesystem_under_the_disk_tier_loses_no_claim_and_recovers(tmp_path):
    """The kernel's own ENOSPC (a small tmpfs over the disk tier, filled with a ballast): the
    demotion that cannot be written is dropped and reported, never claimed in disk; once space
    is freed the next demotion lands. Every event still folds to what the stores hold."""
    s = _settings(tmp_path, S3Settings(bucket="unused"), host_capacity=1, disk_capacity=4, object_capacity=0)
    disk = SmallDisk(s.disk_root, 1024 * 1024)
    try:
        disk.mount()
    except DiskFaultUnavailable as e:
        pytest.skip(f"no small filesystem to fill on this machine: {e}")
    try:
        sink = MemorySink()
        kvbm = build_kvbm(s, sink)
        kvbm.on_device_evicted(1)
        kvbm.on_device_evicted(2)  # 1: host -> disk
        assert disk.fill() > 0 and disk.free_bytes() == 0
        kvbm.on_device_evicted(3)  # 2 cannot be written to disk: dropped from host
        assert _compact(sink.events)[-2:] == [("removed", "host", [2]), ("moved", "device", "host", [3])]
        stats = kvbm.stats()
        assert stats["write_errors_disk_full"] == 1 and stats["write_errors"] == 1
        assert kvbm.tiers_of(2) == () and kvbm.tiers_of(1) == (DISK,)
        disk.free()
        kvbm.on_device_evicted(4)  # 3: host -> disk, written this time
        assert _compact(sink.events)[-2:] == [("moved", "host", "disk", [3]), ("moved", "device", "host", [4])]
        assert claimed_persistent(sink.events, WORKER)[DISK] == [1, 3] == kvbm.scan_persistent()[DISK]
        assert verify(3, kvbm.onboard([3], pin=False) and kvbm.read_host(3))
        kvbm.close()
    finally:
        disk.unmount()


def test_an_object_store_outage_keeps_claims_recomputes_and_recovers(tmp_path):
    """A real S3-compatible server (its own, so stopping it touches no other test) goes away
    with blocks in the object tier. Reads of them fail with TierUnavailable: the onboard stops
    with "error" (the engine recomputes), the claim stays (the bytes are still in the bucket),
    nothing is reported removed from object; demotions into object are dropped from disk
    instead, without calling the store while its breaker is open. Once the server is back on the
    same address, the first probe after the backoff finds it and the same block is served,
    verified."""
    # A SeaweedFS of its own: its own data dir and ports, the stack's secrets.
    server = SeaweedService(StackSettings(state_dir=tmp_path / "stack", secrets_dir=default_secrets_dir(),
                                          seaweedfs_port=free_port(span=SEAWEEDFS_PORTS)))
    server.start()
    s3 = server.s3_settings(f"kvbm-{uuid.uuid4().hex[:12]}", create_bucket=True, max_attempts=1,
                            connect_timeout_s=0.5)
    sink = MemorySink()
    kvbm = build_kvbm(_settings(tmp_path, s3, host_capacity=1, disk_capacity=1, object_capacity=4,
                                outage_breaker=BreakerConfig(backoff_s=0.1, max_backoff_s=0.2)), sink)
    try:
        for h in (1, 2, 3):
            kvbm.on_device_evicted(h)
        assert kvbm.tiers_of(1) == (OBJECT,)
        server.stop()
        mark = len(sink.events)
        res = kvbm.onboard([1], pin=False)
        assert res.stop_reason == "error" and res.blocks == ()
        assert kvbm.tiers_of(1) == (OBJECT,) and sink.events[mark:] == []
        kvbm.on_device_evicted(4)  # 2: disk -> object cannot be written: dropped from disk
        assert _compact(sink.events[mark:]) == [
            ("removed", "disk", [2]), ("moved", "host", "disk", [3]), ("moved", "device", "host", [4])]
        st = kvbm.stats()
        assert st["read_errors_object_unavailable"] == 1 and st["write_errors_object_unavailable"] == 1
        assert st["unavailable_object"] == 1
        server.start()  # the same ports and data directory
        # Skipped (stop "error", claim kept) until a probe after the backoff gets an answer.
        res = wait_for(lambda: (r := kvbm.onboard([1], pin=False)).blocks and r,
                       what="an onboard from object once the store answers again")
        assert res.found_by_tier() == {OBJECT: 1} and verify(1, kvbm.read_host(1))
        assert kvbm.stats()["probes_object"] >= 1
        # Making room for 1 in host pushed 4 to disk and 3 on to object, written this time; the
        # log folds to what the stores hold.
        assert claimed_persistent(sink.events, WORKER)[OBJECT] == [1, 3] == kvbm.scan_persistent()[OBJECT]
    finally:
        kvbm.close()
        server.stop()
