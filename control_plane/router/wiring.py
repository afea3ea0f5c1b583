"""One wiring function for the router process: settings -> running FastAPI app.

Start-up order, for a restart's sake: the log side (:func:`restore_router`: config, orphans,
API keys, the newest snapshot and the log tail) is read in a thread while the main thread
imports the HTTP side; :func:`build_router` then puts the HTTP side on it, and the app's start
only starts following the log (from the loop) on a view that has already reached its end.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from control_plane.router import RouterConfig
from control_plane.router.admission import RULE as ADMISSION_RULE, AdmissionConfig
from control_plane.router.config import load_router_config
from control_plane.router.health import HealthThresholds
from control_plane.router.keys import KeyTable
from control_plane.router.limits import RequestLimits
from control_plane.router.loop_lag_probe import LoopLagProbe
from control_plane.router.orphans import close_orphans
from control_plane.router.shared_gate import SharedKeyGate, SharedWaiting, waiting_key, waiting_shared
from control_plane.router.stream import RouterViewProcessor
from control_plane.router.view import DEFAULT_WORKER_NETWORKS, EndpointAllowlist
from control_plane.streaming import StreamFollower
from common.hashing import HashAlgo, HashConfig
from common.connection_limits import ConnectionLimits
from common.native_http import serve
from common.log.native_producer import NativeEventProducer
from common.log.reader import read_events
from common.settings import BusSettings, worker_credential
from common.tokenizer import HFTokenizer, Tokenizer, build_tokenizer
from schemas.events import RouterConfigChanged

if TYPE_CHECKING:
    from control_plane.router.serving import RouterApp

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterSettings:
    """Everything one router replica needs; built once at start-up."""

    #: Replica id: names its consumer group and appears in every decision it records.
    router_id: str = field(default_factory=lambda: f"router-{socket.gethostname()}-{os.getpid()}")
    host: str = "127.0.0.1"
    port: int = 8000
    #: Routing mode and weights; a JSON/TOML file overrides the defaults (RouterConfig fields).
    mode: str = "kv"
    config_file: Path | None = None
    #: Prefix-hash algorithm and block size the engines use (the index refuses others).
    hash_algo: str = "sha256"
    block_size: int = 64
    tokenizer: str = "hash"
    served_model: str = "switchyard-sim"
    #: Seconds between index checkpoints to the snapshots topic.
    snapshot_every_s: float = 5.0
    #: Longest a start folds the log tail after the snapshot, before it serves (a tail longer
    #: than that is folded while serving, ``/health`` saying LOADING until it is done): the port
    #: must open before a liveness probe gives up on the process.
    restore_budget_s: float = 20.0
    max_attempts: int = 3
    read_timeout_s: float = 60.0
    #: TCP connect timeout to a worker; a timeout is retried on another worker.
    connect_timeout_s: float = 5.0
    thresholds: HealthThresholds = HealthThresholds()
    #: The admission queue's bounds (control_plane/router/admission.py).
    admission: AdmissionConfig = AdmissionConfig()
    #: Bounds on one request (body bytes, context, output, vocabulary:
    #: control_plane/router/limits.py). ``None``: the served model's, as far as it is known
    #: (the simulated model's context and vocabulary; an HF tokenizer's vocabulary size).
    limits: RequestLimits | None = None
    #: Where workers' endpoints may be: networks or host names (a registration elsewhere is
    #: refused and dead-lettered; control_plane/router/view.py ``EndpointAllowlist``).
    worker_networks: tuple[str, ...] = DEFAULT_WORKER_NETWORKS
    #: API keys on the generation routes (control_plane/router/keys.py), folded from the admin
    #: stream. Off only when asked (``--no-auth``, ``SWITCHYARD_ROUTER_AUTH=0``), said loudly.
    auth: bool = True
    #: Where the per-key limits are counted (with ``auth``): ``shared``, in Redis for every replica
    #: (control_plane/router/shared_gate.py; this replica alone for a call Redis does not answer),
    #: or ``local``, in this process (N replicas admit up to N times a key's limits). None:
    #: shared when :attr:`redis_url` is set, else local.
    key_limits: str | None = None
    #: The Redis of the shared limits (the stack's, as the planner's lease; ``SWITCHYARD_REDIS_URL``).
    redis_url: str | None = field(default=None, repr=False)
    #: A concurrency slot's lease in Redis, renewed every third of it while its request runs: the
    #: longest a replica killed with -9 keeps its slots.
    key_slot_lease_s: float = 10.0
    #: The bearer every call to a worker carries (the cluster's worker credential, a stack
    #: secret: ``common.settings.worker_credential``); None: read it from the secrets dir.
    worker_credential: str | None = field(default=None, repr=False)
    #: Connections served at once, and how long one may take to send a request's headers
    #: (the native server: common/native_http.py); a body's own bound is ``limits.body_timeout_s``.
    connections: ConnectionLimits = ConnectionLimits()
    #: ``linger.ms`` of this replica's event producer: how long a request's events wait to share
    #: a produce request with its next events and other requests'. 5 ms: longer than a short
    #: request takes, so its decision's and its end's events go in one produce request, not two
    #: (the broker's CPU for them about in proportion, docs/router-events-cost.md); no request
    #: waits for them. At 20 ms a request's ``RequestAdmitted`` landed on the log after its
    #: prefill worker's ``PrefillCompleted`` (test_router_workers caught it).
    events_linger_ms: int = 5
    #: Longest the broker holds the view's fetch (``fetch.max.wait.ms``, with ``fetch.min.bytes``
    #: 64 KB) before answering with what it has. The view fetches about once per wait, busy or
    #: idle, and a fetch costs the broker about a millisecond of CPU: 10 ms made ~42 fetches/s,
    #: 50 ms makes ~16 (docs/router-events-cost.md, ``benchmarks/router_events_cost.py
    #: --fetches``), for an index up to 50 ms staler. What this router routed meanwhile is in its
    #: ledger (speculative overlap, until the request completes): in the routing simulation a
    #: KV-event lag up to 100 ms changed no TTFT and no hit (``benchmarks/view_staleness.py``).
    #: 0: answer at once (fetch.min.bytes 1: a fetch per record batch).
    view_fetch_wait_ms: int = 50


def view_fetch(wait_ms: int) -> dict[str, int]:
    """The view consumer's fetch settings for a longest wait of ``wait_ms``: the broker answers
    once 64 KB are there (never, at a router's rates) or the wait is over; 0: at once."""
    if wait_ms < 0:
        raise ValueError(f"view_fetch_wait_ms={wait_ms}: 0 (answer at once) or more")
    return {"fetch_min_bytes": 65536 if wait_ms else 1, "fetch_wait_ms": wait_ms or 1500}


def key_limits_mode(s: RouterSettings) -> str:
    """``shared`` or ``local``: the setting, else shared when a Redis URL is configured."""
    mode = s.key_limits or ("shared" if s.redis_url else "local")
    if mode not in ("shared", "local"):
        raise ValueError(f"key_limits={mode!r}: shared (Redis, every replica) or local (this replica)")
    if mode == "shared" and not s.redis_url:
        raise ValueError("key_limits=shared needs a Redis URL (--redis-url, SWITCHYARD_REDIS_URL)")
    return mode


def request_limits(s: RouterSettings, tokenizer: Tokenizer) -> RequestLimits:
    """The settings' limits, else the model's: the sim defaults with the tokenizer's vocabulary."""
    if s.limits is not None:
        return s.limits
    vocab = getattr(tokenizer, "vocab_size", None)
    if isinstance(tokenizer, HFTokenizer) and vocab:
        return RequestLimits(vocab_size=vocab)
    return RequestLimits()


def resolve_router_config(s: RouterSettings, bus: BusSettings, producer: NativeEventProducer) -> RouterConfig:
    """The log is the source of truth for config versions too.

    * No ``--config``/``--mode`` override and a config in the log: use the newest one.
    * Otherwise the local config (file or defaults): if it equals the newest logged one, reuse
      that version; else record it as the next version (``RouterConfigChanged`` by this router).
    Every decision then names a version whose full config is in the log.
    """
    latest = _latest_config(bus)
    local = load_router_config(s.config_file, version=1, mode=s.mode)
    explicit = s.config_file is not None or s.mode != "kv"
    if latest is not None and not explicit:
        version, cfg = latest
        return msgspec.convert({**cfg, "version": version}, RouterConfig)
    body = {k: v for k, v in msgspec.to_builtins(local).items() if k != "version"}
    if latest is not None and {k: v for k, v in latest[1].items() if k != "version"} == body:
        return msgspec.structs.replace(local, version=latest[0])
    version = (latest[0] + 1) if latest else 1
    producer.publish(RouterConfigChanged(actor=f"router:{s.router_id}", actor_role="system",
                                         config_version=version, config={**body, "version": version}))
    producer.flush(10)
    return msgspec.structs.replace(local, version=version)


def _latest_config(bus: BusSettings) -> tuple[int, dict] | None:
    best: tuple[int, dict] | None = None
    for env in read_events(bus, "admin"):
        if isinstance(env.data, RouterConfigChanged) and (best is None or env.data.config_version >= best[0]):
            best = (env.data.config_version, dict(env.data.config))
    return best


@dataclass
class RouterLog:
    """The log side of a router replica: what it reads from the log before it serves."""

    producer: NativeEventProducer
    config: RouterConfig
    hash_config: HashConfig
    #: The router view, restored from the newest snapshot with the tail folded (not following yet).
    processor: RouterViewProcessor
    #: The API keys folded from the ``admin`` stream and the thread that keeps them current
    #: (None without auth).
    keys: KeyTable | None = None
    follower: StreamFollower | None = None


def restore_router(s: RouterSettings, bus: BusSettings) -> RouterLog:
    """Everything a replica reads from the log before it serves, the independent reads side by
    side: the config lookup, the orphan scan (requests its killed incarnations left open are
    closed) and the API keys in threads, while this one restores the newest snapshot and folds
    the log tail in batches (:meth:`~control_plane.streaming.FoldProcessor.restore`)."""
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.monotonic()
    hash_config = HashConfig(HashAlgo(s.hash_algo), s.block_size)
    producer = NativeEventProducer(bus, s.router_id, **{"linger.ms": s.events_linger_ms})
    keys: KeyTable | None = None
    follower: StreamFollower | None = None
    with ThreadPoolExecutor(3, thread_name_prefix="router-start") as pool:
        config = pool.submit(resolve_router_config, s, bus, producer)
        orphans = pool.submit(close_orphans, bus, producer)
        if s.auth:
            # Every key the log holds is known before the first request: a new replica never
            # refuses a key its peers accept.
            keys = KeyTable()
            follower = StreamFollower(bus, ["admin"], f"{s.router_id}.keys", keys.apply)
            keys_read = pool.submit(lambda: follower.start().wait_caught_up(60.0))
        view = RouterViewProcessor.load_view(bus, hash_config.hash_algo, s.block_size,
                                             EndpointAllowlist(s.worker_networks))
        t_view = time.monotonic()
        processor = RouterViewProcessor(bus, s.router_id, view, snapshot_every_s=s.snapshot_every_s,
                                        thresholds=s.thresholds, **view_fetch(s.view_fetch_wait_ms))
        processor.restore(s.restore_budget_s)
        t_tail = time.monotonic()
        orphans.result()
        if follower is not None:
            keys_read.result()
        out = RouterLog(producer, config.result(), hash_config, processor, keys, follower)
    log.info("router %s restored from the log in %.2f s: snapshot %.2f s, tail to the log end and group seeded "
             "%.2f s, then config/orphans/keys %.2f s", s.router_id, time.monotonic() - t0, t_view - t0,
             t_tail - t_view, time.monotonic() - t_tail)
    return out


def build_router(s: RouterSettings, bus: BusSettings, restored: RouterLog) -> RouterApp:
    """The HTTP side on the restored log side."""
    # lazy: start-up time: loads aiohttp, fastapi, prometheus_client ... only when called
    from control_plane.router.serving import RouterApp, RouterAuth, RouterMetrics
    # lazy: start-up time: loads aiohttp only when called
    from control_plane.router.proxy import Router

    producer, config, processor, follower = restored.producer, restored.config, restored.processor, restored.follower
    view = processor.view
    metrics = RouterMetrics()
    # Read at each scrape: how far the broker's acknowledgements trail this router's events.
    metrics.events_queued.set_function(producer.outstanding)
    # The router's own saturation, counted as load by admission (RouterConfig.max_loop_lag_ms).
    probe = LoopLagProbe(on_sample=metrics.loop_lag_sample_seconds.observe)
    # The replicas' requests waiting for a first token, shared for the TTFT budget's queue
    # (admission rule 4), in the Redis of the shared key limits, one hash per system; only when
    # the budget test is in force (its config, folded from the log at start).
    shared_waiting: SharedWaiting | None = None
    router: Router | None = None
    if waiting_shared(s.redis_url, config.ttft_slo_ms, ADMISSION_RULE):
        shared_waiting = SharedWaiting.from_url(s.redis_url, replica=s.router_id,
                                                key=waiting_key(bus.topic_prefix),
                                                waiting=lambda: router.ledger.margin.waiting() if router else 0,
                                                max_count=s.connections.max_connections,
                                                on_rejected=lambda why: metrics.waiting_rejected.labels(why).inc())
    router = Router(router_id=s.router_id, view=view, producer=producer, config=config,
                    hash_config=restored.hash_config, health=processor.health, max_attempts=s.max_attempts,
                    read_timeout_s=s.read_timeout_s, connect_timeout_s=s.connect_timeout_s, admission=s.admission,
                    metrics=metrics, worker_credential=s.worker_credential or worker_credential(bus.secrets_dir),
                    loop_lag=lambda: probe.lag, others_waiting=shared_waiting.others if shared_waiting else None)
    auth: RouterAuth | None = None
    if restored.keys is not None:
        auth = RouterAuth(restored.keys)
        if key_limits_mode(s) == "shared":
            auth.gate = SharedKeyGate.from_url(s.redis_url, lease_s=s.key_slot_lease_s,
                                               on_fallback=lambda op: metrics.key_gate_fallbacks.labels(op).inc())
    else:
        logging.getLogger("switchyard.security").warning(
            "INSECURE: router %s runs WITHOUT API keys (--no-auth / SWITCHYARD_ROUTER_AUTH=0): anyone who reaches "
            "%s:%d can send prompts to the workers, with no per-key rate or concurrency limit", s.router_id,
            s.host, s.port)

    async def start() -> None:
        if auth is not None:
            await auth.gate.start()
        await processor.start()
        probe.start()
        if shared_waiting is not None:
            await shared_waiting.start()
        log.info("router %s serving on %s:%d (mode %s, view at %d records, %s)", s.router_id, s.host, s.port,
                 config.mode, view.applied,
                 f"API keys on: {len(auth.table.keys)} in the log, limits {key_limits_mode(s)}"
                 if auth is not None else "API keys OFF")

    async def stop() -> None:
        import asyncio

        await probe.stop()
        if shared_waiting is not None:
            await shared_waiting.close()
        await processor.checkpoint()
        await processor.stop()
        await router.close()
        if follower is not None:
            await asyncio.to_thread(follower.stop)
        if auth is not None:
            await auth.gate.close()
        producer.close(10)

    tokenizer = build_tokenizer(s.tokenizer)
    return RouterApp(router=router, tokenizer=tokenizer, metrics=metrics, served_model=s.served_model,
                     health=processor.health, start=start, stop=stop, limits=request_limits(s, tokenizer),
                     auth=auth)


def run_router(s: RouterSettings, bus: BusSettings) -> None:
    """Restore the log side in a thread while this one imports the HTTP side (FastAPI, the
    proxy: about as long as the snapshot takes to read), then serve. A restart from a
    1M-block snapshot spends most of its time in these two, so they overlap."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, thread_name_prefix="router-restore") as pool:
        restoring = pool.submit(restore_router, s, bus)
        # lazy: start-up time: loads aiohttp, fastapi, prometheus_client ... only when called
        from control_plane.router.server import create_app

        restored = restoring.result()
    serve(create_app(build_router(s, bus, restored)), s.host, s.port, s.connections)
