"""The metrics projection: worked examples, idempotence under redelivery, checkpoints.

Core-only, no mocks: a small in-memory log (:class:`_Log`) numbers offsets per partition and
envelopes per producer exactly as the Kafka producer does, and the tests fold it. Unless a test
says otherwise: block size 16, pool ``chat`` with workers ``w1`` and ``w2``, default SLO
TTFT 2 s / ITL 50 ms.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from control_plane.metrics.catalog import SPECS, Kind, MetricSpec
from control_plane.metrics.exposition import build_registry
from control_plane.metrics.families import BrokerState, HistogramValue, processor_families
from control_plane.metrics.labels import reason_class
from control_plane.metrics.projection import MetricsProjection, ProjectionConfig
from schemas import events as ev
from schemas.envelope import Envelope, EnvelopeFactory

ALGO, BS = "sha256", 16
SEC = 1_000_000_000

# ----------------------------------------------------------------------------------------------
# Builders
# ----------------------------------------------------------------------------------------------


class _Log:
    """An in-memory log: ``(stream, partition, offset, envelope)`` records, partition 0 unless
    given, offsets dense per partition, seqs dense per producer and partition."""

    def __init__(self) -> None:
        self.records: list[tuple[str, int, int, Envelope]] = []
        self._factories: dict[tuple[str, int], EnvelopeFactory] = {}
        self._next: dict[tuple[str, int], int] = {}
        self.now_ns = 1_800_000_000 * SEC

    def add(self, payload: ev.Event, producer: str = "p", epoch: int = 1, partition: int = 0,
            at_s: float | None = None) -> Envelope:
        f = self._factories.get((producer, epoch))
        if f is None:
            f = self._factories[(producer, epoch)] = EnvelopeFactory(producer, epoch, lambda: self.now_ns)
        if at_s is not None:
            self.now_ns = int(at_s * SEC)
        env = f.wrap(payload, scope=f"{payload.STREAM}:{partition}")
        self.append(payload.STREAM, partition, env)
        return env

    def append(self, stream: str, partition: int, env: Envelope) -> None:
        off = self._next.get((stream, partition), 0)
        self._next[(stream, partition)] = off + 1
        self.records.append((stream, partition, off, env))

    def fold(self, p: MetricsProjection | None = None, records=None) -> MetricsProjection:
        p = p or MetricsProjection(ProjectionConfig(hash_algo=ALGO, block_size=BS))
        for stream, part, off, env in (self.records if records is None else records):
            p.apply(env, stream, part, off, env.occurred_at_ns // 1_000_000)
        return p


def _register(log: _Log, wid: str, pool: str = "chat", role: str = "aggregated", epoch: int = 1) -> None:
    log.add(ev.WorkerRegistered(worker_id=wid, role=role, pool=pool, endpoint=f"http://{wid}",
                             capacity={"device": 100}, block_size=BS, hash_algo=ALGO), producer=wid, epoch=epoch)


def _admit(log: _Log, rid: str, blocks: int = 4, endpoint: str = "completions") -> None:
    log.add(ev.RequestAdmitted(request_id=rid, model="m", prompt_tokens=blocks * BS, max_tokens=8,
                            block_hashes=list(range(1, blocks + 1)), block_size=BS, hash_algo=ALGO,
                            endpoint=endpoint), producer="router")


def _row(wid: str, overlap: int = 0, by_tier: dict[str, int] | None = None, **kw) -> ev.CandidateScore:
    return ev.CandidateScore(worker_id=wid, overlap_blocks=overlap, overlap_by_tier=by_tier or {}, **kw)


def _route(log: _Log, rid: str, wid: str, scores: list[ev.CandidateScore], phase: str = "aggregated",
           view_state: str = "EXACT") -> None:
    log.add(ev.RequestRouted(request_id=rid, worker_id=wid, phase=phase, mode="kv", scores=scores, config_version=1,
                          rng_seed=0, router_id="r1", view_state=view_state), producer="router")


def _complete(log: _Log, rid: str, wid: str = "w1", ttft_ms: float = 1500.0, itl_ms: float = 40.0,
              output_tokens: int = 10, cached: int = 32) -> None:
    log.add(ev.RequestCompleted(request_id=rid, worker_id=wid, prompt_tokens=64, output_tokens=output_tokens,
                             cached_tokens=cached, ttft_ms=ttft_ms, itl_mean_ms=itl_ms, e2e_ms=ttft_ms + 400),
            producer="router")


def _m(p: MetricsProjection, name: str) -> dict:
    return p.as_dict()[name]


def _without_records(d: dict) -> dict:
    return {k: v for k, v in d.items() if k != "switchyard_metrics_records_total"}


def _traffic() -> _Log:
    """A bit of everything, used by the idempotence and checkpoint tests."""
    log = _Log()
    _register(log, "w1")
    _register(log, "w2")
    for i in range(6):
        rid = f"r{i}"
        _admit(log, rid, blocks=4)
        _route(log, rid, "w1" if i % 2 else "w2", [_row("w1", i % 4, {"device": i % 4}), _row("w2", 1, {"host": 1})])
        log.add(ev.BlockStored(worker_id="w1", tier="device", block_hashes=[10 * i + k for k in range(3)],
                            block_size=BS, hash_algo=ALGO), producer="w1")
        if i % 3 == 0:
            log.add(ev.BlockMoved(worker_id="w1", block_hashes=[10 * i], from_tier="device", to_tier="host"),
                    producer="w1")
        log.add(ev.WorkerLoadReported(worker_id="w2", running=i, waiting=1, tier_usage={"device": i / 10}), producer="w2")
        _complete(log, rid, "w1" if i % 2 else "w2", ttft_ms=500.0 * i, itl_ms=20.0 * i)
    log.add(ev.ScalingDecision(pool="chat", decision_id="d1", role="aggregated", from_replicas=2, to_replicas=3,
                            reason="load", config_version=1), producer="planner")
    log.add(ev.PoolUpdated(actor="ops", pool="chat", role="aggregated", ttft_slo_ms=1000.0), producer="admin")
    return log


# ----------------------------------------------------------------------------------------------
# Worked examples
# ----------------------------------------------------------------------------------------------


def test_one_request_end_to_end_worked_example() -> None:
    """Prompt of 4 blocks (64 tokens). The router picks w1, which holds 2 blocks (1 on device, 1
    on host); w2 holds 3 and is eligible; w3 holds 4 but is draining (ineligible), so the best
    eligible overlap is 3: avoidable prefill = (3 - 2) x 16 = 16 tokens. The request completes
    with TTFT 1.5 s <= 2 s and mean ITL 40 ms <= 50 ms: one goodput request, no violations."""
    log = _Log()
    _register(log, "w1")
    _register(log, "w2")
    _admit(log, "r1", blocks=4)
    _route(log, "r1", "w1", [_row("w1", 2, {"device": 1, "host": 1}), _row("w2", 3, {"device": 3}),
                             _row("w3", 4, {"device": 4}, eligible=False, excluded="draining")])
    _complete(log, "r1", "w1", ttft_ms=1500.0, itl_ms=40.0, output_tokens=10, cached=32)
    p = log.fold()

    assert _m(p, "switchyard_requests_total") == {("chat", "completions", "completed"): 1.0}
    assert _m(p, "switchyard_prefix_lookup_blocks_total") == {("chat",): 4.0}
    assert _m(p, "switchyard_prefix_hit_blocks_total") == {("chat", "device"): 1.0, ("chat", "host"): 1.0}
    assert _m(p, "switchyard_avoidable_prefill_tokens_total") == {("chat",): 16.0}
    assert _m(p, "switchyard_routing_suboptimal_decisions_total") == {("chat",): 1.0}
    assert _m(p, "switchyard_routed_prompt_tokens_total") == {("chat",): 64.0}
    assert _m(p, "switchyard_routing_decisions_total") == {("kv", "aggregated", "EXACT"): 1.0}
    assert _m(p, "switchyard_router_last_view_state") == {("r1",): 1.0}
    assert _m(p, "switchyard_goodput_requests_total") == {("chat",): 1.0}
    assert _m(p, "switchyard_slo_violations_total") == {("chat", "ttft"): 0.0, ("chat", "itl"): 0.0}
    assert _m(p, "switchyard_request_cached_tokens_total") == {("chat",): 32.0}
    assert _m(p, "switchyard_request_prompt_tokens_total") == {("chat",): 64.0}
    assert _m(p, "switchyard_requests_in_flight") == {(): 0.0}
    # TTFT 1.5 s lands in the le=1.5 bucket (inclusive bounds): cumulative 0 up to le=1.0, then 1.
    ttft = next(f for f in p.families() if f.spec.name == "switchyard_request_ttft_seconds").samples[("chat",)]
    assert isinstance(ttft, HistogramValue)
    bounds = list(ttft.bounds)
    assert ttft.cumulative[bounds.index(1.0)] == 0 and ttft.cumulative[bounds.index(1.5)] == 1
    assert ttft.count == 1 and ttft.sum == pytest.approx(1.5)


def test_pool_slo_comes_from_pool_updated_and_itl_is_not_judged_for_one_token() -> None:
    """PoolUpdated sets chat's TTFT SLO to 1 s (ITL None keeps the 50 ms default):
    r1 TTFT 1.5 s > 1 s -> ttft violation; r2 ITL 60 ms > 50 ms -> itl violation;
    r3 has one output token (no ITL to judge) and TTFT 0.9 s -> goodput. 1 of 3 good."""
    log = _Log()
    _register(log, "w1")
    log.add(ev.PoolUpdated(actor="ops", pool="chat", role="aggregated", ttft_slo_ms=1000.0, min_replicas=1,
                        max_replicas=4), producer="admin")
    _complete(log, "r1", ttft_ms=1500.0, itl_ms=10.0)
    _complete(log, "r2", ttft_ms=500.0, itl_ms=60.0)
    _complete(log, "r3", ttft_ms=900.0, itl_ms=999.0, output_tokens=1)
    p = log.fold()
    assert _m(p, "switchyard_goodput_requests_total") == {("chat",): 1.0}
    assert _m(p, "switchyard_slo_violations_total") == {("chat", "ttft"): 1.0, ("chat", "itl"): 1.0}
    assert _m(p, "switchyard_pool_slo_ttft_seconds") == {("chat",): 1.0}
    assert _m(p, "switchyard_pool_slo_itl_seconds") == {("chat",): 0.05}
    assert _m(p, "switchyard_pool_min_replicas") == {("chat",): 1.0}
    assert _m(p, "switchyard_pool_max_replicas") == {("chat",): 4.0}
    # Requests without an admission in the log (joined late) still count, endpoint unknown.
    assert _m(p, "switchyard_requests_total") == {("chat", "unknown", "completed"): 3.0}
    # r3's single token puts nothing in the ITL histogram.
    itl = next(f for f in p.families() if f.spec.name == "switchyard_request_itl_seconds").samples[("chat",)]
    assert itl.count == 2


def test_failures_rejections_and_abandoned_requests() -> None:
    """A retried failure is an attempt failure only; the final one finishes the request as
    failed; a rejection has no pool; an admission with no end after the TTL (600 s of event
    time) is counted as abandoned when a later admission arrives."""
    log = _Log()
    _register(log, "w1")
    _admit(log, "r1")
    log.add(ev.RequestFailed(request_id="r1", worker_id="w1", reason="boom", code="worker_lost", retried=True),
            producer="router")
    log.add(ev.RequestFailed(request_id="r1", worker_id="w1", reason="boom", code="worker_lost"), producer="router")
    _admit(log, "r2", endpoint="chat")
    log.add(ev.RequestRejected(request_id="r2", reason="no workers", code="no_workers", http_status=503),
            producer="router")
    log.add(ev.RequestAdmitted(request_id="r3", model="m", prompt_tokens=16, max_tokens=1, block_size=BS,
                            hash_algo=ALGO), producer="router", at_s=1_800_000_000)
    p = log.fold()
    assert _m(p, "switchyard_requests_in_flight") == {(): 1.0}
    _admit_later = ev.RequestAdmitted(request_id="r4", model="m", prompt_tokens=16, max_tokens=1, block_size=BS,
                                   hash_algo=ALGO)
    log.add(_admit_later, producer="router", at_s=1_800_000_000 + 601)
    p = log.fold()
    assert _m(p, "switchyard_request_attempt_failures_total") == {("chat", "worker_lost", "true"): 1.0,
                                                                  ("chat", "worker_lost", "false"): 1.0}
    assert _m(p, "switchyard_requests_total") == {("chat", "completions", "failed"): 1.0,
                                                  ("none", "chat", "rejected"): 1.0,
                                                  ("none", "completions", "abandoned"): 1.0}
    assert _m(p, "switchyard_requests_in_flight") == {(): 1.0}  # r4


def test_kv_tiers_moves_and_index() -> None:
    """w1 stores 4 blocks on device, moves 2 to host, removes 1 from device: resident device 1,
    host 2 (3 distinct hashes); w2 stores 2 then clears everything. Counters count the blocks
    named in events."""
    log = _Log()
    _register(log, "w1")
    _register(log, "w2")
    log.add(ev.BlockStored(worker_id="w1", tier="device", block_hashes=[1, 2, 3, 4], block_size=BS, hash_algo=ALGO),
            producer="w1")
    log.add(ev.BlockMoved(worker_id="w1", block_hashes=[3, 4], from_tier="device", to_tier="host"), producer="w1")
    log.add(ev.BlockRemoved(worker_id="w1", tier="device", block_hashes=[2]), producer="w1")
    log.add(ev.BlockStored(worker_id="w2", tier="device", block_hashes=[1, 9], block_size=BS, hash_algo=ALGO),
            producer="w2")
    log.add(ev.AllBlocksCleared(worker_id="w2"), producer="w2")
    p = log.fold()
    assert _m(p, "switchyard_kv_blocks") == {("device",): 1.0, ("host",): 2.0, ("disk",): 0.0, ("object",): 0.0}
    assert _m(p, "switchyard_kv_worker_blocks") == {("w1", "device"): 1.0, ("w1", "host"): 2.0}
    assert _m(p, "switchyard_index_hashes") == {(): 3.0}
    assert _m(p, "switchyard_kv_blocks_stored_total")[("device",)] == 6.0
    assert _m(p, "switchyard_kv_blocks_removed_total")[("device",)] == 1.0
    assert _m(p, "switchyard_kv_blocks_moved_total") == {("device", "host"): 2.0}
    assert _m(p, "switchyard_kv_clears_total") == {("all",): 1.0}
    assert _m(p, "switchyard_index_stale_workers") == {(): 0.0}
    assert _m(p, "switchyard_index_events_total")[("applied",)] == 7.0  # 2 registrations + 5 kv events


def test_onboards_are_counted_by_source_tier() -> None:
    """Blocks 3, 4 offloaded to host and 5 to disk come back: 2 onboarded from host, 1 from
    disk. A plain store (no source tier) and a host store are no onboard."""
    log = _Log()
    _register(log, "w1")
    log.add(ev.BlockStored(worker_id="w1", tier="device", block_hashes=[1, 2, 3, 4, 5], block_size=BS,
                           hash_algo=ALGO), producer="w1")
    log.add(ev.BlockMoved(worker_id="w1", block_hashes=[3, 4], from_tier="device", to_tier="host"), producer="w1")
    log.add(ev.BlockStored(worker_id="w1", tier="disk", block_hashes=[5], block_size=BS, hash_algo=ALGO),
            producer="w1")
    log.add(ev.BlockStored(worker_id="w1", tier="device", block_hashes=[3, 4], block_size=BS, hash_algo=ALGO,
                           source_tier="host"), producer="w1")
    log.add(ev.BlockStored(worker_id="w1", tier="device", block_hashes=[5], block_size=BS, hash_algo=ALGO,
                           source_tier="disk"), producer="w1")
    p = log.fold()
    assert _m(p, "switchyard_kv_blocks_onboarded_total") == {("host",): 2.0, ("disk",): 1.0}
    assert _m(p, "switchyard_kv_blocks_moved_total") == {("device", "host"): 2.0}


def test_index_staleness_from_a_sequence_gap() -> None:
    """w1's events seq 0, 1 then 3: seq 2 was lost, so w1's entries are stale and the gap is
    counted once on the kv stream."""
    log = _Log()
    _register(log, "w1")
    stores = [ev.BlockStored(worker_id="w1", tier="device", block_hashes=[i], block_size=BS, hash_algo=ALGO)
              for i in range(4)]
    envs = [log.add(s, producer="w1") for s in stores]
    lost = envs[2]
    log.records = [r for r in log.records if r[3] is not lost]
    p = log.fold()
    assert _m(p, "switchyard_sequence_gaps_total")[("kv",)] == 1.0
    assert _m(p, "switchyard_index_stale_workers") == {(): 1.0}
    assert _m(p, "switchyard_index_worker_stale") == {("w1",): 1.0}


def test_kv_transfers() -> None:
    """1 MiB in 5 ms completed; a failed pull with an exception-shaped reason is classed
    ``transfer_timeout`` (no unbounded label values)."""
    log = _Log()
    common = dict(request_id="r1", src_worker="p1", dst_worker="d1", blocks=64, backend="UCX")
    log.add(ev.KvTransferStarted(transfer_id="t1", bytes=1 << 20, **common), producer="d1")
    log.add(ev.KvTransferCompleted(transfer_id="t1", bytes=1 << 20, duration_ms=5.0, **common), producer="d1")
    log.add(ev.KvTransferStarted(transfer_id="t2", bytes=1 << 20, **common), producer="d1")
    log.add(ev.KvTransferFailed(transfer_id="t2", duration_ms=10_000.0, reason="TransferTimeout: READ after 10 s",
                             fallback="recompute", **common), producer="d1")
    p = log.fold()
    assert _m(p, "switchyard_kv_transfers_started_total") == {("UCX",): 2.0}
    assert _m(p, "switchyard_kv_transfers_total") == {("UCX", "completed"): 1.0, ("UCX", "failed"): 1.0}
    assert _m(p, "switchyard_kv_transfer_bytes_total") == {("UCX",): float(1 << 20)}
    assert _m(p, "switchyard_kv_transfer_blocks_total") == {("UCX",): 64.0}
    assert _m(p, "switchyard_kv_transfer_failures_total") == {("UCX", "transfer_timeout", "recompute"): 1.0}
    d = _m(p, "switchyard_kv_transfer_duration_seconds")
    assert d[("UCX", "completed")][0][-1] == 1 and d[("UCX", "failed")][1] == pytest.approx(10.0)


def test_disaggregated_decode_routing_is_not_a_prefix_lookup() -> None:
    """Decode-phase decisions reuse the prefill's KV (via a transfer): they count as decisions
    but not as prompt lookups, so the hit rate is not counted twice per request."""
    log = _Log()
    _register(log, "p1", pool="prefill", role="prefill")
    _register(log, "d1", pool="decode", role="decode")
    _admit(log, "r1", blocks=2)
    _route(log, "r1", "p1", [_row("p1", 2, {"device": 2})], phase="prefill")
    _route(log, "r1", "d1", [_row("d1", 0)], phase="decode", view_state="DEGRADED")
    log.add(ev.PrefillCompleted(request_id="r1", worker_id="p1", prompt_tokens=32, duration_ms=250.0), producer="p1")
    p = log.fold()
    assert _m(p, "switchyard_prefix_lookup_blocks_total") == {("prefill",): 2.0}
    assert _m(p, "switchyard_prefix_hit_blocks_total") == {("prefill", "device"): 2.0}
    assert _m(p, "switchyard_routing_decisions_total") == {("kv", "prefill", "EXACT"): 1.0,
                                                           ("kv", "decode", "DEGRADED"): 1.0}
    assert _m(p, "switchyard_router_last_view_state") == {("r1",): 2.0}
    assert _m(p, "switchyard_prefill_duration_seconds")[("prefill",)][0][-1] == 1


def test_worker_lifecycle_and_epochs() -> None:
    """A load report counts only from the current incarnation; a late registration of an older
    epoch changes nothing; draining then deregistering moves the worker between states."""
    log = _Log()
    _register(log, "w1", epoch=2)
    log.add(ev.WorkerLoadReported(worker_id="w1", running=3, waiting=1, queued_prefill_tokens=128,
                               tier_usage={"device": 0.5, "host": 0.25}), producer="w1", epoch=2)
    log.add(ev.WorkerLoadReported(worker_id="w1", running=99, waiting=99), producer="w1", epoch=3)
    _register(log, "w2")
    log.add(ev.WorkerDraining(worker_id="w2", reason="scale down"), producer="w2")
    p = log.fold()
    assert _m(p, "switchyard_worker_running_requests") == {("w1", "chat"): 3.0, ("w2", "chat"): 0.0}
    assert _m(p, "switchyard_worker_tier_usage_ratio") == {("w1", "chat", "device"): 0.5, ("w1", "chat", "host"): 0.25}
    assert _m(p, "switchyard_workers") == {("chat", "aggregated", "ready"): 1.0, ("chat", "aggregated", "draining"): 1.0,
                                           ("chat", "aggregated", "gone"): 0.0}
    log.add(ev.WorkerDeregistered(worker_id="w2"), producer="w2")
    p = log.fold()
    assert _m(p, "switchyard_workers")[("chat", "aggregated", "gone")] == 1.0
    assert ("w2", "chat") not in _m(p, "switchyard_worker_running_requests")
    assert _m(p, "switchyard_worker_lifecycle_total") == {("chat", "registered"): 2.0, ("chat", "draining"): 1.0,
                                                          ("chat", "deregistered"): 1.0}


def test_planner_and_admin() -> None:
    """Scaling 2 -> 4 is up, 4 -> 4 hold; the applied size and pin are gauges; config versions
    keep the highest seen."""
    log = _Log()
    for frm, to in ((2, 4), (4, 4)):
        log.add(ev.ScalingDecision(pool="decode", decision_id=f"d{to}{frm}", role="decode", from_replicas=frm,
                                to_replicas=to, reason="ttft", config_version=1), producer="planner")
    log.add(ev.ScalingApplied(pool="decode", decision_id="d42", replicas=4, scaler="virtual"), producer="scaler")
    log.add(ev.ScalingApplied(pool="decode", decision_id="d44", replicas=9, success=False, error="quota"),
            producer="scaler")
    log.add(ev.PoolPinned(actor="ops", pool="decode", replicas=3), producer="admin")
    log.add(ev.RouterConfigChanged(actor="ops", config_version=7), producer="admin")
    log.add(ev.RouterConfigChanged(actor="ops", config_version=6), producer="admin")
    log.add(ev.PlannerConfigChanged(actor="ops", config_version=2), producer="admin")
    log.add(ev.AdminAction(actor="ops", action="token_created", target="t1"), producer="admin")
    p = log.fold()
    assert _m(p, "switchyard_scaling_decisions_total") == {("decode", "decode", "up"): 1.0,
                                                           ("decode", "decode", "hold"): 1.0}
    assert _m(p, "switchyard_scaling_applied_total") == {("decode", "success"): 1.0, ("decode", "failure"): 1.0}
    assert _m(p, "switchyard_pool_target_replicas") == {("decode", "decode"): 4.0}
    assert _m(p, "switchyard_pool_applied_replicas") == {("decode",): 4.0}
    assert _m(p, "switchyard_pool_pinned_replicas") == {("decode",): 3.0}
    assert _m(p, "switchyard_config_version") == {("router",): 7.0, ("planner",): 2.0}
    assert _m(p, "switchyard_admin_events_total") == {("PoolPinned",): 1.0, ("RouterConfigChanged",): 2.0,
                                                      ("PlannerConfigChanged",): 1.0, ("AdminAction",): 1.0}
    # A pool known only from the planner still gets its (default) SLO gauges.
    assert _m(p, "switchyard_pool_slo_ttft_seconds") == {("decode",): 2.0}


def test_dead_letters_and_undecodable_records() -> None:
    p = MetricsProjection()
    assert p.deadletter(0, 0, "malformed", "kv") == "applied"
    assert p.deadletter(0, 1, "index_rejected:hash_algo", "kv") == "applied"
    assert p.deadletter(0, 1, "index_rejected:hash_algo", "kv") == "redelivered"
    assert p.undecodable("requests", 2, 0) == "undecodable"
    assert _m(p, "switchyard_deadletter_records_total") == {("malformed", "kv"): 1.0,
                                                            ("index_rejected", "kv"): 1.0}
    rec = _m(p, "switchyard_metrics_records_total")
    assert rec[("requests", "undecodable")] == 1.0 and rec[("deadletter", "redelivered")] == 1.0
    assert rec[("kv", "applied")] == 0.0  # initialised: "nothing yet" is a visible 0


def test_dead_letter_labels_come_from_a_fixed_set() -> None:
    """Any role may write the dead-letter topic: 3,000 invented reasons and sources make no more
    series than the fixed set (issue 36)."""
    p = MetricsProjection()
    for i in range(3000):
        p.deadletter(0, i, f"invented-{i}", f"sy-x.topic-{i}")
    p.deadletter(0, 3000, "forged:unsigned", "workers")
    p.deadletter(0, 3001, "apply_failed:ValueError", "")
    assert _m(p, "switchyard_deadletter_records_total") == {("other", "other"): 3000.0, ("forged", "workers"): 1.0,
                                                            ("apply_failed", "unknown"): 1.0}


# ----------------------------------------------------------------------------------------------
# Idempotence and checkpoints
# ----------------------------------------------------------------------------------------------


def test_redelivered_offsets_change_nothing_but_the_redelivered_count() -> None:
    log = _traffic()
    once = log.fold()
    twice = log.fold(log.fold())  # the whole log again, same offsets
    assert _without_records(twice.as_dict()) == _without_records(once.as_dict())
    rec = twice.as_dict()["switchyard_metrics_records_total"]
    assert sum(v for (s, o), v in rec.items() if o == "redelivered") == len(log.records)


def test_an_event_written_twice_is_applied_once() -> None:
    """The same envelope at a new offset (a producer that re-sent it) is a duplicate by its
    (producer, epoch, seq), whatever its offset."""
    log = _traffic()
    once = log.fold()
    stream, part, _off, env = next(r for r in log.records if r[3].type == "RequestCompleted")
    log.append(stream, part, env)
    again = log.fold()
    assert _without_records(again.as_dict()) == _without_records(once.as_dict())
    assert again.as_dict()["switchyard_metrics_records_total"][(stream, "duplicate")] == 1.0


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_any_redelivery_pattern_folds_like_one_clean_pass(seed: int) -> None:
    """Faust may redeliver any suffix of a partition after a rebalance: interleave such replays
    at random points; everything but the redelivered count equals one clean fold."""
    log = _traffic()
    rng = random.Random(seed)
    noisy: list = []
    seen: dict[tuple[str, int], list] = {}
    for rec in log.records:
        noisy.append(rec)
        seen.setdefault(rec[:2], []).append(rec)
        if rng.random() < 0.3:
            past = seen[rec[:2]]
            noisy.extend(past[rng.randrange(len(past)):])
    assert _without_records(log.fold(records=noisy).as_dict()) == _without_records(log.fold().as_dict())


def test_snapshot_then_tail_equals_the_whole_fold() -> None:
    log = _traffic()
    half = len(log.records) // 2
    first = log.fold(records=log.records[:half])
    restored = MetricsProjection.restore(first.snapshot(), first.config)
    assert restored.as_dict() == first.as_dict()
    # Resuming from the snapshot's positions: a replay of the head is recognised as redelivery.
    log.fold(restored, records=log.records)
    whole = log.fold()
    assert _without_records(restored.as_dict()) == _without_records(whole.as_dict())


def test_restore_refuses_another_index_configuration() -> None:
    snap = MetricsProjection(ProjectionConfig(hash_algo=ALGO, block_size=BS)).snapshot()
    with pytest.raises(ValueError, match="block_size|16"):
        MetricsProjection.restore(snap, ProjectionConfig(hash_algo=ALGO, block_size=64))


# ----------------------------------------------------------------------------------------------
# Broker-derived metrics, labels, exposition
# ----------------------------------------------------------------------------------------------


def test_broker_lag_worked_example() -> None:
    """kv:0 ends at 120, the processor read up to 100: lag 20; kv:1 ends at 5, read to 7 (the
    probe is older than the position): lag 0, never negative. Group g committed kv:0 at 90:
    lag 30; a partition g never committed has no lag series."""
    broker = BrokerState(end_offsets={("kv", 0): 120, ("kv", 1): 5},
                         group_members={"sy.router-view.r1.1": 1, "sy.old.2": 0},
                         group_offsets={"sy.router-view.r1.1": {("kv", 0): 90}})
    fams = {f.spec.name: f.samples for f in processor_families(broker, {("kv", 0): 100, ("kv", 1): 7})}
    assert fams["switchyard_metrics_lag_records"] == {("kv", "0"): 20.0, ("kv", "1"): 0.0}
    assert fams["switchyard_log_end_offset"] == {("kv", "0"): 120.0, ("kv", "1"): 5.0}
    assert fams["switchyard_consumer_group_lag_records"] == {("sy.router-view.r1.1", "kv", "0"): 30.0}
    assert fams["switchyard_consumer_group_members"] == {("sy.router-view.r1.1",): 1.0, ("sy.old.2",): 0.0}


@pytest.mark.parametrize("reason, cls", [
    ("TransferTimeout: READ did not finish in 10 s", "transfer_timeout"),
    ("request cancelled", "request_cancelled"),
    ("no free staging slots (3 needed, 0 free)", "no_free_staging_slots"),
    ("12 blocks offered for a prompt of 3 full blocks", "other"),
    ("", "other"),
])
def test_reason_class(reason: str, cls: str) -> None:
    assert reason_class(reason) == cls


def test_catalog_names_follow_prometheus_conventions() -> None:
    for s in SPECS:
        assert s.name.startswith("switchyard_") and s.name == s.name.lower()
        assert (s.kind is Kind.COUNTER) == s.name.endswith("_total")
        if s.kind is Kind.HISTOGRAM:
            assert s.name.endswith("_seconds") and s.buckets
    with pytest.raises(ValueError, match="_total"):
        MetricSpec("switchyard_things", Kind.COUNTER, "no suffix")


def test_exposition_text_format() -> None:
    p = _traffic().fold()
    text = generate_latest(build_registry(p.families)).decode()
    assert 'switchyard_requests_total{endpoint="completions",outcome="completed",pool="chat"} 6.0' in text
    assert 'switchyard_request_ttft_seconds_bucket{le="2.0",pool="chat"}' in text
    assert 'switchyard_request_ttft_seconds_bucket{le="+Inf",pool="chat"} 6.0' in text
    assert "# TYPE switchyard_kv_blocks gauge" in text
