"""``switchyard admin ...``: serve the admin API, migrate its database, issue tokens, run the audit."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Optional

import typer

from control_plane.clikit import fail, setup_logging

admin_app = typer.Typer(help="Admin API, its database (migrations) and the audit projection.", no_args_is_help=True)

DbOpt = Annotated[Optional[str], typer.Option("--db-url", help="SQLAlchemy URL (default $SWITCHYARD_DB_URL or SQLite "
                                                                "under .stack/).")]


def _settings(db_url: str | None, **kw):
    # lazy: CLI start-up: the command's modules load only when it runs
    from control_plane.admin.settings import AdminSettings

    if db_url:
        kw["db_url"] = db_url
    return AdminSettings.from_env(**kw)


@admin_app.command("serve")
def serve(
    host: Annotated[Optional[str], typer.Option(help="Bind address.")] = None,
    port: Annotated[Optional[int], typer.Option(help="HTTP port.")] = None,
    db_url: DbOpt = None,
    no_audit: Annotated[bool, typer.Option("--no-audit", help="Do not run the audit consumer in this process.")] = False,
    no_migrate: Annotated[bool, typer.Option("--no-migrate", help="Do not run `alembic upgrade head` first.")] = False,
) -> None:
    """Run the admin API (migrating the database first) with the audit consumer in-process."""
    setup_logging()
    # lazy: start-up time: loads confluent_kafka, msgspec, sqlalchemy ... only when called
    from control_plane.admin.wiring import run_admin

    kw = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
    if no_audit:
        kw["audit"] = False
    run_admin(_settings(db_url, **kw), migrate_first=not no_migrate)


@admin_app.command("migrate")
def migrate_cmd(
    revision: Annotated[str, typer.Argument(help="Target revision (head, base, or an id).")] = "head",
    down: Annotated[bool, typer.Option("--down", help="Downgrade to the revision instead.")] = False,
    db_url: DbOpt = None,
) -> None:
    """Apply the Alembic migrations (``alembic upgrade head``; ``--down base`` removes everything)."""
    # lazy: start-up time: loads confluent_kafka, msgspec, sqlalchemy ... only when called
    from control_plane.admin.wiring import migrate

    s = _settings(db_url)
    migrate(s.db_url, revision, down=down)
    typer.echo(f"{'downgraded' if down else 'upgraded'} {_safe(s.db_url)} to {revision}")


@admin_app.command("create-token")
def create_token_cmd(
    name: Annotated[str, typer.Option(help="Token name (what the audit records as the actor).")],
    role: Annotated[str, typer.Option(help="viewer | operator | admin")] = "admin",
    expires_in_days: Annotated[Optional[int], typer.Option(help="Days it authenticates (default: "
                                                                "$SWITCHYARD_ADMIN_TOKEN_TTL_DAYS, 30).")] = None,
    db_url: DbOpt = None,
) -> None:
    """Issue an API token directly in the database (bootstrap the first admin; access to the
    database is the credential here). Recorded in the log as AdminAction(token_created) by
    actor "cli". Every other change goes through the API with a token."""
    logging.getLogger("switchyard.rdkafka").setLevel(logging.CRITICAL)
    # lazy: CLI start-up: the command's modules load only when it runs
    from control_plane.admin.auth import Principal, Role
    # lazy: start-up time: loads confluent_kafka, msgspec, sqlalchemy ... only when called
    from control_plane.admin.context import AdminContext
    # lazy: start-up time: loads sqlalchemy only when called
    from control_plane.admin.db.session import make_engine, session_factory
    # lazy: CLI start-up: the command's modules load only when it runs
    from control_plane.admin.errors import ApiError
    # lazy: CLI start-up: the command's modules load only when it runs
    from control_plane.admin.ports import InlineJobRunner, KafkaEventLog
    # lazy: start-up time: loads confluent_kafka, msgspec, pydantic ... only when called
    from control_plane.admin.services import create_token
    # lazy: start-up time: loads msgspec, pydantic, switchyard_native ... only when called
    from control_plane.admin.shapes import TokenCreate
    # lazy: CLI start-up: the command's modules load only when it runs
    from common.log.catalog import Catalog
    # lazy: start-up time: loads confluent_kafka, msgspec, xxhash only when called
    from common.log.kafka import EventProducer
    # lazy: CLI start-up: the command's modules load only when it runs
    from common.settings import BusSettings

    s = _settings(db_url)
    bus = BusSettings.from_env(role="admin")
    try:
        body = TokenCreate(name=name, role=role, expires_in_days=expires_in_days)
    except ValueError as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    engine = make_engine(s.db_url)
    events = KafkaEventLog(EventProducer(bus, f"{s.producer_id}-cli", catalog=Catalog(bus.topic_prefix)))
    ctx = AdminContext(settings=s, sessions=session_factory(engine), events=events, catalog=Catalog(bus.topic_prefix),
                       reader_factory=lambda: None, jobs=InlineJobRunner())
    try:
        with ctx.sessions() as session:
            row, token = create_token(session, ctx, Principal("-", "cli", Role.ADMIN), body)
    except ApiError as e:
        typer.secho(f"error: {e.message}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    finally:
        events.close()
        engine.dispose()
    typer.echo(f"token {row.id} ({row.role}) for {row.name}, expires {row.expires_at.isoformat(timespec='seconds')}:"
               f"\n{token}")


TokenFileOpt = Annotated[Optional[Path], typer.Option(
    "--token-file", help="File holding an admin token (mode 600; default: $SWITCHYARD_ADMIN_TOKEN).")]
AdminUrlOpt = Annotated[Optional[str], typer.Option(
    "--admin-url", help="Admin API (default: $SWITCHYARD_ADMIN_URL or http://127.0.0.1:8300).")]


def api_call(token_file: Path | None, url: str | None, call):
    """``call(client)`` through the admin API with the caller's token; a refusal exits 1 (2: no
    credential)."""
    # lazy: start-up time: loads httpx only when called
    from control_plane.admin.client import AdminClient, ClientError, admin_url, load_token

    try:
        client = AdminClient(admin_url(url), load_token(token_file))
    except ClientError as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(e.exit_code) from None
    try:
        return call(client)
    except ClientError as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(e.exit_code) from None
    finally:
        client.close()


@admin_app.command("issue-router-key")
def issue_router_key_cmd(
    name: Annotated[str, typer.Option(help="Who or what the key is for.")],
    expires_in_days: Annotated[Optional[int], typer.Option(help="Days it authenticates (default: no expiry).")] = None,
    rate: Annotated[Optional[float], typer.Option(help="Requests/s it may start on each router replica.")] = None,
    burst: Annotated[Optional[int], typer.Option(help="Requests above the rate at once (default: one second's).")] = None,
    max_concurrent: Annotated[Optional[int], typer.Option(help="Requests in flight on each router replica.")] = None,
    session_from_user: Annotated[bool, typer.Option(help="The OpenAI `user` field names the request's session.")] = False,
    token_file: TokenFileOpt = None,
    admin_url: AdminUrlOpt = None,
) -> None:
    """Issue a router API key through the admin API (an admin token): RouterKeyIssued on the log,
    which every router folds. Prints the key once (only its hash is kept)."""
    made = api_call(token_file, admin_url, lambda c: c.issue_router_key(
        name, expires_in_days=expires_in_days, rate_per_s=rate, burst=burst, max_concurrent=max_concurrent,
        session_from_user=session_from_user))
    typer.echo(f"router key {made['key_id']} for {made['name']}:\n{made['key']}")


@admin_app.command("revoke-router-key")
def revoke_router_key_cmd(
    key_id: Annotated[str, typer.Argument(help="The key's id (the 8 hex chars after sk-sy_).")],
    reason: Annotated[str, typer.Option(help="Why (recorded in the event).")] = "",
    token_file: TokenFileOpt = None,
    admin_url: AdminUrlOpt = None,
) -> None:
    """Revoke a router API key through the admin API (RouterKeyRevoked): the routers refuse it
    once they folded the event."""
    api_call(token_file, admin_url, lambda c: c.revoke_router_key(key_id, reason))
    typer.echo(f"router key {key_id} revoked")


@admin_app.command("audit")
def audit_cmd(
    once: Annotated[bool, typer.Option("--once", help="Catch up with the log end, then exit.")] = False,
    db_url: DbOpt = None,
) -> None:
    """Run only the audit consumer (fold the topics into the audit tables)."""
    logging.basicConfig(level=logging.INFO)
    logging.getLogger("switchyard.rdkafka").setLevel(logging.CRITICAL)
    import time

    # lazy: start-up time: loads confluent_kafka, msgspec, sqlalchemy ... only when called
    from control_plane.admin.audit.consumer import AuditConsumer
    # lazy: start-up time: loads sqlalchemy only when called
    from control_plane.admin.db.session import make_engine, session_factory
    # lazy: CLI start-up: the command's modules load only when it runs
    from common.settings import BusSettings

    s = _settings(db_url)
    c = AuditConsumer(BusSettings.from_env(role="admin"), session_factory(make_engine(s.db_url)), streams=s.audit_streams,
                      batch=s.audit_batch)
    if once:
        c.drain(timeout=600)
        typer.echo(f"audit: {c.totals.inserted} new events, {c.totals.duplicates} already stored")
        c.stop()
        return
    c.start()
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        c.stop()


def _safe(url: str) -> str:
    """The URL without a password."""
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


# -- `switchyard planner pin|unpin`: a planner override, recorded through the admin API -----------

ActorOpt = Annotated[Optional[str], typer.Option(
    hidden=True, help="Deprecated: the actor is the token's name; refused when it names anyone else.")]


def pin(
    pool: Annotated[str, typer.Argument(help="Pool to pin.")],
    replicas: Annotated[int, typer.Argument(help="Replicas to hold it at (within the pool's bounds).")],
    reason: Annotated[str, typer.Option(help="Why (recorded in the event and in the planner's decision).")] = "",
    token_file: TokenFileOpt = None,
    admin_url: AdminUrlOpt = None,
    actor: ActorOpt = None,
) -> None:
    """Pin a pool (manual override) through the admin API (operator token): it records PoolPinned
    on the admin stream naming the token as the actor; the leading planner holds the pool at
    REPLICAS until unpinned."""
    if replicas < 0:
        fail("replicas must be >= 0", 2)
    who = _pin_call(token_file, admin_url, actor, lambda c: c.pin(pool, replicas, reason))
    typer.echo(f"pinned {pool} to {replicas} (as {who})")


def unpin(pool: Annotated[str, typer.Argument(help="Pool to release.")],
          reason: Annotated[str, typer.Option(help="Why.")] = "",
          token_file: TokenFileOpt = None,
          admin_url: AdminUrlOpt = None,
          actor: ActorOpt = None) -> None:
    """Release a pin through the admin API (PoolPinned with no replicas): the planner sizes the
    pool from the load again."""
    who = _pin_call(token_file, admin_url, actor, lambda c: c.unpin(pool, reason))
    typer.echo(f"unpinned {pool} (as {who})")


def _pin_call(token_file: Path | None, url: str | None, actor: str | None, call) -> str:
    """Run ``call`` through the admin API with the caller's token (:func:`api_call`); the actor
    the API records."""

    def checked(client):
        if actor is not None:
            name = client.whoami()["name"]
            if actor != name:
                fail(f"--actor {actor!r} is not this token's name ({name!r}): the log records the token's name "
                      "as the actor; --actor is deprecated, drop it", 2)
            typer.secho("warning: --actor is deprecated (the actor is the token's name)", err=True,
                        fg=typer.colors.YELLOW)
        return call(client)

    return api_call(token_file, url, checked).get("updated_by", "?")


def add_pin_commands(app: typer.Typer) -> None:
    """Add ``pin`` and ``unpin`` to ``app`` (the ``switchyard planner`` group): they are admin API
    calls, so they live here and the planner's package does not import the admin's."""
    app.command("pin")(pin)
    app.command("unpin")(unpin)
