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

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI imports this package's cli module: typer only
    from fastapi import FastAPI


def mount(app: FastAPI) -> None:
    """Add the console's routes, static files and error pages to the admin app."""
    # lazy: start-up time: loads confluent_kafka, fastapi, msgspec ... only when called
    from control_plane.admin.console.routes import install

    install(app)
