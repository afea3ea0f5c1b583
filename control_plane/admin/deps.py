"""FastAPI dependencies and parameters as named ``Annotated`` types: route signatures read like
documentation.

``SessionDep`` is one database session per request; ``Viewer`` / ``Operator`` / ``Admin`` are the
authenticated caller, checked to hold at least that role (401 without a valid bearer token,
403 with a weaker role). The path and query parameter types bound every input, so no value
a client can send becomes a 500.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Path, Query, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from control_plane.admin.auth import Principal, Role, parse_token, verify_secret
from control_plane.admin.context import AdminContext
from control_plane.admin.db.models import ApiToken
from control_plane.admin.errors import Forbidden, Unauthorized


def get_ctx(request: Request) -> AdminContext:
    return request.app.state.ctx


Ctx = Annotated[AdminContext, Depends(get_ctx)]


def get_session(ctx: Ctx) -> Iterator[Session]:
    with ctx.sessions() as s:
        yield s


SessionDep = Annotated[Session, Depends(get_session)]

bearer = HTTPBearer(auto_error=False, bearerFormat="sy_<id>_<secret>",
                    description="An API token (`switchyard admin create-token`, or POST /tokens as admin).")


def current_principal(ctx: Ctx, creds: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)]) -> Principal:
    if creds is None or not creds.credentials:
        raise Unauthorized("missing bearer token (Authorization: Bearer sy_<id>_<secret>)")
    parsed = parse_token(creds.credentials)
    if parsed is None:
        raise Unauthorized("malformed token")
    token_id, secret = parsed
    with ctx.sessions() as s:
        row = s.get(ApiToken, token_id)
        if row is None or row.revoked_at is not None or not verify_secret(row.salt, row.token_hash, secret):
            raise Unauthorized("invalid or revoked token")
        return Principal(token_id=row.id, name=row.name, role=Role(row.role))


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
