"""Load view projection: worker states, pool attribution, event-time windows, SLO judgement,
checkpoints. Pure: events are stamped in code and folded without a broker.

Unless a test says otherwise: 10 s tumbling windows, 30 s hopping windows stepping 10 s, 1 s
grace; pool "pre" holds prefill worker p1, pool "dec" decode worker d1, pool "agg" aggregated
worker a1, all registered at t=0 and reporting load at t=1.
"""

from __future__ import annotations

import random

import pytest

from control_plane.planner.load_view import NS, Histogram, LoadView, LoadViewConfig, PoolSlo, stamp
from schemas import events as ev

S = NS


def _make_config(**overrides) -> LoadViewConfig:
    fields = {"tumbling_s": 10.0, "hopping_s": 30.0, "hop_step_s": 10.0, "grace_s": 1.0,
              "slos": {"pre": PoolSlo(ttft_ms=500.0), "dec": PoolSlo(itl_ms=20.0),
                       "agg": PoolSlo(ttft_ms=500.0, itl_ms=20.0)}}
    fields.update(overrides)
    return LoadViewConfig(**fields)


def _reg(wid: str, pool: str, role: str, at: float, epoch: int = 1):
    return stamp(ev.WorkerRegistered(worker_id=wid, role=role, pool=pool, endpoint=f"http://{wid}", block_size=16,
                                  hash_algo="sha256"), int(at * S), epoch=epoch, producer=wid)


def _load(wid: str, at: float, epoch: int = 1, **kw):
    return stamp(ev.WorkerLoadReported(worker_id=wid, running=kw.get("running", 0), waiting=0,
                                    tier_usage={"device": 0.5}), int(at * S), epoch=epoch, producer=wid)


def _admit(rid: str, at: float, prompt: int = 1000):
    return stamp(ev.RequestAdmitted(request_id=rid, model="m", prompt_tokens=prompt, max_tokens=100, block_size=16,
                                 hash_algo="sha256"), int(at * S), producer="router")


def _route(rid: str, wid: str, at: float, phase: str = "aggregated"):
    return stamp(ev.RequestRouted(request_id=rid, worker_id=wid, phase=phase, mode="kv", config_version=1, rng_seed=0),
                 int(at * S), producer="router")


def _done(rid: str, wid: str, at: float, *, ttft: float = 100.0, itl: float = 10.0, out: int = 50,
          prompt: int = 1000, cached: int = 0):
    return stamp(ev.RequestCompleted(request_id=rid, worker_id=wid, prompt_tokens=prompt, output_tokens=out,
                                  cached_tokens=cached, ttft_ms=ttft, itl_mean_ms=itl, e2e_ms=ttft + itl * out),
                 int(at * S), producer="router")


def _make_view(**overrides) -> LoadView:
    v = LoadView(_make_config(**overrides), start_ns=0)
    for wid, pool, role in (("p1", "pre", "prefill"), ("d1", "dec", "decode"), ("a1", "agg", "aggregated")):
        v.apply(_reg(wid, pool, role, 0))
        v.apply(_load(wid, 1))
    return v


def test_worker_lifecycle_starting_ready_draining_gone_and_stale():
    """Registered -> starting; first load report -> ready; draining; deregistered -> gone. A
    ready worker silent for more than stale_after_s (15 s) counts as stale, not ready."""
    v = LoadView(_make_config(), start_ns=0)
    v.apply(_reg("w1", "agg", "aggregated", 0))
    assert v.snapshot(1 * S).pool("agg").replicas.starting == 1
    v.apply(_load("w1", 2))
    snap = v.snapshot(3 * S).pool("agg")
    assert snap.replicas.ready == 1 and snap.workers[0].ready_at_ns == 2 * S
    assert v.snapshot(20 * S).pool("agg").replicas.stale == 1
    v.apply(stamp(ev.WorkerDraining(worker_id="w1"), 21 * S, producer="w1"))
    assert v.snapshot(21 * S).pool("agg").replicas.draining == 1
    v.apply(stamp(ev.WorkerDeregistered(worker_id="w1"), 22 * S, producer="w1"))
    reps = v.snapshot(22 * S).pool("agg").replicas
    assert (reps.starting, reps.ready, reps.draining, reps.stale) == (0, 0, 0, 0)


def test_events_of_an_older_incarnation_are_ignored():
    v = LoadView(_make_config(), start_ns=0)
    v.apply(_reg("w1", "agg", "aggregated", 0, epoch=2))
    v.apply(stamp(ev.WorkerDraining(worker_id="w1"), 1 * S, epoch=1, producer="w1"))
    v.apply(_reg("w1", "agg", "aggregated", 1, epoch=1))
    w = v.snapshot(2 * S).pool("agg").workers[0]
    assert (w.epoch, w.state) == (2, "starting")


def test_arrivals_isl_and_the_tumbling_window_closing_after_grace():
    """Three requests routed at t = 12, 15, 19 (ISL 1,000, 2,000, 3,000) fall in [10, 20). The
    window closes at 20 + 1 s grace: not reported at t=20.5, reported at t=21 with 0.3 req/s,
    ISL mean 2,000."""
    v = _make_view()
    for i, (t, isl) in enumerate([(12, 1000), (15, 2000), (19, 3000)]):
        v.apply(_admit(f"r{i}", t, isl))
        v.apply(_route(f"r{i}", "a1", t))
    assert [w.end_ns for w in v.snapshot(int(20.5 * S)).pool("agg").windows] == [10 * S]
    w = v.snapshot(21 * S).pool("agg").last_window
    assert (w.start_ns, w.end_ns, w.arrivals) == (10 * S, 20 * S, 3)
    assert w.arrival_rate == pytest.approx(0.3)
    assert w.isl_mean == 2000 and w.isl_sd == pytest.approx(816.4966)
    assert w.isl.p50 == pytest.approx(2000, rel=0.011)


def test_retry_in_the_same_pool_is_one_arrival_and_disaggregated_requests_count_in_both_pools():
    v = _make_view()
    v.apply(stamp(ev.WorkerRegistered(worker_id="a2", role="aggregated", pool="agg", endpoint="x", block_size=16,
                                   hash_algo="sha256"), 0, producer="a2"))
    v.apply(_route("r1", "a1", 12))
    v.apply(_route("r1", "a2", 12.5))  # retry on another worker of the same pool
    v.apply(_route("r2", "p1", 13, "prefill"))
    v.apply(_route("r2", "d1", 13.2, "decode"))
    snap = v.snapshot(21 * S)
    assert snap.pool("agg").last_window.arrivals == 1
    assert snap.pool("pre").last_window.arrivals == 1
    assert snap.pool("dec").last_window.arrivals == 1


def test_disaggregated_completion_judges_ttft_on_the_prefill_pool_and_itl_on_the_decode_pool():
    """r1: TTFT 300 (prefill SLO 500: good), ITL 25 (decode SLO 20: bad). r2: TTFT 800 (bad),
    ITL 15 (good). Each pool: 2 completions, 1 good, attainment 0.5. The prefill pool's hit rate
    comes from PrefillCompleted: 500 cached of 2,000 prompt tokens = 0.25."""
    v = _make_view()
    for rid, ttft, itl in (("r1", 300.0, 25.0), ("r2", 800.0, 15.0)):
        v.apply(_admit(rid, 11))
        v.apply(_route(rid, "p1", 11, "prefill"))
        v.apply(stamp(ev.PrefillCompleted(request_id=rid, worker_id="p1", prompt_tokens=1000, cached_tokens=250,
                                       duration_ms=100.0), 12 * S, producer="p1"))
        v.apply(_route(rid, "d1", 12, "decode"))
        v.apply(_done(rid, "d1", 15, ttft=ttft, itl=itl))
    snap = v.snapshot(21 * S)
    pre, dec = snap.pool("pre").last_window, snap.pool("dec").last_window
    assert (pre.completions, pre.good, pre.slo_attainment) == (2, 1, 0.5)
    assert (dec.completions, dec.good, dec.slo_attainment) == (2, 1, 0.5)
    assert pre.prefix_hit_rate == 0.25
    assert pre.ttft_mean == 550.0 and dec.ttft_mean is None and dec.itl_mean == 20.0
    assert dec.osl_mean == 50


def test_aggregated_goodput_needs_both_targets_and_failures_are_never_good():
    """4 completions in [10, 20): good, TTFT too high, ITL too high, good; plus one failure that
    was not retried (a retried one does not count). Goodput 2 / 10 s = 0.2/s; attainment 2 / 5."""
    v = _make_view()
    for i, (ttft, itl) in enumerate([(100, 10), (900, 10), (100, 30), (200, 19)]):
        v.apply(_route(f"r{i}", "a1", 10.5))
        v.apply(_done(f"r{i}", "a1", 12 + i, ttft=ttft, itl=itl, prompt=1000, cached=400))
    v.apply(stamp(ev.RequestFailed(request_id="rx", worker_id="a1", reason="boom", code="worker_error", retried=True),
                  13 * S, producer="router"))
    v.apply(stamp(ev.RequestFailed(request_id="ry", worker_id="a1", reason="boom", code="worker_error"),
                  14 * S, producer="router"))
    w = v.snapshot(21 * S).pool("agg").last_window
    assert (w.completions, w.good, w.failures) == (4, 2, 1)
    assert w.goodput == pytest.approx(0.2) and w.slo_attainment == pytest.approx(0.4)
    assert w.prefix_hit_rate == pytest.approx(0.4)
    assert w.ttft.p99 == pytest.approx(900, rel=0.011)


def test_hopping_window_merges_the_last_three_steps():
    """Arrivals 1, 2, 3 in [0,10), [10,20), [20,30); at t=31 the 30 s hopping window ending at
    30 holds all 6, the tumbling windows 1, 2, 3."""
    v = _make_view()
    n = 0
    for k, count in enumerate((1, 2, 3)):
        for _ in range(count):
            v.apply(_route(f"r{n}", "a1", 10 * k + 5))
            n += 1
    pl = v.snapshot(31 * S).pool("agg")
    assert [w.arrivals for w in pl.windows] == [1, 2, 3]
    assert (pl.hopping.start_ns, pl.hopping.end_ns, pl.hopping.arrivals) == (0, 30 * S, 6)


def test_steady_latency_leaves_out_workers_in_warm_up():
    """warmup 30 s: a1 ready at t=1 is warm from t=31; a2 ready at t=40 is still warming at 50.
    Completions at t=52: a1 300 ms (steady), a2 3,000 ms (not): steady TTFT 300, overall 1,650."""
    v = _make_view(warmup_s=30.0)
    v.apply(_reg("a2", "agg", "aggregated", 39))
    v.apply(_load("a2", 40))
    v.apply(_load("a1", 45))
    v.apply(_done("r1", "a1", 52, ttft=300.0))
    v.apply(_done("r2", "a2", 52, ttft=3000.0))
    w = v.snapshot(61 * S).pool("agg").last_window
    assert w.steady_ttft_mean == 300.0 and w.steady_samples == 1
    assert w.ttft_mean == 1650.0


def test_routing_before_the_registration_is_attributed_when_it_arrives():
    """Across topics a RequestRouted can be folded before the worker's WorkerRegistered."""
    v = LoadView(_make_config(), start_ns=0)
    v.apply(_route("r1", "late", 12))
    v.apply(_reg("late", "agg", "aggregated", 13))
    assert v.snapshot(21 * S).pool("agg").last_window.arrivals == 1


def test_windows_before_the_view_started_are_not_reported():
    """A view that starts folding at t=15 cannot know the load of [10, 20): its first reported
    window is [20, 30)."""
    v = LoadView(_make_config(), start_ns=15 * S)
    v.apply(_reg("a1", "agg", "aggregated", 15))
    assert [w.start_ns for w in v.snapshot(41 * S).pool("agg").windows] == [20 * S, 30 * S]


def test_checkpoint_round_trip_and_fold_order_within_a_window_does_not_matter():
    events = [_reg("a1", "agg", "aggregated", 0), _load("a1", 1)]
    for i in range(50):
        t = 10 + (i % 10) * 0.9
        events += [_admit(f"r{i}", t, 500 + 37 * i), _route(f"r{i}", "a1", t),
                   _done(f"r{i}", "a1", t + 0.05, ttft=50.0 + i, itl=5.0 + i % 7, out=10 + i)]
    a = LoadView(_make_config(), start_ns=0)
    a.apply_all(events)
    # the same events, requests shuffled (each request's own events stay ordered)
    reqs = [events[2 + 3 * i: 5 + 3 * i] for i in range(50)]
    random.Random(7).shuffle(reqs)
    b = LoadView(_make_config(), start_ns=0)
    b.apply_all(events[:2] + [e for r in reqs for e in r])
    assert a.snapshot(30 * S) == b.snapshot(30 * S)
    c = LoadView.from_bytes(a.to_bytes(), _make_config())
    assert c.digest() == a.digest() and c.snapshot(30 * S) == a.snapshot(30 * S)


def test_record_positions_skip_redeliveries():
    v = LoadView(_make_config(), start_ns=0)
    assert v.apply_record(_reg("a1", "agg", "aggregated", 0), "sy.workers", 0, 0) == ()
    assert v.apply_record(_route("r1", "a1", 12), "sy.requests", 2, 5) == (("agg", "arrivals", 12 * S),)
    assert v.apply_record(_route("r1", "a1", 12), "sy.requests", 2, 5) is None
    assert v.snapshot(21 * S).pool("agg").last_window.arrivals == 1


def test_histogram_quantiles_are_within_one_percent():
    h = Histogram()
    for x in range(1, 10001):
        h.add(float(x))
    assert h.quantile(0.5) == pytest.approx(5000, rel=0.01)
    assert h.quantile(0.99) == pytest.approx(9900, rel=0.01)
    assert h.mean == 5000.5


def test_config_rejects_windows_that_are_not_whole_steps():
    with pytest.raises(ValueError, match="multiple of hop_step_s"):
        LoadViewConfig(tumbling_s=15.0, hop_step_s=10.0)
