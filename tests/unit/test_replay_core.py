"""Replay's pure cores: points, the ledger timeline, re-execution from score tables.

Core-only, no mocks: decisions are made by the real ``decide`` with the real
``InflightLedger``, recorded as the router records them, and re-executed.
"""

from __future__ import annotations

import time

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from control_plane.replay.errors import BadPoint
from control_plane.replay.ledger import ENDED, FIRST_TOKEN, ROUTED, LedgerReplay, Located, build_timelines
from control_plane.replay.points import parse_point
from control_plane.replay.verify import DecisionRecord, check_table, decision_diffs, ledger_entry, replayed_event
from control_plane.routing import (
    InflightLedger,
    NoEligibleWorker,
    RouterConfig,
    RoutingRequest,
    WorkerLoad,
    WorkerOverlap,
    decide,
)
from schemas import EnvelopeFactory
from schemas.events import (
    PrefillCompleted,
    RequestAdmitted,
    RequestCompleted,
    RequestFailed,
    RequestRouted,
)
from schemas.types import RequestPhase, RoutingMode, WorkerRole

BS = 16


# -- points ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "kind"), [
    ("start", "start"), ("end", "end"), ("1780000000000", "time"), ("2026-05-01T12:00:00Z", "time"),
    ("2026-05-01T12:00:00+02:00", "time"), ("sy.kv:3:1200", "record"), ('{"sy.kv:0": 5}', "positions"),
    ("request:cmpl-1", "request"),
])
def test_points_parse(text: str, kind: str) -> None:
    assert parse_point(text).kind == kind


def test_point_details_and_errors() -> None:
    assert parse_point("2026-05-01T00:00:00Z").ts_ms == parse_point("2026-05-01T02:00:00+02:00").ts_ms
    p = parse_point("t1.requests:2:17")
    assert (p.topic, p.partition, p.offset) == ("t1.requests", 2, 17)
    assert parse_point('{"a.kv:1": 3}').positions == {("a.kv", 1): 3}
    for bad in ("", "12345", "yesterday", '{"a.kv:x": 1}', '{"a.kv:1": -1}', "request:"):
        with pytest.raises(BadPoint):
            parse_point(bad)


# -- recording decisions like the router does ---------------------------------------------------


def _record(req: RoutingRequest, workers, config: RouterConfig, seed: int, *, overlaps=None, ledger=None,
            cursor=None, at_s: float = 100.0) -> DecisionRecord:
    d = decide(req, workers, config, rng_seed=seed, overlaps=overlaps, inflight=ledger, rr_cursor=cursor)
    ev = msgspec.structs.replace(d.to_event(index_position={"t.kv:0": 3}, router_id="r", attempt=0), rr_cursor=cursor,
                                 guards=list(d.guards), expected_output_tokens=req.expected_output_tokens,
                                 decided_at_s=at_s)
    adm = RequestAdmitted(request_id=req.request_id, model="m", prompt_tokens=req.prompt_tokens,
                          max_tokens=req.expected_output_tokens, block_hashes=list(req.block_hashes), block_size=BS,
                          hash_algo="sha256")
    return DecisionRecord(routed=ev, admitted=adm, at_ns=int(at_s * 1e9), producer="r", epoch=1,
                          position="t.requests:0:1", event_id="e")


_modes = st.sampled_from(list(RoutingMode))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_decision_reexecutes_from_its_score_table(data) -> None:
    """Whatever the mode, load combination, temperature, staleness, guards and in-flight
    requests, the recorded score table alone reproduces the event bit for bit, and
    ``ledger_entry`` gives the prefill tokens the router added to its ledger."""
    n_blocks = data.draw(st.integers(0, 24))
    hashes = tuple(range(1, n_blocks + 1))
    phase = data.draw(st.sampled_from(list(RequestPhase)))
    req = RoutingRequest(request_id="q", prompt_tokens=n_blocks * BS + data.draw(st.integers(0, BS - 1)),
                         block_size=BS, block_hashes=hashes, expected_output_tokens=data.draw(st.integers(0, 300)),
                         phase=phase)
    config = RouterConfig(version=3, mode=data.draw(_modes), load_combine=data.draw(st.sampled_from(["max", "sum"])),
                          temperature=data.draw(st.sampled_from([0.0, 0.0, 0.7])),
                          stale_overlap_factor=data.draw(st.sampled_from([0.0, 0.5])),
                          prefill_load_scale=data.draw(st.sampled_from([1.0, 2.5])),
                          imbalance_abs_threshold=data.draw(st.sampled_from([0, 64])),
                          least_loaded_metric=data.draw(st.sampled_from(["blocks", "requests"])))
    n = data.draw(st.integers(1, 5))
    role = WorkerRole(phase.value)
    workers, overlaps = [], {}
    ledger = InflightLedger()
    for i in range(n):
        wid = f"w{i}"
        workers.append(WorkerLoad(
            worker_id=wid, role=data.draw(st.sampled_from([role, role, role, WorkerRole.AGGREGATED])),
            draining=data.draw(st.booleans()) and i > 0, queued_prefill_tokens=data.draw(st.integers(0, 5000)),
            active_decode_blocks=data.draw(st.integers(0, 400)), inflight_requests=data.draw(st.integers(0, 80)),
            kv_capacity_blocks=data.draw(st.sampled_from([0, 50, 500, 5000]))))
        if n_blocks and data.draw(st.booleans()):
            dev = data.draw(st.integers(0, n_blocks))
            host = data.draw(st.integers(0, n_blocks - dev))
            disk = data.draw(st.integers(0, n_blocks - dev - host))
            if dev + host + disk:
                overlaps[wid] = WorkerOverlap(device=dev, host=host, disk=disk, stale=data.draw(st.booleans()))
        for k in range(data.draw(st.integers(0, 2))):
            depth = data.draw(st.integers(0, n_blocks))
            ledger.add(f"o{i}{k}", wid, hashes[:depth], data.draw(st.integers(0, 3000)),
                       depth + data.draw(st.integers(0, 40)), 0.0, 600.0)
    try:
        rec = _record(req, workers, config, data.draw(st.integers(0, 2**63 - 1)), overlaps=overlaps, ledger=ledger,
                      cursor=data.draw(st.sampled_from([None, "w0", "w3"])))
    except NoEligibleWorker:
        return
    status, d, diffs = check_table(rec, config)
    assert status == "match", diffs
    d_live = decide(req, workers, config, rng_seed=rec.routed.rng_seed, overlaps=overlaps, inflight=ledger,
                    rr_cursor=rec.routed.rr_cursor)
    assert ledger_entry(rec, config) == (d_live.prefill_tokens, d_live.decode_blocks)
    # And any tampering with the recorded choice or a row is caught, with the field named.
    other = next((s.worker_id for s in rec.routed.scores if s.worker_id != rec.routed.worker_id), None)
    if other is not None:
        forged = msgspec.structs.replace(rec, routed=msgspec.structs.replace(rec.routed, worker_id=other))
        status, _, diffs = check_table(forged, config)
        assert status == "mismatch" and any(x.startswith("worker_id:") for x in diffs)


def test_a_changed_config_is_a_mismatch_that_names_the_costs() -> None:
    req = RoutingRequest(request_id="q", prompt_tokens=64, block_size=BS, block_hashes=(1, 2, 3, 4),
                         expected_output_tokens=16)
    workers = [WorkerLoad(worker_id="a"), WorkerLoad(worker_id="b", queued_prefill_tokens=100)]
    rec = _record(req, workers, RouterConfig(version=1), 5, overlaps={"b": WorkerOverlap(device=4)})
    status, _, diffs = check_table(rec, RouterConfig(version=1, prefill_load_scale=3.0))
    assert status == "mismatch"
    assert any(d.startswith("scores[a].cost") for d in diffs) and any(d.startswith("reason:") for d in diffs)


# -- the ledger timeline ------------------------------------------------------------------------


def _loc(f: EnvelopeFactory, payload, off: int) -> Located:
    return Located(f.wrap(payload, correlation_id=getattr(payload, "request_id", None)), "t.requests", 0, off)


def test_timeline_orders_a_routers_ledger_changes_and_prefers_recorded_first_tokens() -> None:
    clock = iter(range(1_000, 100_000, 1_000))
    r = EnvelopeFactory("r", 1, lambda: next(clock))
    w = EnvelopeFactory("w1", 9, lambda: 0)
    evs = [
        _loc(r, RequestAdmitted(request_id="a", model="m", prompt_tokens=32, max_tokens=4, block_size=BS,
                                hash_algo="sha256", block_hashes=[1, 2]), 0),
        _loc(r, RequestRouted(request_id="a", worker_id="w1", mode=RoutingMode.KV, config_version=1, rng_seed=1), 1),
        _loc(r, PrefillCompleted(request_id="a", worker_id="w1", prompt_tokens=32, duration_ms=1.0), 2),
        _loc(r, RequestCompleted(request_id="a", worker_id="w1", prompt_tokens=32, output_tokens=4, ttft_ms=0.5,
                                 e2e_ms=2), 3),
        _loc(r, RequestAdmitted(request_id="b", model="m", prompt_tokens=32, max_tokens=4, block_size=BS,
                                hash_algo="sha256"), 4),
        _loc(r, RequestCompleted(request_id="b", worker_id="w1", prompt_tokens=32, output_tokens=4, ttft_ms=0.0005,
                                 e2e_ms=2), 5),
        _loc(w, PrefillCompleted(request_id="b", worker_id="w1", prompt_tokens=32, duration_ms=1.0), 6),  # a worker's
    ]
    [tl] = build_timelines(reversed(evs)).values()  # input order does not matter
    kinds = [(op.kind, op.request_id) for op in tl.ops]
    assert kinds[:4] == [("admitted", "a"), (ROUTED, "a"), (FIRST_TOKEN, "a"), (ENDED, "a")]
    # b has no router PrefillCompleted: its first token is estimated from the TTFT (0.5 us after admission).
    assert (FIRST_TOKEN, "b") in kinds and tl.estimated_first_token == {"b"}
    assert kinds.index((FIRST_TOKEN, "b")) < kinds.index((ENDED, "b"))


def test_ledger_replay_follows_the_router() -> None:
    """Disaggregated: the decode route completes the prefill entry first; a refused connection
    drops everything sent to that worker."""
    lr = LedgerReplay(600.0)
    pre = RequestRouted(request_id="a", worker_id="p1", phase=RequestPhase.PREFILL, mode=RoutingMode.KV,
                        config_version=1, rng_seed=1, decided_at_s=10.0)
    lr.before_decision(pre, 0)
    lr.routed(pre, [1, 2], 32, 3, 0)
    other = RequestRouted(request_id="b", worker_id="p1", phase=RequestPhase.PREFILL, mode=RoutingMode.KV,
                          config_version=1, rng_seed=1, decided_at_s=10.5)
    lr.routed(other, [1, 2], 32, 3, 0)
    assert lr.ledger.load_for("p1").requests == 2
    dec = RequestRouted(request_id="a", worker_id="d1", phase=RequestPhase.DECODE, mode=RoutingMode.KV,
                        config_version=1, rng_seed=2, decided_at_s=11.0)
    lr.before_decision(dec, 0)
    assert lr.ledger.load_for("p1").requests == 1
    lr.routed(dec, [1, 2], 0, 3, 0)
    env = EnvelopeFactory("r", 1, time.time_ns).wrap(RequestFailed(request_id="b", reason="refused",
                                                                   code="worker_unreachable", worker_id="p1"))
    lr.ended(env)
    assert lr.ledger.load_for("p1").requests == 0 and lr.ledger.load_for("d1").requests == 1
    # Entries expire on the recorded clock: 600 s after decided_at_s.
    late = msgspec.structs.replace(dec, request_id="c", decided_at_s=611.5)
    lr.before_decision(late, 0)
    assert len(lr.ledger) == 0


def test_replayed_event_copies_only_inputs() -> None:
    req = RoutingRequest(request_id="q", prompt_tokens=32, block_size=BS, block_hashes=(1, 2))
    rec = _record(req, [WorkerLoad(worker_id="a"), WorkerLoad(worker_id="b")], RouterConfig(version=2), 11)
    d = decide(req, [WorkerLoad(worker_id="a"), WorkerLoad(worker_id="b")], RouterConfig(version=2), rng_seed=11)
    assert decision_diffs(rec.routed, replayed_event(rec, d)) == []
    assert decision_diffs(rec.routed, replayed_event(rec, msgspec.structs.replace(d, reason="x")))[0].startswith("reason")
