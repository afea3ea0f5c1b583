"""P/D pairs chosen together (``control_plane/router/pairs.py``, ``RouterConfig.pd_pairs``)."""

from __future__ import annotations

import msgspec
import pytest

from control_plane.replay.verify import DecisionRecord, check_state, check_table
from control_plane.router import RouterConfig
from control_plane.router.decision import RoutingRequest, WorkerLoad, decide
from control_plane.router.inputs import decision_inputs
from control_plane.router.ledger import RouterLedger
from control_plane.router.pairs import HOP_PRIOR, ITL_PRIOR, LinearMs, PairFit, PairInputs, pair_key
from control_plane.simulation import SimRouter
from schemas.events import RequestAdmitted, RequestRouted
from schemas.types import RequestPhase, WorkerRole

P, D = WorkerRole.PREFILL, WorkerRole.DECODE


def _req(phase=RequestPhase.PREFILL, prompt=640, out=100) -> RoutingRequest:
    return RoutingRequest(request_id="r1", prompt_tokens=prompt, block_size=64, expected_output_tokens=out,
                          phase=phase)


def _loads(**active) -> list[WorkerLoad]:
    return [WorkerLoad(worker_id=w, role=D, active_decode_blocks=a, kv_capacity_blocks=1000) for w, a in active.items()]


def test_the_pair_adds_the_hand_off_and_the_decode_itl_to_the_prefill_ttft() -> None:
    """Blocks cost: the prefill worker is the blocks argmin (p1, the emptier), and its decode
    worker the cheapest hand-off + ITL: d2's hand-off from p1 is fitted slow (500 ms), so d1
    (10 + 0.013 x 640 = 18.32 ms, ITL 20 + 0.004 x (50 + 12 blocks) ms) wins although d2 holds
    fewer blocks."""
    prefill = [WorkerLoad(worker_id="p1", role=P), WorkerLoad(worker_id="p2", role=P, queued_prefill_tokens=4096)]
    pair = PairInputs(workers=_loads(d1=50, d2=0), hop={pair_key("p1", "d2"): LinearMs(500.0, 0.0)})
    d = decide(_req(), prefill, RouterConfig(pd_pairs=True), rng_seed=1, ttft_models={}, pair=pair)
    assert (d.worker_id, d.paired_worker_id) == ("p1", "d1")
    by = {(r.prefill_worker, r.decode_worker): r for r in d.pairs}
    assert set(by) == {("p1", "d1"), ("p1", "d2")}
    r = by[("p1", "d1")]
    assert r.transfer_ms == pytest.approx(HOP_PRIOR.at(640)) and r.itl_ms == ITL_PRIOR.at(50 + 12)
    assert r.cost == r.prefill_ttft_ms + r.transfer_ms + r.itl_ms
    assert [s.worker_id for s in d.decode_scores] == ["d1", "d2"]
    assert "pair p1 -> d1" in d.reason
    # Off: no pair, nothing recorded.
    off = decide(_req(), prefill, RouterConfig(), rng_seed=1, ttft_models={}, pair=pair)
    assert (off.paired_worker_id, off.pairs, off.decode_scores) == ("", (), ())


def test_an_itl_over_the_slo_costs_the_excess_per_output_token() -> None:
    """d1 predicts 30 ms a token against an SLO of 25: 5 ms x 100 output tokens = 500 ms
    penalty, so d2 (a slower hand-off, +100 ms) wins."""
    prefill = [WorkerLoad(worker_id="p1", role=P)]
    pair = PairInputs(workers=_loads(d1=0, d2=0), itl={"d1": LinearMs(30.0, 0.0), "d2": LinearMs(20.0, 0.0)},
                      hop={pair_key("p1", "d2"): LinearMs(HOP_PRIOR.at(640) + 100.0, 0.0)})
    d = decide(_req(), prefill, RouterConfig(pd_pairs=True, itl_slo_ms=25.0), rng_seed=1, ttft_models={}, pair=pair)
    assert d.paired_worker_id == "d2"
    pen = {r.decode_worker: r.itl_penalty_ms for r in d.pairs}
    assert pen == {"d1": pytest.approx(500.0), "d2": 0.0}


def test_a_decode_worker_that_cannot_take_the_request_now_does_not_pair() -> None:
    prefill = [WorkerLoad(worker_id="p1", role=P)]
    pair = PairInputs(workers=_loads(d1=995, d2=400))  # d1: 995 + 12 blocks > 1,000
    d = decide(_req(), prefill, RouterConfig(pd_pairs=True), rng_seed=1, ttft_models={}, pair=pair)
    assert d.paired_worker_id == "d2"
    assert [r.decode_worker for r in d.pairs] == ["d2"]
    assert next(s for s in d.decode_scores if s.worker_id == "d1").excluded.startswith("over KV capacity")


def test_the_decode_decision_takes_the_paired_worker_unless_the_guards_leave_it_out() -> None:
    cfg = RouterConfig(pd_pairs=True)
    dec = decide(_req(RequestPhase.DECODE), _loads(d1=100, d2=0), cfg, rng_seed=1, paired="d1")
    assert dec.worker_id == "d1" and dec.paired_worker_id == "d1"
    assert dec.reason.startswith("paired at the prefill decision: d1")
    full = decide(_req(RequestPhase.DECODE), _loads(d1=995, d2=0), cfg, rng_seed=1, paired="d1")
    assert full.worker_id == "d2" and "passed over (over KV capacity" in full.reason
    assert decide(_req(RequestPhase.DECODE), _loads(d1=100, d2=0), RouterConfig(), rng_seed=1,
                  paired="d1").worker_id == "d2"


def test_requests_paired_and_not_handed_off_yet_count_on_their_decode_worker() -> None:
    """A burst's prefill decisions come before any decode decision: the blocks of the requests
    already paired with d1 (500) make d2 the emptier, so the burst spreads."""
    prefill = [WorkerLoad(worker_id="p1", role=P)]
    pair = PairInputs(workers=_loads(d1=0, d2=100), pending={"d1": 500})
    d = decide(_req(), prefill, RouterConfig(pd_pairs=True), rng_seed=1, ttft_models={}, pair=pair)
    assert d.paired_worker_id == "d2"
    assert {r.decode_worker: r.paired_blocks for r in d.pairs} == {"d1": 500, "d2": 0}
    led = RouterLedger()
    led.apply(_wrap(RequestAdmitted(request_id="r1", model="m", prompt_tokens=640, max_tokens=100, block_size=64, hash_algo="xxh3_64")))
    led.apply(_wrap(RequestRouted(request_id="r1", worker_id="p1", phase=RequestPhase.PREFILL, mode="kv",
                                  config_version=0, rng_seed=0, decided_at_s=1.0, inflight_blocks=12,
                                  paired_worker_id="d2")))
    assert led.pair_pending() == {"d2": 12} and led.paired("r1") == "d2"
    led.apply(_wrap(RequestRouted(request_id="r1", worker_id="d2", phase=RequestPhase.DECODE, mode="kv",
                                  config_version=0, rng_seed=0, decided_at_s=1.2, paired_worker_id="d2")))
    assert led.pair_pending() == {}


def _wrap(payload):
    from schemas.envelope import EnvelopeFactory

    return EnvelopeFactory("router-1", 1, lambda: 10**9).wrap(payload, correlation_id=payload.request_id)


def test_the_fit_is_exact_sums_over_its_window() -> None:
    """Hand-offs of 30 + 0.01 ms a token: after 4 the pair's own fit is near the truth (the
    prior weighs 4 points), and they leave the window 300 s later, whatever their order."""
    f, g = PairFit(), PairFit()
    obs = [(t, 1000 * (t + 1)) for t in range(8)]
    for t, tokens in obs:
        f.observe_hop("p", "d", tokens, 30.0 + 0.01 * tokens, float(t))
    for t, tokens in reversed(obs):
        g.observe_hop("p", "d", tokens, 30.0 + 0.01 * tokens, 0.0)
    a, b = f.inputs([]).hop[pair_key("p", "d")], g.inputs([]).hop[pair_key("p", "d")]
    assert a == b
    assert a.at(4000) == pytest.approx(70.0, rel=0.1)
    f.expire(310.0)
    assert f.observations() == 0 and f.inputs([]).hop == {} and f.inputs([]).hop_pool == HOP_PRIOR


@pytest.mark.parametrize("cost", ["blocks", "ttft"])
def test_a_simulated_pd_run_with_pairs_re_executes_from_its_tables_and_its_fold_is_the_live_one(cost) -> None:
    """Virtual time, 2 prefill + 2 decode: every decision's recorded table re-executes to the
    same event (pairs, decode rows, the decode leg's pairing), and a ledger folded from the log
    holds the live router's pair fit."""
    cfg = RouterConfig(pd_pairs=True, cost=cost, itl_slo_ms=5.0)
    roles = [("p0", P), ("p1", P), ("d0", D), ("d1", D)]
    r = SimRouter(cfg, roles, hash_algo="xxh3_64", block_size=64, kv_capacity_blocks=1024, record=True)
    t = 1000.0
    for i in range(12):
        rid = f"r{i}"
        r.admit(rid, [], 300 + 50 * i, 8, t)
        p = r.route(rid, r.entry_phase, t)
        r.on_first_token(p, rid, t + 20)
        d = r.route(rid, RequestPhase.DECODE, t + 20)
        r.on_first_token(d, rid, t + 35 + i)
        r.on_complete(d, rid, t + 35 + i + 7 * (4 + i % 3))
        t += 10.0
    routed = [e for e in r.recorded if isinstance(e.data, RequestRouted)]
    adm = {e.data.request_id: e.data for e in r.recorded if isinstance(e.data, RequestAdmitted)}
    pre = [e.data for e in routed if e.data.phase is RequestPhase.PREFILL]
    dec = {e.data.request_id: e.data for e in routed if e.data.phase is RequestPhase.DECODE}
    assert all(x.paired_worker_id and x.pairs and x.decode_scores for x in pre)
    assert all(dec[x.request_id].worker_id == x.paired_worker_id for x in pre)
    for e in routed:
        rec = DecisionRecord(routed=e.data, admitted=adm[e.data.request_id], at_ns=e.occurred_at_ns,
                             producer=e.producer, epoch=e.epoch, position="requests:0:0", event_id=e.event_id)
        verdict, _, diffs = check_table(rec, cfg)
        assert verdict == "match", diffs
    # The state check: each decision re-executed on inputs rebuilt from a ledger folded from the
    # log up to it (the simulated router's source has no load reports or KV events here, so it
    # is the same at every moment).
    folded = RouterLedger(cfg.inflight_ttl_s)
    for e in r.recorded:
        ev = e.data
        if isinstance(ev, RequestRouted):
            a = adm[ev.request_id]
            inputs = decision_inputs(r, folded, request_id=ev.request_id, prompt_tokens=a.prompt_tokens,
                                     block_hashes=a.block_hashes, block_size=a.block_size,
                                     expected_output_tokens=ev.expected_output_tokens, phase=ev.phase,
                                     attempt=ev.attempt, now=ev.decided_at_s, pairs=cfg.pd_pairs)
            rec = DecisionRecord(routed=ev, admitted=a, at_ns=e.occurred_at_ns, producer=e.producer, epoch=e.epoch,
                                 position="requests:0:0", event_id=e.event_id)
            verdict, _, diffs, _ = check_state(rec, inputs, cfg)
            assert verdict == "match", diffs
        folded.apply(e)
    live = r.ledger.pair_fit.inputs([])
    assert live.hop_pool != HOP_PRIOR and live.itl  # it learned
    assert folded.pair_fit.inputs([]) == live
    assert msgspec.json.decode(msgspec.json.encode(pre[0]), type=RequestRouted) == pre[0]
