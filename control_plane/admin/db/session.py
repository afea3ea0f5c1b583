"""Engine and session factory for the admin store (PostgreSQL or SQLite, from one URL)."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker
from common.stack_settings import StackSettings


def make_engine(url: str, **kw) -> Engine:
    """An engine for ``url``. SQLite gets WAL, foreign keys and a busy timeout (the audit
    consumer and the API write from different threads); its directory is created."""
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, **kw)

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        return engine
    kw.setdefault("connect_args", _passfile(url))
    return create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=10, **kw)


def _passfile(url: str) -> dict[str, str]:
    """For a PostgreSQL URL without a password: the local stack's password file (libpq picks the
    entry for the URL's host and port; a server it has no entry for is asked as usual)."""
    from sqlalchemy.engine import make_url

    if make_url(url).password is not None:
        return {}
    path = StackSettings.from_env().pgpass_file
    return {"passfile": str(path)}


def session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)
