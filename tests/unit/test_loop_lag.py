"""The router's event-loop lag (control_plane/router/loop_lag.py): smoothing and the admission
rule, core only, with given timings; and the Router refusing while it lags."""

from __future__ import annotations

import math

import msgspec
import pytest

from control_plane.router import RouterConfig
from control_plane.router.errors import RouterConfigError
from control_plane.router.loop_lag import LoopLag, observe, overloaded
from control_plane.router.proxy import Router, RouterRejected
from control_plane.router.view import RouterView
from common.hashing import HashAlgo, HashConfig
from common.log.sink import MemorySink
from schemas.events import RequestAdmitted, RequestRejected, RequestRouted


def _feed(samples: list[tuple[float, float]], tau_s: float = 0.5, state: LoopLag = LoopLag()) -> LoopLag:
    for due, ran in samples:
        state = observe(state, due, ran, tau_s)
    return state


def test_the_first_sample_is_taken_as_it_is_and_an_early_run_is_no_lag():
    """Due at 10.0, ran at 10.03: 30 ms. Ran before it was due: 0, not negative."""
    s = _feed([(10.0, 10.03)])
    assert (s.smoothed_s, s.last_s, s.at, s.samples) == (pytest.approx(0.03), pytest.approx(0.03), 10.03, 1)
    assert observe(LoopLag(), 5.0, 4.9).smoothed_s == 0.0


def test_the_weight_follows_the_time_between_samples():
    """From 0 ms smoothed at t=1.0, a 100 ms sample at t=1.0+0.5 (one tau later) moves the mean by
    1 - e^-1 = 63.2%: 63.2 ms. The same sample 0.05 s later moves it by 1 - e^-0.1 = 9.5%."""
    base = LoopLag(0.0, 0.0, 1.0, 1)
    far = observe(base, 1.4, 1.5)
    near = observe(base, 0.95, 1.05)
    assert far.smoothed_s == pytest.approx(0.1 * (1 - math.exp(-1)))
    assert near.smoothed_s == pytest.approx(0.1 * (1 - math.exp(-0.1)))
    assert far.last_s == pytest.approx(0.1) and far.samples == 2


def test_a_sustained_lag_is_reached_and_a_recovered_loop_decays():
    """From a quiet loop (0 ms at t=0), samples due every 50 ms that run 80 ms late (130 ms
    apart): after 10, 1 - e^(-10 x 0.26) = 92.6% of 80 ms = 74.1 ms; then 10 on-time samples
    50 ms apart leave e^(-10 x 0.1) = 36.8% of that."""
    t, samples = 0.0, []
    for _ in range(10):
        due = t + 0.05
        t = due + 0.08
        samples.append((due, t))
    hot = _feed(samples, state=LoopLag(0.0, 0.0, 0.0, 1))
    assert hot.smoothed_s == pytest.approx(0.08 * (1 - math.exp(-0.26) ** 10), rel=1e-9)
    assert 0.07 < hot.smoothed_s < 0.08
    cool = hot
    for _ in range(10):
        due = cool.at + 0.05
        cool = observe(cool, due, due)
    assert cool.smoothed_s == pytest.approx(hot.smoothed_s * math.exp(-1))


def test_one_long_block_after_a_quiet_loop_counts_by_its_length():
    """A quiet loop (0 ms) blocked for 1 s: the sample due at +0.05 ran at +1.05, 1 s late,
    1.05 s after the previous one: weight 1 - e^-2.1 = 87.8%: 878 ms."""
    s = observe(LoopLag(0.0, 0.0, 0.0, 5), 0.05, 1.05)
    assert s.smoothed_s == pytest.approx(1 - math.exp(-2.1))


def test_overloaded_only_over_the_limit_and_never_when_off():
    """Limit 100 ms: 100 ms smoothed is not over; 250 ms is (Retry-After ceil(0.25) = 1);
    2.4 s: Retry-After 3. Limit 0: off, whatever the lag."""
    assert overloaded(LoopLag(0.1, 0.3, 1.0, 3), 100) is None
    reason, retry = overloaded(LoopLag(0.25, 0.3, 1.0, 3), 100)
    assert retry == 1 and "250 ms late" in reason and "last sample 300 ms" in reason and "100 ms" in reason
    assert overloaded(LoopLag(2.4, 2.4, 1.0, 3), 100)[1] == 3
    assert overloaded(LoopLag(9.0, 9.0, 1.0, 3), 0) is None


def test_the_config_field_refuses_a_negative_limit_and_old_configs_decode():
    with pytest.raises(RouterConfigError):
        RouterConfig(max_loop_lag_ms=-1)
    logged = msgspec.to_builtins(RouterConfig())
    del logged["max_loop_lag_ms"]  # a config recorded before the field existed
    assert msgspec.convert(logged, RouterConfig).max_loop_lag_ms == RouterConfig().max_loop_lag_ms


async def test_a_lagging_router_rejects_at_once_with_its_reason_on_the_log():
    """Smoothed 300 ms over a 100 ms limit: 503 router_overloaded before any decision (no
    worker needed), Retry-After 1, and the request ends with RequestRejected. Back under the
    limit, the same router routes again (here: to no worker, a 503 no_workers)."""
    lag = {"now": LoopLag(0.3, 0.35, 1.0, 20)}
    sink = MemorySink()
    router = Router(router_id="r-test", view=RouterView("sha256", 16), producer=sink,
                    config=RouterConfig(max_loop_lag_ms=100), hash_config=HashConfig(HashAlgo.SHA256, 16),
                    loop_lag=lambda: lag["now"])
    try:
        adm = router.admit(request_id="o-1", model="m", tokens=list(range(40)), max_tokens=2, stream=True,
                           endpoint="completions")
        with pytest.raises(RouterRejected) as shed:
            await router.queue(adm)
        e = shed.value
        assert (e.status, e.code, e.retry_after_s) == (503, "router_overloaded", 1)
        assert router.reject(adm, str(e), e.code, e.status)
        rejected = sink.of_type(RequestRejected)
        assert [(r.request_id, r.code, r.http_status) for r in rejected] == [("o-1", "router_overloaded", 503)]
        assert "300 ms late" in rejected[0].reason and sink.of_type(RequestRouted) == []
        assert len(sink.of_type(RequestAdmitted)) == 1 and len(router.admission) == 0

        lag["now"] = LoopLag(0.01, 0.01, 2.0, 40)
        calm = router.admit(request_id="o-2", model="m", tokens=list(range(40)), max_tokens=2, stream=True,
                            endpoint="completions")
        await router.queue(calm)  # granted: the lag is under the limit
        with pytest.raises(RouterRejected) as none:
            _ = [c async for c in router.serve(calm)]
        assert none.value.code != "router_overloaded"
    finally:
        await router.close()
