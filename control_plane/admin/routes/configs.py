"""``/router-config`` and ``/planner-config``: one router per config kind, built by one function.

No ``from __future__ import annotations`` here, on purpose: the PUT route's body type differs
per kind, and FastAPI must see the class itself, which an annotation evaluated when ``put`` is
defined gives (a string annotation would be looked up in the module's globals and not found).
"""

from fastapi import APIRouter

from control_plane.admin import queries, services
from control_plane.admin.deps import Ctx, Limit, Offset, Operator, SessionDep, VersionPath, Viewer
from control_plane.admin.routes.common import AUTH, errors, page
from control_plane.admin.shapes import ConfigVersionPublic, Page


def routers() -> list[APIRouter]:
    """One router per config kind, in the order of :data:`services.CONFIG_KINDS`."""
    return [config_router(kind) for kind in services.CONFIG_KINDS]


def config_router(kind: str) -> APIRouter:
    spec = services.CONFIG_KINDS[kind]
    r = APIRouter(prefix=f"/{kind}-config", tags=["configs"], responses=AUTH)

    def current(s: SessionDep, who: Viewer):
        return ConfigVersionPublic.model_validate(queries.config_version(s, kind, None), from_attributes=True)

    def versions(s: SessionDep, who: Viewer, limit: Limit = 50, offset: Offset = 0):
        rows, total = queries.config_versions(s, kind, limit, offset)
        return page(ConfigVersionPublic, rows, total, limit, offset)

    def one(version: VersionPath, s: SessionDep, who: Viewer):
        return ConfigVersionPublic.model_validate(queries.config_version(s, kind, version), from_attributes=True)

    def put(body: spec.body, s: SessionDep, c: Ctx, who: Operator):  # type: ignore[valid-type]
        return ConfigVersionPublic.model_validate(services.put_config(s, c, who, kind, body), from_attributes=True)

    r.add_api_route("", current, methods=["GET"], response_model=ConfigVersionPublic, responses=errors(404),
                    name=f"get_{kind}_config", description=f"The newest {kind} config version.")
    r.add_api_route("/versions", versions, methods=["GET"], response_model=Page[ConfigVersionPublic],
                    name=f"list_{kind}_config_versions", description=f"Every {kind} config version, newest first.")
    r.add_api_route("/versions/{version}", one, methods=["GET"], response_model=ConfigVersionPublic,
                    responses=errors(404), name=f"get_{kind}_config_version")
    r.add_api_route("", put, methods=["PUT"], response_model=ConfigVersionPublic, responses=errors(409, 503),
                    name=f"put_{kind}_config",
                    description=f"Record the next {kind} config version ({spec.event.TYPE}); 409 when "
                                "``expected_version`` is not the current one, 422 when the config breaks a rule "
                                "(the message says which).")
    return r
