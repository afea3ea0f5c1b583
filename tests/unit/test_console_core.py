"""The console's pure cores: the doctor's checks, the score table's arithmetic and the cache
ledger (the pages and the browser are tests/integration/test_console.py)."""

from __future__ import annotations

from control_plane.admin.console.doctor import Actual, Expected, RegisteredWorker, actual_from_debug_state, diagnose
from control_plane.admin.console.views import cache_ledger, parse_router_config, score_rows
from control_plane.router import RouterConfig
from schemas.events import CandidateScore, RequestRouted
from schemas.types import RoutingMode

EXP = Expected(block_size=64, hash_algo="sha256", topic_prefix="sy")


def _w(wid: str, **kw) -> RegisteredWorker:
    base = dict(worker_id=wid, epoch=1, state="ready", endpoint=f"http://127.0.0.1/{wid}", block_size=64,
                hash_algo="sha256", capacity={"device": 100})
    return RegisteredWorker(**{**base, **kw})


def test_doctor_is_clean_when_everything_agrees() -> None:
    idx = {"w1": {"device": frozenset({1, 2, 3})}}
    rep = diagnose(EXP, [_w("w1"), _w("w2")], idx,
                   {"w1": Actual(epoch=1, blocks={"device": frozenset({1, 2, 3})}), "w2": Actual(epoch=1)})
    assert rep.ok and rep.checked_workers == 2
    assert [a.agreement for a in rep.agreement] == [1.0, 1.0]


def test_doctor_names_each_mismatch_with_a_fix() -> None:
    workers = [_w("bs", block_size=32), _w("algo", hash_algo="xxhash@ab12"), _w("tiers", capacity={"gpu": 1}),
               _w("prefix", epoch=5), _w("drift"), _w("down"), _w("gone", state="gone", block_size=16)]
    actual = {"bs": Actual(epoch=1), "algo": Actual(epoch=1), "tiers": Actual(epoch=1), "prefix": Actual(epoch=9),
              "drift": Actual(epoch=1, blocks={"device": frozenset({1})}), "down": Actual(error="ConnectError")}
    idx = {"drift": {"device": frozenset({1, 2, 3, 4}), "host": frozenset({5})}}
    rep = diagnose(EXP, workers, idx, actual)
    got = {(m.worker_id, m.check) for m in rep.mismatches}
    assert got == {("bs", "block_size"), ("algo", "hash_algo"), ("tiers", "tier_names"), ("prefix", "topic_prefix"),
                   ("drift", "index_agreement"), ("down", "reachable")}
    fixes = {m.check: m.fix for m in rep.mismatches}
    assert "--block-size 64" in fixes["block_size"] and "PYTHONHASHSEED" in fixes["hash_algo"]
    assert "SWITCHYARD_TOPIC_PREFIX=sy" in fixes["topic_prefix"]
    drift = next(a for a in rep.agreement if a.worker_id == "drift")
    assert drift.agreement == 1 / 5 and drift.tiers == {"device": (1, 3, 0), "host": (0, 1, 0)}


def test_debug_state_reads_every_tier() -> None:
    a = actual_from_debug_state({"epoch": 3, "device_cached": [1, 2], "tiers": {"host": [3], "disk": []}})
    assert a.epoch == 3 and a.blocks == {"device": frozenset({1, 2}), "host": frozenset({3})}


def test_score_rows_add_up_and_flag_a_row_that_does_not() -> None:
    cfg = RouterConfig(prefill_load_scale=2.0)
    routed = RequestRouted(request_id="r", worker_id="a", mode=RoutingMode.KV, config_version=1, rng_seed=0, scores=[
        CandidateScore(worker_id="b", prefill_blocks=3.0, decode_blocks=1.0, cost=7.0),
        CandidateScore(worker_id="a", prefill_blocks=1.5, decode_blocks=2.0, cost=5.0),
        CandidateScore(worker_id="c", prefill_blocks=1.0, decode_blocks=1.0, cost=9.0)])
    rows = score_rows(routed, cfg)
    assert [r.worker_id for r in rows] == ["a", "b", "c"] and rows[0].chosen
    assert [r.adds_up for r in rows] == [True, True, False]
    rr = RequestRouted(request_id="r", worker_id="a", mode=RoutingMode.ROUND_ROBIN, config_version=1, rng_seed=0,
                       scores=[CandidateScore(worker_id="a")])
    assert score_rows(rr, cfg)[0].adds_up is None


def test_cache_ledger_puts_prediction_beside_what_happened() -> None:
    evs = [{"type": "RequestAdmitted", "payload": {"block_size": 64, "prompt_tokens": 400}},
           {"type": "RequestRouted", "payload": {"phase": "prefill", "worker_id": "p", "scores": [
               {"worker_id": "p", "overlap_blocks": 5, "speculative_overlap": 1}, {"worker_id": "q"}]}},
           {"type": "PrefillCompleted", "payload": {"cached_tokens": 320}},
           {"type": "RequestRouted", "payload": {"phase": "decode", "worker_id": "d", "scores": []}},
           {"type": "KvTransferCompleted", "payload": {"blocks": 7}},
           {"type": "RequestCompleted", "payload": {"cached_tokens": 0}}]
    led = cache_ledger(evs)
    assert (led.predicted_blocks, led.predicted_tokens, led.engine_cached_tokens, led.nixl_blocks) == (5, 320, 320, 7)


def test_an_edited_config_is_checked_like_the_router_checks_it() -> None:
    assert parse_router_config('{"prefill_load_scale": 1}', 4).version == 4
    for bad in ("[1]", "{", '{"nope": 1}', '{"tier_weights": {"device": 0}}'):
        try:
            parse_router_config(bad, 1)
        except ValueError:
            continue
        raise AssertionError(bad)


def test_planner_lines_step_through_each_decision() -> None:
    from control_plane.admin.console.routes import pool_load, replica_lines
    from control_plane.admin.shapes import PlannerDecisionPublic

    ds = [PlannerDecisionPublic(decision_id=str(t), pool="p", occurred_at_ns=t, role="decode", from_replicas=1,
                                to_replicas=r, reason="", config_version=1, inputs={}, applied=None)
          for t, r in ((0, 1), (10, 3), (20, 2))]
    line = replica_lines(ds, width=100, height=42)["p"]
    assert line["last"] == 2 and line["top"] == 3
    assert line["points"].split() == ["0.0,27.3", "50.0,27.3", "50.0,2.0", "100.0,2.0", "100.0,14.7", "100.0,14.7"]
    w = dict(state="ready", pool="p", running=2, waiting=1, queued_prefill_tokens=10, active_decode_blocks=5,
             capacity={"device": 100}, tier_usage={"device": 0.5})
    load = pool_load([w, {**w, "tier_usage": {"device": 0.25}}, {**w, "state": "gone"}])
    assert load == {"p": {"ready": 2, "running": 4, "waiting": 2, "queued_prefill_tokens": 20,
                          "active_decode_blocks": 10, "device_blocks": 200, "device_usage": 0.375}}
