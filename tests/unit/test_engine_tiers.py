"""Onboarding: the engine loads a prefix held below the device instead of recomputing it, when
that is cheaper, and recomputes what does not load. Over the simulation's virtual tiers and
over a real KVBM (host memory and a disk directory, real bytes, verified)."""

from __future__ import annotations

from pathlib import Path

import pytest

from data_plane.engines import EngineCore, EngineRequest, default_hash_config, load_profile
from data_plane.engines.profiles import Admission
from data_plane.engines.tiers import (
    DEFAULT_LINKS,
    OnboardCosts,
    TierLink,
    VirtualTiers,
    plan_onboard,
    prefill_ms,
    tier_weights,
)
from data_plane.kvbm import ADMIT_ALL, KvbmSettings, build_kvbm
from data_plane.workers.onboard import KvbmTiers
from common.log.sink import MemorySink
from schemas.events import BlockRemoved, BlockStored
from schemas.types import Tier

HOST, DISK, OBJECT, DEVICE = Tier.HOST, Tier.DISK, Tier.OBJECT, Tier.DEVICE
BS = 4
#: Prompt A: 4 full blocks and one token (the last token is always computed).
PROMPT_A = list(range(100, 117))
#: Prompt B: 29 tokens, 8 blocks: takes the whole 8-block device pool, evicting all of A.
PROMPT_B = list(range(500, 529))


def _profile(**overrides):
    base = dict(block_size=BS, num_device_blocks=8, max_num_seqs=4, max_num_batched_tokens=64,
                admission=Admission.CHUNK, reuse_uncached_first=False)
    base.update(overrides)
    return load_profile("mocker").replace(name="tiny", **base)


def _virtual_core(costs: OnboardCosts | None = None, host: int = 16, disk: int = 0, **profile):
    prof = _profile(**profile)
    hc = default_hash_config(BS)
    core = EngineCore(prof, hash_config=hc, onboard_costs=costs)
    tiers = VirtualTiers({HOST: host, DISK: disk}, worker_id=core.worker_id, block_size=BS,
                         hash_algo=hc.hash_algo, emit=core.pool.queue_event)
    core.pool.on_evict = tiers.on_device_evicted
    core.scheduler.tiers = tiers
    return core, tiers


def _run(core: EngineCore, rid: str, prompt: list[int], steps: list | None = None):
    """Run one request alone to its end; return (its admission step, every KV event); every
    step's result goes to ``steps`` when given."""
    core.add_request(EngineRequest(request_id=rid, prompt=prompt, max_tokens=1))
    first = None
    while core.has_work():
        res = core.step()
        if steps is not None:
            steps.append(res)
        if first is None:
            first = res
    return first, core.take_kv_events()


def _offload_a(core: EngineCore) -> list[int]:
    """Cache A on the device, then let B evict it (offloaded to the tiers); A's block hashes."""
    _run(core, "a", PROMPT_A)
    hashes = list(core.scheduler.kv.pool.cached_hashes())
    _run(core, "b", PROMPT_B)
    assert not set(hashes) & core.pool.cached_hashes()
    return hashes


def _device_stores(events):
    return [e for e in events if isinstance(e, BlockStored) and e.tier is DEVICE]


def test_offloaded_prefix_is_onboarded_not_recomputed():
    """A's 4 blocks were evicted to host. A again: 0 device hits, 4 host blocks. Loading one
    4-token block of 512 KiB at 25 GB/s takes 0.021 ms; recomputing it ~0.06 ms: all 4 load.
    The load runs beside the steps; with nothing else to compute, the admission step is a stall
    of the load's 4 * 0.021 ms, and the next step computes the last token: prefill_ms(1)."""
    core, tiers = _virtual_core()
    hashes = _offload_a(core)
    assert tiers.count(HOST) == 4
    steps: list = []
    step, events = _run(core, "a2", PROMPT_A, steps)
    assert step.admitted == [("a2", 16)]
    st = core.onboard_stats()
    assert st.loaded == {HOST: 4} and st.skipped == 0 and st.fallbacks == {}
    load = OnboardCosts().load_ms({HOST: 4}, BS)
    assert load == pytest.approx(4 * 1e3 * BS * 131072 / 25e9)
    assert step.onboarded == (("a2", 16, pytest.approx(load)),)
    assert (step.shape.prefill_tokens, step.tokens, step.num_scheduled) == (0, [], 1)
    assert step.duration_ms == pytest.approx(load)
    assert len(steps) == 2 and steps[1].shape.prefill_tokens == 1
    assert steps[1].duration_ms == pytest.approx(core.timing.prefill_ms(1))
    onboarded = [e for e in _device_stores(events) if e.source_tier is HOST]
    assert sorted(h for e in onboarded for h in e.block_hashes) == sorted(hashes)
    assert tiers.moves[("host", "device")] == 4


def test_a_load_runs_beside_the_steps_of_other_requests():
    """X decodes while A2's 4 host blocks load (0.084 ms): the step that admits A2 is X's
    decode step alone, no longer by the load (only A2 waits for it); A2 computes its last token
    in the next step, beside X. Two loads share the one host -> device link: the second is in
    once both are."""
    core, tiers = _virtual_core()
    _offload_a(core)
    core.add_request(EngineRequest(request_id="x", prompt=[900, 901], max_tokens=8))
    core.step()  # x's prefill
    core.add_request(EngineRequest(request_id="a2", prompt=PROMPT_A, max_tokens=1))
    admit = core.step()
    load = OnboardCosts().load_ms({HOST: 4}, BS)
    assert admit.admitted == [("a2", 16)] and admit.onboarded == (("a2", 16, pytest.approx(load)),)
    assert [t.request_id for t in admit.tokens] == ["x"]
    assert admit.duration_ms == pytest.approx(core.timing.step_ms(admit.shape))
    assert admit.shape.prefill_tokens == 0 and admit.shape.decode_seqs == 1
    nxt = core.step()
    assert sorted(t.request_id for t in nxt.tokens) == ["a2", "x"]
    assert nxt.shape.prefill_tokens == 1 and nxt.shape.decode_seqs == 1



def test_loads_queue_on_the_one_host_to_device_link():
    """A and C (4 full blocks each) are offloaded; A2 and C2 arrive together and are admitted in
    one step, both loading: C2's load starts when A2's is done, so C2 waits for both (2 x 0.084
    ms); the step is the stall until A2's is in, then A2 computes while C2 still waits."""
    core, _ = _virtual_core(host=16, num_device_blocks=16)
    prompt_c = list(range(300, 317))
    _run(core, "a", PROMPT_A)
    _run(core, "c", prompt_c)
    _run(core, "d", list(range(700, 763)))  # 16 blocks: evicts A and C to host
    core.add_request(EngineRequest(request_id="a2", prompt=PROMPT_A, max_tokens=1))
    core.add_request(EngineRequest(request_id="c2", prompt=prompt_c, max_tokens=1))
    load = OnboardCosts().load_ms({HOST: 4}, BS)
    admit = core.step()
    assert admit.onboarded == (("a2", 16, pytest.approx(load)), ("c2", 16, pytest.approx(2 * load)))
    assert admit.duration_ms == pytest.approx(load) and admit.tokens == []
    a2 = core.step()  # A2's last token; C2's load is in by the end of this (longer) step
    assert [t.request_id for t in a2.tokens] == ["a2"] and a2.duration_ms > load
    c2 = core.step()
    assert [t.request_id for t in c2.tokens] == ["c2"] and not core.has_work()


def test_a_slow_tier_is_skipped_when_recompute_is_cheaper():
    """Host at 1 MB/s: 4 blocks of 512 KiB take 2 s to load, recomputing 16 tokens ~0.25 ms."""
    core, _ = _virtual_core(OnboardCosts(links={HOST: TierLink(1e6)}))
    _offload_a(core)
    step, events = _run(core, "a2", PROMPT_A)
    assert step.admitted == [("a2", 0)]
    st = core.onboard_stats()
    assert st.loaded == {} and st.skipped == 4
    assert step.shape.prefill_tokens == 17
    assert all(e.source_tier is None for e in _device_stores(events))


def test_a_corrupt_tier_block_falls_back_to_recompute_and_is_recorded():
    core, tiers = _virtual_core()
    _offload_a(core)
    # The order A's blocks have in the prompt (the hash chain), from the engine's own hashing.
    core.add_request(EngineRequest(request_id="probe", prompt=PROMPT_A, max_tokens=1))
    req = core.scheduler.waiting[0]
    core.kv.ensure_hashes(req, 4)
    chain = list(req.hashes[:4])
    core.abort("probe")
    tiers.fail[chain[2]] = "corrupt"
    steps: list = []
    step, events = _run(core, "a2", PROMPT_A, steps)
    assert step.admitted == [("a2", 8)]  # blocks 0 and 1 loaded, 2 and 3 recomputed
    st = core.onboard_stats()
    assert st.loaded == {HOST: 2} and st.fallbacks == {"corrupt": 2}
    assert [s.shape.prefill_tokens for s in steps] == [0, 17 - 8]  # the load's stall, then compute
    assert any(isinstance(e, BlockRemoved) and e.tier is HOST and e.block_hashes == [chain[2]]
               for e in events)
    by_source = {h: e.source_tier for e in _device_stores(events) for h in e.block_hashes}
    assert [by_source[h] for h in chain] == [HOST, HOST, None, None]


def test_plan_loads_the_cheapest_leading_run():
    """Host blocks first, then object blocks: object's 30 ms latency never pays for itself on
    short prompts, so the plan stops at the end of the host run."""
    timing = load_profile("mocker").timing
    costs = OnboardCosts()
    plan = plan_onboard([HOST, HOST, OBJECT, OBJECT], cached_blocks=1, num_tokens=6 * 64 + 1,
                        block_size=64, costs=costs, timing=timing)
    assert plan.load_blocks == 2 and plan.sources == (HOST, HOST)
    assert plan.recompute_ms == pytest.approx(prefill_ms(timing, 64, 6 * 64 + 1))
    assert plan.saved_ms > 0
    empty = plan_onboard([], cached_blocks=0, num_tokens=10, block_size=64, costs=costs,
                         timing=timing)
    assert empty.load_blocks == 0 and empty.reason == "nothing below the device"


def test_plan_times_recompute_in_the_engines_chunks():
    """Recompute is timed as the engine runs it, in chunks of max_num_batched_tokens (8,192 on
    the mocker): 80,000 tokens are ten steps, 1,650.5 ms, not one 80,000-token step (3,925.6 ms,
    whose T^2 term no engine step ever reaches). So a disk block (1.78 ms) is not worth loading
    in the middle of a long suffix (a block's share of a step is 1.0-1.4 ms)... but it is where
    it saves a whole step: 8,192 + 64 tokens are two steps (16.5 ms of fixed cost for the last
    64 tokens), one block loaded leaves one."""
    prof = load_profile("mocker")
    timing, chunk = prof.timing, prof.max_num_batched_tokens
    assert prefill_ms(timing, 0, 80_000, chunk) == pytest.approx(1650.5, abs=0.1)
    assert prefill_ms(timing, 0, 80_000) == pytest.approx(3925.6, abs=0.1)
    costs = OnboardCosts()
    long = plan_onboard([DISK] * 10, cached_blocks=0, num_tokens=60 * 64 + 20_000, block_size=64,
                        costs=costs, timing=timing, chunk=chunk)
    assert long.load_blocks == 0 and long.recompute_ms == pytest.approx(
        prefill_ms(timing, 0, 60 * 64 + 20_000, chunk))
    edge = plan_onboard([DISK] * 3, cached_blocks=0, num_tokens=chunk + 64, block_size=64,
                        costs=costs, timing=timing, chunk=chunk)
    assert edge.load_blocks >= 1 and edge.saved_ms > 10.0


def test_tier_weights_derive_from_the_same_cost():
    """Mocker timing, 64-token blocks of 8 MiB: the marginal block of a 4096-token prompt costs
    ~1.19 ms to recompute; host loads in 0.34 ms (weight ~0.72), disk in 1.78 ms and object in
    38 ms (weight 0)."""
    w = tier_weights(OnboardCosts(), load_profile("mocker").timing, 64)
    assert w[DEVICE] == 1.0
    assert 0.6 < w[HOST] < 0.8
    assert w[DISK] == 0.0 and w[OBJECT] == 0.0
    fast_disk = OnboardCosts(links={**DEFAULT_LINKS, DISK: TierLink(25e9)})
    assert tier_weights(fast_disk, load_profile("mocker").timing, 64)[DISK] == pytest.approx(w[HOST])


# -- over a real KVBM: bytes in host memory and in files -------------------------------------


def _real_core(tmp_path: Path):
    prof = _profile()
    hc = default_hash_config(BS)
    sink = MemorySink()
    manager = build_kvbm(KvbmSettings(
        worker_id="worker-0", bytes_per_block=256, block_size=BS, hash_algo=hc.hash_algo,
        host_capacity=2, disk_capacity=64, data_dir=tmp_path, verify_synthetic_content=True,
        device_eviction_events=False, admission=ADMIT_ALL), sink)  # blocks used once reach disk
    # Test costs: no per-read latency on disk, so 4-token disk blocks are worth loading.
    costs = OnboardCosts(kv_bytes_per_token=64, links={HOST: TierLink(25e9), DISK: TierLink(5e9)})
    tiers = KvbmTiers(manager)
    core = EngineCore(prof, hash_config=hc, on_evict=manager.on_device_evicted, tiers=tiers,
                      onboard_costs=costs)
    return core, manager, tiers, sink


def test_real_kvbm_onboards_from_host_and_disk_with_verified_bytes(tmp_path: Path):
    core, manager, tiers, sink = _real_core(tmp_path)
    hashes = _offload_a(core)
    assert sorted(manager.residency()[HOST] + manager.residency()[DISK]) >= sorted(hashes)
    assert any(h in manager.residency()[DISK] for h in hashes)  # host holds 2: the rest spilled
    sink.clear()
    step, events = _run(core, "a2", PROMPT_A)
    assert step.admitted == [("a2", 16)]
    st = core.onboard_stats()
    assert sum(st.loaded.values()) == 4 and st.loaded.get(DISK, 0) >= 1
    assert tiers.bytes_loaded == 4 * 256
    assert manager.stats().get("onboarded_disk", 0) >= 1  # read from a file, verified
    # The KVBM reported the host copies it made; the engine the device blocks and their source.
    assert any(isinstance(e, BlockStored) and e.tier is HOST for e in sink.events)
    sources = {h: e.source_tier for e in _device_stores(events) for h in e.block_hashes}
    assert {sources[h] for h in hashes} <= {HOST, DISK} and DISK in {sources[h] for h in hashes}


def test_real_kvbm_corrupt_disk_block_falls_back_to_recompute(tmp_path: Path):
    core, manager, tiers, sink = _real_core(tmp_path)
    hashes = _offload_a(core)
    on_disk = [h for h in hashes if h in manager.residency()[DISK]]
    for h in on_disk:
        for f in (tmp_path / "kvbm" / "g3").glob(f"*{h:016x}*"):
            raw = bytearray(f.read_bytes())
            raw[len(raw) // 2] ^= 0xFF
            f.write_bytes(bytes(raw))
    sink.clear()
    step, events = _run(core, "a2", PROMPT_A)
    st = core.onboard_stats()
    assert sum(st.fallbacks.values()) >= 1 and "corrupt" in st.fallbacks
    assert step.admitted[0][1] == sum(st.loaded.values()) * BS < 16
    removed = [h for e in sink.events if isinstance(e, BlockRemoved) and e.tier is DISK
               for h in e.block_hashes]
    assert removed and set(removed) <= set(on_disk)


def test_worker_metrics_export_offloads_and_onboards_per_direction():
    from data_plane.workers.metrics import WorkerMetrics

    m = WorkerMetrics("m", "w1")
    m.set_kv_moves({"offloaded_host": 5, "demoted_host_disk": 2, "onboarded_disk": 1},
                   {HOST: 3, DISK: 1}, {"corrupt": 2})
    m.set_kv_moves({"offloaded_host": 7, "demoted_host_disk": 2, "onboarded_disk": 1, "write_errors": 3,
                    "write_errors_disk_full": 3}, {HOST: 3, DISK: 1}, {"corrupt": 2})  # totals, not increments
    text = m.render().decode()
    lbl = 'engine="w1",from_tier="{}",model_name="m",to_tier="{}"'
    assert f"switchyard_worker_kvbm_offload_blocks_total{{{lbl.format('device', 'host')}}} 7.0" in text
    assert f"switchyard_worker_kvbm_offload_blocks_total{{{lbl.format('host', 'disk')}}} 2.0" in text
    assert f"switchyard_worker_kvbm_onboard_blocks_total{{{lbl.format('host', 'device')}}} 3.0" in text
    assert f"switchyard_worker_kvbm_onboard_blocks_total{{{lbl.format('disk', 'device')}}} 1.0" in text
    assert f"switchyard_worker_kvbm_onboard_blocks_total{{{lbl.format('disk', 'host')}}} 1.0" in text
    assert ('switchyard_worker_kvbm_onboard_fallback_blocks_total{engine="w1",model_name="m",'
            'reason="corrupt"} 2.0') in text
    assert ('switchyard_worker_kvbm_write_errors_total{engine="w1",model_name="m",reason="full",'
            'tier="disk"} 3.0') in text


# -- the cluster simulator -------------------------------------------------------------------


def _sim_requests():
    return [EngineRequest(request_id="a", prompt=PROMPT_A, max_tokens=2, arrival_ms=0.0),
            EngineRequest(request_id="b", prompt=PROMPT_B, max_tokens=2, arrival_ms=100.0),
            EngineRequest(request_id="a2", prompt=PROMPT_A, max_tokens=2, arrival_ms=200.0)]


@pytest.mark.parametrize("coalesce", [True, False])
def test_simulation_models_tiers_and_onboarding_time(coalesce):
    """Device only, A2 recomputes 17 tokens; with a host tier it loads 16 and computes 1, and its
    first token comes that much sooner (minus the modelled load time)."""
    from data_plane.engines import simulate

    prof = _profile()
    base = simulate(_sim_requests(), prof, coalesce=coalesce)
    tiered = simulate(_sim_requests(), prof, coalesce=coalesce, tiers={HOST: 16})
    b = {r.request_id: r for r in base.requests}
    t = {r.request_id: r for r in tiered.requests}
    assert b["a2"].cached_tokens == 0 and t["a2"].cached_tokens == 16
    assert t["a2"].onboarded_tokens == 16 and b["a2"].onboarded_tokens == 0
    timing = prof.timing
    load = OnboardCosts().load_ms({HOST: 4}, BS)
    assert b["a2"].ttft_ms == pytest.approx(timing.prefill_ms(17))
    assert t["a2"].ttft_ms == pytest.approx(timing.prefill_ms(1) + load)
    # The driver's account: admitted on arrival (an idle worker); one step without tiers, two
    # with (the stall while the prefix loads, then the last token).
    assert b["a2"].admitted_ms == t["a2"].admitted_ms == 200.0
    assert (b["a2"].prefill_steps, t["a2"].prefill_steps) == (1, 2)
    assert (b["a2"].onboard_ms, t["a2"].onboard_ms) == (0.0, pytest.approx(load))
    # Everything else is as without tiers.
    assert [b[r].token_times.tolist() for r in "ab"] == [t[r].token_times.tolist() for r in "ab"]


def test_simulation_tiers_cascade_to_disk_and_report_events():
    from data_plane.engines import simulate

    sink = MemorySink()
    res = simulate(_sim_requests(), _profile(), sink=sink, tiers={HOST: 2, DISK: 16},
                   onboard_costs=OnboardCosts(links={HOST: TierLink(25e9), DISK: TierLink(25e9)}))
    a2 = next(r for r in res.requests if r.request_id == "a2")
    assert a2.onboarded_tokens == 16
    kinds = {(type(e).__name__, getattr(e, "tier", None) or (e.from_tier, e.to_tier))
             for e in sink.events}
    assert ("BlockStored", HOST) in kinds and ("BlockMoved", (HOST, DISK)) in kinds
    sources = {e.source_tier for e in sink.events if isinstance(e, BlockStored) and e.tier is DEVICE}
    assert {HOST, DISK} <= sources


def _tiered_case(seed):
    """The driver property test's random cluster, with half the device (so prefixes get evicted
    and come back) and small host and disk tiers."""
    from tests.unit.test_cluster_driver import _case

    prof, workers, reqs, opts, hooks_kw = _case(seed)
    prof = prof.replace(num_device_blocks=max(prof.num_device_blocks // 2, 12))
    return prof, workers, reqs, opts, hooks_kw


@pytest.mark.parametrize("seed", range(80))
def test_coalesced_decode_runs_keep_their_results_with_tiers(seed):
    """The driver's speed-up (decode runs applied at once) changes nothing with tiers either:
    coalesced and step-by-step runs agree on every token time, cached and onboarded count, step
    count, hook call and tier move."""
    from data_plane.engines.cluster import Cluster
    from tests.unit.test_cluster_driver import _run, _same

    prof, workers, reqs, opts, hooks_kw = _tiered_case(seed)
    tiers = {HOST: 4, DISK: 8}
    fast = _run(Cluster, prof, workers, reqs, opts, hooks_kw, tiers=tiers)
    slow = _run(Cluster, prof, workers, reqs, opts, hooks_kw, tiers=tiers, coalesce=False)
    _same(fast, slow)
    assert [r.onboarded_tokens for r in fast[2]] == [r.onboarded_tokens for r in slow[2]]
    assert {w: dict(vt.moves) for w, vt in fast[1].virtual_tiers.items()} == \
        {w: dict(vt.moves) for w, vt in slow[1].virtual_tiers.items()}


@pytest.mark.parametrize("seed", range(20))
def test_coalesced_decode_runs_keep_their_results_with_the_admission_filter(seed):
    """The same with the KVBM's disk admission filter in the tiers: it counts uses, not time,
    so the coalesced and step-by-step runs still make every decision alike."""
    from data_plane.engines.cluster import Cluster
    from data_plane.kvbm import AdmissionConfig
    from tests.unit.test_cluster_driver import _run, _same

    prof, workers, reqs, opts, hooks_kw = _tiered_case(seed)
    kw = dict(tiers={HOST: 4, DISK: 8}, tier_admission=AdmissionConfig())
    fast = _run(Cluster, prof, workers, reqs, opts, hooks_kw, **kw)
    slow = _run(Cluster, prof, workers, reqs, opts, hooks_kw, coalesce=False, **kw)
    _same(fast, slow)
    assert {w: (dict(vt.moves), dict(vt.admission_refused))
            for w, vt in fast[1].virtual_tiers.items()} == \
        {w: (dict(vt.moves), dict(vt.admission_refused)) for w, vt in slow[1].virtual_tiers.items()}


def test_the_tiered_property_cases_do_onboard():
    """Not vacuous: several of those random clusters really load prefixes from their tiers."""
    from data_plane.engines.cluster import Cluster
    from tests.unit.test_cluster_driver import _run

    onboarding = 0
    for seed in range(80):
        prof, workers, reqs, opts, hooks_kw = _tiered_case(seed)
        _, _, records = _run(Cluster, prof, workers, reqs, opts, hooks_kw, tiers={HOST: 4, DISK: 8})
        onboarding += any(r.onboarded_tokens for r in records)
    assert onboarding >= 5
