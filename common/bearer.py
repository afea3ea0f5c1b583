"""Bearer secrets: the one scheme for every credential Switchyard issues. Pure (hashlib,
hmac and secrets only).

A credential is ``<prefix>_<id>_<secret>``: ``id`` (8 hex chars) finds the record, ``secret``
(32 random bytes, url-safe base64) is checked against ``sha256(salt || secret)`` with a
per-credential random salt, compared in constant time. A fast hash is enough because the secret
has 256 bits of entropy (a slow KDF protects *guessable* passwords); the salt keeps equal hashes
from ever revealing equal secrets. The plain credential is shown once, when it is issued, and
never stored, logged or put on the log: what is kept (in a table, or in an event) is the salt
and the hash.

Used by the admin API's tokens (prefix ``sy``) and the router's API keys (prefix ``sk-sy``):
one format, one hash, one comparison.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass


@dataclass(frozen=True)
class Issued:
    """A new credential: the id and the plain text (shown once), the salt and hash (kept)."""

    id: str
    plain: str
    salt: str
    hash: str


def hash_secret(salt: str, secret: str) -> str:
    return hashlib.sha256(bytes.fromhex(salt) + secret.encode()).hexdigest()


def issue(prefix: str, cred_id: str | None = None) -> Issued:
    """A new credential under ``prefix``; with ``cred_id``, a new secret for that id (rotation)."""
    cred_id = cred_id or secrets.token_hex(4)
    secret = secrets.token_urlsafe(32)
    salt = secrets.token_hex(16)
    return Issued(cred_id, f"{prefix}_{cred_id}_{secret}", salt, hash_secret(salt, secret))


def parse(plain: str, prefix: str) -> tuple[str, str] | None:
    """(id, secret) of a well-formed credential under ``prefix``, else None."""
    parts = plain.split("_", 2)
    if len(parts) != 3 or parts[0] != prefix or len(parts[1]) != 8 or not parts[2]:
        return None
    try:
        int(parts[1], 16)
    except ValueError:
        return None
    return parts[1], parts[2]


def verify_secret(salt: str, expected_hash: str, secret: str) -> bool:
    """Whether ``secret`` hashes to ``expected_hash`` with ``salt`` (constant-time compare)."""
    try:
        got = hash_secret(salt, secret)
    except (ValueError, UnicodeEncodeError):
        return False
    return hmac.compare_digest(got, expected_hash)
