"""The chaos verdict (ops/chaos/report.py): a pure fold of client records, the
requests log, the ledger check and the view checks. Core only, no mocks."""

from __future__ import annotations

import msgspec

from ops.chaos.load import Sent
from ops.chaos.plan import PlanConfig, make_plan
from ops.chaos.report import FaultRecord, ViewCheck, build_report, request_rows
from ops.demo.loadgen import Result
from common.log.acks import AckEntry, LedgerCheck
from schemas import Envelope
from schemas.events import RequestAdmitted, RequestCompleted, RequestFailed, RequestRejected, RequestRouted


def _env(payload) -> Envelope:
    return Envelope(event_id="x", type=payload.TYPE, version=payload.VERSION, key=payload.key(), producer="r1",
                    epoch=1, seq=0, occurred_at_ns=0, data=payload)


def _adm(rid: str, client: str) -> Envelope:
    return _env(RequestAdmitted(request_id=rid, model="m", prompt_tokens=1, max_tokens=1, block_size=64,
                                hash_algo="a", client_request_id=client))


def _sent(i: int, *, ok: bool = True, status: int = 200, code: str = "", rid: str = "", rejected: bool = False,
          at: float = 10.0, overload: bool = False) -> Sent:
    r = Result(i, f"c-{i}", 10, ok=ok, status=status, code=code, rejected=rejected, router_request_id=rid,
               ttft_ms=5.0)
    return Sent(i, f"c-{i}", at, overload, replica=0, attempts=1, end_s=at + 0.1, result=r)


def _report(sent, events, faults=(), ledger=None, views=None, client_loop_lag=None, **plan):
    p = make_plan(PlanConfig(duration_s=60, faults=("router_kill",), overload_s=10, **plan))
    return build_report(p, list(faults) or [_recovered()], sent, events,
                        ledger or LedgerCheck(acked=10, failed=0, records=10),
                        [ViewCheck("router-0", True, "d", "d", 5)] if views is None else views,
                        client_loop_lag=client_loop_lag)


def _recovered() -> FaultRecord:
    return FaultRecord("router_kill", 20.0, 20.0, "router-0", healthy_s=24.0, traffic_s=23.0, recovered=True)


def test_a_clean_run_is_all_zeros_and_recovery_is_the_later_of_health_and_traffic() -> None:
    """Killed at 20 s, healthy at 24 s, traffic served again at 23 s: recovery 4 s."""
    events = [_adm("r-0", "c-0"), _env(RequestCompleted(request_id="r-0", worker_id="w", prompt_tokens=1,
                                                        output_tokens=1, ttft_ms=1, e2e_ms=2))]
    rep = _report([_sent(0, rid="r-0")], events)
    assert rep.ok
    assert rep.checks["max_recovery_s"] == 4.0 and rep.checks["faults"] == 1
    assert rep.result_line().startswith("RESULT faults=1 acked_lost=0 duplicates=0 gaps=0 views_equal_oracle=1 "
                                        "unended=0 silent_failures=0 unrecovered=0 crashed=0 max_recovery_s=4.00 "
                                        "broker_failover_s=nan")


def test_failures_the_log_explains_are_not_silent_and_the_others_are() -> None:
    """c-1: 503 and a final RequestFailed (explained); c-2: stream cut, the log says completed
    (silent); c-3: stream cut, admitted, nothing after (silent and unended); c-4: no answer,
    never admitted (the fault cut it before the log: counted apart); c-5: overload 429 with
    RequestRejected."""
    events = [
        _adm("r-1", "c-1"), _env(RequestFailed(request_id="r-1", reason="x", code="worker_lost", retried=True)),
        _env(RequestFailed(request_id="r-1", reason="x", code="no_worker")),
        _adm("r-2", "c-2"), _env(RequestCompleted(request_id="r-2", worker_id="w", prompt_tokens=1, output_tokens=1,
                                                  ttft_ms=1, e2e_ms=2)),
        _adm("r-3", "c-3"),
        _adm("r-5", "c-5"), _env(RequestRejected(request_id="r-5", reason="full", code="queue_full", http_status=429)),
    ]
    sent = [_sent(1, ok=False, status=503, code="no_worker", rid="r-1"),
            _sent(2, ok=False, status=200, code="stream_ended_early", rid="r-2"),
            _sent(3, ok=False, status=0, code="RemoteProtocolError"),
            _sent(4, ok=False, status=0, code="ReadError"),
            _sent(5, ok=False, status=429, code="queue_full", rid="r-5", rejected=True, at=55.0, overload=True)]
    rep = _report(sent, events)
    assert rep.checks["silent_failures"] == 2 and rep.examples["silent"] == ["c-2", "c-3"]
    assert rep.checks["unended"] == 1 and rep.examples["unended"] == ["r-3"]
    assert rep.unadmitted_client_errors == {"ReadError": 1}
    assert rep.overload == {"sent": 1, "ok": 0, "rejected": 1, "failed": 0, "shed": 1.0, "over_slo": 0,
                            "over_slo_client": 0, "send_late_ms_p50": None, "send_late_ms_p99": None,
                            "rejected_by_reason": {"queue_full": 1}, "failed_by_reason": {},
                            "ttft_ms_p50": None, "ttft_ms_p99": None, "router_ttft_ms_p50": None,
                            "router_ttft_ms_p99": None, "predicted_ttft_ms_p50": None,
                            "predicted_ttft_ms_p99": None, "unseen_ms_p50": None, "unseen_ms_p99": None,
                            "client_loop_lag_ms_p50": None, "client_loop_lag_ms_p99": None,
                            "client_loop_late_share": 0.0, "router_loop_lag_ms_p50": None,
                            "router_loop_lag_ms_p99": None}
    assert rep.checks["rejections_without_reason"] == 0
    assert rep.log_ends_by_reason["failed:no_worker"] == 1
    assert not rep.ok


def test_ledger_views_and_recovery_failures_make_the_run_fail() -> None:
    lost = AckEntry(event_id="e1", topic="t", partition=0, offset=3, producer="p", epoch=1, seq=3)
    unrecovered = FaultRecord("router_kill", 20.0, 20.0, "router-0", error="timed out")
    rep = _report([], [], faults=[unrecovered], ledger=LedgerCheck(acked=1, failed=0, records=0, missing=(lost,)),
                  views=[ViewCheck("router-0", False, "a", "b", 5)])
    assert (rep.checks["acked_lost"], rep.checks["views_equal_oracle"], rep.checks["unrecovered"]) == (1, 0, 1)
    assert rep.checks["max_recovery_s"] is None and not rep.ok


def test_a_process_that_exited_on_its_own_fails_the_run_even_when_everything_recovered() -> None:
    p = make_plan(PlanConfig(duration_s=60, faults=("router_kill",), overload_s=10))
    rep = build_report(p, [_recovered()], [], [], LedgerCheck(acked=10, failed=0, records=10),
                       [ViewCheck("router-0", True, "d", "d", 5)], crashes=["metrics start 2 exited -11"])
    assert rep.checks["crashed"] == 1 and rep.checks["unrecovered"] == 0 and not rep.ok
    assert " crashed=1 " in rep.result_line()
    assert "CRASHED    metrics start 2 exited -11" in rep.summary()


def test_served_ttft_is_reported_before_and_during_the_overload_phase() -> None:
    """Nearest rank: of 100 served before the overload with TTFT 1..100 ms, p50 is the 50th (50)
    and p99 the 99th (99); the overload phase's two served (200, 400 ms): p50 200, p99 400, and
    as their router measured them (150, 300 ms); its rejected request's TTFT does not count."""
    before = []
    for i in range(100):
        s = _sent(i, rid=f"r-{i}")
        s.result.ttft_ms = float(i + 1)
        before.append(s)
    during = [_sent(100 + i, rid=f"r-o{i}", at=55.0, overload=True) for i in range(2)]
    events = [_env(RequestCompleted(request_id=f"r-o{i}", worker_id="w", prompt_tokens=1, output_tokens=1,
                                    ttft_ms=ms, e2e_ms=ms)) for i, ms in ((0, 150.0), (1, 300.0))]
    during[0].result.ttft_ms, during[1].result.ttft_ms = 200.0, 400.0
    shed = _sent(200, ok=False, status=503, code="router_overloaded", rid="r-x", rejected=True, at=56.0,
                 overload=True)
    # The client's own loop: 1 s late before the overload phase (not counted), 10 and 30 ms in it.
    rep = _report(before + during + [shed], events, client_loop_lag=[(20.0, 1.0), (51.0, 0.01), (52.0, 0.03)])
    assert (rep.requests["ttft_ms_p50"], rep.requests["ttft_ms_p99"]) == (50.0, 99.0)
    assert (rep.overload["ttft_ms_p50"], rep.overload["ttft_ms_p99"]) == (200.0, 400.0)
    assert (rep.overload["router_ttft_ms_p50"], rep.overload["router_ttft_ms_p99"]) == (150.0, 300.0)
    assert (rep.overload["client_loop_lag_ms_p50"], rep.overload["client_loop_lag_ms_p99"]) == (10.0, 30.0)
    assert rep.overload["client_loop_late_share"] == 0.004  # (0.01 + 0.03) s late in the 10 s phase
    summary = "\n".join(rep.summary())
    assert "overload   3 sent: 2 ok, 1 rejected (router_overloaded 1), 0 failed; served TTFT p50 200.00 / p99 400.00" in summary
    assert "outside    100 sent: 100 ok, 0 rejected (none), 0 failed; served TTFT p50 50.00 / p99 99.00" in summary


def test_each_phase_reports_what_it_shed_and_every_rejection_needs_a_reason_on_both_sides() -> None:
    """Fault (router_kill) at 20 s, recovered at 24 s. Outside the overload phase: c-0 served at
    10 s in 300 ms (the router saw 100 of it from admission and predicted 80: 200 ms unseen by
    the router), c-1 rejected at 22 s (in the fault's window: not quiet) with its reason on the
    log. In it (the SLO 250 ms): c-2 served in 400 ms (over the SLO), c-3 rejected ttft_budget
    with a reason, c-4 a bare 429 (no code, nothing on the log), c-5 429 ttft_budget whose log
    entry has no reason: 2 rejections without a reason, and the run fails. c-2 left 100 ms after
    its arrival was due (the generator's lateness, not in its TTFT), and the client's loop was
    200 ms late while it waited: 400 - 200 <= 250, so its miss is the client's."""
    routed = lambda rid, ms: _env(RequestRouted(request_id=rid, worker_id="w", mode="kv", config_version=1,  # noqa: E731
                                                 rng_seed=0, predicted_ttft_ms=ms, queued_ms=5.0))
    events = [
        _adm("r-0", "c-0"), routed("r-0", 80.0),
        _env(RequestCompleted(request_id="r-0", worker_id="w", prompt_tokens=1, output_tokens=1, ttft_ms=100,
                              e2e_ms=200)),
        _adm("r-1", "c-1"), _env(RequestRejected(request_id="r-1", reason="no worker", code="no_workers",
                                                 http_status=429)),
        _adm("r-2", "c-2"), routed("r-2", 200.0),
        _env(RequestCompleted(request_id="r-2", worker_id="w", prompt_tokens=1, output_tokens=1, ttft_ms=390,
                              e2e_ms=500)),
        _adm("r-3", "c-3"), _env(RequestRejected(request_id="r-3", reason="predicted 900 ms", code="ttft_budget",
                                                 http_status=429)),
        _adm("r-5", "c-5"), _env(RequestRejected(request_id="r-5", reason="", code="ttft_budget", http_status=429)),
    ]
    sent = [_sent(0, rid="r-0"), _sent(1, ok=False, status=429, code="no_workers", rid="r-1", rejected=True, at=22.0),
            _sent(2, rid="r-2", at=55.0, overload=True),
            _sent(3, ok=False, status=429, code="ttft_budget", rid="r-3", rejected=True, at=55.0, overload=True),
            _sent(4, ok=False, status=429, code="http_429", rejected=True, at=56.0, overload=True),
            _sent(5, ok=False, status=429, code="ttft_budget", rid="r-5", rejected=True, at=56.0, overload=True)]
    sent[0].result.ttft_ms, sent[2].result.ttft_ms = 300.0, 400.0
    sent[2].due_s = 54.9
    p = make_plan(PlanConfig(duration_s=60, faults=("router_kill",), overload_s=10))
    rep = build_report(p, [_recovered()], sent, events, LedgerCheck(acked=10, failed=0, records=10),
                       [ViewCheck("router-0", True, "d", "d", 5)], slo_ms=250.0,
                       client_loop_lag=[(55.3, 0.2)])
    o, out, quiet = rep.overload, rep.outside, rep.quiet
    assert (o["sent"], o["ok"], o["rejected"], o["shed"], o["over_slo"]) == (4, 1, 3, 0.75, 1)
    assert o["rejected_by_reason"] == {"ttft_budget": 2, "http_429": 1}
    assert (o["ttft_ms_p99"], o["router_ttft_ms_p99"], o["predicted_ttft_ms_p99"], o["unseen_ms_p99"]) == \
        (400.0, 390.0, 200.0, 10.0)
    assert (out["sent"], out["rejected"], out["shed"], out["unseen_ms_p50"]) == (2, 1, 0.5, 200.0)
    assert (quiet["sent"], quiet["rejected"], quiet["shed"]) == (1, 0, 0.0)
    assert rep.checks["rejections_without_reason"] == 2 and not rep.ok
    line = rep.result_line()
    assert ("rejections_without_reason=2 slo_ms=250 overload_ttft_p99_ms=400.00 overload_over_slo=1 "
            "overload_over_slo_client=1 overload_send_late_p99_ms=100.00 overload_shed=0.750 outside_shed=0.500 "
            "quiet_shed=0.000") in line


def test_the_part_the_router_never_saw_is_split_into_the_way_in_and_the_way_back() -> None:
    """Load started at wall 1,000 s; sent at 10 s of load; the router admitted it at wall
    1,010.3 s (300 ms in), saw its first token 400 ms after; the client saw it at 900 ms: the
    way back took 900 - 300 - 400 = 200 ms. Without the wall clock there is no split."""
    s = _sent(1, rid="r-1")
    s.result.ttft_ms = 900.0
    adm = msgspec.structs.replace(_adm("r-1", "c-1"), occurred_at_ns=1_010_300_000_000)
    done = _env(RequestCompleted(request_id="r-1", worker_id="w", prompt_tokens=1, output_tokens=1, ttft_ms=400.0,
                                 e2e_ms=500.0))
    row = request_rows([s], [adm, done], wall_t0=1000.0)[0]
    assert (row["inbound_ms"], row["outbound_ms"], row["router_ttft_ms"]) == (300.0, 200.0, 400.0)
    assert (lambda r: (r["inbound_ms"], r["outbound_ms"]))(request_rows([s], [adm, done])[0]) == (None, None)
