"""How a CLI changes anything: through the admin API, with a bearer token.

The API authenticates the token, rate-limits failures, checks the role and records the action
as an event whose actor is the token's name: a CLI never chooses who it says it is, and never
writes an operator action to the log itself.

The token comes from ``--token-file`` (a file only its owner can read, like an ssh key) or else
``$SWITCHYARD_ADMIN_TOKEN``; the API's URL from ``--admin-url`` or ``$SWITCHYARD_ADMIN_URL``
(default ``http://127.0.0.1:8300``, where ``switchyard admin serve`` listens).
"""

from __future__ import annotations

import os
import stat
from urllib.parse import quote
from pathlib import Path
from typing import Any

import httpx

TOKEN_ENV = "SWITCHYARD_ADMIN_TOKEN"
URL_ENV = "SWITCHYARD_ADMIN_URL"
DEFAULT_URL = "http://127.0.0.1:8300"


class ClientError(Exception):
    """No usable credential, or the API refused the call; ``exit_code`` is what a CLI exits with
    (2: the invocation is wrong, 1: the call failed)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def load_token(token_file: Path | None, env: dict[str, str] | None = None) -> str:
    """The bearer token from ``token_file``, else from ``$SWITCHYARD_ADMIN_TOKEN``. A token file
    readable or writable by anyone but its owner is refused: the secret may already be out."""
    env = os.environ if env is None else env
    if token_file is not None:
        try:
            st = token_file.stat()
        except OSError as e:
            raise ClientError(f"token file {token_file}: {e.strerror}", 2) from None
        if not stat.S_ISREG(st.st_mode):
            raise ClientError(f"token file {token_file} is not a regular file", 2)
        if st.st_mode & 0o077:
            raise ClientError(f"token file {token_file} is accessible to others (mode {stat.S_IMODE(st.st_mode):o}): "
                              f"chmod 600 {token_file}, and rotate the token if others could read it", 2)
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            raise ClientError(f"token file {token_file} belongs to another user", 2)
        token = token_file.read_text().strip()
        if not token:
            raise ClientError(f"token file {token_file} is empty", 2)
        return token
    token = env.get(TOKEN_ENV, "").strip()
    if not token:
        raise ClientError(f"this changes the deployment and needs an admin API token: set ${TOKEN_ENV} or pass "
                          "--token-file (an operator token: `switchyard admin create-token`, or POST /tokens)", 2)
    return token


def admin_url(url: str | None, env: dict[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    return (url or env.get(URL_ENV) or DEFAULT_URL).rstrip("/")


class AdminClient:
    """The admin API calls the CLIs make. ``http`` is any httpx client (tests pass one)."""

    def __init__(self, base_url: str, token: str, *, timeout_s: float = 30.0,
                 http: httpx.Client | None = None) -> None:
        self._http = http or httpx.Client(base_url=base_url, timeout=timeout_s)
        self._headers = {"Authorization": f"Bearer {token}"}
        self.base_url = base_url

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kw) -> dict[str, Any]:
        try:
            r = self._http.request(method, path, headers=self._headers, **kw)
        except httpx.HTTPError as e:
            raise ClientError(f"the admin API at {self.base_url} cannot be reached ({type(e).__name__}): "
                              f"is `switchyard admin serve` running? (--admin-url / ${URL_ENV})") from None
        if r.status_code >= 400:
            try:
                err = r.json()["error"]
                msg = f"{err['message']} ({err['code']})"
            except (ValueError, KeyError, TypeError):
                msg = r.text[:300]
            raise ClientError(f"{method} {path}: {r.status_code} {msg}")
        return r.json()

    def whoami(self) -> dict[str, Any]:
        return self._call("GET", "/whoami")

    def doctor(self) -> dict[str, Any]:
        """The doctor's report (``GET /doctor``, viewer)."""
        return self._call("GET", "/doctor")

    def pin(self, pool: str, replicas: int, reason: str) -> dict[str, Any]:
        return self._call("PUT", f"/pools/{quote(pool, safe='')}/pin", json={"replicas": replicas, "reason": reason})

    def unpin(self, pool: str, reason: str) -> dict[str, Any]:
        return self._call("DELETE", f"/pools/{quote(pool, safe='')}/pin", params={"reason": reason} if reason else None)

    def issue_router_key(self, name: str, *, expires_in_days: int | None = None, rate_per_s: float | None = None,
                         burst: int | None = None, max_concurrent: int | None = None,
                         session_from_user: bool = False) -> dict[str, Any]:
        """A router API key (admin token): the answer's ``key`` is the secret, shown this once."""
        body = {k: v for k, v in (("name", name), ("expires_in_days", expires_in_days), ("rate_per_s", rate_per_s),
                                  ("burst", burst), ("max_concurrent", max_concurrent)) if v is not None}
        if session_from_user:
            body["session_from_user"] = True
        return self._call("POST", "/router-keys", json=body)

    def revoke_router_key(self, key_id: str, reason: str = "") -> dict[str, Any]:
        return self._call("DELETE", f"/router-keys/{quote(key_id, safe='')}", params={"reason": reason} if reason else None)
