"""The admin API's routes: one ``APIRouter`` per resource, assembled by
:func:`control_plane.admin.app.create_app`.

Routes parse, check the caller's role (:mod:`~control_plane.admin.deps`), call a query
(:mod:`~control_plane.admin.queries`) or an operator action (:mod:`~control_plane.admin.services`)
and shape its answer; they never touch tables themselves.
"""
