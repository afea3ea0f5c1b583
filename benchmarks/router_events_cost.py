"""What a routed request's events cost the router and the broker, per producer setting (issue 38).

The router's producer (:class:`NativeEventProducer`, signing as a router) publishes the four
events a routed request leaves in the log (RequestAdmitted with 64 block hashes, RequestRouted with two score rows,
PrefillCompleted, RequestCompleted: the shapes ``bench peers`` reads back from its topics),
request after request ``GAP_S`` apart (sequential requests), on a topic prefix of its own. Per
request: this process's CPU (``getrusage``: librdkafka's threads included) and the local
broker's (``/proc``, minus its rate over a quiet window right after, since other clients share
it). The settings alternate round by round, so the box's load drifts over all of them alike.

    uv run --group bench python -m benchmarks.router_events_cost [--rounds 3] [--n 1000]
    uv run --group bench python -m benchmarks.router_events_cost --read-prefix peers1234abcd

``--read-prefix``: instead, the bytes per event type (value + key + headers, as stored) of every
topic under that prefix, e.g. a ``bench peers`` run's (its workers' prefix, ``peers<8 hex>``;
the bench leaves its topics). Last line ``RESULT <stream>_<type>_bytes=...``.

Last line: ``RESULT <setting>_router_ms=... <setting>_thread_ms=... <setting>_broker_ms=...``
(medians over rounds; ``thread``: the publishing thread's own CPU, what a router's event loop
spends on its events, ``time.thread_time``).
"""

from __future__ import annotations

import argparse
import collections
import resource
import statistics
import time
import uuid

from benchmarks.peers_bench import broker_cpu_s, broker_idle_rate, broker_pids
from common.log.admin import apply_topics
from common.log.native_producer import NativeEventProducer
from common.settings import BusSettings
from schemas.envelope import EnvelopeFactory, EventCodec
from schemas.events import CandidateScore, PrefillCompleted, RequestAdmitted, RequestCompleted, RequestRouted

#: Seconds between two requests' events (about one sequential request of ``bench peers``).
GAP_S = 0.004
#: name -> librdkafka overrides of the producer (the bus defaults: lz4, linger.ms 2).
SETTINGS: dict[str, dict[str, object]] = {
    "linger2_lz4": {},
    "linger2_none": {"compression.type": "none"},
    "linger20_lz4": {"linger.ms": 20},
}


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _request(p: NativeEventProducer, i: int, prefix: str) -> None:
    for ev in _events(i, prefix):
        p.publish(ev, correlation_id=ev.request_id)


def _events(i: int, prefix: str) -> list:
    """The four events of one routed request (a fresh request id)."""
    rid = f"cmpl-{uuid.uuid4().hex}"
    hashes = [(k * 0x9E3779B97F4A7C15 + i) & (2**64 - 1) for k in range(64)]
    return [RequestAdmitted(request_id=rid, model="switchyard-sim", prompt_tokens=4096, max_tokens=1,
                              block_hashes=hashes, block_size=64, hash_algo="sha256"),
        RequestRouted(
        request_id=rid, worker_id="w1", mode="kv", config_version=1, rng_seed=i,
        scores=[CandidateScore(worker_id=f"w{k}", prefill_blocks=64.0, decode_blocks=65.0, cost=385.0,
                               kv_capacity_blocks=16384) for k in range(2)],
        reason="kv argmin over 2 candidates chose w1: cost 385 = 5 x 64 + 65", router_id="bench-router",
        index_position={f"{prefix}.kv:0": 2, f"{prefix}.kv:2": 2376}, expected_output_tokens=1,
        view_state="EXACT", decided_at_s=time.time(), inflight_prefill_tokens=4096, inflight_blocks=65,
        inflight_ttl_s=600.0),
        PrefillCompleted(request_id=rid, worker_id="w1", prompt_tokens=4096, duration_ms=8.9),
        RequestCompleted(request_id=rid, worker_id="w1", prompt_tokens=4096, output_tokens=1, ttft_ms=9.0,
                         e2e_ms=9.4)]


def shape_bytes(prefix: str, producer: str = "router-host-12345") -> dict[str, int]:
    """Bytes per event type as stored (value with its 38-byte signature, Kafka key, the three
    headers) of the four shapes, the request id in ``corr`` as the router passes it."""
    f, codec = EnvelopeFactory(producer, 3, time.time_ns), EventCodec()
    out = {}
    for ev in _events(0, prefix):
        env = f.wrap(ev, correlation_id=ev.request_id)
        headers = len("sy-type") + len(env.type) + len("sy-v") + len(str(env.version)) + len("sy-producer") + len(producer)
        out[env.type] = len(codec.encode(env)) + 38 + len(env.key) + headers
    return out


def measure(bus: BusSettings, overrides: dict[str, object], n: int,
            brokers: list[int]) -> tuple[float, float, float]:
    """(router CPU ms, broker CPU ms, the publishing thread's CPU ms) per request under
    ``overrides``: the last is what the router's event loop spends (``publish`` on it), the
    rest of the router's is the producer's own threads."""
    p = NativeEventProducer(bus, "bench-router", **overrides)
    for i in range(50):  # warm: connections, topic metadata
        _request(p, i, bus.topic_prefix)
    p.flush()
    c0, b0, t0 = _cpu_s(), broker_cpu_s(brokers), time.monotonic()
    on_thread = 0.0
    for i in range(n):
        a = time.thread_time()
        _request(p, i, bus.topic_prefix)
        on_thread += time.thread_time() - a
        time.sleep(GAP_S)
    p.flush()
    wall, router, broker = time.monotonic() - t0, _cpu_s() - c0, broker_cpu_s(brokers) - b0
    idle = broker_idle_rate(brokers)
    if p.acked < 4 * (n + 50):
        raise RuntimeError(f"only {p.acked} of {4 * (n + 50)} events acknowledged")
    return router * 1000 / n, max(broker - idle * wall, 0.0) * 1000 / n, on_thread * 1000 / n


def bytes_by_type(prefix: str) -> dict[tuple[str, str], tuple[int, int]]:
    """(stream, event type) -> (records, bytes as stored: value + key + headers) of every
    topic under ``prefix``, read from the beginning to the end offsets of now."""
    from confluent_kafka import Consumer, TopicPartition

    bus = BusSettings.from_env(topic_prefix=prefix)
    c = Consumer({**bus.client_conf(), "group.id": f"sizes-{uuid.uuid4().hex[:6]}", "enable.auto.commit": False})
    n: collections.Counter = collections.Counter()
    size: collections.Counter = collections.Counter()
    try:
        topics = c.list_topics(timeout=10).topics
        for t in sorted(x for x in topics if x.startswith(prefix + ".")):
            parts = [TopicPartition(t, p, 0) for p in topics[t].partitions]
            left = sum(c.get_watermark_offsets(p, timeout=10)[1] for p in parts)
            c.assign(parts)
            while left > 0:
                msgs = c.consume(1000, 5)
                if not msgs:
                    raise RuntimeError(f"{t}: {left} records not read in 5 s")
                for m in msgs:
                    if m.error():
                        continue
                    left -= 1
                    headers = m.headers() or []
                    k = (t.split(".", 1)[1], dict(headers).get("sy-type", b"?").decode())
                    n[k] += 1
                    size[k] += len(m.value() or b"") + len(m.key() or b"") + sum(len(a) + len(b) for a, b in headers)
            c.unassign()
    finally:
        c.close()
    return {k: (n[k], size[k]) for k in n}


def print_bytes(prefix: str) -> None:
    got = bytes_by_type(prefix)
    for (stream, ty), (n, b) in sorted(got.items(), key=lambda kv: -kv[1][1]):
        print(f"{stream:<10} {ty:<22} records {n:>7}  bytes/record {b / n:>8.0f}  total {b}")
    print("RESULT " + " ".join(f"{s}_{t}_bytes={b / n:.0f}" for (s, t), (n, b) in sorted(got.items())))


def main(rounds: int = 3, n: int = 1000) -> dict[str, tuple[float, float, float]]:
    prefix = f"revcost{uuid.uuid4().hex[:6]}"
    apply_topics(BusSettings.from_env(topic_prefix=prefix))
    bus = BusSettings.from_env(topic_prefix=prefix, role="router")
    brokers = broker_pids()
    got: dict[str, list[tuple[float, float, float]]] = {k: [] for k in SETTINGS}
    for r in range(rounds):
        names = list(SETTINGS)[r % len(SETTINGS):] + list(SETTINGS)[:r % len(SETTINGS)]
        for name in names:
            got[name].append(measure(bus, SETTINGS[name], n, brokers))
            router, broker, thread = got[name][-1]
            print(f"  round {r + 1} {name:<14} router {router:.3f} ms/req (publishing thread {thread:.3f}), "
                  f"broker {broker:.3f} ms/req")
    out = {k: tuple(statistics.median(x[i] for x in v) for i in range(3)) for k, v in got.items()}
    sizes = shape_bytes(prefix)
    print("bytes per event as stored: " + ", ".join(f"{k} {v}" for k, v in sizes.items())
          + f"; per request {sum(sizes.values())}")
    print(f"{n} requests x 4 events per round, {rounds} rounds, median [min-max] ms per request")
    for k, v in got.items():
        rs, bs, ts = ([x[i] for x in v] for i in range(3))
        print(f"{k:<14} router {out[k][0]:.3f} [{min(rs):.3f}-{max(rs):.3f}]  publishing thread {out[k][2]:.3f} "
              f"[{min(ts):.3f}-{max(ts):.3f}]  broker {out[k][1]:.3f} [{min(bs):.3f}-{max(bs):.3f}]")
    print("RESULT " + " ".join(f"{k}_router_ms={v[0]:.3f} {k}_thread_ms={v[2]:.3f} {k}_broker_ms={v[1]:.3f}"
                               for k, v in out.items())
          + f" request_bytes={sum(sizes.values())}")
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--read-prefix", help="Instead: bytes per event type on this topic prefix's topics.")
    a = ap.parse_args()
    if a.read_prefix:
        print_bytes(a.read_prefix)
    else:
        main(a.rounds, a.n)
