"""Who may write the log: one Kafka principal per component, with ACLs by topic and operation.

Every component authenticates as its own SCRAM user (``sy-<role>``, password in the stack's
secrets dir as ``kafka-<role>``) and the brokers' StandardAuthorizer lets it do only what its
role needs. The stack's own user (``switchyard``) is the super user: brokers between
themselves, the controllers, and the operator's tools (``stack``, ``topics``, ``replay``,
``bench``).

=========== =================================================== ===============================
role        writes (topics under the prefix)                     run by
=========== =================================================== ===============================
router      requests, snapshots, deadletter; admin (the config   ``switchyard router``
            it was started with, ``RouterConfigChanged``)
worker      kv, workers, requests, deadletter                    ``switchyard worker``
planner     planner, snapshots, deadletter; its load view's      ``switchyard planner run``
            changelog topics (``load-view.*``: created, written)
admin       admin, deadletter                                    ``switchyard admin serve|audit``
processor   snapshots, deadletter                                ``switchyard metrics run``
=========== =================================================== ===============================

Each role reads only the streams it folds (:attr:`Role.reads`) and describes the cluster; its
bulk readers (``KafkaLogReader``: restores, start-up scans) authenticate as it too:

=========== =================================================== ===============================
role        reads                                                for
=========== =================================================== ===============================
router      kv, workers, requests, admin, snapshots             its view, the orphan scan, its
                                                                config and keys, its restore
worker      kv, workers                                         its own history, its peers
planner     requests, workers, admin, snapshots; ``load-view.*`` its load view, pins, its restore
admin       every topic of the prefix                           the audit, traces, replay jobs,
                                                                the live view: the operator's
                                                                read surface (docs/security.md)
processor   every topic of the prefix                           a metric of every stream, dead
                                                                letters and lag included
=========== =================================================== ===============================
 Consumer groups are owned like topics: a role joins, commits and deletes only the
groups under its own prefixes (:attr:`Role.groups`, after ``<prefix>.``):

=========== ======================================== ==========================================
role        its groups                               which are
=========== ======================================== ==========================================
router      ``router.``                              its view's tail, its followers (assign-only)
worker      ``worker.``                              the peer directory's reader
planner     ``load-view.``, ``planner.``             its load view's group, its follower
admin       ``admin.``                               the audit's reader
processor   ``metrics.``, ``processor.``;            its own group; the others' lag and members
            describes every group of the prefix      (``switchyard_consumer_group_*``)
=========== ======================================== ==========================================

So a stolen processor credential cannot join another role's group (issue 36): the broker
answers GROUP_AUTHORIZATION_FAILED. The router's view is in no group at all (it assigns every
partition itself: ``control_plane/streaming.py`` ``TailProcessor``), so no member, of any role,
can be handed its partitions. A member of the *same* role in the planner's or the metrics'
group is caught by that view itself (an assignment that is not every partition is a foreign
member; the view moves to a fresh group). Consumers that only ``assign()`` get a group id under
their role's prefix too (:func:`group_id`): with a ``group.id`` librdkafka looks the group's
coordinator up even when it never joins.

Nothing else: a worker cannot write
``admin`` or ``planner``, a router cannot register a worker or scale a pool, no component can create, delete or
reconfigure a catalog topic. Writes a worker makes to ``requests`` are the handoff facts
(``PrefillCompleted``, ``KvTransfer*``); who may write *which key* of a shared topic is not
something Kafka ACLs express: event signatures by owner do that (schemas/signing.py).

:func:`role_bindings` is pure (the ACLs of one topic prefix); :func:`apply_principals` upserts
the users' credentials and creates the ACLs, idempotently, as the super user.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from common.log.catalog import Catalog
from common.roles import OPERATOR_GROUPS, ROLES, SUPER_USER, Role, group_id, role, role_of_user
from common.settings import stack_secret

__all__ = ["OPERATOR_GROUPS", "ROLES", "SUPER_USER", "Grant", "Role", "apply_principals", "group_id", "role",
           "role_bindings", "role_of_user"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Grant:
    """One ACL, allowed to ``User:<user>`` from any host: (resource, pattern, name, operation)."""

    user: str
    resource: str  # topic | group | cluster
    pattern: str  # literal | prefixed
    name: str
    operation: str  # read | write | describe | create | delete | all


def role_bindings(prefix: str, roles: dict[str, Role] = ROLES) -> list[Grant]:
    """Every ACL of the roles for the topics under ``prefix`` (pure)."""
    catalog = Catalog(prefix)
    out: list[Grant] = []
    for r in roles.values():
        if r.reads is None:
            out.append(Grant(r.user, "topic", "prefixed", f"{prefix}.", "read"))
        for stream in r.reads or ():
            out.append(Grant(r.user, "topic", "literal", catalog.topic(stream), "read"))
        for stream in r.writes:
            out.append(Grant(r.user, "topic", "literal", catalog.topic(stream), "write"))
        for own in r.owns:
            out.append(Grant(r.user, "topic", "prefixed", f"{prefix}.{own}", "all"))
        for g in r.groups:
            # READ: join, sync, heartbeat, commit and fetch offsets (it implies DESCRIBE);
            # DELETE: a view drops the empty groups of its earlier incarnations.
            out.append(Grant(r.user, "group", "prefixed", f"{prefix}.{g}", "read"))
            out.append(Grant(r.user, "group", "prefixed", f"{prefix}.{g}", "delete"))
        if r.describes_groups:
            out.append(Grant(r.user, "group", "prefixed", f"{prefix}.", "describe"))
        out.append(Grant(r.user, "cluster", "literal", "kafka-cluster", "describe"))
    return out


#: What earlier versions granted and a stack upgraded in place must lose: every role ``ALL`` on
#: every consumer group (``*``), which let any credential join any view's group.
STALE_GRANTS: tuple[tuple[str, str, str, str], ...] = (("group", "literal", "*", "all"),)


#: Group prefixes (after ``<prefix>.``) a role was granted and no longer uses, by role: the
#: router's view left its Faust group (``router-view.``) for a tail it assigns itself.
RETIRED_GROUPS: dict[str, tuple[str, ...]] = {"router": ("router-view.",)}


def stale_grants(prefix: str, roles: dict[str, Role] = ROLES) -> list[Grant]:
    """Grants of earlier versions a stack upgraded in place must lose (pure): :data:`STALE_GRANTS`,
    the read of every topic of the prefix a role that reads only its streams once had, and the
    groups of :data:`RETIRED_GROUPS`."""
    out = [Grant(r.user, *g) for r in roles.values() for g in STALE_GRANTS]
    out += [Grant(r.user, "topic", "prefixed", f"{prefix}.", "read") for r in roles.values() if r.reads is not None]
    out += [Grant(roles[name].user, "group", "prefixed", f"{prefix}.{g}", op)
            for name, gs in RETIRED_GROUPS.items() if name in roles for g in gs for op in ("read", "delete")]
    return out


def _acl_binding(g: Grant, as_filter: bool = False):
    from confluent_kafka.admin import (
        AclBinding,
        AclBindingFilter,
        AclOperation,
        AclPermissionType,
        ResourcePatternType,
        ResourceType,
    )

    return (AclBindingFilter if as_filter else AclBinding)(
        {"topic": ResourceType.TOPIC, "group": ResourceType.GROUP, "cluster": ResourceType.BROKER}[g.resource],
        g.name,
        {"literal": ResourcePatternType.LITERAL, "prefixed": ResourcePatternType.PREFIXED}[g.pattern],
        f"User:{g.user}", "*",
        {"read": AclOperation.READ, "write": AclOperation.WRITE, "describe": AclOperation.DESCRIBE,
         "create": AclOperation.CREATE, "delete": AclOperation.DELETE, "all": AclOperation.ALL}[g.operation],
        AclPermissionType.ALLOW,
    )


_credentials_set: set[tuple[str, str]] = set()


def apply_principals(admin, prefix: str, secrets_dir: Path, bootstrap: str, timeout: float = 30.0) -> int:
    """Create the ACLs of ``prefix`` and upsert every role's SCRAM credential (from the stack's
    secrets; once per process and cluster), through an ``AdminClient`` of the super user.
    Returns the ACLs created or kept; 0 when the cluster has no authorizer (logged)."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import ScramCredentialInfo, ScramMechanism, UserScramCredentialUpsertion

    bindings = [_acl_binding(g) for g in role_bindings(prefix)]
    stale = [_acl_binding(g, as_filter=True) for g in stale_grants(prefix)]
    try:
        for fut in admin.create_acls(bindings, request_timeout=timeout).values():
            fut.result()
        for fut in admin.delete_acls(stale, request_timeout=timeout).values():
            for gone in fut.result():
                log.warning("removed a stale ACL: %s", gone)
    except KafkaException as e:
        if "SECURITY_DISABLED" in str(e) or "No Authorizer" in str(e):
            log.warning("the cluster has no authorizer: components are not confined to their topics (%s)", e)
            return 0
        raise
    done = (bootstrap, str(secrets_dir))
    if done in _credentials_set:
        return len(bindings)
    info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_256, 8192)
    upserts = [UserScramCredentialUpsertion(r.user, info, stack_secret(secrets_dir, r.secret_name).encode())
               for r in ROLES.values()]
    for fut in admin.alter_user_scram_credentials(upserts, request_timeout=timeout).values():
        fut.result()
    _credentials_set.add(done)
    return len(bindings)
