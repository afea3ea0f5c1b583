"""What a security probe is and says: its verdicts, its result and the system it targets. Below
the check (:mod:`ops.security.check`) and its probe modules, which all use them."""

from __future__ import annotations

import logging
from dataclasses import dataclass

REFUSED, ACCEPTED, SERVER_ERROR = "refused", "accepted", "server_error"
#: A probe that could not run here (what it needs is missing); not counted as an attack.
SKIPPED = "skipped"
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
    #: A valid router API key (the input probes carry it) and an admin token (the key probes
    #: issue and revoke keys with it).
    router_key: str | None = None
    admin_token: str | None = None
    worker_urls: tuple[str, ...] = ()
    #: The stack's S3 endpoint (SeaweedFS, the object tier's store).
    s3_url: str | None = None
    #: The Redis as the routers' and the planners' own ACL users (``StackSettings.redis_role_url``;
    #: ``redis_url`` is the super user's).
    redis_router_url: str | None = None
    redis_planner_url: str | None = None


def quiet() -> logging.Logger:
    """The logger the probes' Kafka clients log to (kept out of the check's output)."""
    return logging.getLogger("switchyard.rdkafka")
