"""What a routed request's events cost the router and the broker, per producer setting (issue 38).

The router's producer (:class:`NativeEventProducer`, signing as a router) publishes the four
events a routed request leaves in the log (RequestAdmitted with 64 block hashes, RequestRouted with two score rows,
PrefillCompleted, RequestCompleted: the shapes ``bench peers`` reads back from its topics), at
the two instants the router records them: the decision's two, then ``--hop-ms`` later (the
request at its worker) the end's two, then the next request ``GAP_S`` after (sequential
requests), on a topic prefix of its own. Per request: this process's CPU (``getrusage``:
librdkafka's threads included), the local broker's (``/proc``, minus its rate over a quiet
window right after, since other clients share it: noisy on a shared broker), and what does not
depend on the box's load, from librdkafka's own statistics: the produce requests the broker
served (``brokers.*.req.Produce``) and the bytes sent (``txbytes``). The settings alternate
round by round, so the box's load drifts over all of them alike.

    uv run --group bench python -m benchmarks.router_events_cost [--rounds 3] [--n 1000] [--hop-ms 2]
    uv run --group bench python -m benchmarks.router_events_cost --read-prefix peers1234abcd

``--fetches``: instead, the requests the router's consumers send the broker while the router
idles or serves (librdkafka's statistics, ``brokers.*.req``): the view's tail (``kv`` and
``workers``, as ``RouterViewProcessor`` sets it up, at each ``--view-waits`` value of
``view_fetch_wait_ms``) and the API keys' follower (``admin``, an ``EventConsumer``), each alone
beside the request events of ``--n`` requests at the router's linger, then idle; and what one
fetch costs the broker: ``--tails`` tails at the smallest wait above 0 against a quiet window, alternating.
Last line ``RESULT view<w>_fetches_per_s=... keys_fetches_per_s=... broker_us_per_fetch=...``.

``--read-prefix``: instead, the bytes per event type (value + key + headers, as stored) of every
topic under that prefix, e.g. a ``bench peers`` run's (its workers' prefix, ``peers<8 hex>``;
the bench leaves its topics). Last line ``RESULT <stream>_<type>_bytes=...``.

Last line: ``RESULT <setting>_router_ms=... <setting>_thread_ms=... <setting>_broker_ms=...
<setting>_produce_reqs=... <setting>_tx_bytes=...`` (medians over rounds, per request;
``thread``: the publishing thread's own CPU, what a router's event loop spends on its events,
``time.thread_time``).
"""

from __future__ import annotations

import argparse
import collections
import os
import resource
import statistics
import time
import uuid

from benchmarks.peers_bench import broker_cpu_s, broker_idle_rate, broker_pids
from common.log.admin import apply_topics
from common.log.kafka import EventConsumer
from common.log.native_producer import NativeEventProducer
from common.log.reader import KafkaLogTail
from common.settings import BusSettings
from control_plane.router.stream import STREAMS
from control_plane.router.wiring import view_fetch
from schemas.envelope import EnvelopeFactory, EventCodec
from schemas.events import CandidateScore, PrefillCompleted, RequestAdmitted, RequestCompleted, RequestRouted

#: Seconds from one request's end to the next one's decision (sequential requests; with the
#: default hop, about one sequential request of ``bench peers``).
GAP_S = 0.002
#: Default milliseconds between a request's decision and its end (its time at the worker).
HOP_MS = 2.0
#: name -> librdkafka overrides of the producer (the bus defaults: lz4, linger.ms 2).
SETTINGS: dict[str, dict[str, object]] = {
    "linger2": {},
    "linger5": {"linger.ms": 5},
    "linger10": {"linger.ms": 10},
}
#: How often librdkafka reports its statistics to the measured producer (every setting alike).
STATS_MS = 100


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _request(p: NativeEventProducer, i: int, prefix: str, hop_s: float = 0.0) -> None:
    """One request's events as the router records them: the decision's, ``hop_s``, the end's."""
    evs = _events(i, prefix)
    for ev in evs[:2]:
        p.publish(ev, correlation_id=ev.request_id)
    if hop_s:
        time.sleep(hop_s)
    for ev in evs[2:]:
        p.publish(ev, correlation_id=ev.request_id)


def _sent(p: NativeEventProducer) -> tuple[int, int]:
    """(produce requests, bytes) sent to every broker so far, from a statistics report newer
    than this call (so it counts everything flushed before it)."""
    n0, _ = p.statistics()
    deadline = time.monotonic() + 10 * STATS_MS / 1000 + 5
    while (got := p.statistics())[0] < n0 + 2:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no librdkafka statistics within {deadline:.0f} s (statistics.interval.ms {STATS_MS})")
        time.sleep(STATS_MS / 4000)
    brokers = got[1]["brokers"].values()
    return sum(b["req"].get("Produce", 0) for b in brokers), sum(b["txbytes"] for b in brokers)


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


def measure(bus: BusSettings, overrides: dict[str, object], n: int, brokers: list[int],
            hop_s: float = HOP_MS / 1000) -> tuple[float, float, float, float, float]:
    """Per request under ``overrides``: (router CPU ms, broker CPU ms, the publishing thread's
    CPU ms, produce requests, bytes sent). The thread's is what the router's event loop spends
    (``publish`` on it), the rest of the router's is the producer's own threads. The broker's
    is net of its idle rate over a quiet window right after (``broker_idle_rate``)."""
    p = NativeEventProducer(bus, "bench-router", **{"statistics.interval.ms": STATS_MS, **overrides})
    for i in range(50):  # warm: connections, topic metadata
        _request(p, i, bus.topic_prefix)
    p.flush()
    r0, x0 = _sent(p)
    c0, b0, t0 = _cpu_s(), broker_cpu_s(brokers), time.monotonic()
    on_thread = 0.0
    for i in range(n):
        a = time.thread_time()
        _request(p, i, bus.topic_prefix, hop_s)
        on_thread += time.thread_time() - a
        time.sleep(GAP_S)
    p.flush()
    wall, router, broker = time.monotonic() - t0, _cpu_s() - c0, broker_cpu_s(brokers) - b0
    idle = broker_idle_rate(brokers)
    r1, x1 = _sent(p)
    if p.acked < 4 * (n + 50):
        raise RuntimeError(f"only {p.acked} of {4 * (n + 50)} events acknowledged")
    p.close()
    return (router * 1000 / n, max(broker - idle * wall, 0.0) * 1000 / n, on_thread * 1000 / n, (r1 - r0) / n,
            (x1 - x0) / n)


class _Requests:
    """Requests sent to the brokers by one librdkafka client, by type, from its statistics
    (``stats_cb``; every ``STATS_MS``): :meth:`since` the counts over a window."""

    def __init__(self) -> None:
        self.latest: dict[str, int] = {}
        self.reports = 0

    def conf(self) -> dict[str, object]:
        return {"statistics.interval.ms": STATS_MS, "stats_cb": self._cb}

    def _cb(self, raw: str) -> None:
        import json

        out: collections.Counter = collections.Counter()
        for b in json.loads(raw)["brokers"].values():
            out.update({k: v for k, v in b.get("req", {}).items() if v})
        self.latest, self.reports = dict(out), self.reports + 1

    def fresh(self) -> dict[str, int]:
        """Counts from a report newer than this call."""
        n0, deadline = self.reports, time.monotonic() + 5
        while self.reports < n0 + 2:
            if time.monotonic() > deadline:
                raise RuntimeError("no librdkafka statistics within 5 s")
            time.sleep(STATS_MS / 4000)
        return dict(self.latest)


def _follow(poll, stop) -> None:
    while not stop.is_set():
        poll()


def _consumers(bus: BusSettings, waits: list[int]):
    """name -> a factory of (poll, close, _Requests) for each consumer a router runs."""
    def tail(wait: int):
        def make():
            reqs = _Requests()
            t = KafkaLogTail(bus, [f"{bus.topic_prefix}.{s}" for s in STREAMS], {}, f"fetches.view{wait}",
                             **{"fetch.min.bytes": view_fetch(wait)["fetch_min_bytes"],
                                "fetch.wait.max.ms": view_fetch(wait)["fetch_wait_ms"]}, **reqs.conf())
            return lambda: t.poll(2000, 0.2), t.close, reqs
        return make

    def keys():
        reqs = _Requests()
        c = EventConsumer(bus, ["admin"], assign_all=True, consumer_name="fetches.keys", **reqs.conf())
        return lambda: c.poll_batch(200, 0.2), c.close, reqs

    return {**{f"view{w}": tail(w) for w in waits}, "keys": keys}


def fetches(rounds: int, n: int, waits: list[int], tails: int, quiet_s: float = 5.0) -> dict[str, float]:
    """The router's consumers' requests to the broker per second (serving, idle) and the
    broker's CPU per fetch (see the module's docstring)."""
    import threading

    prefix = f"revfetch{uuid.uuid4().hex[:6]}"
    apply_topics(BusSettings.from_env(topic_prefix=prefix))
    bus = BusSettings.from_env(topic_prefix=prefix, role="router")
    brokers = broker_pids()
    makers = _consumers(bus, waits)
    rates: dict[str, list[tuple[float, float, dict]]] = {k: [] for k in makers}
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    p = NativeEventProducer(bus, "bench-router", **{"linger.ms": 5})
    for r in range(rounds):
        names = list(makers)[r % len(makers):] + list(makers)[:r % len(makers)]
        for name in names:
            poll, close, reqs = makers[name]()
            stop = threading.Event()
            th = threading.Thread(target=_follow, args=(poll, stop), daemon=True)
            th.start()
            time.sleep(1.0)  # connected, assigned, coordinator known
            a, t0 = reqs.fresh(), time.monotonic()
            for i in range(n):
                _request(p, i, prefix, HOP_MS / 1000)
                time.sleep(GAP_S)
            p.flush()
            b, t1 = reqs.fresh(), time.monotonic()
            time.sleep(quiet_s)
            c, t2 = reqs.fresh(), time.monotonic()
            stop.set()
            th.join()
            close()
            serving = {k: (b.get(k, 0) - a.get(k, 0)) / (t1 - t0) for k in b}
            idle = {k: (c.get(k, 0) - b.get(k, 0)) / (t2 - t1) for k in c}
            rates[name].append((serving.get("Fetch", 0.0), idle.get("Fetch", 0.0),
                                {k: round(v, 1) for k, v in idle.items() if v}))
            print(f"  round {r + 1} {name:<8} fetches/s serving {rates[name][-1][0]:.1f} "
                  f"({rates[name][-1][0] * (t1 - t0) / n:.2f} per request at {n / (t1 - t0):.0f} req/s), "
                  f"idle {rates[name][-1][1]:.1f}; idle requests/s by type {rates[name][-1][2]} "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
    p.close()
    # What one fetch costs the broker: ``tails`` tails at the smallest wait, against quiet windows.
    per_fetch: list[float] = []
    for r in range(rounds):
        idle = broker_idle_rate(brokers, quiet_s)
        made = [makers[f"view{min(w for w in waits if w)}"]() for _ in range(tails)]
        stops = [threading.Event() for _ in made]
        ths = [threading.Thread(target=_follow, args=(m[0], s), daemon=True) for m, s in zip(made, stops)]
        for th in ths:
            th.start()
        time.sleep(1.0)
        a = [m[2].fresh().get("Fetch", 0) for m in made]
        c0, t0 = broker_cpu_s(brokers), time.monotonic()
        time.sleep(quiet_s)
        busy = (broker_cpu_s(brokers) - c0) / (time.monotonic() - t0)
        b = [m[2].fresh().get("Fetch", 0) for m in made]
        for s in stops:
            s.set()
        for th, m in zip(ths, made):
            th.join()
            m[1]()
        idle = (idle + broker_idle_rate(brokers, quiet_s)) / 2
        rate = sum(b) / quiet_s - sum(a) / quiet_s
        per_fetch.append((busy - idle) / rate * 1e6)
        print(f"  round {r + 1} {tails} tails: {rate:.0f} fetches/s, broker {busy * 1000:.1f} ms/s against "
              f"{idle * 1000:.1f} idle: {per_fetch[-1]:.0f} us per fetch (load {os.getloadavg()[0]:.1f})", flush=True)
    out = {k: statistics.median(x[1] for x in v) for k, v in rates.items()}
    serving = {k: statistics.median(x[0] for x in v) for k, v in rates.items()}
    us = statistics.median(per_fetch)
    for k in rates:
        print(f"{k:<8} fetches/s idle {out[k]:.1f}, serving {serving[k]:.1f}: broker ~{out[k] * us / 1000:.2f} ms/s")
    print(f"broker CPU per fetch {us:.0f} us [{min(per_fetch):.0f}-{max(per_fetch):.0f}]")
    print("RESULT " + " ".join(f"{k}_fetches_per_s={v:.1f}" for k, v in out.items())
          + " " + " ".join(f"{k}_serving_fetches_per_s={v:.1f}" for k, v in serving.items())
          + f" broker_us_per_fetch={us:.0f}")
    return {**out, "broker_us_per_fetch": us}


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


def main(rounds: int = 3, n: int = 1000, hop_ms: float = HOP_MS,
         only: list[str] | None = None) -> dict[str, tuple[float, ...]]:
    prefix = f"revcost{uuid.uuid4().hex[:6]}"
    apply_topics(BusSettings.from_env(topic_prefix=prefix))
    bus = BusSettings.from_env(topic_prefix=prefix, role="router")
    brokers = broker_pids()
    settings = [k for k in SETTINGS if not only or k in only]
    got: dict[str, list[tuple[float, ...]]] = {k: [] for k in settings}
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for r in range(rounds):
        names = settings[r % len(settings):] + settings[:r % len(settings)]
        for name in names:
            got[name].append(measure(bus, SETTINGS[name], n, brokers, hop_ms / 1000))
            router, broker, thread, reqs, tx = got[name][-1]
            print(f"  round {r + 1} {name:<10} router {router:.3f} ms/req (publishing thread {thread:.3f}), "
                  f"broker {broker:.3f} ms/req, produce requests {reqs:.2f}/req, {tx:.0f} B/req sent "
                  f"(load {os.getloadavg()[0]:.1f})")
    out = {k: tuple(statistics.median(x[i] for x in v) for i in range(5)) for k, v in got.items()}
    sizes = shape_bytes(prefix)
    print("bytes per event as stored: " + ", ".join(f"{k} {v}" for k, v in sizes.items())
          + f"; per request {sum(sizes.values())}")
    print(f"{n} requests x 4 events per round (2 + 2, {hop_ms:g} ms apart, next request {GAP_S * 1000:g} ms "
          f"after), {rounds} rounds, median [min-max] per request")
    for k, v in got.items():
        rs, bs, ts, qs, xs = ([x[i] for x in v] for i in range(5))
        print(f"{k:<10} router {out[k][0]:.3f} [{min(rs):.3f}-{max(rs):.3f}]  publishing thread {out[k][2]:.3f} "
              f"[{min(ts):.3f}-{max(ts):.3f}]  broker {out[k][1]:.3f} [{min(bs):.3f}-{max(bs):.3f}] ms  "
              f"produce requests {out[k][3]:.2f} [{min(qs):.2f}-{max(qs):.2f}]  sent {out[k][4]:.0f} B")
    print("RESULT " + " ".join(f"{k}_router_ms={v[0]:.3f} {k}_thread_ms={v[2]:.3f} {k}_broker_ms={v[1]:.3f} "
                               f"{k}_produce_reqs={v[3]:.2f} {k}_tx_bytes={v[4]:.0f}" for k, v in out.items())
          + f" request_bytes={sum(sizes.values())}")
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--hop-ms", type=float, default=HOP_MS,
                    help="Milliseconds between a request's decision events and its end's.")
    ap.add_argument("--settings", nargs="*", choices=list(SETTINGS), help="Only these settings.")
    ap.add_argument("--read-prefix", help="Instead: bytes per event type on this topic prefix's topics.")
    ap.add_argument("--fetches", action="store_true", help="Instead: the router's consumers' requests to the broker.")
    ap.add_argument("--view-waits", type=int, nargs="*", default=[10, 25, 50],
                    help="view_fetch_wait_ms values for --fetches.")
    ap.add_argument("--tails", type=int, default=6, help="Tails at once, for --fetches' cost of one fetch.")
    a = ap.parse_args()
    if a.fetches:
        fetches(a.rounds, a.n, a.view_waits, a.tails)
    elif a.read_prefix:
        print_bytes(a.read_prefix)
    else:
        main(a.rounds, a.n, a.hop_ms, a.settings)
