"""One wiring function for the admin process: settings -> context -> FastAPI app."""

from __future__ import annotations

import logging

from control_plane.admin.audit.consumer import AuditConsumer
from control_plane.admin.context import AdminContext
from control_plane.admin.db.session import make_engine, session_factory
from control_plane.admin.liveview import LiveView
from control_plane.admin.ports import KafkaEventLog, ThreadJobRunner
from control_plane.admin.settings import AdminSettings
from control_plane.replay.engine import ReplayEngine
from common.hashing import HashAlgo, HashConfig
from common.log.catalog import Catalog
from common.log.kafka import EventProducer
from common.log.reader import KafkaLogReader
from common.settings import BusSettings, repo_root

log = logging.getLogger(__name__)


def build_admin(settings: AdminSettings, bus: BusSettings | None = None) -> AdminContext:
    bus = bus or BusSettings.from_env(role="admin")
    # Fail at start-up, not on the first overlap query, when the hashing cannot be reproduced.
    HashConfig(HashAlgo(settings.hash_algo), settings.block_size)
    engine = make_engine(settings.db_url)
    sessions = session_factory(engine)
    catalog = Catalog(bus.topic_prefix)
    producer = EventProducer(bus, settings.producer_id, catalog=catalog)
    events = KafkaEventLog(producer)
    live_reader = KafkaLogReader(bus)
    live = LiveView(ReplayEngine(live_reader, catalog), settings.hash_algo, settings.block_size,
                    settings.view_max_age_s)
    jobs = ThreadJobRunner(settings.job_workers)
    audit = AuditConsumer(bus, sessions, streams=settings.audit_streams, batch=settings.audit_batch) \
        if settings.audit else None
    ctx = AdminContext(settings=settings, sessions=sessions, events=events, catalog=catalog,
                       reader_factory=lambda: KafkaLogReader(bus), jobs=jobs, live=live, audit=audit)
    ctx.on_close.extend([jobs.shutdown, events.close, live_reader.close, engine.dispose])
    return ctx


def migrate(db_url: str, revision: str = "head", *, down: bool = False) -> None:
    """``alembic upgrade head`` (or ``downgrade <revision>``) on ``db_url``."""
    from alembic import command

    cfg = alembic_config(db_url)
    if down:
        command.downgrade(cfg, revision)
    else:
        command.upgrade(cfg, revision)


def alembic_config(db_url: str):
    from alembic.config import Config

    cfg = Config(str(repo_root() / "alembic.ini"))
    cfg.attributes["db_url"] = db_url
    cfg.attributes["no_logging_config"] = True
    return cfg


def run_admin(settings: AdminSettings, bus: BusSettings | None = None, *, migrate_first: bool = True) -> None:
    # lazy: start-up time: loads fastapi, pydantic, starlette only when called
    from control_plane.admin.app import create_app
    # lazy: start-up time: loads uvicorn only when called
    from common.http_server import serve

    if migrate_first:
        migrate(settings.db_url)
    serve(create_app(build_admin(settings, bus)), settings.host, settings.port)
