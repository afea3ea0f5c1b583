"""Scalers: what turns a ``ScalingDecision`` into running replicas. One ``Protocol``, three
implementations:

* :class:`VirtualScaler`: in memory, replicas become ready after ``startup_s`` and leave
  ``drain_s`` after being told to drain. Tests, backtests and the benchmark use it.
* :class:`LocalProcessScaler`: the embedded default. Starts ``switchyard worker`` processes
  (``--port 0``: each picks a free port and prints ``READY <url>``), drains them with SIGTERM
  (the worker answers 503 to new requests, finishes in-flight ones, deregisters, exits 0).
  Its processes and the newest fencing token live under a state directory, so a new leader's
  scaler adopts the workers the dead one started and keeps rejecting the dead one's tokens.
* :class:`control_plane.planner.k8s.KubernetesScaler`: patches a Deployment's scale
  subresource.

Fencing: every scaler rejects a decision whose ``fencing_token`` is older than the newest it
has seen (:class:`StaleFencingToken`); the rejection is reported as ``ScalingApplied(success=
False)`` with the reason, never applied. Scale-down is only ever a drain: a scaler picks the
victims the decision names (``inputs["drain_workers"]``) first.

Every ``apply`` returns the ``ScalingApplied`` payload and hands it to ``emit`` (the planner
publishes it to the ``planner`` stream).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from control_plane.planner.errors import ScalerError, StaleFencingToken
from control_plane.planner.load_view import NS, PoolWorker, ReplicaCounts
from common.processes import alive
from schemas.events import ScalingApplied, ScalingDecision
from schemas.types import WorkerRole

log = logging.getLogger(__name__)

Emit = Callable[[ScalingApplied], None]


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    """What a scaler knows about one pool."""

    pool: str
    #: Replicas the scaler was last asked to run.
    desired: int
    #: Replicas that exist and are not draining (ready or starting).
    running: int
    ready: int
    draining: int = 0


@runtime_checkable
class Scaler(Protocol):
    name: str

    def apply(self, decision: ScalingDecision, *, now_ns: int | None = None) -> ScalingApplied:
        """Apply one decision (or reject it as stale); never raises for a stale token."""
        ...

    def status(self, pool: str) -> ReplicaStatus: ...

    def desired(self) -> dict[str, int]:
        """Replicas per pool this scaler runs now (a new leader adopts these as its targets)."""
        ...

    def close(self) -> None: ...


# ----------------------------------------------------------------------------------------------
# Fencing
# ----------------------------------------------------------------------------------------------


class Fence(Protocol):
    def admit(self, token: int) -> None:
        """Raise :class:`StaleFencingToken` if ``token`` is older than the newest seen; else
        remember it (if newer)."""
        ...

    @property
    def newest(self) -> int: ...


class MemoryFence:
    def __init__(self) -> None:
        self._newest = 0
        self._lock = threading.Lock()

    @property
    def newest(self) -> int:
        return self._newest

    def admit(self, token: int) -> None:
        with self._lock:
            if token < self._newest:
                raise StaleFencingToken(token, self._newest)
            self._newest = token


class FileFence:
    """The newest token in a file, checked and raised under an exclusive ``flock``: scalers in
    different processes (an old and a new leader) share it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(exist_ok=True)

    @property
    def newest(self) -> int:
        with open(self.path) as f:
            fcntl.flock(f, fcntl.LOCK_SH)
            return int(f.read().strip() or 0)

    def admit(self, token: int) -> None:
        with open(self.path, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            newest = int(f.read().strip() or 0)
            if token < newest:
                raise StaleFencingToken(token, newest)
            if token > newest:
                f.seek(0)
                f.truncate()
                f.write(str(token))
                f.flush()
                os.fsync(f.fileno())


def drain_list(decision: ScalingDecision) -> list[str]:
    raw = decision.inputs.get("drain_workers", "")
    return [w for w in str(raw).split(",") if w]


def _emitted(emit: Emit | None, out: ScalingApplied) -> ScalingApplied:
    """Hand ``out`` to ``emit`` (when there is one) and return it: the last step of every apply."""
    if emit is not None:
        emit(out)
    return out


def _rejected(decision: ScalingDecision, err: Exception, scaler: str, replicas: int) -> ScalingApplied:
    return ScalingApplied(pool=decision.pool, decision_id=decision.decision_id, replicas=replicas,
                          success=False, error=str(err), scaler=scaler)


# ----------------------------------------------------------------------------------------------
# Virtual
# ----------------------------------------------------------------------------------------------


@dataclass(slots=True)
class VirtualReplica:
    worker_id: str
    pool: str
    role: str
    started_ns: int
    ready_ns: int
    draining_ns: int | None = None
    gone_ns: int | None = None

    def state(self, now_ns: int) -> str:
        if self.gone_ns is not None and now_ns >= self.gone_ns:
            return "gone"
        if self.draining_ns is not None and now_ns >= self.draining_ns:
            return "draining"
        return "ready" if now_ns >= self.ready_ns else "starting"


class VirtualScaler:
    """In-memory replicas on the caller's clock (``now_ns``), or the wall clock if not given."""

    name = "virtual"

    def __init__(self, *, startup_s: float = 0.0, drain_s: float = 0.0, fence: Fence | None = None,
                 emit: Emit | None = None, clock: Callable[[], int] = time.time_ns) -> None:
        self.startup_ns = int(startup_s * NS)
        self.drain_ns = int(drain_s * NS)
        self.fence = fence or MemoryFence()
        self.emit = emit
        self.clock = clock
        self.replicas: list[VirtualReplica] = []
        self._desired: dict[str, int] = {}
        self._next = 0
        self.applied: list[ScalingApplied] = []

    def _new(self, pool: str, role: str, now: int, ready_now: bool = False) -> VirtualReplica:
        r = VirtualReplica(f"{pool}-v{self._next}", pool, role, now, now if ready_now else now + self.startup_ns)
        self._next += 1
        self.replicas.append(r)
        return r

    def seed(self, pool: str, role: str | WorkerRole, n: int, *, now_ns: int = 0) -> None:
        """Start with ``n`` ready replicas in ``pool``."""
        role = WorkerRole(role).value
        for _ in range(n):
            self._new(pool, role, now_ns, ready_now=True)
        self._desired[pool] = self._desired.get(pool, 0) + n

    def _active(self, pool: str, now: int) -> list[VirtualReplica]:
        return [r for r in self.replicas if r.pool == pool and r.state(now) in ("starting", "ready")]

    def apply(self, decision: ScalingDecision, *, now_ns: int | None = None) -> ScalingApplied:
        now = self.clock() if now_ns is None else now_ns
        pool = decision.pool
        active = self._active(pool, now)
        try:
            self.fence.admit(decision.fencing_token)
        except StaleFencingToken as e:
            out = _rejected(decision, e, self.name, len(active))
            return self._done(out)
        role = WorkerRole(decision.role).value
        to = decision.to_replicas
        if to > len(active):
            for _ in range(to - len(active)):
                self._new(pool, role, now)
        elif to < len(active):
            named = drain_list(decision)
            order = sorted(active, key=lambda r: (r.worker_id not in named,
                                                  r.state(now) != "starting", -r.started_ns, r.worker_id))
            for r in order[: len(active) - to]:
                r.draining_ns = now
                r.gone_ns = now + self.drain_ns
        self._desired[pool] = to
        return self._done(ScalingApplied(pool=pool, decision_id=decision.decision_id, replicas=to,
                                         scaler=self.name))

    def _done(self, out: ScalingApplied) -> ScalingApplied:
        self.applied.append(out)
        return _emitted(self.emit, out)

    def counts(self, pool: str, now_ns: int) -> ReplicaCounts:
        c = {"starting": 0, "ready": 0, "draining": 0}
        for r in self.replicas:
            if r.pool == pool:
                s = r.state(now_ns)
                if s in c:
                    c[s] += 1
        return ReplicaCounts(**c)

    def workers(self, pool: str, now_ns: int) -> tuple[PoolWorker, ...]:
        out = []
        for r in self.replicas:
            if r.pool != pool:
                continue
            s = r.state(now_ns)
            if s == "gone":
                continue
            out.append(PoolWorker(worker_id=r.worker_id, pool=pool, role=r.role, state=s,
                                  registered_at_ns=r.started_ns,
                                  ready_at_ns=r.ready_ns if now_ns >= r.ready_ns else None,
                                  reported_at_ns=now_ns))
        return tuple(out)

    def replica_seconds(self, pool: str, start_ns: int, end_ns: int) -> float:
        """Seconds replicas of ``pool`` existed (starting, ready or draining) in [start, end)."""
        total = 0
        for r in self.replicas:
            if r.pool != pool:
                continue
            a = max(r.started_ns, start_ns)
            b = min(r.gone_ns if r.gone_ns is not None else end_ns, end_ns)
            total += max(b - a, 0)
        return total / NS

    def status(self, pool: str, now_ns: int | None = None) -> ReplicaStatus:
        now = self.clock() if now_ns is None else now_ns
        c = self.counts(pool, now)
        return ReplicaStatus(pool, self._desired.get(pool, 0), c.active, c.ready, c.draining)

    def desired(self) -> dict[str, int]:
        return dict(self._desired)

    def close(self) -> None:
        pass


# ----------------------------------------------------------------------------------------------
# Local processes
# ----------------------------------------------------------------------------------------------

_READY = re.compile(r"^READY (\S+) epoch=(\d+)", re.M)


@dataclass(frozen=True, slots=True)
class PoolLaunch:
    """How to start one pool's workers."""

    pool: str
    role: WorkerRole
    profile: str = "mocker"
    speedup: float = 1.0
    #: Further ``switchyard worker`` arguments (e.g. ``["--load-interval", "0.5"]``).
    extra_args: tuple[str, ...] = ()


@dataclass(slots=True)
class LocalWorker:
    worker_id: str
    pool: str
    pid: int
    log_path: Path
    started_at: float
    url: str | None = None
    draining: bool = False
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def record(self) -> dict:
        return {"worker_id": self.worker_id, "pool": self.pool, "pid": self.pid, "log": str(self.log_path),
                "started_at": self.started_at, "url": self.url, "draining": self.draining}


def default_worker_command() -> list[str]:
    """``switchyard worker`` in this interpreter (signals go straight to the worker process)."""
    return [sys.executable, "-m", "switchyard.cli", "worker"]


class LocalProcessScaler:
    """Runs each pool's replicas as ``switchyard worker`` child processes (see module doc).

    State under ``state_dir``: ``fence`` (newest fencing token), ``counter`` (next worker
    number), ``workers/<worker_id>.json`` (pid, log, url, draining), ``logs/``, ``data/``.
    """

    name = "local"

    def __init__(self, state_dir: Path, launches: Sequence[PoolLaunch], *,
                 command: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
                 emit: Emit | None = None, drain_timeout_s: float = 30.0) -> None:
        self.state_dir = Path(state_dir)
        self.launches = {p.pool: p for p in launches}
        self.command = list(command or default_worker_command())
        self.env = dict(os.environ if env is None else env)
        self.emit = emit
        self.drain_timeout_s = drain_timeout_s
        for d in ("workers", "logs", "data"):
            (self.state_dir / d).mkdir(parents=True, exist_ok=True)
        self.fence = FileFence(self.state_dir / "fence")
        self._lock = threading.RLock()
        self.workers: dict[str, LocalWorker] = {}
        self._desired: dict[str, int] = {}
        self._adopt()

    # -- bookkeeping ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _state_lock(self):
        with self._lock, open(self.state_dir / ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    def _adopt(self) -> None:
        """Take over live workers recorded by an earlier scaler (a previous leader)."""
        for path in sorted((self.state_dir / "workers").glob("*.json")):
            try:
                rec = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if not alive(rec["pid"]):
                path.unlink(missing_ok=True)
                continue
            w = LocalWorker(rec["worker_id"], rec["pool"], rec["pid"], Path(rec["log"]), rec["started_at"],
                            rec.get("url"), rec.get("draining", False))
            self.workers[w.worker_id] = w
            log.info("adopted worker %s (pid %d) of pool %s", w.worker_id, w.pid, w.pool)
        for pool in {w.pool for w in self.workers.values()}:
            self._desired[pool] = len(self._active(pool))

    def _save(self, w: LocalWorker) -> None:
        path = self.state_dir / "workers" / f"{w.worker_id}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(w.record()))
        tmp.replace(path)

    def _next_id(self, pool: str) -> str:
        path = self.state_dir / "counter"
        n = int(path.read_text().strip() or 0) if path.exists() else 0
        path.write_text(str(n + 1))
        return f"{pool}-{n}"

    def _active(self, pool: str) -> list[LocalWorker]:
        return [w for w in self.workers.values() if w.pool == pool and not w.draining]

    # -- actions ----------------------------------------------------------------------------

    def apply(self, decision: ScalingDecision, *, now_ns: int | None = None) -> ScalingApplied:
        with self._state_lock():
            self._reap()
            pool = decision.pool
            active = self._active(pool)
            try:
                self.fence.admit(decision.fencing_token)
            except StaleFencingToken as e:
                log.warning("rejected %s: %s", decision.decision_id, e)
                return _emitted(self.emit, _rejected(decision, e, self.name, len(active)))
            try:
                if pool not in self.launches:
                    raise ScalerError(f"no launch settings for pool {pool!r}")
                to = decision.to_replicas
                if to > len(active):
                    for _ in range(to - len(active)):
                        self._spawn(pool)
                elif to < len(active):
                    self._drain(self._pick(active, len(active) - to, drain_list(decision)))
                self._desired[pool] = to
            except (OSError, ScalerError) as e:
                return _emitted(self.emit, _rejected(decision, e, self.name, len(self._active(pool))))
            return _emitted(self.emit, ScalingApplied(pool=pool, decision_id=decision.decision_id, replicas=to,
                                                      scaler=self.name))

    def _spawn(self, pool: str) -> LocalWorker:
        spec = self.launches[pool]
        wid = self._next_id(pool)
        logp = self.state_dir / "logs" / f"{wid}.log"
        cmd = self.command + ["--worker-id", wid, "--role", spec.role.value, "--pool", pool, "--port", "0",
                              "--profile", spec.profile, "--speedup", str(spec.speedup),
                              "--data-dir", str(self.state_dir / "data" / wid), *spec.extra_args]
        with open(logp, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=self.env, start_new_session=True)
        w = LocalWorker(wid, pool, proc.pid, logp, time.time(), proc=proc)
        self.workers[wid] = w
        self._save(w)
        log.info("started worker %s (pid %d) in pool %s", wid, proc.pid, pool)
        return w

    def _pick(self, active: list[LocalWorker], k: int, named: list[str]) -> list[LocalWorker]:
        """Named victims first, then not-yet-ready ones (newest first), then the newest."""
        self._refresh_urls(active)
        order = sorted(active, key=lambda w: (w.worker_id not in named, w.url is not None, -w.started_at))
        return order[:k]

    def _drain(self, victims: list[LocalWorker]) -> None:
        for w in victims:
            w.draining = True
            self._save(w)
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.pid, signal.SIGTERM)
            log.info("draining worker %s (pid %d): SIGTERM", w.worker_id, w.pid)

    def _refresh_urls(self, workers) -> None:
        for w in workers:
            if w.url is None:
                try:
                    m = _READY.search(w.log_path.read_text(errors="replace"))
                except OSError:
                    m = None
                if m:
                    w.url = m.group(1)
                    self._save(w)

    def _reap(self) -> list[tuple[LocalWorker, int | None]]:
        """Forget workers whose process ended; returns them with their exit codes."""
        gone = []
        for wid, w in list(self.workers.items()):
            code: int | None
            if w.proc is not None:
                code = w.proc.poll()
                ended = code is not None
            else:
                code, ended = None, not alive(w.pid)
            if ended:
                gone.append((w, code))
                del self.workers[wid]
                (self.state_dir / "workers" / f"{wid}.json").unlink(missing_ok=True)
                if not w.draining:
                    log.warning("worker %s exited unexpectedly (code %s)", wid, code)
        return gone

    def reconcile(self) -> list[str]:
        """Start replacements for workers that died without being drained; returns new ids."""
        with self._state_lock():
            self._reap()
            started = []
            for pool, want in self._desired.items():
                for _ in range(want - len(self._active(pool))):
                    started.append(self._spawn(pool).worker_id)
            return started

    # -- queries ----------------------------------------------------------------------------

    def status(self, pool: str) -> ReplicaStatus:
        with self._state_lock():
            self._reap()
            active = self._active(pool)
            self._refresh_urls(active)
            draining = sum(1 for w in self.workers.values() if w.pool == pool and w.draining)
            return ReplicaStatus(pool, self._desired.get(pool, 0), len(active),
                                 sum(1 for w in active if w.url is not None), draining)

    def desired(self) -> dict[str, int]:
        with self._state_lock():
            self._reap()
            return {p: len(self._active(p)) for p in set(self._desired) | {w.pool for w in self.workers.values()}}

    def urls(self, pool: str) -> dict[str, str]:
        """worker id -> URL of the pool's ready, not draining workers."""
        with self._state_lock():
            active = self._active(pool)
            self._refresh_urls(active)
            return {w.worker_id: w.url for w in active if w.url}

    def wait_ready(self, pool: str, n: int, timeout_s: float = 60.0) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while True:
            urls = self.urls(pool)
            if len(urls) >= n:
                return urls
            if time.monotonic() > deadline:
                raise ScalerError(f"pool {pool}: {len(urls)} of {n} workers ready after {timeout_s:g}s")
            time.sleep(0.1)

    def wait_gone(self, worker_ids: Sequence[str], timeout_s: float = 60.0) -> dict[str, int | None]:
        """Wait until the given workers' processes exited; returns their exit codes."""
        codes: dict[str, int | None] = {}
        deadline = time.monotonic() + timeout_s
        want = set(worker_ids)
        while want - set(codes):
            with self._state_lock():
                for w, code in self._reap():
                    codes[w.worker_id] = code
                for wid in want - set(codes):
                    if wid not in self.workers:
                        codes.setdefault(wid, None)
            if time.monotonic() > deadline:
                raise ScalerError(f"workers {sorted(want - set(codes))} still running after {timeout_s:g}s")
            time.sleep(0.05)
        return codes

    def close(self, *, stop_workers: bool = False, timeout_s: float = 30.0) -> None:
        """Leave the workers running (a new leader adopts them), or drain them all."""
        if not stop_workers:
            return
        with self._state_lock():
            victims = [w for w in self.workers.values() if not w.draining]
            self._drain(victims)
        ids = list(self.workers)
        try:
            self.wait_gone(ids, timeout_s)
        except ScalerError:
            for w in list(self.workers.values()):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, signal.SIGKILL)
            self.wait_gone(ids, 10)
