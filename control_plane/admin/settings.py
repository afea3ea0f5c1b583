"""Typed settings of the admin process, built once at start-up from the environment."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from common.stack_settings import StackSettings
from common.settings import BusSettings


def default_db_url() -> str:
    """SQLite file in the stack's state directory: zero setup on one box."""
    return f"sqlite:///{StackSettings.from_env().state_dir / 'switchyard.db'}"


def db_url_from_env(env: dict[str, str] | None = None) -> str | None:
    env = os.environ if env is None else env
    return env.get("SWITCHYARD_DB_URL") or None


@dataclass(frozen=True)
class AdminSettings:
    """The admin API, audit consumer and replay jobs of one process."""

    #: SQLAlchemy URL of the admin store (PostgreSQL or SQLite). $SWITCHYARD_DB_URL.
    db_url: str = field(default_factory=default_db_url)
    #: Bind address and port of the HTTP API. $SWITCHYARD_ADMIN_HOST / _PORT.
    host: str = "127.0.0.1"
    port: int = 8300
    #: Producer id of the events this process records (operator actions). Its epoch is the
    #: start time, like every producer's.
    producer_id: str = "admin-api"
    #: Run the audit consumer in the API process (folds the topics into the audit tables).
    audit: bool = True
    #: Streams the audit consumer folds.
    audit_streams: tuple[str, ...] = ("requests", "workers", "planner", "admin", "kv")
    #: Records per audit transaction (one batch upsert, positions committed with it).
    audit_batch: int = 2000
    #: Prefix hashing of the engines (the index the overlap query folds must match them).
    hash_algo: str = "sha256"
    block_size: int = 64
    #: Replay jobs run in this many background threads.
    job_workers: int = 1
    #: Seconds a cached index view may lag the log before a query catches it up.
    view_max_age_s: float = 0.5
    #: Days a token authenticates after it is issued or rotated, unless the issuer says otherwise.
    token_ttl_days: int = 30
    #: The longest lifetime an issuer may ask for (a token must not outlive its reason).
    token_max_ttl_days: int = 365
    #: Failed authentications allowed in a burst per client address and per token id, and the
    #: rate they are allowed at after it (token buckets, :mod:`control_plane.admin.ratelimit`).
    auth_fail_burst: int = 10
    auth_fail_per_s: float = 0.5
    #: Addresses of the reverse proxies in front of the API, whose ``X-Forwarded-For`` names the
    #: client (comma-separated in $SWITCHYARD_ADMIN_TRUSTED_PROXIES). Empty: the header is
    #: ignored, and a client is limited under the address it connects from.
    trusted_proxies: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not 1 <= self.token_ttl_days <= self.token_max_ttl_days:
            raise ValueError(f"need 1 <= token_ttl_days ({self.token_ttl_days}) <= token_max_ttl_days "
                             f"({self.token_max_ttl_days})")
        if self.auth_fail_burst < 1 or not self.auth_fail_per_s > 0:
            raise ValueError("need auth_fail_burst >= 1 and auth_fail_per_s > 0: a limit of nothing would "
                             "lock every client out after its first typo")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides) -> AdminSettings:
        env = dict(os.environ if env is None else env)
        kw: dict = {}
        if db_url_from_env(env):
            kw["db_url"] = db_url_from_env(env)
        for f in fields(cls):
            raw = env.get(f"SWITCHYARD_ADMIN_{f.name.upper()}")
            if raw is None:
                continue
            if f.type in ("int", int):
                kw[f.name] = int(raw)
            elif f.type in ("float", float):
                kw[f.name] = float(raw)
            elif f.type in ("bool", bool):
                kw[f.name] = raw.lower() in ("1", "true", "yes", "on")
            elif f.name == "audit_streams":
                kw[f.name] = tuple(s.strip() for s in raw.split(",") if s.strip())
            elif f.name == "trusted_proxies":
                kw[f.name] = frozenset(s.strip() for s in raw.split(",") if s.strip())
            else:
                kw[f.name] = raw
        kw.update(overrides)
        return cls(**kw)

    def bus(self) -> BusSettings:
        return BusSettings.from_env(role="admin")
