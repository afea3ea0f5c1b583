"""``switchyard security-check``: probes the running system the way an attacker on the same box
would, and says for each attack whether it was refused.

Each probe is one attempt with a verdict: ``refused`` (the system said no, with a 4xx or an
authentication error), ``accepted`` (it went through: a hole), or ``server_error`` (a 5xx, a
reset, a crash: a bug, whatever the intent). Nothing a probe sends changes state when it is
refused; the probes that would (a forged worker registration) are not sent: whether the broker
lets an unauthenticated client in at all is asked instead.

Probes:

* **router input** (issue 14's list): a lone surrogate, non-text chat content, empty messages,
  a negative ``max_completion_tokens``, a request id with a newline, an oversized body, a
  prompt beyond the context, huge ``max_tokens``, token ids beyond the vocabulary, an unknown
  model, ``n: 2``. Refused means a 4xx on a keep-alive connection that still serves the next
  request; afterwards the router's ``/health`` must still be EXACT.
* **admin API**: mutations without a credential (issue a token, change the planner config).
* **CLI**: ``switchyard planner pin`` without a token.
* **Kafka roles**: each component's own credential writing a topic its role does not own
  (a worker pinning or scaling a pool, a router registering a worker).
* **stores**: an unauthenticated Kafka client listing topics, PostgreSQL without a password, Redis
  without a password.
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
from dataclasses import dataclass
from pathlib import Path

import httpx

REFUSED, ACCEPTED, SERVER_ERROR = "refused", "accepted", "server_error"
#: Listener verdicts.
LOOPBACK, EXPOSED = "loopback", "exposed"


@dataclass(frozen=True)
class Probe:
    area: str
    attack: str
    verdict: str
    detail: str = ""


@dataclass(frozen=True)
class Targets:
    router_url: str | None
    admin_url: str | None
    kafka_bootstrap: str
    postgres_url: str
    redis_url: str
    #: Every process of the system, children included (whose listeners are checked).
    pids: list[int]
    topic_prefix: str = "sy"


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


def probe_router(url: str) -> list[Probe]:
    out: list[Probe] = []
    with httpx.Client(base_url=url, timeout=60) as c:
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

    from kernel.settings import kafka_conf

    real = kafka_conf(bootstrap)
    try:
        AdminClient({**real, "logger": _quiet()}).list_topics(timeout=10)
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
            md = AdminClient({**conf, "logger": _quiet()}).list_topics(timeout=10)
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


def probe_listeners(pids: list[int]) -> list[Probe]:
    from control_plane.stack.process import listening_sockets

    out = []
    for x in listening_sockets(pids):
        words = x.command.split()
        name = Path(words[0]).name if words else str(x.pid)
        if "switchyard.cli" in words[:-1]:  # which component, not "python"
            name = "switchyard " + " ".join(words[words.index("switchyard.cli") + 1:][:2])
        out.append(Probe("listeners", f"{name} {x.proto} {x.address}:{x.port}", LOOPBACK if x.loopback else EXPOSED,
                         f"pid {x.pid}" if x.loopback else f"pid {x.pid}, reachable off the box"))
    return out


#: (role whose credential is used, topic stream it must not write, what it would be)
ROLE_ATTACKS = [
    ("worker", "admin", "a worker's credential pins a pool (writes the admin topic)"),
    ("worker", "planner", "a worker's credential scales a pool (writes the planner topic)"),
    ("router", "workers", "a router's credential registers a worker (writes the workers topic)"),
    ("processor", "kv", "the metrics processor's credential writes KV events"),
]


def probe_kafka_roles(bootstrap: str, topic_prefix: str = "sy") -> list[Probe]:
    """Each component's own credential writing a topic its role does not own: the broker must
    refuse it (TOPIC_AUTHORIZATION_FAILED). The record is one byte no consumer could fold, so
    a hole shows up as a dead-lettered record, not as a changed view."""
    from confluent_kafka import Producer

    from kernel.log.catalog import Catalog
    from kernel.settings import BusSettings

    out = []
    for role, stream, attack in ROLE_ATTACKS:
        bus = BusSettings.from_env(role=role, bootstrap=bootstrap, topic_prefix=topic_prefix)
        errors: list[str] = []
        p = Producer({**bus.client_conf(), "message.timeout.ms": 10000, "logger": _quiet()})
        p.produce(Catalog(topic_prefix).topic(stream), value=b"\xc1", key=b"security-check",
                  on_delivery=lambda err, _m: errors.append(str(err)) if err else None)
        left = p.flush(20)
        if left:
            out.append(Probe("kafka", attack, SERVER_ERROR, "no delivery report within 20 s"))
        elif errors and "AUTHORIZATION" in errors[0]:
            out.append(Probe("kafka", attack, REFUSED, errors[0][:100]))
        elif errors:
            out.append(Probe("kafka", attack, SERVER_ERROR, errors[0][:100]))
        else:
            out.append(Probe("kafka", attack, ACCEPTED, f"written to {Catalog(topic_prefix).topic(stream)}"))
    return out


def _quiet():
    import logging

    return logging.getLogger("switchyard.rdkafka")


# -- the whole check ---------------------------------------------------------------------------

def run(t: Targets) -> list[Probe]:
    probes: list[Probe] = []
    steps: list[Callable[[], list[Probe] | Probe]] = []
    if t.router_url:
        steps.append(lambda: probe_router(t.router_url))
    if t.admin_url:
        steps.append(lambda: probe_admin(t.admin_url))
    steps += [lambda: probe_cli_pin(t.admin_url), lambda: probe_kafka(t.kafka_bootstrap),
              lambda: probe_kafka_roles(t.kafka_bootstrap, t.topic_prefix),
              lambda: probe_postgres(t.postgres_url), lambda: probe_redis(t.redis_url),
              lambda: probe_listeners(t.pids)]
    for step in steps:
        got = step()
        probes += got if isinstance(got, list) else [got]
    return probes


def summary(probes: list[Probe]) -> dict[str, int]:
    attacks = [p for p in probes if p.area != "listeners"]
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
    from control_plane.demo.up import Supervisor, system_pids

    urls = {p.name: p.url or None for p in Supervisor(stack_settings).procs}
    return Targets(router_url=urls.get("router"), admin_url=urls.get("admin"),
                   kafka_bootstrap=stack_settings.kafka_bootstrap, postgres_url=stack_settings.postgres_url,
                   redis_url=stack_settings.redis_url, pids=system_pids(stack_settings),
                   topic_prefix=os.environ.get("SWITCHYARD_TOPIC_PREFIX", "sy"))
