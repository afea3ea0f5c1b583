"""The one wiring function of a planner process, and its loop.

Every replica, leader or passive, folds the ``requests`` and ``workers`` topics into its load
view (Faust, seeded from the newest snapshot) so a takeover decides at once. Only the replica
holding the Redis lease ticks:

1. On election: a fresh :class:`PlannerState` that adopts the replica counts the scaler reports
   (a new leader starts from reality, not from a dead leader's memory), the new fencing token,
   the pins. ``LEADER planner=<id> token=<n>`` goes to stdout.
2. Every ``tick_s``, just after a window closes (:meth:`PlannerConfig.next_tick_ns`), and at once
   after an election, once the view has caught up with the log:
   ``decide(now, view.snapshot(now), config, state)``; each effect's ``ScalingDecision`` is
   published to the ``planner`` stream, then handed to the scaler (if the lease is still ours),
   whose ``ScalingApplied`` is published too.
3. The local-process scaler also restarts workers that died without being drained.

Operator input comes from the ``admin`` stream, folded from its start by
:class:`AdminFollower` (:mod:`control_plane.planner.admin`): ``PoolPinned`` pins (they override
the config's ``pins``), ``PlannerConfigChanged`` and ``PoolUpdated`` (the effective config is
rebuilt when they change; an invalid one is refused and the previous config kept). Window
geometry changes need a restart (the live load view keeps the geometry it started with).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from control_plane.planner.admin import AdminInputs
from control_plane.planner.config import (
    DEFAULT_ITL_SLO_MS,
    DEFAULT_TTFT_SLO_MS,
    PlannerConfig,
    PoolConfig,
    load_config,
    resolve_profiles,
)
from control_plane.planner.errors import PlannerConfigError
from control_plane.planner.k8s import KubernetesScaler
from control_plane.planner.load_view import NS
from control_plane.planner.policy import Pin, PlannerState, decide
from control_plane.planner.scalers import FileFence, LocalProcessScaler, PoolLaunch, Scaler, VirtualScaler
from common.stack_settings import StackSettings
from common.settings import BusSettings
from schemas.types import WorkerRole

log = logging.getLogger(__name__)


def default_config() -> PlannerConfig:
    """One aggregated pool named ``default`` (what ``switchyard worker`` registers by default)."""
    return resolve_profiles(PlannerConfig(pools=(PoolConfig(
        name="default", role=WorkerRole.AGGREGATED, min_replicas=1, max_replicas=4,
        ttft_slo_ms=DEFAULT_TTFT_SLO_MS, itl_slo_ms=DEFAULT_ITL_SLO_MS),), gpu_budget=4))


@dataclass(frozen=True)
class PlannerSettings:
    """One planner process."""

    #: Replica id: names its consumer group, its producer and its lease value.
    planner_id: str = field(default_factory=lambda: f"planner-{socket.gethostname()}-{os.getpid()}")
    #: Planner config (TOML/JSON); None: :func:`default_config`.
    config_path: Path | None = None
    #: "local" (start/stop worker processes), "kubernetes" or "virtual" (in memory).
    scaler: str = "local"
    #: Where the local scaler keeps its workers' records, logs and the fencing file; Faust data.
    state_dir: Path = field(default_factory=lambda: StackSettings.from_env().state_dir / "planner")
    #: The planners' own Redis ACL user (confined to their lease keys).
    redis_url: str = field(default_factory=lambda: StackSettings.from_env().redis_role_url("planner"))
    #: Lease name: planners sharing it elect one leader.
    lease_name: str = "default"
    lease_ttl_ms: int = 3000
    dry_run: bool = False
    namespace: str = "default"
    kube_host: str | None = None
    kubeconfig: str | None = None
    in_cluster: bool = False
    #: Extra ``switchyard worker`` arguments for locally started workers.
    worker_args: tuple[str, ...] = ()
    #: Virtual scaler: seconds a new replica takes to become ready.
    virtual_startup_s: float = 0.0
    snapshot_every_s: float = 10.0
    #: ``GET /health`` (200 once the load view caught up: leader or standby) on this address;
    #: port None: no HTTP server.
    health_host: str = "127.0.0.1"
    health_port: int | None = None

    def __post_init__(self) -> None:
        if self.scaler not in ("local", "kubernetes", "virtual"):
            raise PlannerConfigError(f"unknown scaler {self.scaler!r} (local, kubernetes, virtual)")


def build_scaler(s: PlannerSettings, config: PlannerConfig, bus: BusSettings, emit) -> Scaler:
    if s.scaler == "virtual":
        return VirtualScaler(startup_s=s.virtual_startup_s, fence=FileFence(s.state_dir / "virtual" / "fence"),
                             emit=emit)
    if s.scaler == "kubernetes":
        return KubernetesScaler.connect(s.namespace, {p.name: p.deployment_name for p in config.pools},
                                        host=s.kube_host, kubeconfig=s.kubeconfig, in_cluster=s.in_cluster,
                                        dry_run=s.dry_run, emit=emit)
    env = dict(os.environ)
    env["SWITCHYARD_KAFKA_BOOTSTRAP"] = bus.bootstrap
    env["SWITCHYARD_TOPIC_PREFIX"] = bus.topic_prefix
    launches = [PoolLaunch(p.name, WorkerRole(p.role), p.profile, p.profile_speedup, tuple(s.worker_args))
                for p in config.pools]
    return LocalProcessScaler(s.state_dir / "local", launches, env=env, emit=emit)


class AdminFollower:
    """Folds the ``admin`` stream from its start in a thread (a
    :class:`~control_plane.streaming.StreamFollower`); :meth:`current` hands the loop a
    consistent copy."""

    def __init__(self, bus: BusSettings, planner_id: str) -> None:
        # lazy: start-up time: loads confluent_kafka only when called
        from control_plane.streaming import StreamFollower

        self.inputs = AdminInputs()
        # Through self.inputs at each event (a test swaps the inputs before start).
        self._follower = StreamFollower(bus, ["admin"], f"{planner_id}.admin", lambda env: self.inputs.apply(env))

    def start(self) -> AdminFollower:
        self._follower.start()
        return self

    def positions(self) -> dict[tuple[str, int], int]:
        """Next offset per admin partition: how far the follower has read (poison included)."""
        return self._follower.positions()

    def current(self, base: PlannerConfig) -> tuple[dict[str, Pin], int, PlannerConfig | None, str]:
        """(pins, config generation, effective config or None if unchanged/invalid, error)."""
        with self._follower.lock:
            pins = dict(self.inputs.pins)
            gen = self.inputs.generation
            try:
                cfg = self.inputs.effective_config(base) if gen else None
                err = ""
            except PlannerConfigError as e:
                cfg, err = None, str(e)
        return pins, gen, cfg, err

    def stop(self) -> None:
        self._follower.stop()


def run_planner(s: PlannerSettings, bus: BusSettings) -> int:
    return asyncio.run(_main(s, bus))


async def _main(s: PlannerSettings, bus: BusSettings) -> int:
    import redis

    # lazy: start-up time: loads redis only when called
    from control_plane.planner.leader import LeaderElector, LeaderLease
    # lazy: start-up time: loads confluent_kafka only when called
    from control_plane.planner.stream import LoadViewProcessor
    # lazy: start-up time: loads confluent_kafka, xxhash only when called
    from common.log.kafka import EventProducer

    base_config = load_config(s.config_path) if s.config_path else default_config()
    config = base_config
    s.state_dir.mkdir(parents=True, exist_ok=True)
    producer = EventProducer(bus, s.planner_id)

    def emit(applied) -> None:
        producer.publish(applied)

    scaler = build_scaler(s, config, bus, emit)
    lv_config = config.load_view_config()
    view = await asyncio.to_thread(LoadViewProcessor.load_view, bus, lv_config)
    proc = LoadViewProcessor(bus, s.planner_id, view, snapshot_every_s=s.snapshot_every_s,
                             datadir=s.state_dir / "faust")
    admin = AdminFollower(bus, s.planner_id).start()
    admin_gen = 0
    elector = LeaderElector(LeaderLease(redis.Redis.from_url(s.redis_url), s.lease_name, s.planner_id,
                                        s.lease_ttl_ms)).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await proc.start()
    state = PlannerState()
    led_with: int | None = None

    def health() -> tuple[bool, dict]:
        stopped = proc.stopped_reason()  # the load view's fold stopped while the log moved
        return proc.caught_up, {"planner_id": s.planner_id, "caught_up": proc.caught_up,
                                "state": "LOADING" if not proc.caught_up else "DEGRADED" if stopped else "OK",
                                "reasons": [stopped] if stopped else [],
                                "leader": elector.token is not None, "token": elector.token,
                                "config_version": config.version, "scaler": scaler.name,
                                "records_applied": view.applied}

    server = await _serve_health(s.health_host, s.health_port, health) if s.health_port is not None else None
    print(f"STARTED planner={s.planner_id} scaler={scaler.name} pools={[p.name for p in config.pools]}", flush=True)

    next_tick = 0.0
    try:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=0.2)
            except asyncio.TimeoutError:
                pass
            if stop.is_set():
                break
            token = elector.token
            if token is None:
                if led_with is not None:
                    print(f"FOLLOWER planner={s.planner_id} lost token={led_with}", flush=True)
                    led_with = None
                continue
            if not proc.caught_up:
                continue
            if token != led_with:
                targets = await asyncio.to_thread(scaler.desired)
                state = PlannerState().with_token(token).with_targets(
                    {p.name: targets[p.name] for p in config.pools if p.name in targets})
                led_with = token
                next_tick = 0.0
                print(f"LEADER planner={s.planner_id} token={token}", flush=True)
            if time.monotonic() < next_tick:
                continue
            admin_pins, gen, admin_cfg, err = admin.current(base_config)
            if gen != admin_gen:
                admin_gen = gen
                if admin_cfg is not None:
                    config = await asyncio.to_thread(resolve_profiles, admin_cfg)
                    print(f"CONFIG version={config.version} pools={[p.name for p in config.pools]}", flush=True)
                else:
                    log.warning("admin config change refused, keeping version %d: %s", config.version, err)
            pins: dict[str, int | Pin] = dict(config.pins)
            pins.update(admin_pins)
            state = state.with_pins({k: v for k, v in pins.items() if k in {p.name for p in config.pools}})
            now = time.time_ns()
            # the next tick just after the next window closes (event time is wall time)
            next_tick = time.monotonic() + (config.next_tick_ns(now) - now) / NS
            decision, state = decide(now, view.snapshot(now), config, state)
            for eff in decision.effects:
                producer.publish(eff.event)
                if elector.token != token:
                    log.warning("lease lost mid-tick: %s not applied", eff.event.decision_id)
                    break
                applied = await asyncio.to_thread(scaler.apply, eff.event)
                print(f"DECISION {eff.pool} {eff.from_replicas}->{eff.to_replicas} token={token} "
                      f"applied={applied.success} {applied.error}", flush=True)
                log.info("%s", eff.reason)
            for r in decision.reports:
                if r.action == "hold":
                    log.debug("%s: %s", r.pool, r.reason)
            if isinstance(scaler, LocalProcessScaler):
                await asyncio.to_thread(scaler.reconcile)
            producer.poll(0)
    finally:
        if server is not None:
            server.close()
        elector.stop(release=True)
        admin.stop()
        await proc.stop()
        scaler.close()
        producer.close(10)
    return 0


async def _serve_health(host: str, port: int, health) -> asyncio.base_events.Server:
    """A minimal HTTP server for probes: ``GET /health`` -> 200/503 with a JSON body."""
    import json

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), 5)
            while (await asyncio.wait_for(reader.readline(), 5)) not in (b"\r\n", b"\n", b""):
                pass
            path = request.split(b" ")[1] if request.count(b" ") >= 2 else b"/"
            if path.split(b"?")[0] == b"/health":
                ok, body = health()
                status = "200 OK" if ok else "503 Service Unavailable"
            else:
                status, body = "404 Not Found", {"error": "not found"}
            data = json.dumps(body).encode()
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                         f"Connection: close\r\n\r\n".encode() + data)
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, host, port)
    log.info("health on http://%s:%d/health", host, server.sockets[0].getsockname()[1])
    return server
