"""The operator console: server-rendered pages over the admin API's queries, at ``/console``.

Same tokens and roles as the API (a viewer reads; an operator may also re-execute, what-if and
pin). A browser cannot attach a bearer header to a page load, so the login form puts the token
in an HttpOnly, SameSite=Strict cookie scoped to ``/console``; every page then authenticates it
through the API's own dependency (:func:`control_plane.admin.deps.current_principal`: the same
expiry, revocation and failed-authentication limit). Pages carry a Content-Security-Policy
without ``'unsafe-inline'``: the only script is the static ``console.js`` (the Fleet page's
server-sent events). No Node toolchain, no vendored library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Awaitable, Callable

if TYPE_CHECKING:  # the CLI imports this package's cli module: typer only
    from fastapi import FastAPI, Request, Response

    from control_plane.admin.errors import ApiError


def mount(app: FastAPI, api_error: Callable[[Request, ApiError], Awaitable[Response]]) -> None:
    """Add the console's routes, static files and error pages to the admin app. ``api_error`` is
    the app's JSON response to an :class:`ApiError`, which the console's handler gives every path
    outside ``/console`` (passed in: the app imports the console, never the other way)."""
    # Function-local: the admin CLI imports this package for its cli module, without FastAPI's pages.
    from control_plane.admin.console.routes import install

    install(app, api_error)
