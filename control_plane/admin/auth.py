"""API tokens and roles. Pure.

A token is ``sy_<id>_<secret>``, in the one credential scheme of :mod:`common.bearer` (the
router's API keys use it too): ``id`` finds the row, the secret is checked against
``sha256(salt || secret)`` in constant time. The plain token is shown once, at creation, and
never stored or logged.

Roles are ordered: ``viewer`` < ``operator`` < ``admin``; a route names the least role it needs.

Every token expires (``expires_at``, set at issue; rotation sets a new one with the new secret).
:func:`authenticate` is the whole decision, with the time as an input: the secret is checked
*before* revocation and expiry, so only a caller holding the secret learns why a token is
refused; anyone else reads "invalid token", and only those refusals count as guesses for the
rate limit (:mod:`control_plane.admin.ratelimit`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import Enum

from common import bearer
from common.bearer import hash_secret, verify_secret  # noqa: F401 - re-exported under their old names

TOKEN_PREFIX = "sy"


class Role(str, Enum):
    VIEWER = "viewer"
    OPERATOR = "operator"
    ADMIN = "admin"

    @property
    def rank(self) -> int:
        return {"viewer": 0, "operator": 1, "admin": 2}[self.value]

    def allows(self, needed: Role) -> bool:
        return self.rank >= needed.rank


@dataclass(frozen=True)
class Principal:
    """Who is calling: the token's id, name and role (the name is what events record)."""

    token_id: str
    name: str
    role: Role


@dataclass(frozen=True)
class IssuedToken:
    token_id: str
    token: str
    salt: str
    token_hash: str


def issue_token(token_id: str | None = None) -> IssuedToken:
    """A new token; with ``token_id``, a new secret for that id (rotation)."""
    i = bearer.issue(TOKEN_PREFIX, token_id)
    return IssuedToken(i.id, i.plain, i.salt, i.hash)


def parse_token(token: str) -> tuple[str, str] | None:
    """(id, secret) of a well-formed token, else None."""
    return bearer.parse(token, TOKEN_PREFIX)


def expiry(now: datetime, days: int) -> datetime:
    """When a token issued (or rotated) at ``now`` for ``days`` stops authenticating."""
    return now + timedelta(days=days)


class Denial(str, Enum):
    """Why a presented token does not authenticate."""

    MALFORMED = "malformed"
    INVALID = "invalid"
    REVOKED = "revoked"
    EXPIRED = "expired"

    @property
    def guess(self) -> bool:
        """A refusal of a secret nobody showed to be right: what the rate limit counts. A revoked
        or expired token presented with its right secret is a stale client, not an attack."""
        return self in (Denial.MALFORMED, Denial.INVALID)


@dataclass(frozen=True)
class TokenRecord:
    """What authentication reads of a stored token."""

    token_id: str
    name: str
    role: str
    salt: str
    token_hash: str
    expires_at: datetime
    revoked_at: datetime | None = None


def authenticate(record: TokenRecord | None, secret: str, now: datetime) -> Principal | Denial:
    """The caller a token names, or why it does not authenticate at ``now``."""
    if record is None or not verify_secret(record.salt, record.token_hash, secret):
        return Denial.INVALID
    if record.revoked_at is not None:
        return Denial.REVOKED
    if now >= record.expires_at:
        return Denial.EXPIRED
    return Principal(token_id=record.token_id, name=record.name, role=Role(record.role))
