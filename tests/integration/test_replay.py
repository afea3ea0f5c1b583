"""Replay against a recorded run of real traffic: a real router and two mini workers
(tests/support/mini_worker.py) through the real broker.

* every recorded routing decision re-executes identically (table and rebuilt state);
* a tampered copy of one decision is reported as a mismatch with the differing fields;
* the state rebuilt at a snapshot's offsets (and at the live router's position) has the digest
  of the live view;
* the same answers from a file export of the log; whatif re-scores and simulates.
"""

from __future__ import annotations

import concurrent.futures as cf
import json

import httpx
import msgspec
import pytest

from control_plane.replay.engine import ReplayEngine
from control_plane.router import RouterConfig
from common.log.admin import apply_topics
from common.log.catalog import Catalog
from common.log.reader import FileLogReader, KafkaLogReader, MemoryLogReader, export_log
from common.net import free_port
from common.settings import BusSettings
from schemas import EventCodec
from schemas.events import RequestRouted
from schemas.signing import about_of
from schemas.types import RoutingMode
from tests.integration.test_router import Procs, _checkpointed, _view_caught_up, _wait_http
from tests.support.events import router_ids
from tests.support.waits import wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.fixture(scope="module")
def recorded(kafka_bootstrap: str, tmp_path_factory):
    """Run real traffic once; yield (bus, live view positions + digest at quiescence)."""
    import uuid

    bus = BusSettings(bootstrap=kafka_bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:10]}")
    apply_topics(bus)
    procs = Procs(bus)
    try:
        procs.worker("w1", "--token-delay", "0.01")
        procs.worker("w2", "--token-delay", "0.01")
        port = free_port()
        procs.router(port, rid="r-replay")
        base = f"http://127.0.0.1:{port}"
        _wait_http(f"{base}/health", lambda r: r.status_code == 200 and r.json()["workers"] == 2)
        with httpx.Client(base_url=base, timeout=30) as c:
            def send(rid: str, prompt, max_tokens: int = 4, stream: bool = False) -> None:
                r = c.post("/v1/completions", json={"model": "switchyard-sim", "prompt": prompt, "max_tokens": max_tokens,
                                                    "stream": stream, "request_id": rid})
                assert r.status_code == 200, r.text

            doc = list(range(5000, 5000 + 64 * 12))  # 12 shared blocks
            send("seq-0", doc + [1, 2])
            _wait_http(f"{base}/router/view", lambda r: r.json()["hashes"] >= 12)
            for i in range(1, 6):
                send(f"seq-{i}", doc + [7, i])
            # A session's three turns (docs/sessions.md): recorded with the worker of the previous
            # turn, which replay re-derives from the fold; a malformed id is refused, not recorded.
            talk = list(range(30000, 30000 + 64 * 3))
            for turn in range(3):
                talk += list(range(40000 + 100 * turn, 40000 + 100 * turn + 70))
                r = c.post("/v1/completions", json={"model": "switchyard-sim", "prompt": talk, "max_tokens": 4,
                                                    "request_id": f"sess-{turn}"}, headers={"x-session-id": "conv-1"})
                assert r.status_code == 200, r.text
            r = c.post("/v1/completions", json={"model": "switchyard-sim", "prompt": talk, "max_tokens": 4},
                       headers={"x-session-id": "x" * 300})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_session_id", r.text
            for i in range(6):
                send(f"uniq-{i}", list(range(90000 + i * 1000, 90000 + i * 1000 + 64 * (2 + i))))
            # Concurrent bursts: the router's in-flight ledger (speculative overlap, load) decides.
            with cf.ThreadPoolExecutor(6) as pool:
                for burst in range(3):
                    futs = [pool.submit(send, f"burst{burst}-{k}", doc + list(range(70000 + 64 * 3 * k + burst,
                                                                                      70000 + 64 * 3 * (k + 1))),
                                        6, k % 2 == 0) for k in range(6)]
                    for f in futs:
                        f.result()
                    _view_caught_up(base, bus, ("kv",))  # the burst's KV events are in the view
            # Under the client's own TTFT budget (the router has none): the test's terms are
            # recorded for those it admits and for the one it refuses (replay re-executes both).
            for i in range(3):
                r = c.post("/v1/completions", json={"model": "switchyard-sim", "prompt": doc + [9, i], "max_tokens": 4,
                                                    "request_id": f"budget-{i}"}, headers={"x-ttft-budget-ms": "60000"})
                assert r.status_code == 200, r.text
            r = c.post("/v1/completions", json={"model": "switchyard-sim", "prompt": doc + [9, 9], "max_tokens": 4,
                                                "request_id": "budget-refused"}, headers={"x-ttft-budget-ms": "0.001"})
            assert r.status_code == 429 and r.json()["error"]["code"] == "ttft_budget", r.text
            # Load reports and a checkpoint land: the view has folded the log as it is now, and a
            # snapshot of it is on the log.
            applied = _view_caught_up(base, bus)["applied"]
            wait_for(lambda: _checkpointed(bus, applied), timeout=30, what=f"a router-view checkpoint of {applied} records")
            view = _wait_http(f"{base}/router/view?digest=true", lambda r: r.status_code == 200).json()
        yield bus, view
    finally:
        procs.close()


def _engine(bus: BusSettings, reader=None) -> ReplayEngine:
    return ReplayEngine(reader or KafkaLogReader(bus.bootstrap), Catalog(bus.topic_prefix))


def _whole_log(bus: BusSettings, cat: Catalog) -> list:
    """Every record of the run's four streams, read back from the broker."""
    live = KafkaLogReader(bus.bootstrap)
    records = []
    for stream in ("kv", "workers", "requests", "snapshots"):
        t = cat.topic(stream)
        for p in live.partitions(t):
            lo, hi = live.bounds(t, p)
            records.extend(live.read(t, p, lo, hi))
    return records


def test_every_recorded_decision_reexecutes_identically(recorded) -> None:
    bus, _ = recorded
    report = _engine(bus).verify("start", "end", keep_checks=True)
    s = report.summary()
    assert report.decisions >= 6 + 6 + 18, s
    assert report.identical == report.decisions, [msgspec.to_builtins(m) for m in report.mismatches[:3]]
    assert report.table_matches == report.state_matches == report.decisions
    assert report.configs_assumed == []  # the router recorded its config (RouterConfigChanged v1) in the log
    # The budget test re-executed: the three admitted decisions are among the identical ones, and
    # the refusal gives its recorded reason again, with the margin and queue the ledger's fold gives.
    assert (report.rejections, report.rejections_matched) == (1, 1), report.rejection_mismatches
    codec, cat = EventCodec(), Catalog(bus.topic_prefix)
    routed = [e.data for e in (codec.decode(r.value) for r in _whole_log(bus, cat)
                               if r.topic == cat.topic("requests") and r.value) if isinstance(e.data, RequestRouted)]
    assert sum(1 for e in routed if e.admission is not None and e.admission.budget_ms == 60000.0) == 3
    turns = sorted((e for e in routed if e.session), key=lambda e: e.decided_at_s)
    assert [e.session for e in turns] == ["conv-1"] * 3
    assert [e.session_worker for e in turns] == ["", turns[0].worker_id, turns[1].worker_id]
    # The bursts exercised the ledger: some decision saw speculative overlap from in-flight requests.
    client = {rid: cid for cid, rid in router_ids(bus).items()}
    spec = [c for c in report.checks if client.get(c.request_id, "").startswith("burst")]
    assert len(spec) == 18


def test_a_tampered_decision_is_reported_with_the_differing_fields(recorded) -> None:
    bus, _ = recorded
    cat = Catalog(bus.topic_prefix)
    codec = EventCodec()
    records = _whole_log(bus, cat)
    mem = MemoryLogReader(records)
    seq3 = router_ids(bus)["seq-3"]
    # Alter one recorded decision: send it to the other worker and claim a bigger overlap.
    victim = next(r for r in records if r.topic == cat.topic("requests") and r.value
                  and isinstance((env := codec.decode(r.value)).data, RequestRouted)
                  and env.data.request_id == seq3)
    env = codec.decode(victim.value)
    other = next(s.worker_id for s in env.data.scores if s.worker_id != env.data.worker_id)
    scores = [msgspec.structs.replace(s, overlap_blocks=s.overlap_blocks + 1) if s.worker_id == other else s
              for s in env.data.scores]
    forged = msgspec.structs.replace(env, data=msgspec.structs.replace(env.data, worker_id=other, scores=scores))
    # Re-signed with the master (requests is a guarded stream: schemas/signing.py), as only the
    # stack's own tools can; an unsigned tamper would be refused as forged before any replay.
    master = bus.signer("security-test")
    mem.replace(victim.topic, victim.partition, victim.offset, master.sign(forged.type, forged.key, codec.encode(forged)))

    report = _engine(bus, mem).verify("start", "end")
    [bad] = [m for m in report.mismatches if m.request_id == seq3]
    # The forged record also taught the router ledger's TTFT fit (control_plane/router/ttft_fit.py)
    # that seq-3's time was the other worker's: every later decision's recorded model (fitted
    # from the true log) then differs from the state rebuilt through the forgery, and only there.
    for later in (m for m in report.mismatches if m.request_id != seq3):
        assert later.table == "match" and later.state == "mismatch", later
        assert ({d.split(":")[0].rsplit(".", 1)[-1] for d in later.state_diffs}
                <= {"ttft_model", "ttft_models", "predicted_ttft_ms", "admission"}), later.state_diffs
    assert report.table_matches == report.decisions - 1
    assert bad.request_id == seq3 and bad.recorded_worker == other
    assert bad.table == "mismatch" and bad.state == "mismatch"
    assert bad.state_worker == env.data.worker_id  # the rebuilt state chooses what the router chose
    assert any(d.startswith("worker_id:") for d in bad.state_diffs)
    assert any(f"scores[{other}].overlap_blocks" in d for d in bad.input_diffs), bad.input_diffs


def test_a_log_written_before_v2_request_events_replays_identically(recorded) -> None:
    """Every request event of the run re-encoded as v1 wrote it (the request id in the payload
    and in ``corr`` besides the key), re-signed: the codec upcasts them and every decision still
    re-executes identically."""
    bus, _ = recorded
    cat = Catalog(bus.topic_prefix)
    codec = EventCodec()
    records = _whole_log(bus, cat)
    mem = MemoryLogReader(records)
    master = bus.signer("security-test")
    old = 0
    for r in records:
        if r.topic != cat.topic("requests") or not r.value:
            continue
        env = codec.decode(r.value)
        assert env.version == codec.latest_version(env.type) and "request_id" not in msgspec.msgpack.decode(r.value)["data"]
        if env.type == "FirstToken":  # no v1: the type came later (the log is as a router of either age wrote it)
            continue
        v1 = codec.payload_type(env.type, 1)(**msgspec.structs.asdict(env.data))
        was = msgspec.structs.replace(env, version=1, data=v1, correlation_id=env.key)
        value = codec.encode(was)
        assert value.count(env.key.encode()) == 3  # key, corr, payload
        mem.replace(r.topic, r.partition, r.offset, master.sign(was.type, was.key, value, about_of(v1)))
        old += 1
    assert old >= 4 * 30
    report = _engine(bus, mem).verify("start", "end")
    assert report.decisions >= 6 + 6 + 18
    assert report.identical == report.table_matches == report.state_matches == report.decisions, report.summary()


def test_state_at_a_snapshot_equals_the_live_view_snapshotted_there(recorded) -> None:
    bus, live = recorded
    engine = _engine(bus)
    snaps = [s for s in engine.snapshots() if s.key.startswith("router-view:sha256:64")]
    assert snaps, "the router wrote no snapshot"
    snap = max(snaps, key=lambda s: s.applied)
    live_view = engine._load_snapshot(snap)
    at = json.dumps({f"{t}:{p}": o for (t, p), o in snap.positions.items()})
    state, view = engine.state(at, use_snapshots=False, with_requests=False)
    assert state["snapshot"] is None and view.positions == live_view.positions
    assert view.digest() == live_view.digest()
    # And the live router's own view at quiescence (positions and digest from /router/view).
    state, view = engine.state(json.dumps(live["positions"]), use_snapshots=False)
    assert view.digest() == live["digest"]
    assert state["load"]["completed"] >= 30 and state["load"]["inflight"] == 0
    assert all(v["inflight_entries"] == 0 for v in state["ledgers"].values())
    # From the newest snapshot plus the tail: the same view.
    state2, view2 = engine.state(json.dumps(live["positions"]), use_snapshots=True, with_requests=False)
    assert state2["snapshot"] is not None and view2.digest() == live["digest"]


def test_export_file_gives_the_same_answers_and_whatif_rescores(recorded, tmp_path) -> None:
    bus, live = recorded
    cat = Catalog(bus.topic_prefix)
    path = tmp_path / "run.sylog"
    n = export_log(KafkaLogReader(bus.bootstrap), [cat.topic(s) for s in ("kv", "workers", "requests", "snapshots")],
                   path, frame_records=50)
    assert n > 50
    engine = _engine(bus, FileLogReader(path))
    _, view = engine.state(json.dumps(live["positions"]), with_requests=False)
    assert view.digest() == live["digest"]
    report = engine.verify()
    assert report.identical == report.decisions > 0
    # What-if under the recorded config is the live router again: every decision re-scores to the
    # recorded choice, and the closed-loop simulations of the two sides are the same run.
    [recorded_config] = _engine(bus).router_configs().values()  # the admin stream is not in the export
    same = engine.whatif("start", "end", recorded_config)
    assert same.rescored == report.decisions and same.changed == 0 and same.errors == 0
    strip = lambda side: {k: v for k, v in same.simulation[side]["summary"].items() if k != "decide_us"}  # noqa: E731 - wall time
    assert strip("baseline") == strip("alternative")
    assert all(v in (0, 0.0) for v in same.simulation["delta"].values()), same.simulation["delta"]
    # Round robin ignores the cache: the shared-prefix requests spread, avoidable prefill grows.
    w = engine.whatif("start", "end", RouterConfig(version=2, mode=RoutingMode.ROUND_ROBIN))
    assert w.rescored == report.decisions and w.changed > 0
    assert w.avoidable_prefill_tokens_alternative > w.avoidable_prefill_tokens_recorded
    sim = w.simulation
    assert sim["baseline"]["summary"]["requests"] == sim["alternative"]["summary"]["requests"] >= 30
    assert sim["alternative"]["prefill_tokens_computed"] >= sim["baseline"]["prefill_tokens_computed"]


def test_cli_commands(recorded, tmp_path) -> None:
    from typer.testing import CliRunner

    from control_plane.replay.cli import replay_app

    bus, live = recorded
    run = CliRunner()
    env = {"SWITCHYARD_KAFKA_BOOTSTRAP": bus.bootstrap}
    common = ["--prefix", bus.topic_prefix, "--no-progress"]
    r = run.invoke(replay_app, ["verify", *common, "--json", "--plot", str(tmp_path / "v.png")], env=env)
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["identical"] == out["decisions"] > 0 and (tmp_path / "v.png").read_bytes()[:4] == b"\x89PNG"
    r = run.invoke(replay_app, ["state", *common, "--json", "--at", json.dumps(live["positions"])], env=env)
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["view"]["digest"] == live["digest"]
    (tmp_path / "alt.toml").write_text('mode = "least_loaded"\nversion = 9\n')
    r = run.invoke(replay_app, ["whatif", *common, "--router-config", str(tmp_path / "alt.toml"), "--no-sim"], env=env)
    assert r.exit_code == 0 and "re-scored" in r.output, r.output
    r = run.invoke(replay_app, ["state", *common, "--at", "yesterday"], env=env)
    assert r.exit_code == 2 and "not a point of the log" in r.output


def test_reconcile_sets_each_prediction_beside_the_engine_outcome(recorded) -> None:
    """The sequential requests reuse a prefix the view had folded before each was sent
    (``seq-0``'s 12 blocks), so each of ``seq-1..5`` saw what its worker then reported cached."""
    from typer.testing import CliRunner

    from control_plane.replay.cli import replay_app

    bus, _ = recorded
    r = CliRunner().invoke(replay_app, ["reconcile", "--prefix", bus.topic_prefix, "--no-progress", "--json"],
                           env={"SWITCHYARD_KAFKA_BOOTSTRAP": bus.bootstrap})
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    checks = {c["request_id"]: c for c in out["checks"]}
    assert out["requests"] == len(checks) > 0 and out["unmatched"] == 0
    seq = [c for rid, c in checks.items() if rid and c["seen_blocks"] >= 12]
    assert seq and all(c["cached_blocks"] == c["predicted_blocks"] == 12 and not c["blame"] for c in seq)
