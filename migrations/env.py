"""Alembic environment of the admin store.

URL, first found: ``config.attributes["db_url"]`` (set by ``switchyard admin migrate`` and the
tests), ``$SWITCHYARD_DB_URL``, the default SQLite file under the stack's state directory.
SQLite runs in batch mode so later ALTERs work there too.
"""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context

from control_plane.admin.db.models import Base
from control_plane.admin.settings import default_db_url, db_url_from_env

config = context.config
if config.config_file_name is not None and not config.attributes.get("no_logging_config"):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def _url() -> str:
    return config.attributes.get("db_url") or db_url_from_env() or default_db_url()


def run_migrations_offline() -> None:
    url = _url()
    context.configure(url=url, target_metadata=target_metadata, literal_binds=True,
                      render_as_batch=url.startswith("sqlite"), dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    from control_plane.admin.db.session import make_engine

    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(_url())
    try:
        with engine.connect() as conn:
            _run(conn)
    finally:
        engine.dispose()


def _run(conn) -> None:
    context.configure(connection=conn, target_metadata=target_metadata,
                      render_as_batch=conn.dialect.name == "sqlite", compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
