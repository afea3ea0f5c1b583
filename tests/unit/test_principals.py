"""The ACLs each component role gets (pure): who may write which topic of a prefix."""

from __future__ import annotations

import pytest

from common.log.catalog import Catalog
from common.log.principals import ROLES, SUPER_USER, role, role_bindings
from common.settings import BusSettings


def _writers(prefix: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for g in role_bindings(prefix):
        if g.resource == "topic" and g.operation == "write":
            out.setdefault(g.name, set()).add(g.user)
    return out


def test_only_the_planner_writes_planner_only_workers_kv_and_workers_admin_and_router_admin() -> None:
    c = Catalog("p1")
    w = _writers("p1")
    # The router records the config it was started with (RouterConfigChanged), nothing else does.
    assert w[c.topic("admin")] == {"sy-admin", "sy-router"}
    assert w[c.topic("planner")] == {"sy-planner"}
    assert w[c.topic("kv")] == {"sy-worker"} and w[c.topic("workers")] == {"sy-worker"}
    assert w[c.topic("requests")] == {"sy-router", "sy-worker"}
    assert w[c.topic("deadletter")] == {r.user for r in ROLES.values()}  # every consumer dead-letters
    assert SUPER_USER not in {g.user for g in role_bindings("p1")}


def test_grants_never_reach_past_their_prefix_or_allow_topic_admin() -> None:
    for g in role_bindings("p1"):
        if g.resource == "topic":
            assert g.name.startswith("p1."), g
            # Creating, deleting or reconfiguring topics: only the planner's own changelogs.
            assert g.operation in ("read", "write") or (g.pattern == "prefixed" and g.name == "p1.load-view."), g
    assert not any(g.name.startswith("p10") for g in role_bindings("p1"))


def test_a_role_is_its_own_principal_with_its_own_secret(tmp_path) -> None:
    env = {"SWITCHYARD_SECRETS_DIR": str(tmp_path), "SWITCHYARD_KAFKA_TLS": "0"}  # no CA needed here
    b = BusSettings.from_env(env, role="worker")
    assert (b.username, b.secret_name) == ("sy-worker", "kafka-worker")
    assert b.client_conf()["sasl.username"] == "sy-worker"
    assert b.client_conf()["security.protocol"] == "SASL_PLAINTEXT"
    assert b.secret() != BusSettings.from_env(env).secret()
    assert (tmp_path / "kafka-worker").stat().st_mode & 0o077 == 0
    # An explicit user wins over the role (an operator's own credential).
    assert BusSettings.from_env({"SWITCHYARD_KAFKA_USERNAME": "ops"}, role="worker").username == "ops"
    with pytest.raises(ValueError, match="unknown Kafka role 'root'"):
        role("root")


def test_consumer_groups_are_owned_like_topics() -> None:
    """Issue 36: every role had ``ALL`` on every group, so the processor's credential could join
    the router view's group. Now each role reads (joins, commits) and deletes only its own
    prefixes; the processor alone describes the others (their lag)."""
    groups = [g for g in role_bindings("p1") if g.resource == "group"]
    assert not any(g.name == "*" or g.operation == "all" for g in groups)
    joins: dict[str, set[str]] = {}
    for g in groups:
        assert g.pattern == "prefixed" and g.name.startswith("p1."), g
        if g.operation == "read":
            joins.setdefault(g.user, set()).add(g.name)
    assert joins["sy-router"] == {"p1.router."}  # its view is in no group (it assigns its partitions)
    assert joins["sy-processor"] == {"p1.metrics.", "p1.processor."}
    assert joins["sy-planner"] == {"p1.load-view.", "p1.planner."}
    owned = [(u, n) for u, names in joins.items() for n in names]
    for user, name in owned:  # no role's group prefix reaches into another's
        assert not any(n.startswith(name) or name.startswith(n) for u, n in owned if u != user), (user, name)
    describers = {g.user for g in groups if g.operation == "describe"}
    assert describers == {"sy-processor"}


def test_a_consumer_group_id_is_under_its_principals_prefix() -> None:
    from common.log.principals import group_id

    for r in ROLES.values():
        gid = group_id("p1", r.user, "assign.x")
        assert any(gid.startswith(f"p1.{g}") for g in r.groups), gid
    assert group_id("p1", SUPER_USER, "assign.x") == "p1.ops.assign.x"


def test_a_role_reads_the_streams_it_folds_and_the_operator_surfaces_read_all() -> None:
    """Components read with their own principal (issue 36): a router, a worker and the planner
    read only the streams they fold; the admin API and the processor every topic (the operator's
    read surface, every stream's metrics); an upgraded stack loses the old read-everything."""
    from common.log.principals import stale_grants

    c = Catalog("p1")
    reads: dict[str, set[str]] = {}
    for g in role_bindings("p1"):
        if g.resource == "topic" and g.operation == "read":
            reads.setdefault(g.user, set()).add(g.name if g.pattern == "literal" else f"{g.name}*")
    assert reads["sy-router"] == {c.topic(s) for s in ("kv", "workers", "requests", "admin", "snapshots")}
    assert reads["sy-worker"] == {c.topic("kv"), c.topic("workers")}
    assert reads["sy-planner"] == {c.topic(s) for s in ("requests", "workers", "admin", "snapshots")}
    assert reads["sy-admin"] == reads["sy-processor"] == {"p1.*"}
    stale = {(g.user, g.name) for g in stale_grants("p1") if g.resource == "topic"}
    assert stale == {("sy-router", "p1."), ("sy-worker", "p1."), ("sy-planner", "p1.")}
    retired = {(g.user, g.name, g.operation) for g in stale_grants("p1") if g.resource == "group" and g.name != "*"}
    assert retired == {("sy-router", "p1.router-view.", "read"), ("sy-router", "p1.router-view.", "delete")}
