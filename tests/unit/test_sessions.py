"""Sessions (issue 39 item 6): the fold of ``RequestRouted.session``, the bounded affinity that
yields to predicted TTFT, its re-execution from the recorded event, and the key opt-in for the
OpenAI ``user`` field.

Core-only, no mocks: the real ``decide`` over the real ledger, recorded as the router records.
"""

from __future__ import annotations

import msgspec
import pytest

from control_plane.replay.verify import DecisionRecord, check_table
from control_plane.router import RouterConfig, RoutingRequest, WorkerLoad, WorkerOverlap
from control_plane.router.errors import RouterConfigError
from control_plane.router.inputs import DecisionInputs, execute, routed_event
from control_plane.router.keys import KeyTable
from control_plane.router.ledger import RouterLedger
from control_plane.router import sessions as sessions_mod
from control_plane.router.sessions import SessionTable, affinity
from schemas import EnvelopeFactory
from schemas.events import RequestAdmitted, RequestRouted, RouterKeyIssued, TtftModel
from schemas.types import RequestPhase, RoutingMode

BS = 16
_MODEL = TtftModel(base_ms=10.0, step_ms=0.0, ms_per_token=0.1, ms_per_token_ctx=0.0, samples=9, pool_samples=9)


def _req(rid: str = "q") -> RoutingRequest:
    return RoutingRequest(request_id=rid, prompt_tokens=40 * BS, block_size=BS, block_hashes=tuple(range(1, 41)),
                          expected_output_tokens=16)


def _inputs(session_worker: str, *, queued_b: int = 0, session: str = "s1") -> DecisionInputs:
    """Two workers: ``a`` holds 30 of the prompt's 40 blocks (the kv argmin), ``b`` none, with
    ``queued_b`` prefill tokens of the router's own queued ahead of it."""
    workers = [WorkerLoad(worker_id="a"), WorkerLoad(worker_id="b", queued_prefill_tokens=queued_b)]
    return DecisionInputs(request=_req(), workers=workers, overlaps={"a": WorkerOverlap.of(device=30)}, inflight={},
                          rng_seed=7, ttft_models={"a": _MODEL, "b": _MODEL}, session=session,
                          session_worker=session_worker)


def _row(d, wid: str):
    return next(r for r in d.scores if r.worker_id == wid)


def test_the_affinity_keeps_the_sessions_worker_within_the_margin() -> None:
    """a: 10 uncached blocks = 160 tokens x 0.1 + 10 = 26 ms; b: 640 x 0.1 + 10 = 74 ms. The
    session on b is kept with a margin of 50 ms (74 <= 26 + 50) and yields with 40 (74 > 66)."""
    kept = execute(_inputs("b"), RouterConfig(session_affinity=True, session_margin_ms=50.0))
    assert kept.worker_id == "b" and _row(kept, "b").session_affinity == "applied"
    assert _row(kept, "a").session_affinity == "" and "session affinity kept b" in kept.reason
    assert _row(kept, "a").predicted_ttft_ms == pytest.approx(26.0) and _row(kept, "b").predicted_ttft_ms == pytest.approx(74.0)
    gone = execute(_inputs("b"), RouterConfig(session_affinity=True, session_margin_ms=40.0))
    assert gone.worker_id == "a" and _row(gone, "b").session_affinity == "yielded"
    assert "session affinity yielded" in gone.reason
    rel = execute(_inputs("b"), RouterConfig(session_affinity=True, session_margin_ms=0.0, session_margin_rel=2.0))
    assert rel.worker_id == "b"  # 74 <= 26 + 2 x 26


def test_off_by_default_and_only_for_kv() -> None:
    assert execute(_inputs("b"), RouterConfig()).worker_id == "a"
    assert all(r.session_affinity == "" for r in execute(_inputs("b"), RouterConfig()).scores)
    rr = execute(_inputs("b"), RouterConfig(mode=RoutingMode.RANDOM, session_affinity=True, session_margin_ms=1e6))
    assert all(r.session_affinity == "" for r in rr.scores)
    same = execute(_inputs("a"), RouterConfig(session_affinity=True))
    assert same.worker_id == "a" and _row(same, "a").session_affinity == "applied"
    gone = execute(_inputs("zz"), RouterConfig(session_affinity=True))
    assert gone.worker_id == "a" and "not a candidate" in gone.reason


def test_a_session_worker_the_guards_leave_out_is_yielded() -> None:
    inputs = msgspec.structs.replace(_inputs("b"), workers=[
        WorkerLoad(worker_id="a"), WorkerLoad(worker_id="b", draining=True)])
    d = execute(inputs, RouterConfig(session_affinity=True, session_margin_ms=1e6))
    assert d.worker_id == "a" and _row(d, "b").session_affinity == "yielded"


def test_the_pure_rule() -> None:
    assert affinity(["a", "b", "c"], [0, 1, 2], 0, [10.0, 20.0, 5.0], "b", 10.0, 0.0)[:3] == (1, 1, "applied")
    assert affinity(["a", "b", "c"], [0, 1, 2], 0, [10.0, 20.5, 5.0], "b", 10.0, 0.0)[:3] == (0, 1, "yielded")
    assert affinity(["a", "b"], [0], 0, [10.0, 1.0], "b", 10.0, 0.0)[:3] == (0, 1, "yielded")


def _record(inputs: DecisionInputs, config: RouterConfig) -> DecisionRecord:
    d = execute(inputs, config)
    ev = routed_event(d, inputs, config, index_position={"t.kv:0": 3}, router_id="r", decided_at_s=100.0)
    adm = RequestAdmitted(request_id="q", model="m", prompt_tokens=40 * BS, max_tokens=16,
                          block_hashes=list(range(1, 41)), block_size=BS, hash_algo="sha256")
    return DecisionRecord(routed=ev, admitted=adm, at_ns=10**11, producer="r", epoch=1, position="t.requests:0:1",
                          event_id="e")


def test_a_decision_with_affinity_re_executes_from_its_event_and_old_events_decode() -> None:
    """The event records the session and the worker the fold gave (``session_worker``): the
    table check re-executes it bit for bit; without the field (an older event) the same
    decision is one without affinity, so a config that turns it on later does not change how
    an old decision re-executes."""
    config = RouterConfig(version=2, session_affinity=True, session_margin_ms=50.0)
    rec = _record(_inputs("b"), config)
    assert rec.routed.session == "s1" and rec.routed.session_worker == "b" and rec.routed.worker_id == "b"
    status, _, diffs = check_table(rec, config)
    assert status == "match", diffs
    wire = msgspec.json.encode(rec.routed)
    assert msgspec.json.decode(wire, type=RequestRouted) == rec.routed
    old = _record(_inputs("", session=""), RouterConfig(version=2))
    raw = msgspec.json.decode(msgspec.json.encode(old.routed))
    assert "session" not in raw and "session_worker" not in raw  # omitted defaults: old bytes unchanged
    assert all("session_affinity" not in r for r in raw["scores"])
    status, _, diffs = check_table(old, config)
    assert status == "match", diffs


def _routed(rid: str, worker: str, session: str, at: float, phase=RequestPhase.AGGREGATED) -> RequestRouted:
    return RequestRouted(request_id=rid, worker_id=worker, phase=phase, mode=RoutingMode.KV, config_version=1,
                         rng_seed=1, decided_at_s=at, inflight_prefill_tokens=0, inflight_blocks=1,
                         inflight_ttl_s=600.0, session=session)


def test_the_ledger_folds_sessions_with_an_age_bound() -> None:
    """The fold keeps each session's last prefill-bearing turn; a decode phase does not move
    it; the lookup ignores an entry older than the config's age."""
    f = EnvelopeFactory("r", 1, lambda: 0)
    led = RouterLedger(600.0)
    for ev in (_routed("a", "w1", "s1", 10.0), _routed("b", "w2", "s1", 20.0),
               _routed("b", "d9", "s1", 21.0, RequestPhase.DECODE), _routed("c", "w3", "s2", 30.0)):
        led.apply(f.wrap(ev, correlation_id=ev.request_id))
    assert led.sessions.worker("s1", 25.0, 60.0) == "w2"
    assert led.sessions.worker("s1", 90.0, 60.0) == ""  # routed 70 s before: older than the bound
    assert led.sessions.worker("s2", 31.0, 60.0) == "w3" and led.sessions.worker("nope", 31.0, 60.0) == ""


def test_the_table_is_bounded_in_size_and_age(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sessions_mod, "SESSIONS_MAX", 3)
    t = SessionTable()
    for i in range(5):
        t.routed(f"s{i}", "w", float(i))
    assert len(t) == 3 and "s0" not in t and "s1" not in t and t.evicted == 2
    t.routed("s2", "w", 5.0)  # touched: now the most recent
    t.routed("s5", "w", 6.0)
    assert "s3" not in t and "s2" in t
    t.routed("s6", "w", 6.0 + sessions_mod.SESSION_MAX_AGE_S + 1)
    assert list(t._entries) == ["s6"]  # every older entry dropped by the fold's own age bound


def test_config_bounds() -> None:
    with pytest.raises(RouterConfigError, match="session_ttl_s"):
        RouterConfig(session_ttl_s=sessions_mod.SESSION_MAX_AGE_S + 1)
    with pytest.raises(RouterConfigError, match="session_margin_ms"):
        RouterConfig(session_margin_ms=-1.0)


def test_a_key_opts_in_to_user_as_the_session() -> None:
    """``RouterKeyIssued.session_from_user`` (default off, omitted) folds into the key table."""
    f = EnvelopeFactory("admin", 1, lambda: 0)
    table = KeyTable()
    for kid, opt in (("0000000a", True), ("0000000b", False)):
        table.apply(f.wrap(RouterKeyIssued(key_id=kid, name=kid, salt="00", key_hash="00", actor="t",
                                           actor_role="admin", session_from_user=opt), correlation_id=kid))
    assert table.session_from_user("sk-sy_0000000a_secret") and not table.session_from_user("sk-sy_0000000b_secret")
    assert not table.session_from_user(None) and not table.session_from_user("sk-sy_0000000c_x")
    assert "session_from_user" not in msgspec.json.decode(msgspec.json.encode(
        RouterKeyIssued(key_id="k", name="k", salt="0", key_hash="0", actor="t", actor_role="admin")))


def test_a_simulated_routers_session_decisions_re_execute_from_the_log() -> None:
    """Virtual time, 3 aggregated workers, 2 sessions of 6 turns each beside session-less
    traffic: every decision's table re-executes to the same event, and each decision re-executed
    on a ledger folded from the log up to it (the state check) reads the same session worker."""
    from control_plane.replay.verify import check_state
    from control_plane.router.inputs import decision_inputs
    from control_plane.simulation import SimRouter
    from schemas.types import WorkerRole

    cfg = RouterConfig(session_affinity=True, session_margin_ms=3.0, session_ttl_s=60.0)
    r = SimRouter(cfg, [(f"w{i}", WorkerRole.AGGREGATED) for i in range(3)], hash_algo="xxh3_64", block_size=64,
                  kv_capacity_blocks=1024, record=True)
    r.sessions = {f"t{i}": f"s{i % 2}" for i in range(12)}
    t = 1000.0
    for i in range(12):
        for rid, tokens in ((f"t{i}", 400 + 100 * i), (f"x{i}", 700 + 30 * (i % 5))):
            r.admit(rid, [], tokens, 8, t)
            w = r.route(rid, RequestPhase.AGGREGATED, t)
            r.on_first_token(w, rid, t + 5 + i)
            if i % 3:
                r.on_complete(w, rid, t + 40)
            t += 2.0
    routed = [e for e in r.recorded if isinstance(e.data, RequestRouted)]
    adm = {e.data.request_id: e.data for e in r.recorded if isinstance(e.data, RequestAdmitted)}
    verdicts = {row.session_affinity for e in routed for row in e.data.scores} - {""}
    assert verdicts == {"applied", "yielded"}, verdicts
    assert sum(1 for e in routed if e.data.session_worker) == 10  # every turn but each session's first
    folded = RouterLedger(cfg.inflight_ttl_s)
    for e in r.recorded:
        ev = e.data
        if isinstance(ev, RequestRouted):
            a = adm[ev.request_id]
            rec = DecisionRecord(routed=ev, admitted=a, at_ns=e.occurred_at_ns, producer=e.producer, epoch=e.epoch,
                                 position="requests:0:0", event_id=e.event_id)
            assert check_table(rec, cfg)[0] == "match"
            inputs = decision_inputs(r, folded, request_id=ev.request_id, prompt_tokens=a.prompt_tokens,
                                     block_hashes=a.block_hashes, block_size=a.block_size,
                                     expected_output_tokens=ev.expected_output_tokens, phase=ev.phase,
                                     attempt=ev.attempt, now=ev.decided_at_s, session=ev.session,
                                     session_ttl_s=cfg.session_ttl_s)
            verdict, _, diffs, _ = check_state(rec, inputs, cfg)
            assert verdict == "match", diffs
        folded.apply(e)
    assert len(folded.sessions) == 2


class _Head:
    """A request's head as the routes read it (``serving.Head``)."""

    arrived_at = 0.0

    def __init__(self, **headers: str) -> None:
        self.headers = {k.lower().replace("_", "-"): v for k, v in headers.items()}

    def header(self, name: str) -> str | None:
        return self.headers.get(name)


def test_the_session_comes_from_the_header_or_an_opted_in_keys_user_field() -> None:
    from types import SimpleNamespace

    from control_plane.router.errors import InvalidRequest
    from control_plane.router.protocol import CompletionRequest
    from control_plane.router.serving import RouterAuth, _session

    f = EnvelopeFactory("admin", 1, lambda: 0)
    table = KeyTable()
    for kid, opt in (("0000000a", True), ("0000000b", False)):
        table.apply(f.wrap(RouterKeyIssued(key_id=kid, name=kid, salt="00", key_hash="00", actor="t",
                                           actor_role="admin", session_from_user=opt), correlation_id=kid))
    c = SimpleNamespace(auth=RouterAuth(table=table))
    body = CompletionRequest(prompt="hi", user="alice")
    opted, other = "Bearer sk-sy_0000000a_s", "Bearer sk-sy_0000000b_s"
    assert _session(c, body, _Head(authorization=opted)) == "alice"
    assert _session(c, body, _Head(authorization=other)) == ""
    assert _session(c, body, _Head(authorization=other, x_session_id="conv-9")) == "conv-9"
    assert _session(c, body, _Head(authorization=opted, x_session_id="conv-9")) == "conv-9"  # the header wins
    assert _session(SimpleNamespace(auth=None), body, _Head()) == ""  # keys off: user stays metadata
    for bad in ("", "x" * 257, "caf\u00e9", "a\tb"):
        with pytest.raises(InvalidRequest, match="x-session-id"):
            _session(c, body, _Head(x_session_id=bad))
