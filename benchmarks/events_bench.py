"""``switchyard bench events``: codec throughput, then produce -> consume through the broker.

The broker part publishes BlockStored events (21 hashes, the shape of one 336-token store) from
one :class:`EventProducer` (idempotent, acks=all, lz4, linger 2 ms) and reads them with one
:class:`EventConsumer` (decode + dedupe) in another thread. Latency per event is consumer
receive time minus the envelope's ``occurred_at`` (same clock: one machine). The producer sends
at full speed, so the latency figure is under saturation, not an idle round trip; an idle
round trip is measured separately with one event at a time.
"""

from __future__ import annotations

import threading
import time
import uuid

from benchmarks import events_codec
from common.log.admin import apply_topics
from common.log.kafka import EventConsumer, EventProducer
from common.settings import BusSettings
from schemas.events import BlockStored


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def broker_round_trip(n: int, bus: BusSettings) -> dict:
    producer = EventProducer(bus, "bench-producer")
    consumer = EventConsumer(bus, ["kv"], group_id=f"bench-{uuid.uuid4().hex[:6]}")
    # Warm up: the consumer joins its group before the clock starts.
    producer.publish(BlockStored(worker_id="warm", tier="device", block_hashes=[0], block_size=16, hash_algo="x"))
    producer.flush()
    while not consumer.poll_batch(10, 0.5):
        pass

    lat_ms: list[float] = []
    received = 0
    done = threading.Event()

    def consume() -> None:
        nonlocal received
        while received < n and not done.is_set():
            batch = consumer.poll_batch(5000, 0.2)
            now = time.time_ns()
            for d in batch:
                lat_ms.append((now - d.envelope.occurred_at_ns) / 1e6)
            received += len(batch)

    t = threading.Thread(target=consume)
    t.start()
    hashes = list(range(1_000_000, 1_000_021))
    start = time.perf_counter()
    for i in range(n):
        producer.publish(BlockStored(worker_id=f"w{i % 16}", tier="device", block_hashes=hashes, parent_hash=i,
                                     block_size=16, hash_algo="sha256_cbor"))
    producer.flush(60)
    t.join(120)
    elapsed = time.perf_counter() - start
    done.set()

    # Idle round trip: one event at a time.
    idle: list[float] = []
    for i in range(200):
        producer.publish(BlockStored(worker_id="idle", tier="device", block_hashes=[i], block_size=16, hash_algo="x"))
        producer.flush()
        got: list = []
        while not got:
            got = consumer.poll_batch(10, 0.5)
        idle.append((time.time_ns() - got[0].envelope.occurred_at_ns) / 1e6)
    consumer.close()
    producer.close()
    return {
        "events": received,
        "events_per_s": received / elapsed,
        "p50_ms": _pct(lat_ms, 0.50),
        "p99_ms": _pct(lat_ms, 0.99),
        "idle_p50_ms": _pct(idle, 0.50),
        "idle_p99_ms": _pct(idle, 0.99),
    }


def main(codec_n: int = 100_000, e2e_n: int = 100_000) -> dict:
    codec = events_codec.run(codec_n)
    bus = BusSettings.from_env(topic_prefix=f"bench{uuid.uuid4().hex[:6]}")
    apply_topics(bus)
    e2e = broker_round_trip(e2e_n, bus)
    print(f"\nbroker produce->consume, {e2e['events']:,} BlockStored events (21 hashes each)")
    print(f"  throughput  {e2e['events_per_s']:,.0f} events/s")
    print(f"  latency under saturation  p50 {e2e['p50_ms']:.1f} ms  p99 {e2e['p99_ms']:.1f} ms")
    print(f"  idle round trip           p50 {e2e['idle_p50_ms']:.2f} ms  p99 {e2e['idle_p99_ms']:.2f} ms")
    o = codec["overall"]
    print(f"RESULT encode_per_s={o['mixed_encode_per_s']:.0f} decode_per_s={o['mixed_decode_per_s']:.0f} "
          f"e2e_events_per_s={e2e['events_per_s']:.0f} e2e_p99_ms={e2e['p99_ms']:.1f} "
          f"idle_p99_ms={e2e['idle_p99_ms']:.2f}")
    return {"codec": codec, "e2e": e2e}
