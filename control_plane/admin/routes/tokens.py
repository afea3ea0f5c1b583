"""API tokens (admin) and ``/whoami`` (any token)."""

from __future__ import annotations

from fastapi import APIRouter

from control_plane.admin import queries, services
from control_plane.admin.deps import Admin, Ctx, HexId, Limit, Offset, SessionDep, Viewer
from control_plane.admin.routes.common import AUTH, errors, page
from control_plane.admin.shapes import Page, TokenCreate, TokenCreated, TokenPublic, TokenRotate, WhoAmI

#: ``/whoami`` answers only 401 and 403: it has no input to be invalid.
caller = APIRouter(tags=["tokens"])
router = APIRouter(prefix="/tokens", tags=["tokens"], responses=AUTH)


@caller.get("/whoami", response_model=WhoAmI, responses=errors(401, 403, 429))
def whoami(who: Viewer) -> WhoAmI:
    return WhoAmI(token_id=who.token_id, name=who.name, role=who.role.value)


@router.get("", response_model=Page[TokenPublic])
def list_tokens(s: SessionDep, who: Admin, limit: Limit = 50, offset: Offset = 0):
    rows, total = queries.tokens(s, limit, offset)
    return page(TokenPublic, rows, total, limit, offset)


@router.post("", response_model=TokenCreated, status_code=201, responses=errors(409, 503))
def create_token(body: TokenCreate, s: SessionDep, c: Ctx, who: Admin):
    """Issue a token (admin), expiring after ``expires_in_days`` (``AdminAction(token_created)``).
    The response carries the token once; only its hash is kept."""
    row, token = services.create_token(s, c, who, body)
    return TokenCreated(**TokenPublic.model_validate(row, from_attributes=True).model_dump(), token=token)


@router.post("/{token_id}/rotate", response_model=TokenCreated, responses=errors(404, 409, 503))
def rotate_token(token_id: HexId, s: SessionDep, c: Ctx, who: Admin, body: TokenRotate | None = None):
    """A new secret and expiry for a token id (admin; ``AdminAction(token_rotated)``): the old
    secret stops authenticating at once; the id, name and role stay. 409 for a revoked token."""
    row, token = services.rotate_token(s, c, who, token_id, body or TokenRotate())
    return TokenCreated(**TokenPublic.model_validate(row, from_attributes=True).model_dump(), token=token)


@router.delete("/{token_id}", response_model=TokenPublic, responses=errors(404, 503))
def revoke_token(token_id: HexId, s: SessionDep, c: Ctx, who: Admin):
    """Revoke a token at once (admin; ``AdminAction(token_revoked)``)."""
    return TokenPublic.model_validate(services.revoke_token(s, c, who, token_id), from_attributes=True)
