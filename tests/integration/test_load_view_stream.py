"""The planner's load view folded by the Faust app from the real broker equals the oracle fold of
the log (the same pure projection, records read partition by partition); its windowed Faust
table counts what the projection counted; a restart from the checkpoint plus the log tail gets
back to the same view; a poison record is dead-lettered and the fold goes on."""

from __future__ import annotations

import asyncio
import time

import pytest

from control_plane.planner.backtest import read_log
from control_plane.planner.load_view import NS, LoadView, LoadViewConfig, PoolSlo
from control_plane.planner.stream import LoadViewProcessor
from common.log.catalog import Catalog
from common.log.kafka import EventProducer
from common.settings import BusSettings
from schemas.events import WorkerLoadReported
from tests.support.traffic import Clock, register_worker, serve_request
from tests.support.waits import until

pytestmark = pytest.mark.kafka

COUNTERS = ("arrivals", "completions", "good")
CFG = LoadViewConfig(tumbling_s=10.0, hopping_s=30.0, hop_step_s=10.0, slos={"agg": PoolSlo(ttft_ms=200.0, itl_ms=20.0)})


def _traffic(bus: BusSettings, clock: Clock, base: int, first: int, n: int, workers=("a1", "a2")) -> None:
    router = EventProducer(bus, "router", clock_ns=clock)
    wps = {w: EventProducer(bus, w, epoch=1, clock_ns=clock) for w in workers}
    if first == 0:
        clock.t = base
        for w, p in wps.items():
            register_worker(p, w, block_size=16)
            p.publish(WorkerLoadReported(worker_id=w, running=1, waiting=0))
    for i in range(first, first + n):
        serve_request(router, clock, f"r{i}", workers[i % len(workers)], at_ns=base + int(i * 0.37 * NS), served_s=0.2,
                      prompt_tokens=500 + 10 * i, output_tokens=64, block_size=16, cached_tokens=100,
                      ttft_ms=50.0 + (i % 7) * 40, itl_mean_ms=10.0 + i % 15, e2e_ms=900.0)
    for p in (router, *wps.values()):
        assert p.flush(30) == 0


def oracle(bus: BusSettings, start_ns: int) -> LoadView:
    """Every record of both topics, in event-time order (read_log), folded from scratch."""
    view = LoadView(CFG, start_ns=start_ns)
    view.apply_all(read_log(bus, start_ns, time.time_ns() + 3600 * NS, lookback_s=3600))
    return view


async def _run(proc: LoadViewProcessor) -> None:
    await proc.start()
    await proc.wait_caught_up(30)


def test_faust_fold_equals_the_oracle_and_restarts_from_its_checkpoint(bus: BusSettings) -> None:
    base = (time.time_ns() // (10 * NS) - 12) * 10 * NS
    clock = Clock(base)
    _traffic(bus, clock, base, 0, 150)
    cat = Catalog(bus.topic_prefix)
    poison = EventProducer(bus, "poison")
    poison.produce_raw(cat.topic("requests"), b"\x00not an envelope", b"zz")
    assert poison.flush(10) == 0
    now = base + 80 * NS

    async def first_run() -> tuple[LoadView, dict, dict]:
        proc = LoadViewProcessor(bus, "lv-test", LoadView(CFG, start_ns=base))
        await _run(proc)

        # The table updates of the last records land: the windowed table counts what the
        # (caught-up) projection counted.
        def table_counts_the_projection() -> dict | None:
            windows = proc.view.snapshot(now, history=100).pool("agg").windows
            want = {k: {w.start_ns: getattr(w, k) for w in windows if getattr(w, k)} for k in COUNTERS}
            got = {k: proc.counter_windows("agg", k) for k in COUNTERS}
            return got if got == want else None

        counters = await until(table_counts_the_projection, timeout=30, what=lambda: {
            k: proc.counter_windows("agg", k) for k in COUNTERS})
        assert proc.dead_lettered == 1
        assert await proc.checkpoint(force=True)
        await proc.stop()
        return proc.view, counters, dict(proc.view.positions)

    live, counters, positions = asyncio.run(first_run())
    expect = oracle(bus, base)
    assert live.snapshot(now) == expect.snapshot(now)
    windows = expect.snapshot(now, history=100).pool("agg").windows
    assert sum(w.arrivals for w in windows) == 150
    assert {w.start_ns: w.arrivals for w in windows if w.arrivals} == counters["arrivals"]
    assert {w.start_ns: w.completions for w in windows if w.completions} == counters["completions"]
    assert {w.start_ns: w.good for w in windows if w.good} == counters["good"]

    # more traffic while it is down; restart from the checkpoint: only the tail is replayed
    _traffic(bus, clock, base, 150, 40)
    restored = LoadViewProcessor.load_view(bus, CFG)
    assert restored.positions == positions

    async def second_run() -> LoadView:
        proc = LoadViewProcessor(bus, "lv-test", restored)
        await _run(proc)
        await proc.stop()
        return proc.view

    again = asyncio.run(second_run())
    later = base + 95 * NS
    assert again.snapshot(later) == oracle(bus, base).snapshot(later)
    assert again.applied - live.applied == 3 * 40
