"""Throw-away databases for admin-store tests: a fresh PostgreSQL database (``test_<hex>``) or
SQLite file per test or module, migrated with Alembic, dropped afterwards."""

from __future__ import annotations

import uuid
from contextlib import contextmanager
from pathlib import Path

import sqlalchemy as sa

from control_plane.admin.db.session import make_engine
from common.stack_settings import StackSettings


def pg_admin_url() -> str:
    return StackSettings.from_env().postgres_url


@contextmanager
def postgres_database():
    """Yield the URL of a new, empty PostgreSQL database; drop it afterwards."""
    name = f"test_{uuid.uuid4().hex[:12]}"
    admin = make_engine(pg_admin_url(), isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = pg_admin_url().rsplit("/", 1)[0] + f"/{name}"
    try:
        yield url
    finally:
        with admin.connect() as c:
            c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@contextmanager
def sqlite_database(tmp: Path):
    yield f"sqlite:///{tmp / f'admin-{uuid.uuid4().hex[:8]}.db'}"


def migrated(url: str) -> str:
    from control_plane.admin.wiring import migrate

    migrate(url)
    return url
