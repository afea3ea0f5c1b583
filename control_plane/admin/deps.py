"""FastAPI dependencies and parameters as named ``Annotated`` types: route signatures read like
documentation.

``SessionDep`` is one database session per request; ``Viewer`` / ``Operator`` / ``Admin`` are the
authenticated caller, checked to hold at least that role (401 without a valid bearer token,
403 with a weaker role, 429 after too many failed authentications: see :func:`current_principal`). The path and query parameter types bound every input, so no value
a client can send becomes a 500.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Annotated

from fastapi import Depends, Path, Query, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from control_plane.admin.auth import Denial, Principal, Role, TokenRecord, authenticate, parse_token
from control_plane.admin.context import AdminContext
from control_plane.admin.db.models import ApiToken
from control_plane.admin.errors import Forbidden, TooManyRequests, Unauthorized


def get_ctx(request: Request) -> AdminContext:
    return request.app.state.ctx


Ctx = Annotated[AdminContext, Depends(get_ctx)]


def get_session(ctx: Ctx) -> Iterator[Session]:
    with ctx.sessions() as s:
        yield s


SessionDep = Annotated[Session, Depends(get_session)]

bearer = HTTPBearer(auto_error=False, bearerFormat="sy_<id>_<secret>",
                    description="An API token (`switchyard admin create-token`, or POST /tokens as admin).")


def client_source(request: Request, trusted_proxies: frozenset[str]) -> str:
    """The address a request came from: the peer's, unless the peer is a configured proxy; then
    the last ``X-Forwarded-For`` hop that is not one (a client can prepend any hops it likes, but
    not the ones its proxies append). With no proxies configured the header is ignored: a client
    that sends its own would otherwise pick the address it is limited under."""
    peer = request.client.host if request.client else "-"
    if peer not in trusted_proxies:
        return peer
    hops = [h.strip() for h in ",".join(request.headers.getlist("x-forwarded-for")).split(",") if h.strip()]
    for hop in reversed(hops):
        if hop not in trusted_proxies:
            return hop[:64]
    return peer


def current_principal(request: Request, ctx: Ctx,
                      creds: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)]) -> Principal:
    """The caller, from its bearer token. Failed guesses are limited per (token id, source
    address), and per source for tokens that name no token at all (malformed, unknown id):

    * A request naming a real token id is limited only by that id's failures *from its own
      source*: someone guessing wrong with the admin's id (which is not secret: it is in the
      log) from elsewhere costs the admin nothing, and a spray of invented ids costs nobody.
    * The right secret always authenticates, even while its (id, source) bucket is empty: a
      valid credential is never locked out by someone else's wrong guesses from the same
      address (on one box, every client is 127.0.0.1). The limit then bounds the work and noise
      of guessing, not its odds, which 256-bit secrets (common/bearer.py) already make nil.
    """
    if creds is None or not creds.credentials:
        raise Unauthorized("missing bearer token (Authorization: Bearer sy_<id>_<secret>)")
    now = ctx.clock()
    source = client_source(request, ctx.settings.trusted_proxies)
    parsed = parse_token(creds.credentials)
    record: TokenRecord | None = None
    if parsed is not None:
        with ctx.sessions() as s:
            row = s.get(ApiToken, parsed[0])
            if row is not None:
                record = TokenRecord(token_id=row.id, name=row.name, role=row.role, salt=row.salt,
                                     token_hash=row.token_hash, expires_at=row.expires_at, revoked_at=row.revoked_at)
    keys = [f"addr:{source}"] if record is None else [f"token:{record.token_id}@{source}"]
    if record is None:
        _limited(ctx, keys, now)  # nothing to find: refused before any work
    outcome: Principal | Denial = (Denial.MALFORMED if parsed is None
                                   else authenticate(record, parsed[1], datetime.fromtimestamp(now, timezone.utc)))
    if isinstance(outcome, Principal):
        return outcome
    if outcome.guess:
        _limited(ctx, keys, now)
        ctx.auth_limiter.failed(keys, now)
    raise _denied(outcome, record)


def _limited(ctx: AdminContext, keys: list[str], now: float) -> None:
    wait = ctx.auth_limiter.retry_after(keys, now)
    if wait is not None:
        raise TooManyRequests(f"too many failed authentications; retry in {wait} s",
                              headers={"Retry-After": str(wait)})


def _denied(why: Denial, record: TokenRecord | None) -> Unauthorized:
    if why is Denial.EXPIRED:
        return Unauthorized(f"token {record.token_id} expired at {record.expires_at.isoformat(timespec='seconds')}; "
                            "ask an admin to rotate it (POST /tokens/{id}/rotate)", code="token_expired")
    if why is Denial.REVOKED:
        return Unauthorized(f"token {record.token_id} is revoked", code="token_revoked")
    if why is Denial.MALFORMED:
        return Unauthorized("malformed token (want sy_<id>_<secret>)")
    return Unauthorized("invalid token")


CurrentUser = Annotated[Principal, Depends(current_principal)]


def _require(role: Role):
    def check(who: CurrentUser) -> Principal:
        if not who.role.allows(role):
            raise Forbidden(f"{who.name} is {who.role.value}; this needs {role.value}")
        return who

    return check


Viewer = Annotated[Principal, Depends(_require(Role.VIEWER))]
Operator = Annotated[Principal, Depends(_require(Role.OPERATOR))]
Admin = Annotated[Principal, Depends(_require(Role.ADMIN))]

# -- parameters ----------------------------------------------------------------------------------

Limit = Annotated[int, Query(ge=1, le=500, description="Page size.")]
Offset = Annotated[int, Query(ge=0, le=1_000_000_000, description="Items to skip.")]
#: Ids found in the log (worker ids, request ids): anything printable but "/", bounded.
LogIdPath = Annotated[str, Path(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f/]+$")]
WorkerIdPath = RequestIdPath = LogIdPath
PoolPath = Annotated[str, Path(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
VersionPath = Annotated[int, Path(ge=1, le=2**31 - 1)]
#: Ids the admin store mints (tokens, replay jobs): lowercase hex.
HexId = Annotated[str, Path(min_length=1, max_length=32, pattern=r"^[0-9a-f]+$")]
#: An optional exact-match filter on a column of the log's projections.
FilterStr = Annotated[str | None, Query(max_length=256, pattern=r"^[^\x00-\x1f]*$")]
