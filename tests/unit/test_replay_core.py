"""Replay's pure cores: points, the router's ledger as a fold of its events, re-execution from
score tables.

Core-only, no mocks: decisions are made by the real ``decide`` with the real ledger, recorded
as the router records them (``control_plane.router.inputs``), and re-executed.
"""

from __future__ import annotations

import random
import zlib

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from control_plane.replay.engine import router_streams
from control_plane.replay.errors import BadPoint
from control_plane.replay.points import parse_point
from control_plane.replay.verify import DecisionRecord, check_rejection, check_table, decision_diffs, replayed_event
from control_plane.router import (
    InflightLedger,
    NoEligibleWorker,
    RouterConfig,
    RoutingRequest,
    WorkerLoad,
    WorkerOverlap,
)
from control_plane.router.admission import budget_terms, over_budget
from control_plane.router.inputs import DecisionInputs, execute, routed_event
from control_plane.router.ledger import RouterLedger, _entry_from_row
from common.log.reader import LocatedEvent
from schemas import EnvelopeFactory
from schemas.events import (
    CandidateScore,
    FirstToken,
    PrefillCompleted,
    RequestAdmitted,
    RequestCompleted,
    RequestFailed,
    RequestRejected,
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


def _inputs(req: RoutingRequest, workers, seed: int, *, overlaps=None, ledger=None, cursor=None) -> DecisionInputs:
    return DecisionInputs(request=req, workers=list(workers), overlaps=dict(overlaps or {}),
                          inflight=ledger.view(req.block_hashes) if ledger is not None else {}, rr_cursor=cursor,
                          rng_seed=seed)


def _record(req: RoutingRequest, workers, config: RouterConfig, seed: int, *, overlaps=None, ledger=None,
            cursor=None, at_s: float = 100.0) -> DecisionRecord:
    inputs = _inputs(req, workers, seed, overlaps=overlaps, ledger=ledger, cursor=cursor)
    d = execute(inputs, config)
    ev = routed_event(d, inputs, config, index_position={"t.kv:0": 3}, router_id="r", decided_at_s=at_s)
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
    requests, the recorded score table alone reproduces the event bit for bit, and an event
    written before ``RequestRouted`` carried its ledger entry folds into the same entry (derived
    from the chosen worker's row)."""
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
                overlaps[wid] = WorkerOverlap.of(device=dev, host=host, disk=disk, stale=data.draw(st.booleans()))
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
    old = msgspec.structs.replace(rec.routed, inflight_prefill_tokens=None, inflight_blocks=None, inflight_ttl_s=None)
    derived = _entry_from_row(old, BS, len(hashes))
    assert derived == (rec.routed.inflight_prefill_tokens, rec.routed.inflight_blocks) or (
        # the derivation rounds (q + p) / bs * bs - q, the router rounds p - overlap * bs: they can
        # differ by a token only where the object tier's 0.1 weight makes the overlap fractional
        abs(derived[0] - rec.routed.inflight_prefill_tokens) <= 1 and derived[1] == rec.routed.inflight_blocks)
    # And any tampering with the recorded choice or a row is caught, with the field named.
    other = next((s.worker_id for s in rec.routed.scores if s.worker_id != rec.routed.worker_id), None)
    if other is not None:
        forged = msgspec.structs.replace(rec, routed=msgspec.structs.replace(rec.routed, worker_id=other))
        status, _, diffs = check_table(forged, config)
        assert status == "mismatch" and any(x.startswith("worker_id:") for x in diffs)


@pytest.mark.parametrize("cost", ["blocks", "ttft"])
def test_the_table_check_takes_the_other_rows_predictions_as_recorded(cost: str) -> None:
    """``RequestRouted`` records the chosen worker's model only (``ttft_models`` is deprecated):
    the table check re-derives the chosen row's prediction from it and takes the others' as
    recorded, so a decision over fitted models re-executes bit for bit; a forged prediction
    that would have won under the ttft cost is a mismatch; a log that still carries the other
    models verifies with them."""
    from schemas.events import TtftModel

    req = RoutingRequest(request_id="q", prompt_tokens=40 * BS, block_size=BS, block_hashes=tuple(range(1, 41)),
                         expected_output_tokens=16)
    workers = [WorkerLoad(worker_id=f"w{i}", queued_prefill_tokens=300 * i) for i in range(3)]
    models = {f"w{i}": TtftModel(base_ms=5.0 * i + 1.3, ms_per_token=0.01 * (3 - i), samples=i + 1, pool_samples=9)
              for i in range(3)}
    config = RouterConfig(version=3, cost=cost)
    inputs = DecisionInputs(request=req, workers=workers, overlaps={"w2": WorkerOverlap.of(device=30)}, inflight={},
                            rng_seed=5, ttft_models=models)
    d = execute(inputs, config)
    ev = routed_event(d, inputs, config, index_position={"t.kv:0": 3}, router_id="r", decided_at_s=100.0)
    assert ev.ttft_models == {} and ev.ttft_model == models[d.worker_id]
    assert all(row.predicted_ttft_ms is not None for row in ev.scores)
    adm = RequestAdmitted(request_id="q", model="m", prompt_tokens=req.prompt_tokens, max_tokens=16,
                          block_hashes=list(req.block_hashes), block_size=BS, hash_algo="sha256")
    rec = DecisionRecord(routed=ev, admitted=adm, at_ns=10**11, producer="r", epoch=1, position="t.requests:0:1",
                         event_id="e")
    status, _, diffs = check_table(rec, config)
    assert status == "match", diffs
    older = msgspec.structs.replace(rec, routed=msgspec.structs.replace(
        ev, ttft_models={w: m for w, m in models.items() if w != d.worker_id}))
    status, _, diffs = check_table(older, config)
    assert status == "match", diffs
    if cost == "ttft":
        other = next(s.worker_id for s in ev.scores if s.worker_id != d.worker_id)
        rows = [msgspec.structs.replace(s, predicted_ttft_ms=0.5, cost=0.5) if s.worker_id == other else s
                for s in ev.scores]
        forged = msgspec.structs.replace(rec, routed=msgspec.structs.replace(ev, scores=rows))
        status, _, diffs = check_table(forged, config)
        assert status == "mismatch" and any(x.startswith("worker_id:") for x in diffs), diffs


def test_a_changed_config_is_a_mismatch_that_names_the_costs() -> None:
    req = RoutingRequest(request_id="q", prompt_tokens=64, block_size=BS, block_hashes=(1, 2, 3, 4),
                         expected_output_tokens=16)
    workers = [WorkerLoad(worker_id="a"), WorkerLoad(worker_id="b", queued_prefill_tokens=100)]
    rec = _record(req, workers, RouterConfig(version=1), 5, overlaps={"b": WorkerOverlap.of(device=4)})
    status, _, diffs = check_table(rec, RouterConfig(version=1, prefill_load_scale=3.0))
    assert status == "mismatch"
    assert any(d.startswith("scores[a].cost") for d in diffs) and any(d.startswith("reason:") for d in diffs)


# -- the router's ledger: a fold of its own events ---------------------------------------------


def _env(f: EnvelopeFactory, payload):
    return f.wrap(payload, correlation_id=getattr(payload, "request_id", None))


def _admitted(rid: str, hashes=(1, 2)) -> RequestAdmitted:
    return RequestAdmitted(request_id=rid, model="m", prompt_tokens=BS * len(hashes) + 3, max_tokens=4,
                           block_size=BS, hash_algo="sha256", block_hashes=list(hashes))


def _routed(rid: str, worker: str, phase=RequestPhase.AGGREGATED, at: float = 10.0, prefill: int = 35,
            blocks: int = 3, mode=RoutingMode.KV) -> RequestRouted:
    return RequestRouted(request_id=rid, worker_id=worker, phase=phase, mode=mode, config_version=1, rng_seed=1,
                         decided_at_s=at, inflight_prefill_tokens=prefill, inflight_blocks=blocks, inflight_ttl_s=600.0)


def test_the_ledger_folds_a_routers_events() -> None:
    """Disaggregated: the decode route releases the prefill entry first; a refused connection
    drops everything sent to that worker; the router's own first token ends the prefill load;
    round robin's cursor is folded per role; entries expire on the recorded clock."""
    f = EnvelopeFactory("r", 1, lambda: 0)
    led = RouterLedger(600.0)
    for ev in (_admitted("a"), _routed("a", "p1", RequestPhase.PREFILL), _admitted("b"),
               _routed("b", "p1", RequestPhase.PREFILL, at=10.5)):
        led.apply(_env(f, ev))
    assert led.load_for("p1").requests == 2 and led.load_for("p1").prefill_tokens == 70
    led.prepare("a", RequestPhase.DECODE, 11.0)
    assert led.load_for("p1").requests == 1
    led.apply(_env(f, _routed("a", "d1", RequestPhase.DECODE, at=11.0, prefill=0, mode=RoutingMode.ROUND_ROBIN)))
    assert led.rr_cursor == {"decode": "d1"}
    led.apply(_env(f, RequestFailed(request_id="b", reason="refused", code="worker_unreachable", worker_id="p1")))
    assert led.load_for("p1").requests == 0 and led.load_for("d1").requests == 1 and led.open_requests() == 1
    led.apply(_env(f, _admitted("c")))
    led.apply(_env(f, _routed("c", "w1", at=12.0)))
    led.apply(_env(f, PrefillCompleted(request_id="c", worker_id="w1", prompt_tokens=35, duration_ms=1.0)))
    assert led.load_for("w1").prefill_tokens == 0 and led.load_for("w1").requests == 1
    led.prepare("z", RequestPhase.AGGREGATED, 612.5)  # 600 s after both remaining entries
    assert len(led) == 0


def test_a_retried_failure_keeps_the_request_an_end_forgets_it() -> None:
    f = EnvelopeFactory("r", 1, lambda: 0)
    led = RouterLedger()
    led.apply(_env(f, _admitted("a")))
    led.apply(_env(f, _routed("a", "w1")))
    led.apply(_env(f, RequestFailed(request_id="a", reason="reset", code="worker_lost", worker_id="w1", retried=True)))
    assert len(led) == 0 and led.open_requests() == 1
    led.apply(_env(f, _routed("a", "w2", at=10.2)))  # the retry: its hashes are still known
    assert led.load_for("w2").requests == 1
    led.apply(_env(f, RequestCompleted(request_id="a", worker_id="w2", prompt_tokens=35, output_tokens=4,
                                       ttft_ms=1, e2e_ms=2)))
    assert len(led) == 0 and led.open_requests() == 0


def test_a_disaggregated_request_stays_a_lower_bound_of_the_margin_until_its_first_token() -> None:
    """Two requests predicted 100 ms, decided at 10.0 and 10.1 s: their decode routes (the
    prefill done) do not end their wait; at 10.5 s they are at least 5x and 4x late: margin 4.
    One's ``FirstToken`` ends it: one late request alone, margin 1; its time is the envelope's."""
    f = EnvelopeFactory("r", 1, lambda: 0)
    led = RouterLedger(600.0)
    for rid, at in (("a", 10.0), ("b", 10.1)):
        led.apply(_env(f, _admitted(rid)))
        led.apply(_env(f, msgspec.structs.replace(_routed(rid, "p1", RequestPhase.PREFILL, at=at),
                                                  predicted_ttft_ms=100.0)))
        led.apply(_env(f, _routed(rid, "d1", RequestPhase.DECODE, at=at + 0.05, prefill=0)))
    assert led.margin.factor(10.5) == pytest.approx(4.0)
    led.apply(_env(f, FirstToken(request_id="a", worker_id="d1", ttft_ms=450.0)))
    assert led.margin.factor(10.5) == 1.0


def test_a_budget_refusal_is_re_executed_from_its_terms() -> None:
    """The recorded terms refuse again with the recorded reason (match); a reason that is not
    what the rule gives, a margin the ledger does not give, or terms that admit: mismatch. A
    refusal for waiting out the budget in the queue has no prediction: unverifiable."""
    terms = budget_terms([CandidateScore(worker_id="a", predicted_ttft_ms=400.0)], 1000.0, 50.0, 10.0, 2.5,
                         at_s=100.0)
    reason = over_budget(terms)[0]
    assert "400 ms on the best candidate (a) x 2.50" in reason and "= 1060 ms exceeds the budget of 1000 ms" in reason
    rej = RequestRejected(request_id="r", reason=reason, code="ttft_budget", http_status=429, admission=terms)
    assert check_rejection(rej, (2.5, 0.0, 1.0)) == "match"
    assert check_rejection(rej, (2.0, 0.0, 1.0)).startswith(
        "mismatch: margin, queue_ms, spread (2.5, 0.0, 1.0) -> (2.0, 0.0, 1.0)")
    assert check_rejection(msgspec.structs.replace(rej, reason="x"), (2.5, 0.0, 1.0)).startswith("mismatch: reason")
    admits = msgspec.structs.replace(terms, margin=2.0)
    assert check_rejection(msgspec.structs.replace(rej, admission=admits), None) == "mismatch: the recorded terms admit it"
    queued = msgspec.structs.replace(rej, admission=budget_terms((), 1000.0, 1200.0))
    assert check_rejection(queued, None) == "unverifiable"


def test_an_admitted_decision_whose_test_refuses_on_replay_is_a_mismatch() -> None:
    """A recorded RequestRouted whose budget terms, re-executed over the replayed rows, refuse."""
    row = CandidateScore(worker_id="a", predicted_ttft_ms=900.0)
    ok = budget_terms([row], 1000.0, 50.0, 10.0, 1.0)
    ev = RequestRouted(request_id="r", worker_id="a", mode=RoutingMode.KV, config_version=1, rng_seed=1,
                       scores=[row], admission=ok)
    assert decision_diffs(ev, ev) == []
    late = msgspec.structs.replace(ok, margin=2.0)
    assert decision_diffs(ev, msgspec.structs.replace(ev, admission=late))[0].startswith("admission: admitted -> refused")


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_the_fold_of_a_routers_log_equals_its_live_state_whatever_the_partition_interleaving(seed: int) -> None:
    """A router folds each event as it publishes it. Its events land in several partitions and
    come back interleaved in any order that keeps each partition's; merged by the producer's
    strictly increasing stamps (``router_streams``), they fold into the same state. A worker's
    events in the same topic are not part of it."""
    rng = random.Random(seed)
    clock = iter(range(1, 10**9))
    f = EnvelopeFactory("r", 1, lambda: next(clock) * 1000)
    w = EnvelopeFactory("w1", 7, lambda: 5)
    live = RouterLedger(600.0)
    log: list[LocatedEvent] = []
    open_: list[str] = []
    for i in range(rng.randrange(1, 60)):
        roll = rng.random()
        if roll < 0.35 or not open_:
            rid = f"q{i}"
            evs = [_admitted(rid, tuple(range(1, rng.randrange(1, 6)))),
                   _routed(rid, f"w{rng.randrange(3)}", at=i, prefill=rng.randrange(0, 80), blocks=8)]
            open_.append(rid)
        else:
            rid = rng.choice(open_)
            evs = [rng.choice([
                PrefillCompleted(request_id=rid, worker_id="w0", prompt_tokens=1, duration_ms=1.0),
                RequestCompleted(request_id=rid, worker_id="w0", prompt_tokens=1, output_tokens=1, ttft_ms=1, e2e_ms=1),
                RequestFailed(request_id=rid, reason="x", code=rng.choice(["worker_lost", "worker_unreachable"]),
                              worker_id=f"w{rng.randrange(3)}", retried=rng.random() < 0.5),
            ])]
        for ev in evs:
            env = _env(f, ev)
            live.apply(env)
            log.append(LocatedEvent(env, "t.requests", zlib.crc32(ev.request_id.encode()) % 3, len(log)))
        if rng.random() < 0.2:  # a worker's PrefillCompleted for the same request, in the same topic
            log.append(LocatedEvent(_env(w, PrefillCompleted(request_id=rid, worker_id="w1", prompt_tokens=1,
                                                         duration_ms=1.0)), "t.requests", 0, len(log)))
    # Any interleaving that keeps each partition's order.
    parts = {p: [loc for loc in log if loc.partition == p] for p in range(3)}
    mixed: list[LocatedEvent] = []
    while any(parts.values()):
        p = rng.choice([p for p, v in parts.items() if v])
        mixed.append(parts[p].pop(0))
    [(name, stream)] = router_streams(mixed).items()
    assert name == "r@1"
    replayed = RouterLedger(600.0)
    for loc in stream:
        replayed.apply(loc.env)
    for wid in ("w0", "w1", "w2"):
        assert replayed.load_for(wid) == live.load_for(wid)
        # the queue the TTFT prediction drains, and so the decision's bound model
        assert replayed.inflight.pending_prefills(wid) == live.inflight.pending_prefills(wid)
        assert replayed.ttft_model(wid, 30.5) == live.ttft_model(wid, 30.5)
    assert replayed.view((1, 2, 3)) == live.view((1, 2, 3)) and replayed.open_requests() == live.open_requests()


def test_the_state_check_re_derives_the_queues_drain_and_not_for_a_decision_recorded_before_it() -> None:
    """Worker a has 6,000 tokens of this router's prefills in flight, routed 0.2 s before the
    decision: under the prior the worker has computed 3,980 of them (19.9028 tokens/ms), which
    the decision's model records. The state check over the ledger's inputs reproduces it; a
    record written before the drain (no ``queue_done_tokens``, every prediction behind the
    whole queue) reproduces too, re-derived without it; and one written before the engine's
    steps (no ``ms_per_step_token_sq``: 2,048-token steps, 19.6169 tokens/ms, 3,923 done),
    over the inputs replay rebuilds for it (``engine_steps=False``); and one written before the
    step under way (no ``busy_steps``)."""
    from control_plane.replay.verify import check_state

    led = RouterLedger(600.0)
    led.inflight.add("old", "a", (7,), 6000, 400, now=99.8, ttl=600.0)
    req = RoutingRequest(request_id="q", prompt_tokens=40 * BS, block_size=BS, block_hashes=tuple(range(1, 41)),
                         expected_output_tokens=16)
    workers = [WorkerLoad(worker_id="a"), WorkerLoad(worker_id="b", queued_prefill_tokens=500)]
    inputs = DecisionInputs(request=req, workers=workers, overlaps={}, inflight=led.view(req.block_hashes),
                            rng_seed=3, ttft_models={w.worker_id: led.ttft_model(w.worker_id, 100.0) for w in workers})
    assert inputs.ttft_models["a"].queue_done_tokens == 3980 and inputs.ttft_models["b"].queue_done_tokens == 0
    config = RouterConfig(version=1)
    adm = RequestAdmitted(request_id="q", model="m", prompt_tokens=req.prompt_tokens, max_tokens=16,
                          block_hashes=list(req.block_hashes), block_size=BS, hash_algo="sha256")

    def record(inp: DecisionInputs) -> DecisionRecord:
        ev = routed_event(execute(inp, config), inp, config, router_id="r", decided_at_s=100.0)
        return DecisionRecord(routed=ev, admitted=adm, at_ns=10**11, producer="r", epoch=1,
                              position="t.requests:0:1", event_id="e")

    rec = record(inputs)
    assert check_state(rec, inputs, config)[0] == "match"
    before = msgspec.structs.replace(inputs, ttft_models={
        w: msgspec.structs.replace(m, queue_done_tokens=None) for w, m in inputs.ttft_models.items()})
    old = record(before)
    row_a = next(r for r in old.routed.scores if r.worker_id == "a")
    assert row_a.predicted_ttft_ms > next(r for r in rec.routed.scores if r.worker_id == "a").predicted_ttft_ms
    status, _, diffs, _ = check_state(old, inputs, config)
    assert status == "match", diffs
    steps_before = msgspec.structs.replace(inputs, ttft_models={
        w.worker_id: led.ttft_model(w.worker_id, 100.0, engine_steps=False) for w in workers})
    m = steps_before.ttft_models["a"]
    assert (m.queue_done_tokens, m.ms_per_step_token_sq, m.chunk_tokens) == (3923, None, 2048)
    status, _, diffs, _ = check_state(record(steps_before), steps_before, config)
    assert status == "match", diffs
    # One written before the step under way (no ``busy_steps``: a's model charged no step for
    # the prefills in flight there) re-executes without it.
    assert inputs.ttft_models["a"].busy_steps == 1 and inputs.ttft_models["b"].busy_steps == 0
    not_busy = msgspec.structs.replace(inputs, ttft_models={
        w: msgspec.structs.replace(m, busy_steps=None) for w, m in inputs.ttft_models.items()})
    unbusy = record(not_busy)
    row_a = next(r for r in unbusy.routed.scores if r.worker_id == "a")
    assert row_a.predicted_ttft_ms < next(r for r in rec.routed.scores if r.worker_id == "a").predicted_ttft_ms
    status, _, diffs, _ = check_state(unbusy, inputs, config)
    assert status == "match", diffs


def test_replayed_event_copies_only_inputs() -> None:
    req = RoutingRequest(request_id="q", prompt_tokens=32, block_size=BS, block_hashes=(1, 2))
    config = RouterConfig(version=2)
    rec = _record(req, [WorkerLoad(worker_id="a"), WorkerLoad(worker_id="b")], config, 11)
    inputs = _inputs(req, [WorkerLoad(worker_id="a"), WorkerLoad(worker_id="b")], 11)
    d = execute(inputs, config)
    assert decision_diffs(rec.routed, replayed_event(rec, d, inputs, config)) == []
    assert decision_diffs(rec.routed, replayed_event(rec, msgspec.structs.replace(d, reason="x"), inputs,
                                                     config))[0].startswith("reason")
