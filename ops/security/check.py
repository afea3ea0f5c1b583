"""``switchyard security-check``: probes the running system the way an attacker on the same box
would, and says for each attack whether it was refused.

Each probe is one attempt with a verdict: ``refused`` (the system said no, with a 4xx or an
authentication error), ``accepted`` (it went through: a hole), or ``server_error`` (a 5xx, a
reset, a crash: a bug, whatever the intent). Nothing a probe sends changes state when it is
refused, and the forged events name workers and keys of the probe's own, so even one that got
through would not touch a real worker or key.

Probes:

* **router input** (issue 14's list): a lone surrogate, non-text chat content, empty messages,
  a negative ``max_completion_tokens``, a request id with a newline, an oversized body, a
  prompt beyond the context, huge ``max_tokens``, token ids beyond the vocabulary, an unknown
  model, ``n: 2``. Refused means a 4xx on a keep-alive connection that still serves the next
  request; afterwards the router's ``/health`` must still be EXACT. These carry the demo's
  router key (``.stack/demo/router-key``) when there is one, so they reach the input checks.
* **router connections**: one connection that sends nothing and one that sends its headers a
  byte at a time (slowloris), side by side. Refused means the router closed each (its header
  deadline) and still serves.
* **router API keys**: a generation call without a key, with a wrong key, with a revoked key
  and over a key's rate (the last two issue a key through the admin API with the demo's admin
  token, ``.stack/demo/admin-token``, and revoke it after: without a token they are
  ``skipped``, not counted). Refused means a 401, or a 429 for the rate.
* **workers**: ``/debug/state`` and ``/kv/metadata`` of every worker without the cluster's
  worker credential (refused: a 401).
* **admin API**: mutations without a credential (issue a token, change the planner config).
* **CLI**: ``switchyard planner pin`` without a token.
* **Kafka roles**: each component's own credential writing a topic its role does not own
  (a worker pinning or scaling a pool, a router registering a worker).
* **forged events**: writes a role's topics let through but that are not its to make: a
  worker's credential registering another worker, unsigned and signed with its own key, and
  the router's credential issuing an API key on ``admin``. Refused means the running system's
  consumers dead-letter them as ``forged:*`` (schemas/signing.py); only with a router running.
* **stores**: an unauthenticated Kafka client listing topics, PostgreSQL without a password, Redis
  without a password, the S3 object store (SeaweedFS) listing buckets unsigned and with a wrong
  secret key.
* **Redis users** (:mod:`ops.security.probes_redis`): the planner's Redis credential writing the
  routers' waiting count (admission rule 4) and an API key's slots, the router's taking the
  planners' lease (refused: NOPERM); a router's writing a waiting count over the bound or in the
  future (refused: the routers' reader does not count it).
* **HTTP surfaces** (issue 36: floods, lockout, labels, workers, allowlist, replay CLI):
  :mod:`ops.security.probes_http`.
* **listeners**: every listening socket of the system's processes (and their children) must be
  on loopback (verdict ``loopback``, else ``exposed``).

The last line is ``RESULT attacks_tried=... attacks_refused=... server_errors=...
nonloopback_listeners=...``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx

from control_plane.admin.client import AdminClient, ClientError
from common.stack_settings import S3_ACCESS_KEY
from common.settings import kafka_conf
from ops.demo.up import Supervisor, demo_secret, system_pids
from ops.security import probes_bus, probes_http, probes_redis
from ops.security.probe import ACCEPTED, EXPOSED, LOOPBACK, REFUSED, SERVER_ERROR, SKIPPED, Probe, Targets, quiet
from ops.stack.process import listening_sockets

# -- the router's OpenAI API -------------------------------------------------------------------

def _router_attacks(model: str) -> list[tuple[str, str, dict | bytes]]:
    """(attack, path, JSON body or raw bytes)."""
    completions, chat = "/v1/completions", "/v1/chat/completions"
    return [
        ("prompt with a lone surrogate", completions, b'{"model": "%s", "prompt": "\\ud800"}' % model.encode()),
        ("chat content not text", chat, {"model": model, "messages": [{"role": "user",
                                                                       "content": [{"type": "text", "text": 123}]}]}),
        ("chat content null", chat, {"model": model, "messages": [{"role": "user", "content": None}]}),
        ("empty messages", chat, {"model": model, "messages": []}),
        ("negative max_completion_tokens", chat, {"model": model, "messages": [{"role": "user", "content": "hi"}],
                                                  "max_completion_tokens": -1}),
        ("request id with a newline", completions, {"model": model, "prompt": "hi", "request_id": "a\nb"}),
        ("50 MB body", completions, b'{"model": "m", "prompt": "' + b"a" * (50 * 1024 * 1024) + b'"}'),
        ("prompt beyond the context", completions, {"model": model, "prompt": [1] * 300_000, "max_tokens": 1}),
        ("max_tokens 131072", completions, {"model": model, "prompt": "hi", "max_tokens": 131_072}),
        ("token id 2**64", completions, {"model": model, "prompt": [2**64], "max_tokens": 1}),
        ("token id 10**30", completions, {"model": model, "prompt": [10**30], "max_tokens": 1}),
        ("unknown model", completions, {"model": "no-such-model", "prompt": "hi", "max_tokens": 1}),
        ("n: 2", completions, {"model": model, "prompt": "hi", "max_tokens": 1, "n": 2}),
    ]


def probe_router(url: str, key: str | None = None) -> list[Probe]:
    out: list[Probe] = []
    headers = {"Authorization": f"Bearer {key}"} if key else None
    with httpx.Client(base_url=url, timeout=60, headers=headers) as c:
        models = c.get("/v1/models").json().get("data", [])
        model = models[0]["id"] if models else "m"
        for attack, path, body in _router_attacks(model):
            try:
                if isinstance(body, bytes):
                    r = c.post(path, content=body, headers={"content-type": "application/json"})
                else:
                    r = c.post(path, json=body)
            except httpx.TransportError as e:  # a reset is a server error, whatever the input
                out.append(Probe("router", attack, SERVER_ERROR, f"{type(e).__name__}: {e}"))
                continue
            if r.status_code >= 500:
                out.append(Probe("router", attack, SERVER_ERROR, f"HTTP {r.status_code}"))
                continue
            if not 400 <= r.status_code < 500:
                out.append(Probe("router", attack, ACCEPTED, f"HTTP {r.status_code}"))
                continue
            # The same keep-alive connection still serves (a reset here was the old failure).
            try:
                alive = c.get("/v1/models").status_code == 200
            except httpx.TransportError:
                alive = False
            if not alive:
                out.append(Probe("router", attack, SERVER_ERROR, f"HTTP {r.status_code}, connection unusable after"))
                continue
            try:
                code = (r.json().get("error") or {}).get("code") or ""
            except ValueError:  # a 4xx without a JSON body is still a refusal
                code = ""
            out.append(Probe("router", attack, REFUSED, f"HTTP {r.status_code} {code}".strip()))
        health = c.get("/health").json()
        state = health.get("state")
        out.append(Probe("router", "router stays EXACT after the input attacks",
                         REFUSED if state == "EXACT" else ACCEPTED, f"state {state}"))
    return out


def probe_router_connections(url: str, timeout_s: float = 20.0) -> list[Probe]:
    """Two connections that would hold a socket forever without the server's header deadline
    (common/http_server.py), run side by side: one that sends nothing, and one that sends its
    request headers a byte every 100 ms (slowloris). Refused means the router closed each within
    ``timeout_s`` (its deadline is 10 s by default); afterwards it must still serve ``/health``."""
    import socket
    import threading
    import time
    from urllib.parse import urlsplit

    u = urlsplit(url)
    addr = (u.hostname or "127.0.0.1", u.port or 80)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {addr[0]}\r\nContent-Type: application/json\r\n"
            f"Content-Length: 2\r\nX-Padding: {'a' * 400}\r\n\r\n").encode()
    results: dict[str, Probe] = {}

    def hold(attack: str, trickle: bool) -> None:
        start = time.monotonic()
        try:
            with socket.create_connection(addr, timeout=5) as sock:
                sock.settimeout(0.1)
                sent = 0
                while time.monotonic() - start < timeout_s:
                    if trickle and sent < len(head):
                        sock.sendall(head[sent:sent + 1])
                        sent += 1
                    try:
                        if sock.recv(4096) == b"":
                            break
                    except (TimeoutError, socket.timeout):
                        continue
                else:
                    results[attack] = Probe("router", attack, ACCEPTED, f"still open after {timeout_s:g} s")
                    return
        except (ConnectionResetError, BrokenPipeError):
            pass
        except OSError as e:
            results[attack] = Probe("router", attack, SERVER_ERROR, f"{type(e).__name__}: {e}")
            return
        results[attack] = Probe("router", attack, REFUSED, f"closed after {time.monotonic() - start:.1f} s")

    attacks = [("connection that sends nothing", False), ("headers a byte every 100 ms (slowloris)", True)]
    threads = [threading.Thread(target=hold, args=a, daemon=True) for a in attacks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 10)
    out = [results.get(a, Probe("router", a, SERVER_ERROR, "the probe did not finish")) for a, _ in attacks]
    after = "router serves after the connection attacks"
    try:
        status = httpx.get(f"{url}/health", timeout=10).status_code  # any answer: it serves
    except httpx.TransportError as e:
        out.append(Probe("router", after, SERVER_ERROR, f"{type(e).__name__}: {e}"))
    else:
        out.append(Probe("router", after, REFUSED, f"/health HTTP {status}"))
    return out


# -- the router's API keys ---------------------------------------------------------------------

_GENERATE = {"prompt": "hi", "max_tokens": 1}


def _key_verdict(attack: str, r: httpx.Response, want: int) -> Probe:
    if r.status_code >= 500:
        return Probe("router", attack, SERVER_ERROR, f"HTTP {r.status_code}")
    try:
        code = (r.json().get("error") or {}).get("code") or ""
    except ValueError:
        code = ""
    return Probe("router", attack, REFUSED if r.status_code == want else ACCEPTED, f"HTTP {r.status_code} {code}".strip())


def probe_router_keys(url: str, admin_url: str | None, admin_token: str | None, timeout_s: float = 20.0) -> list[Probe]:
    """Generation calls the keys must stop: none, a wrong one, a revoked one, one over its rate."""
    import time


    out: list[Probe] = []
    with httpx.Client(base_url=url, timeout=60) as c:
        for attack, headers in (("generation without an API key", {}),
                                ("generation with a wrong API key", {"Authorization": "Bearer sk-sy_0badc0de_guess"})):
            try:
                out.append(_key_verdict(attack, c.post("/v1/completions", json=_GENERATE, headers=headers), 401))
            except httpx.TransportError as e:
                out.append(Probe("router", attack, SERVER_ERROR, f"{type(e).__name__}: {e}"))
        needs = ("generation with a revoked API key", "generation over its API key's rate")
        if not (admin_url and admin_token):
            return out + [Probe("router", a, SKIPPED, "no admin token to issue a key with") for a in needs]
        admin = AdminClient(admin_url, admin_token)
        stamp = time.strftime("%Y%m%d-%H%M%S")

        def folded(key: str) -> int:
            """The status of an empty body with ``key`` once the router knows it (400: the key is
            checked first), polled; a bad body is never admitted, but it is one call of the key."""
            deadline = time.monotonic() + timeout_s
            while True:
                r = c.post("/v1/chat/completions", content=b"{}", headers={"Authorization": f"Bearer {key}",
                                                                           "Content-Type": "application/json"})
                if r.status_code != 401 or time.monotonic() > deadline:
                    return r.status_code
                time.sleep(0.1)

        try:
            revoked = admin.issue_router_key(f"security-check-revoked-{stamp}")
            folded(revoked["key"])
            admin.revoke_router_key(revoked["key_id"], "security-check")
            deadline = time.monotonic() + timeout_s
            while True:
                r = c.post("/v1/completions", json=_GENERATE, headers={"Authorization": f"Bearer {revoked['key']}"})
                if r.status_code == 401 or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            out.append(_key_verdict(needs[0], r, 401))
            # Burst 2: the poll below spends one token (the rate counts every call the key makes,
            # a refused body too), the first request the other, the second must be a 429.
            rated = admin.issue_router_key(f"security-check-rated-{stamp}", rate_per_s=0.1, burst=2)
            try:
                folded(rated["key"])
                auth = {"Authorization": f"Bearer {rated['key']}"}
                first = c.post("/v1/completions", json=_GENERATE, headers=auth)
                second = c.post("/v1/completions", json=_GENERATE, headers=auth)
                p = _key_verdict(needs[1], second, 429)
                if p.verdict == REFUSED and "retry-after" not in second.headers:
                    p = Probe("router", needs[1], ACCEPTED, "429 without Retry-After")
                out.append(Probe(p.area, p.attack, p.verdict, f"{p.detail} (the call before it: HTTP {first.status_code})"))
            finally:
                admin.revoke_router_key(rated["key_id"], "security-check")
        except (ClientError, httpx.TransportError) as e:
            got = {p.attack for p in out}
            out += [Probe("router", a, SERVER_ERROR, f"{type(e).__name__}: {str(e)[:100]}") for a in needs if a not in got]
        finally:
            admin.close()
    return out


# -- the workers' private endpoints ---------------------------------------------------------------

def probe_workers(urls: tuple[str, ...]) -> list[Probe]:
    out: list[Probe] = []
    for url in urls:
        for path in ("/debug/state", "/kv/metadata"):
            attack = f"worker {path} without the worker credential ({url.rsplit(':', 1)[-1]})"
            try:
                r = httpx.get(f"{url}{path}", timeout=10)
            except httpx.TransportError as e:
                out.append(Probe("worker", attack, SERVER_ERROR, f"{type(e).__name__}: {e}"))
                continue
            verdict = SERVER_ERROR if r.status_code >= 500 else REFUSED if r.status_code == 401 else ACCEPTED
            out.append(Probe("worker", attack, verdict, f"HTTP {r.status_code}"))
    return out


# -- the admin plane ---------------------------------------------------------------------------

def probe_admin(url: str) -> list[Probe]:
    out: list[Probe] = []
    attempts = [("issue a token without a credential", "POST", "/tokens", {"name": "probe", "role": "admin"}),
                ("change the planner config without a credential", "PUT", "/planner-config", {"tick_s": 1.0})]
    with httpx.Client(base_url=url, timeout=30) as c:
        for attack, method, path, body in attempts:
            try:
                r = c.request(method, path, json=body)
            except httpx.TransportError as e:
                out.append(Probe("admin", attack, SERVER_ERROR, f"{type(e).__name__}: {e}"))
                continue
            verdict = SERVER_ERROR if r.status_code >= 500 else REFUSED if r.status_code >= 400 else ACCEPTED
            out.append(Probe("admin", attack, verdict, f"HTTP {r.status_code}"))
    return out


def probe_cli_pin(admin_url: str | None) -> Probe:
    env = {k: v for k, v in os.environ.items() if k != "SWITCHYARD_ADMIN_TOKEN"}
    if admin_url:
        env["SWITCHYARD_ADMIN_URL"] = admin_url
    r = subprocess.run([sys.executable, "-m", "switchyard.cli", "planner", "pin", "default", "2", "--actor",
                        "probe-admin"], env=env, capture_output=True, text=True, timeout=120)
    said = (r.stderr or r.stdout).strip().splitlines()
    return Probe("admin", "CLI pin without a token", REFUSED if r.returncode != 0 else ACCEPTED,
                 f"exit {r.returncode}: {said[-1][:120] if said else ''}")


# -- the stores --------------------------------------------------------------------------------

def probe_kafka(bootstrap: str) -> list[Probe]:
    """Without a credential and with a wrong password, list the topics (the first step of a
    forged registration). Checked first: the stack's own credential is served, so a refusal is
    the credential's, not a broker that is down."""
    from confluent_kafka.admin import AdminClient


    real = kafka_conf(bootstrap)
    try:
        AdminClient({**real, "logger": quiet()}).list_topics(timeout=10)
    except Exception as e:
        return [Probe("kafka", "the stack's own credential is served", SERVER_ERROR,
                      f"broker not answering: {type(e).__name__}: {str(e)[:100]}")]
    attempts = [("unauthenticated client lists and could write the topics", {"bootstrap.servers": bootstrap})]
    if "sasl.password" in real:
        attempts.append(("a wrong password lists and could write the topics",
                         {**real, "sasl.password": real["sasl.password"] + "-guess"}))
    out = []
    for attack, conf in attempts:
        try:
            md = AdminClient({**conf, "logger": quiet()}).list_topics(timeout=10)
        except Exception as e:
            out.append(Probe("kafka", attack, REFUSED, f"{type(e).__name__}: {str(e)[:100]}"))
        else:
            out.append(Probe("kafka", attack, ACCEPTED, f"{len(md.topics)} topics visible"))
    return out


def probe_postgres(url: str) -> Probe:
    import sqlalchemy as sa

    bare = sa.engine.make_url(url).set(password=None)
    eng = sa.create_engine(bare)
    try:
        with eng.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    except Exception as e:
        return Probe("postgres", "connect without a password", REFUSED, f"{type(e).__name__}")
    finally:
        eng.dispose()
    return Probe("postgres", "connect without a password", ACCEPTED, "trust authentication")


def probe_redis(url: str) -> Probe:
    import redis

    # The URL without its credentials (from_url lets a URL's password win over keyword arguments).
    from urllib.parse import urlsplit, urlunsplit

    u = urlsplit(url)
    netloc = u.hostname + (f":{u.port}" if u.port else "")
    bare = redis.Redis.from_url(urlunsplit((u.scheme, netloc, u.path, u.query, u.fragment)), socket_timeout=5)
    try:
        bare.ping()
    except redis.exceptions.AuthenticationError as e:
        return Probe("redis", "commands without a password", REFUSED, str(e)[:100])
    except redis.exceptions.ResponseError as e:  # NOAUTH
        return Probe("redis", "commands without a password", REFUSED, str(e)[:100])
    finally:
        bare.close()
    return Probe("redis", "commands without a password", ACCEPTED, "PING answered")


def probe_s3(endpoint: str) -> list[Probe]:
    """Listing the buckets without a signature, and signed with the stack's key id and a wrong
    secret: both must get a 403."""
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError


    out = []
    for attack, creds in (("list buckets unsigned", None),
                          ("list buckets with a wrong secret key", (S3_ACCESS_KEY, "not-the-secret"))):
        config = Config(retries={"max_attempts": 1}, connect_timeout=5, read_timeout=10,
                        **({} if creds else {"signature_version": UNSIGNED}))
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", config=config,
                              **({"aws_access_key_id": creds[0], "aws_secret_access_key": creds[1]} if creds else {}))
        try:
            got = client.list_buckets()
        except ClientError as e:
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            code = e.response.get("Error", {}).get("Code", "")
            verdict = REFUSED if 400 <= status < 500 else SERVER_ERROR
            out.append(Probe("s3", attack, verdict, f"{status} {code}"))
        except BotoCoreError as e:
            out.append(Probe("s3", attack, SKIPPED, f"no S3 endpoint at {endpoint}: {type(e).__name__}"))
        else:
            out.append(Probe("s3", attack, ACCEPTED, f"{len(got.get('Buckets', []))} buckets listed"))
        finally:
            client.close()
    return out


def probe_listeners(pids: list[int]) -> list[Probe]:
    out = []
    for x in listening_sockets(pids):
        words = x.command.split()
        name = Path(words[0]).name if words else str(x.pid)
        if "switchyard.cli" in words[:-1]:  # which component, not "python"
            name = "switchyard " + " ".join(words[words.index("switchyard.cli") + 1:][:2])
        out.append(Probe("listeners", f"{name} {x.proto} {x.address}:{x.port}", LOOPBACK if x.loopback else EXPOSED,
                         f"pid {x.pid}" if x.loopback else f"pid {x.pid}, reachable off the box"))
    return out


# -- the whole check ---------------------------------------------------------------------------

def run(t: Targets) -> list[Probe]:
    probes: list[Probe] = []
    steps: list[Callable[[], list[Probe] | Probe]] = []
    if t.router_url:
        steps.append(lambda: probe_router(t.router_url, t.router_key))
        steps.append(lambda: probe_router_connections(t.router_url))
        steps.append(lambda: probe_router_keys(t.router_url, t.admin_url, t.admin_token))
    if t.worker_urls:
        steps.append(lambda: probe_workers(t.worker_urls))
    if t.admin_url:
        steps.append(lambda: probe_admin(t.admin_url))
    steps += [lambda: probe_cli_pin(t.admin_url), lambda: probe_kafka(t.kafka_bootstrap),
              lambda: probes_bus.probe_kafka_roles(t.kafka_bootstrap, t.topic_prefix),
              *([lambda: probes_bus.probe_forged_events(t.kafka_bootstrap, t.topic_prefix)] if t.router_url else []),
              lambda: probes_bus.run(t), lambda: probe_postgres(t.postgres_url), lambda: probe_redis(t.redis_url),
              lambda: probes_redis.run(t),
              *([lambda: probe_s3(t.s3_url)] if t.s3_url else []),
              lambda: probe_listeners(t.pids)]

    steps.insert(-1, lambda: probes_http.run(t))
    for step in steps:
        got = step()
        probes += got if isinstance(got, list) else [got]
    return probes


def summary(probes: list[Probe]) -> dict[str, int]:
    attacks = [p for p in probes if p.area != "listeners" and p.verdict != SKIPPED]
    return {"attacks_tried": len(attacks), "attacks_refused": sum(p.verdict == REFUSED for p in attacks),
            "server_errors": sum(p.verdict == SERVER_ERROR for p in probes),
            "nonloopback_listeners": sum(p.verdict == EXPOSED for p in probes)}


def report(probes: list[Probe]) -> str:
    w = max((len(p.attack) for p in probes), default=10)
    lines = [f"{'area':<10} {'attack':<{w}}  {'verdict':<12} detail"]
    lines += [f"{p.area:<10} {p.attack:<{w}}  {p.verdict:<12} {p.detail}" for p in probes]
    s = summary(probes)
    lines.append("RESULT " + " ".join(f"{k}={v}" for k, v in s.items()))
    return "\n".join(lines)


def demo_targets(stack_settings) -> Targets:
    """The system ``switchyard up`` started: URLs from its ``procs.json``, every process of it."""
    procs = Supervisor(stack_settings).procs
    urls = {p.name: p.url or None for p in procs}
    return Targets(router_url=urls.get("router"), admin_url=urls.get("admin"),
                   kafka_bootstrap=stack_settings.kafka_bootstrap, postgres_url=stack_settings.postgres_url,
                   redis_url=stack_settings.redis_url, pids=system_pids(stack_settings),
                   topic_prefix=os.environ.get("SWITCHYARD_TOPIC_PREFIX", "sy"),
                   router_key=demo_secret(stack_settings, "router-key"),
                   admin_token=demo_secret(stack_settings, "admin-token"),
                   worker_urls=tuple(p.url for p in procs if p.name.startswith("worker-") and p.url),
                   s3_url=stack_settings.s3_endpoint,
                   redis_router_url=stack_settings.redis_role_url("router"),
                   redis_planner_url=stack_settings.redis_role_url("planner"))
