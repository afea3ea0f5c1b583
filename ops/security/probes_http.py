"""``switchyard security-check``'s probes of the HTTP surfaces (issue 36): what an attacker on
the box does with no credential, or with one it captured, against the router, the workers and
the admin API. Each probe is one attack with a verdict, as in :mod:`ops.security.check`.

* **connection flood** (router): 1,030 idle connections, reopened as the router closes them,
  while a legitimate client sends requests on new connections. Refused means every request was
  served and its p99 stayed within 2x of the same client's p99 without the flood, measured in
  the same run, paced alike. The flood runs in its own process (no GIL shared with the client
  being timed), from 127.0.0.1 like everything here: on one box a per-IP cap cannot tell the
  attacker from the clients, so what saves them is that idle connections are closed first.
* **worker flood**: the same flood against every worker's port while the router serves
  generations: refused means all of them were served (the router did not exclude the workers).
* **worker routes**: ``/v1/completions`` and ``/v1/models`` without a bearer, with the cluster
  secret itself, and with another worker's bearer (what a process that took over one worker's
  port captures) must be 401; with the right bearer, the router's bounds (``max_tokens`` 131072,
  an id beyond the vocabulary, a 5 MB body) must be 4xx; a streamed generation whose client
  left must stop (``/debug/state``: it is no longer in flight).
* **admin lockout**: ten bad tokens with random ids, then ten wrong secrets for the admin's own
  token id (it is in the log), from 127.0.0.1 like the admin: the admin's valid token must still
  be served. Ten bad tokens, each with a new ``X-Forwarded-For``, must be limited all the same.
* **admin health**: ``/health`` must not say ``ok`` while it reports an audit ``last_error``.
* **metric labels**: twenty dead-letter records with invented ``reason``/``source`` headers,
  written with a worker's credential: no invented value may become a label of the metrics
  processor's ``switchyard_deadletter_records_total`` (it folds them as ``other``).
* **endpoint allowlist**: a worker registering itself (its own signed registration, a worker id
  of the probe's) with an endpoint that has a path: the router must dead-letter it
  ``endpoint_not_allowed``; a deregistration follows either way.
* **replay CLI**: each known nonsense input must be refused with one ``error:`` line, exit 2.
"""

from __future__ import annotations

import selectors
import socket
import time
import uuid
from collections.abc import Callable
from urllib.parse import urlsplit

import httpx

from control_plane.replay.cli import replay_app
from common.stack_settings import StackSettings
from common.log.catalog import Catalog
from common.log.kafka import H_DLQ_REASON, H_DLQ_SOURCE
from common.settings import BusSettings, worker_credential, worker_token
from ops.demo.up import Supervisor
from ops.security.probe import ACCEPTED, REFUSED, SERVER_ERROR, SKIPPED, Probe, Targets, quiet
from ops.security.probes_bus import probe_forged_events
from schemas import EventCodec
from schemas.envelope import EnvelopeFactory
from schemas.events import WorkerDeregistered, WorkerRegistered

#: The flood of the issue: past the servers' old 1,024-connection limit.
FLOOD_CONNECTIONS = 1030
#: How long the flood lasts at most, and how many connections it may open in all.
FLOOD_MAX_S = 40.0
FLOOD_MAX_CONNECTS = 20_000


# -- the flood (its own process) ------------------------------------------------------------------

def flood(addrs: list[tuple[str, int]], per_addr: int, max_s: float, max_connects: int) -> dict:
    """Hold ``per_addr`` idle connections to each address, reopening every one the server
    closes, until stdin has a line or ends, ``max_s`` or ``max_connects``. Prints ``up <n>`` once
    all are open; returns the counts."""
    import json
    import resource
    import sys

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = len(addrs) * per_addr + 256
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    sel = selectors.DefaultSelector()
    sel.register(sys.stdin, selectors.EVENT_READ, None)
    stats = {"connects": 0, "reopened": 0, "failed": 0}
    deadline = time.monotonic() + max_s

    def open_one(addr: tuple[str, int]) -> None:
        if stats["connects"] >= max_connects:
            return
        stats["connects"] += 1
        try:
            s = socket.create_connection(addr, timeout=2)
        except OSError:
            stats["failed"] += 1
            return
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, addr)

    for addr in addrs:
        for _ in range(per_addr):
            open_one(addr)
    print(json.dumps({"up": len(sel.get_map()) - 1}), flush=True)
    stop = False
    while not stop and time.monotonic() < deadline and stats["connects"] < max_connects:
        for key, _ in sel.select(0.05):
            if key.data is None:  # stdin: told to stop
                stop = True
                break
            s: socket.socket = key.fileobj  # type: ignore[assignment]
            try:
                data = s.recv(4096)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if data:
                continue  # an answer (a 408, a 503): the close follows
            sel.unregister(s)
            s.close()
            stats["reopened"] += 1
            open_one(key.data)
    stats["open_at_end"] = len(sel.get_map()) - 1
    used = resource.getrusage(resource.RUSAGE_SELF)
    stats["cpu_s"] = round(used.ru_utime + used.ru_stime, 3)  # the attacker's own CPU
    return stats


class Flood:
    """The flood in a child process (``python -m ops.security.probes_http``): its own
    interpreter, bounded in time and count, killed if it does not stop when told."""

    def __init__(self, urls: list[str], per_addr: int = FLOOD_CONNECTIONS, max_s: float = FLOOD_MAX_S,
                 max_connects: int = FLOOD_MAX_CONNECTS, nice: int = 0) -> None:
        self.addrs = []
        for u in urls:
            parts = urlsplit(u)
            if parts.hostname not in ("127.0.0.1", "localhost", "::1"):
                raise ValueError(f"{u}: the flood probe runs against loopback only")
            self.addrs.append(f"{parts.hostname}:{parts.port or 80}")
        self.per_addr, self.max_s, self.max_connects = per_addr, max_s, max_connects
        #: The flood process's niceness: on a 2-core box the attacker's own CPU competes with the
        #: server it floods; a measurement runs it niced to tell the two costs apart.
        self.nice = nice
        self.stats: dict = {}
        self.opened = 0

    def __enter__(self) -> Flood:
        import json
        import subprocess
        import sys

        self.proc = subprocess.Popen(
            [*(["nice", "-n", str(self.nice)] if self.nice else []), sys.executable, "-m",
             "ops.security.probes_http", str(self.per_addr), str(self.max_s), str(self.max_connects),
             *self.addrs], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            self.proc.kill()
            raise RuntimeError(f"the flood did not start (exit {self.proc.wait()})")
        self.opened = json.loads(line)["up"]
        return self

    def __exit__(self, *exc) -> None:
        import json
        import subprocess

        try:
            out, _ = self.proc.communicate("stop\n", timeout=self.max_s + 10)
            self.stats = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def _paced(call: Callable[[], int], n: int, every_s: float) -> tuple[list[float], list[int]]:
    """``n`` calls, one every ``every_s`` (a client, not a load test): their latencies in ms and
    statuses (-1: a transport error)."""
    lat, codes = [], []
    start = time.monotonic()
    for i in range(n):
        wait = start + i * every_s - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        t0 = time.perf_counter()
        try:
            code = call()
        except httpx.TransportError:
            code = -1
        lat.append((time.perf_counter() - t0) * 1e3)
        codes.append(code)
    return lat, codes


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, -(-99 * len(ordered) // 100) - 1)]


def probe_connection_flood(url: str, headers: dict | None = None, requests: int = 200,
                           every_s: float = 0.06, path: str = "/v1/models", settle_s: float = 1.0,
                           flood_nice: int = 0) -> Probe:
    """A legitimate client (a new connection per request, paced one every ``every_s``) without,
    then with, the flood: ``requests`` with it, spanning ``requests * every_s`` s (past the 10 s
    header deadline, so the flood's reconnects fall inside), and as many without it, half before
    and half after (the box's own load drifts; both halves see it). The flood's first
    ``settle_s`` are left out: the server accepting its 1,030 opening connects is a one-off, its
    reconnects are not."""
    attack = f"{FLOOD_CONNECTIONS:,} idle connections: clients still served, p99 within 2x"
    # No keep-alive: every request needs a new connection, which the flood's sockets contend for.
    with httpx.Client(base_url=url, timeout=30, headers=headers,
                      limits=httpx.Limits(max_keepalive_connections=0)) as c:

        def call() -> int:
            return c.get(path).status_code

        before, before_codes = _paced(call, requests // 2, every_s)
        try:
            with Flood([url], nice=flood_nice) as flood:
                time.sleep(settle_s)
                under, codes = _paced(call, requests, every_s)
        except (RuntimeError, ValueError) as e:
            return Probe("router", attack, SERVER_ERROR, str(e))
        after, after_codes = _paced(call, requests - requests // 2, every_s)
    base, base_codes = before + after, before_codes + after_codes
    if any(code != 200 for code in base_codes):
        return Probe("router", attack, SERVER_ERROR, f"without the flood: {sorted(set(base_codes))}")
    served = sum(code == 200 for code in codes)
    ratio = p99(under) / p99(base)
    detail = (f"{served}/{requests} served; p99 {p99(base):.1f} ms without, {p99(under):.1f} ms with "
              f"({ratio:.2f}x), max {max(under):.1f} ms; flood {flood.opened} open, "
              f"{flood.stats.get('reopened', '?')} closed by the server and reopened, "
              f"its CPU {flood.stats.get('cpu_s', '?')} s")
    return Probe("router", attack, REFUSED if served == requests and ratio <= 2.0 else ACCEPTED, detail)


def probe_worker_flood(router_url: str, worker_urls: tuple[str, ...], key: str | None, requests: int = 24,
                       every_s: float = 0.5) -> Probe:
    """Every worker's port flooded while the router serves generations (paced past the header
    deadline): refused means all were served (no worker was excluded for a starved connect)."""
    attack = f"{FLOOD_CONNECTIONS:,} idle connections to every worker: the router still routes"
    headers = {"Authorization": f"Bearer {key}"} if key else None
    with httpx.Client(base_url=router_url, timeout=60, headers=headers) as c:
        model = (c.get("/v1/models").json().get("data") or [{"id": "m"}])[0]["id"]
        failures: list[str] = []

        def call() -> int:
            r = c.post("/v1/completions", json={"model": model, "prompt": "security check flood", "max_tokens": 2})
            if r.status_code != 200:
                failures.append(f"HTTP {r.status_code}: {r.text[:120]}")
            return r.status_code

        try:
            with Flood(list(worker_urls)) as flood:
                _, codes = _paced(call, requests, every_s)
        except (RuntimeError, ValueError) as e:
            return Probe("worker", attack, SERVER_ERROR, str(e))
    served = sum(code == 200 for code in codes)
    detail = (f"{served}/{requests} generations served during the flood ({flood.opened} connections to "
              f"{len(worker_urls)} workers, {flood.stats.get('reopened', '?')} closed and reopened)"
              + (f"; first failure {failures[0]}" if failures else ""))
    verdict = REFUSED if served == requests else SERVER_ERROR if any(c >= 500 or c < 0 for c in codes) else ACCEPTED
    return Probe("worker", attack, verdict, detail)


# -- the workers' routes ----------------------------------------------------------------------------

def _verdict(r: httpx.Response, want: tuple[int, ...]) -> str:
    return SERVER_ERROR if r.status_code >= 500 else REFUSED if r.status_code in want else ACCEPTED


def probe_worker_routes(worker_urls: tuple[str, ...], secret: str | None) -> list[Probe]:
    out: list[Probe] = []
    ids = {}
    for u in worker_urls:
        try:
            ids[u] = httpx.get(f"{u}/health", timeout=10).json().get("worker_id")
        except (httpx.HTTPError, ValueError):
            ids[u] = None
    body = {"prompt": "hi", "max_tokens": 1}
    for i, u in enumerate(worker_urls):
        wid = ids[u] or u
        other = next((ids[v] for v in worker_urls if v != u and ids[v]), "security-check-other")
        tries = [("no bearer", {})]
        if secret:
            tries += [("the cluster's worker secret as bearer", {"Authorization": f"Bearer {secret}"}),
                      ("another worker's bearer", {"Authorization": f"Bearer {worker_token(secret, other)}"})]
        for what, headers in tries:
            for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
                attack = f"{wid} {method} {path} with {what}"
                try:
                    r = httpx.request(method, f"{u}{path}", json=body if method == "POST" else None,
                                      headers=headers, timeout=30)
                except httpx.TransportError as e:
                    out.append(Probe("worker", attack, SERVER_ERROR, f"{type(e).__name__}: {e}"))
                    continue
                out.append(Probe("worker", attack, _verdict(r, (401,)), f"HTTP {r.status_code}"))
        if not secret:
            continue
        auth = {"Authorization": f"Bearer {worker_token(secret, ids[u])}"} if ids[u] else {}
        bounds = [("max_tokens 131072", {"prompt": "hi", "max_tokens": 131_072}),
                  ("token id 10**30", {"prompt": [10**30], "max_tokens": 1}),
                  ("token id beyond the vocabulary", {"prompt": [2**40], "max_tokens": 1}),
                  ("5 MB body", b'{"prompt": "' + b"a" * (5 * 1024 * 1024) + b'"}')]
        for what, b in bounds:
            attack = f"{wid} direct call with {what}"
            try:
                if isinstance(b, bytes):
                    r = httpx.post(f"{u}/v1/completions", content=b, timeout=60,
                                   headers={**auth, "content-type": "application/json"})
                else:
                    r = httpx.post(f"{u}/v1/completions", json=b, headers=auth, timeout=60)
            except httpx.TransportError as e:
                out.append(Probe("worker", attack, SERVER_ERROR, f"{type(e).__name__}: {e}"))
                continue
            out.append(Probe("worker", attack, _verdict(r, (400, 413)), f"HTTP {r.status_code}"))
        if i == 0:
            out.append(_probe_disconnect(u, wid, auth))
    return out


def _probe_disconnect(url: str, wid: str, auth: dict) -> Probe:
    """A streamed generation of 4,000 tokens whose client leaves after its first: refused
    means the worker no longer has it in flight within 10 s (the whole run takes far longer)."""
    attack = f"{wid} keeps generating for a client that left"
    rid = f"security-check-{uuid.uuid4().hex[:12]}"

    def inflight() -> int:
        return int(httpx.get(f"{url}/debug/state", headers=auth, timeout=10).json().get("inflight", 0))

    try:
        before = inflight()
        with httpx.stream("POST", f"{url}/v1/completions", headers=auth, timeout=30,
                          json={"prompt": [1, 2, 3], "max_tokens": 4000, "stream": True, "request_id": rid}) as r:
            if r.status_code != 200:
                return Probe("worker", attack, SERVER_ERROR, f"HTTP {r.status_code}")
            next(r.iter_lines())
        left = time.monotonic()
        while time.monotonic() - left < 10:
            if inflight() <= before:
                return Probe("worker", attack, REFUSED, f"stopped {time.monotonic() - left:.2f} s after the client left")
            time.sleep(0.1)
        return Probe("worker", attack, ACCEPTED, f"still in flight 10 s after the client left ({inflight()} vs {before})")
    except (httpx.HTTPError, ValueError, StopIteration) as e:
        return Probe("worker", attack, SERVER_ERROR, f"{type(e).__name__}: {e}")


# -- the admin API --------------------------------------------------------------------------------

def probe_admin_lockout(admin_url: str, admin_token: str | None) -> list[Probe]:
    attacks = ("random bad tokens lock out the admin", "wrong secrets for the admin's token id lock it out",
               "a new X-Forwarded-For on each bad token escapes the limit")
    if not admin_token:
        return [Probe("admin", a, SKIPPED, "no admin token") for a in attacks]
    good = {"Authorization": f"Bearer {admin_token}"}
    token_id = admin_token.split("_")[1] if admin_token.count("_") >= 2 else "x"
    out = []
    with httpx.Client(base_url=admin_url, timeout=30) as c:
        codes = [c.get("/whoami", headers={"Authorization": f"Bearer sy_{uuid.uuid4().hex[:8]}_guess",
                                           "X-Forwarded-For": f"198.51.100.{i}"}).status_code for i in range(12)]
        out.append(Probe("admin", attacks[2], REFUSED if 429 in codes else ACCEPTED,
                         f"statuses {sorted(set(codes))} (429 after {codes.index(429) if 429 in codes else '-'})"))
        for attack, bad in ((attacks[0], lambda: f"sy_{uuid.uuid4().hex[:8]}_guess"),
                            (attacks[1], lambda: f"sy_{token_id}_{uuid.uuid4().hex}")):
            codes = [c.get("/whoami", headers={"Authorization": f"Bearer {bad()}"}).status_code for _ in range(12)]
            r = c.get("/whoami", headers=good)
            verdict = SERVER_ERROR if r.status_code >= 500 else REFUSED if r.status_code == 200 else ACCEPTED
            out.append(Probe("admin", attack, verdict,
                             f"the guesses: {sorted(set(codes))}; the admin after them: HTTP {r.status_code}"))
    return out


def probe_admin_health(admin_url: str) -> Probe:
    attack = "/health says ok while the audit consumer reports an error"
    try:
        body = httpx.get(f"{admin_url}/health", timeout=10).json()
    except (httpx.HTTPError, ValueError) as e:
        return Probe("admin", attack, SERVER_ERROR, f"{type(e).__name__}: {e}")
    err = (body.get("audit") or {}).get("last_error")
    lies = bool(err) and body.get("status") == "ok"
    return Probe("admin", attack, ACCEPTED if lies else REFUSED,
                 f"status {body.get('status')}, last_error {err!r}")


# -- metric labels --------------------------------------------------------------------------------

def probe_metric_labels(bootstrap: str, topic_prefix: str, metrics_url: str | None, n: int = 20,
                        timeout_s: float = 30.0) -> Probe:
    attack = f"{n} dead letters with invented reason/source headers become metric labels"
    if not metrics_url:
        return Probe("metrics", attack, SKIPPED, "no metrics processor")
    from confluent_kafka import Producer


    tag = f"sc{uuid.uuid4().hex[:8]}"

    def series() -> tuple[float, str]:
        text = httpx.get(metrics_url, timeout=10).text
        lines = [x for x in text.splitlines() if x.startswith("switchyard_deadletter_records_total{")]
        return sum(float(x.rsplit(" ", 1)[1]) for x in lines), "\n".join(lines)

    try:
        before, _ = series()
    except httpx.HTTPError as e:
        return Probe("metrics", attack, SERVER_ERROR, f"{type(e).__name__}: {e}")
    bus = BusSettings.from_env(role="worker", bootstrap=bootstrap, topic_prefix=topic_prefix)
    p = Producer({**bus.client_conf(), "message.timeout.ms": 10000, "logger": quiet()})
    errors: list[str] = []
    for i in range(n):
        p.produce(Catalog(topic_prefix).deadletter, value=b"\xc1", key=b"security-check",
                  headers=[(H_DLQ_REASON, f"{tag}-reason-{i}".encode()), (H_DLQ_SOURCE, f"{tag}-topic-{i}:0:0".encode())],
                  on_delivery=lambda err, _m: errors.append(str(err)) if err else None)
    if p.flush(20) or errors:
        detail = errors[0][:100] if errors else "no delivery report"
        return Probe("metrics", attack, REFUSED if "AUTHORIZATION" in detail else SERVER_ERROR, detail)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        total, text = series()
        if total >= before + n:
            break
        time.sleep(0.5)
    else:
        return Probe("metrics", attack, SERVER_ERROR, f"not folded within {timeout_s:g} s ({total - before:g} of {n})")
    n_series = text.count("\n") + 1 if text else 0
    return Probe("metrics", attack, ACCEPTED if tag in text else REFUSED,
                 f"folded; {n_series} dead-letter series, {'some' if tag in text else 'none'} with an invented value")


# -- the endpoint allowlist ------------------------------------------------------------------------

def probe_allowlist(bootstrap: str, topic_prefix: str, block_size: int = 64, hash_algo: str = "sha256") -> list[Probe]:
    """A worker's own signed registration (a probe-owned id) whose endpoint has a path: the
    router must dead-letter it ``endpoint_not_allowed`` (probes_bus.probe_forged_events watches the
    dead-letter topic). A deregistration of that id follows, so no view keeps it. ``block_size``
    and ``hash_algo``: the router's (its defaults, the demo's), so that its index takes the
    registration and only the endpoint is left to refuse it."""
    from confluent_kafka import Producer


    wid = f"security-check-{uuid.uuid4().hex[:8]}"
    bus = BusSettings.from_env(role="worker", bootstrap=bootstrap, topic_prefix=topic_prefix)
    codec, signer = EventCodec(), bus.signer(wid)
    epoch = int(time.time() * 1000)

    def signed(payload, seq: int) -> bytes:
        return signer.seal(codec.encode(EnvelopeFactory(wid, epoch, lambda: seq).wrap(payload, key=payload.key())))

    reg = WorkerRegistered(worker_id=wid, role="decode", pool="security-check", block_size=block_size, hash_algo=hash_algo,
                           endpoint="http://127.0.0.1:9/admin/kv_bridge/stop#")
    try:
        out = probe_forged_events(bootstrap, topic_prefix, forgeries=[
            ("worker", "workers", signed(reg, 1), "a registration whose endpoint has a path and a fragment")],
            refused_reason="index_rejected:endpoint_not_allowed", area="router")
    finally:
        p = Producer({**bus.client_conf(), "message.timeout.ms": 10000, "logger": quiet()})
        gone = WorkerDeregistered(worker_id=wid, reason="security-check")
        p.produce(Catalog(topic_prefix).topic("workers"), value=signed(gone, 2), key=wid.encode())
        p.flush(20)
    return out


# -- the replay CLI ---------------------------------------------------------------------------------

REPLAY_NONSENSE = [
    ["state", "--at", "99999999999999999999999"], ["state", "--source", "/nonexistent/x.sylog"],
    ["state", "--export", "/nonexistent/dir/state.json"], ["verify", "--from", "end", "--to", "start"],
    ["state", "--block-size", "0"], ["state", "--block-size", "-5"], ["state", "--hash-algo", "md5"],
]


def probe_replay_cli() -> list[Probe]:
    """The replay CLI in process (typer's runner): every nonsense input refused before it reads
    anything, with one ``error:`` line and exit 2."""
    from typer.testing import CliRunner


    out = []
    for args in REPLAY_NONSENSE:
        attack = "replay " + " ".join(args)
        r = CliRunner().invoke(replay_app, [*args, "--no-progress"])
        lines = [x for x in r.output.splitlines() if x.strip()]
        crashed = r.exception is not None and not isinstance(r.exception, SystemExit)
        if crashed:
            out.append(Probe("cli", attack, SERVER_ERROR, f"{type(r.exception).__name__}: {r.exception}"[:120]))
        elif r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "):
            out.append(Probe("cli", attack, REFUSED, lines[0][:120]))
        else:
            out.append(Probe("cli", attack, ACCEPTED, f"exit {r.exit_code}: {' | '.join(lines)[:120]}"))
    return out


# -- all of them ----------------------------------------------------------------------------------

def _metrics_url() -> str | None:
    """The metrics processor ``switchyard up`` started, if any."""
    url = next((p.url for p in Supervisor(StackSettings.from_env()).procs if p.name == "metrics" and p.url), None)
    return f"{url}/metrics" if url else None


def run(t: Targets) -> list[Probe]:
    secrets_dir = BusSettings.from_env().secrets_dir
    secret = worker_credential(secrets_dir) if (secrets_dir / "worker-endpoint").exists() else None
    probes: list[Probe] = []
    if t.router_url:
        probes.append(probe_connection_flood(t.router_url, {"Authorization": f"Bearer {t.router_key}"}
                                             if t.router_key else None))
    if t.worker_urls:
        probes += probe_worker_routes(t.worker_urls, secret)
        if t.router_url:
            probes.append(probe_worker_flood(t.router_url, t.worker_urls, t.router_key))
    if t.admin_url:
        probes += probe_admin_lockout(t.admin_url, t.admin_token)
        probes.append(probe_admin_health(t.admin_url))
    probes.append(probe_metric_labels(t.kafka_bootstrap, t.topic_prefix, _metrics_url()))
    if t.router_url:
        probes += probe_allowlist(t.kafka_bootstrap, t.topic_prefix)
    probes += probe_replay_cli()
    return probes


if __name__ == "__main__":  # the flood's process (Flood)
    import json
    import sys

    per, max_s, max_connects, *targets = sys.argv[1:]
    got = flood([(a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1])) for a in targets], int(per), float(max_s),
                int(max_connects))
    print(json.dumps(got), flush=True)
