"""kill -9 a worker under load, restart it with the same id and data dir: the router view folded
from the whole log (the oracle fold) equals what the worker really holds.

The worker runs a tiny device cache (24 blocks) over host (8) and disk (48) tiers, so a few
dozen distinct prompts push blocks device -> host -> disk (every block: the disk admission
filter is set to admit blocks used once, ``--disk-admission-min-uses 1``). While requests are in flight it is
SIGKILLed; before the restart one disk block the log claims is corrupted and another deleted.
The new incarnation must take a higher epoch, report those two ``BlockRemoved(disk)``, report
its memory tiers empty, and register; then the oracle view (in either topic order) shows
exactly its verified disk blocks, no device/host blocks, the worker not stale, and no sequence
gap in anything the broker acknowledged. More traffic afterwards keeps the two in step.
"""

from __future__ import annotations

import random
import threading

import httpx
import pytest

from control_plane.index.errors import IndexRejected
from control_plane.router.view import RouterView
from data_plane.kvbm import claimed_persistent
from common.log.sequencing import SequenceTracker
from common.settings import BusSettings
from schemas.types import Tier
from tests.integration.workerproc import Record, WorkerProc, of, read_log
from tests.support.waits import wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(120)]

WID = "w-restart"
BS = 16
ARGS = ("--speedup", "20", "--block-size", str(BS), "--device-blocks", "24", "--host-blocks", "8",
        "--disk-blocks", "48", "--disk-admission-min-uses", "1", "--bytes-per-block", "4096",
        "--load-interval", "0.3")


def oracle(records: list[Record], order: tuple[str, ...]) -> RouterView:
    """The oracle fold of ``tests/integration/test_router_view.py``: every record of each stream
    in ``order``, partition by partition in offset order."""
    view = RouterView("sha256", BS)
    for stream in order:
        for r in sorted((r for r in records if r.topic.endswith(f".{stream}")),
                        key=lambda r: (r.partition, r.offset)):
            try:
                view.apply(r.env, r.topic, r.partition, r.offset)
            except IndexRejected:
                view.positions[(r.topic, r.partition)] = r.offset + 1
    return view


def residency(view: RouterView) -> dict[str, set[int]]:
    res = view.index.as_dict()["residency"]
    return {t.value: set(res.get((WID, 0, t.value), ())) for t in Tier}


def held(w: WorkerProc) -> dict[str, set[int]]:
    """What the worker process really holds, per tier."""
    st = w.state()
    return {"device": set(st["device_cached"]), **{t: set(v) for t, v in st["tiers"].items()}}


def disk_files(w: WorkerProc) -> set[int]:
    return {int(p.name[:16], 16) for p in (w.data_dir / "kvbm" / "g3").glob("*.kvb")}


def _load(url: str, headers: dict, stop: threading.Event, seed: int, ok: list[int]) -> None:
    rng = random.Random(seed)
    with httpx.Client(timeout=10, headers=headers) as c:
        while not stop.is_set():
            base = rng.randrange(40) * 1000  # 40 distinct prompts: misses, and some hits
            try:
                r = c.post(f"{url}/v1/completions", json={"prompt": list(range(base, base + 3 * BS)), "max_tokens": 4})
            except httpx.HTTPError:
                return  # the worker was killed
            if r.status_code == 200:
                ok.append(1)


def _quiet(w: WorkerProc, view_of) -> None:  # noqa: ANN001
    """Wait until the log's view of the worker equals what it holds (events are async)."""
    def same():
        return residency(view_of()) == held(w)
    wait_for(same, 15, "the log's view to match the worker", interval=0.3)


def test_kill9_under_load_then_restart_matches_the_log(bus: BusSettings, tmp_path):
    w = WorkerProc(bus, WID, tmp_path / "data", tmp_path, args=ARGS).start()
    try:
        old_epoch = w.state()["epoch"]
        stop, ok = threading.Event(), []
        threads = [threading.Thread(target=_load, args=(w.url, w.credential(), stop, i, ok)) for i in range(3)]
        for t in threads:
            t.start()
        wait_for(lambda: len(w.state()["tiers"]["disk"]) >= 12, 30, "blocks cascading to disk")
        w.kill()  # SIGKILL with requests in flight
        stop.set()
        for t in threads:
            t.join(15)
        assert len(ok) > 10

        # Damage two blocks the log says are on disk.
        before = read_log(bus, "kv")
        claimed = claimed_persistent([r.env.data for r in of(before, WID)], WID)[Tier.DISK]
        on_disk = [h for h in claimed if h in disk_files(w)]
        assert len(on_disk) >= 2
        corrupt, missing = on_disk[0], on_disk[1]
        path = w.data_dir / "kvbm" / "g3" / f"{corrupt:016x}.kvb"
        raw = bytearray(path.read_bytes())
        raw[-10] ^= 0xFF
        path.write_bytes(bytes(raw))
        (w.data_dir / "kvbm" / "g3" / f"{missing:016x}.kvb").unlink()

        w.start()
        new_epoch = w.state()["epoch"]
        assert new_epoch > old_epoch

        records = read_log(bus, "workers", "kv")
        mine = of(records, WID)
        new_kv = [r for r in mine if r.env.epoch == new_epoch and r.topic.endswith(".kv")]
        removed = {h for r in new_kv if r.type == "BlockRemoved" and r.env.data.tier is Tier.DISK
                   for h in r.env.data.block_hashes}
        assert {corrupt, missing} <= removed
        cleared = [r.env.data.tier for r in new_kv if r.type == "AllBlocksCleared"]
        assert cleared == [Tier.DEVICE, Tier.HOST]
        regs = [r.env.epoch for r in of(records, WID, "WorkerRegistered")]
        assert regs == [old_epoch, new_epoch]

        # No acknowledged event lost: every (producer, epoch, partition) sequence is dense.
        tracker = SequenceTracker()
        for r in sorted(mine, key=lambda r: (r.topic, r.partition, r.offset)):
            obs = tracker.observe(f"{r.topic}:{r.partition}", r.env.producer, r.env.epoch, r.env.seq)
            assert obs.gap is None, (r.topic, r.partition, r.env.epoch, r.env.seq, obs)

        # The oracle view equals what the worker holds: verified disk blocks, empty memory.
        have = held(w)
        assert have["device"] == set() and have["host"] == set()
        assert have["disk"] == disk_files(w) and not {corrupt, missing} & have["disk"]
        assert set(have["disk"]) <= set(claimed)
        for order in (("workers", "kv"), ("kv", "workers")):
            view = oracle(records, order)
            assert residency(view) == have, order
            assert WID not in {wid for wid, _ in view.index.as_dict()["stale"]}
            state = view.workers[WID]
            assert (state.epoch, state.state) == (new_epoch, "ready")

        # Traffic after the restart: the log keeps describing the worker exactly.
        stop2, ok2 = threading.Event(), []
        threads = [threading.Thread(target=_load, args=(w.url, w.credential(), stop2, 10 + i, ok2)) for i in range(2)]
        for t in threads:
            t.start()
        wait_for(lambda: len(ok2) >= 30, 30, "traffic after restart")
        stop2.set()
        for t in threads:
            t.join(15)
        _quiet(w, lambda: oracle(read_log(bus, "workers", "kv"), ("workers", "kv")))
        assert w.stop() == 0
    finally:
        w.kill()
