"""The metrics processor against the real broker: its projection equals the oracle fold of the
log, it resumes from its checkpoint after a restart (counters continue, only the tail is read),
and ``/metrics`` serves the same numbers."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from confluent_kafka import Consumer, TopicPartition

from control_plane.metrics.catalog import CONSUMED_STREAMS
from control_plane.metrics.projection import MetricsProjection, ProjectionConfig
from control_plane.metrics.stream import MetricsProcessor, MetricsSettings
from common.log.catalog import Catalog
from common.log.kafka import H_DLQ_REASON, H_DLQ_SOURCE, EventProducer
from common.settings import BusSettings
from schemas import EventCodec, SchemaError
from schemas import events as ev
from tests.support.waits import until

pytestmark = pytest.mark.kafka

ALGO, BS = "sha256", 16


def _producers(bus: BusSettings) -> tuple[dict[str, EventProducer], EventProducer]:
    # One incarnation each for the whole test: a new epoch would make the oracle (which folds
    # stream by stream) order registrations and KV events differently from the live fold.
    return {w: EventProducer(bus, w) for w in ("w-a", "w-b")}, EventProducer(bus, "router-x")


def _traffic(bus: BusSettings, producers, rounds: int, base: int) -> None:
    workers, router = producers
    for w, p in workers.items():
        p.publish(ev.WorkerRegistered(worker_id=w, role="aggregated", pool="chat", endpoint=f"http://{w}",
                                   capacity={"device": 1000}, block_size=BS, hash_algo=ALGO))
    for r in range(rounds):
        rid = f"req-{base + r}"
        w = "w-a" if r % 2 else "w-b"
        chain = [base + r * 10 + k for k in range(4)]
        router.publish(ev.RequestAdmitted(request_id=rid, model="m", prompt_tokens=4 * BS, max_tokens=8,
                                       block_hashes=chain, block_size=BS, hash_algo=ALGO))
        router.publish(ev.RequestRouted(request_id=rid, worker_id=w, mode="kv", config_version=1, rng_seed=r,
                                     router_id="router-x", view_state="EXACT",
                                     scores=[ev.CandidateScore(worker_id=w, overlap_blocks=r % 3,
                                                            overlap_by_tier={"device": r % 3})]))
        workers[w].publish(ev.BlockStored(worker_id=w, tier="device", block_hashes=chain, block_size=BS, hash_algo=ALGO))
        if r % 4 == 3:
            workers[w].publish(ev.BlockRemoved(worker_id=w, tier="device", block_hashes=chain[2:]))
            workers[w].publish(ev.WorkerLoadReported(worker_id=w, running=r, waiting=1, tier_usage={"device": 0.2}))
        router.publish(ev.RequestCompleted(request_id=rid, worker_id=w, prompt_tokens=4 * BS, output_tokens=8,
                                        ttft_ms=100.0 * (r % 30), itl_mean_ms=5.0 * (r % 15), e2e_ms=500.0))
    router.produce_raw(Catalog(bus.topic_prefix).topic("requests"), b"\x00junk", b"junk")
    router.produce_raw(Catalog(bus.topic_prefix).deadletter, b"\x00junk", b"junk",
                       [(H_DLQ_REASON, b"malformed"), (H_DLQ_SOURCE, f"{bus.topic_prefix}.kv:0:7".encode())])
    for p in (*workers.values(), router):
        assert p.flush(30) == 0
        assert not p.failed, [(a.envelope.type, a.envelope.key, a.envelope.seq, a.error) for a in p.failed]


def oracle(bus: BusSettings, config: ProjectionConfig) -> MetricsProjection:
    """Fold every record of every consumed stream, partition by partition in offset order."""
    p = MetricsProjection(config)
    codec = EventCodec()
    cat = Catalog(bus.topic_prefix)
    # fetch.wait.max.ms: a fetch parked on the broker would delay every watermark query behind it.
    c = Consumer({**bus.client_conf(), "group.id": "metrics-oracle", "enable.auto.commit": False,
                  "fetch.wait.max.ms": 10})
    for stream in ("workers", *(s for s in CONSUMED_STREAMS if s != "workers")):
        topic = cat.topic(stream)
        for part in c.list_topics(topic, timeout=10).topics[topic].partitions:
            lo, hi = c.get_watermark_offsets(TopicPartition(topic, part), timeout=10)
            if hi <= lo:
                continue
            c.assign([TopicPartition(topic, part, lo)])
            seen = lo
            while seen < hi:
                for m in c.consume(min(1000, hi - seen), 1.0):  # returns once they are all here
                    if m.error() or m.partition() != part or m.offset() < seen or m.offset() >= hi:
                        continue
                    seen = m.offset() + 1
                    if stream == "deadletter":
                        h = dict(m.headers() or [])
                        src = h.get(H_DLQ_SOURCE, b"").decode().split(":", 1)[0]
                        p.deadletter(part, m.offset(), h.get(H_DLQ_REASON, b"").decode(), cat.stream_of(src))
                        continue
                    try:
                        p.apply(codec.decode(m.value()), stream, part, m.offset())
                    except SchemaError:
                        p.undecodable(stream, part, m.offset())
    c.close()
    return p


def _comparable(p: MetricsProjection) -> dict:
    d = p.as_dict()
    d.pop("switchyard_metrics_records_total")  # how often records were read is the one legit difference
    d.pop("switchyard_metrics_last_record_timestamp_seconds")  # the oracle passes no timestamps
    return d


async def test_processor_equals_oracle_and_resumes_from_its_checkpoint(bus: BusSettings, tmp_path: Path) -> None:
    config = ProjectionConfig(hash_algo=ALGO, block_size=BS)
    settings = MetricsSettings(processor_id="it", port=0, projection=config, snapshot_every_s=3600,
                               probe_every_s=0.5, data_dir=tmp_path)
    producers = _producers(bus)
    _traffic(bus, producers, rounds=40, base=0)

    proc = MetricsProcessor(bus, settings, MetricsProcessor.load_projection(bus, settings))
    await proc.start()
    try:
        await proc.sync(60)  # every record produced above is folded
        assert _comparable(proc.projection) == _comparable(oracle(bus, config))
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"http://127.0.0.1:{proc.port}/metrics")).text
            health = (await http.get(f"http://127.0.0.1:{proc.port}/health")).json()
        series = [ln for ln in text.splitlines() if ln.startswith(("switchyard_requests_total",
                                                                     "switchyard_deadletter_records_total"))]
        assert 'switchyard_requests_total{endpoint="completions",outcome="completed",pool="chat"} 40.0' in series, \
            (series, {k: v for k, v in proc.projection.as_dict().items()
                      if k in ("switchyard_requests_total", "switchyard_metrics_records_total",
                               "switchyard_sequence_gaps_total", "switchyard_events_total")})
        assert 'switchyard_deadletter_records_total{reason="malformed",source="kv"} 1.0' in series, series
        assert health["state"] == "OK" and health["in_flight_requests"] == 0
        await proc.checkpoint(force=True)
    finally:
        await proc.stop()
    applied_at_snapshot = proc.projection.applied

    # More traffic while it is down; the restart reads only the tail and its counters continue.
    _traffic(bus, producers, rounds=10, base=1000)
    restored = MetricsProcessor.load_projection(bus, settings)
    assert restored.applied == applied_at_snapshot
    proc2 = MetricsProcessor(bus, settings, restored)
    await proc2.start()
    try:
        await proc2.sync(60)
        assert _comparable(restored) == _comparable(oracle(bus, config))
        records = restored.as_dict()["switchyard_metrics_records_total"]
        assert sum(v for (_s, o), v in records.items() if o == "redelivered") == 0, "the head was not re-read"
        await until(lambda: any(g.startswith(f"{bus.topic_prefix}.metrics.it.") for g in proc2.broker.group_members))
        # The first incarnation's (empty) group was deleted at start.
        assert proc.group not in proc2.broker.group_members
    finally:
        await proc2.stop()
