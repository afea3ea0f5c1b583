"""The Kafka roles: one SCRAM principal per component (``sy-<role>``, its password the stack
secret ``kafka-<role>``), the streams each may write and the consumer groups it owns.

Pure data, below both the bus settings (which authenticate as a role) and the ACLs built from
it (common/log/principals.py, where the table is explained).
"""

from __future__ import annotations

from dataclasses import dataclass

#: The stack's super user (brokers, controllers, operator tools).
SUPER_USER = "switchyard"


@dataclass(frozen=True)
class Role:
    name: str
    #: Streams (catalog names) the role may write.
    writes: tuple[str, ...]
    #: Topic-name prefixes, after ``<prefix>.``, the role may create and use (Faust changelogs).
    owns: tuple[str, ...] = ()
    #: Consumer-group prefixes, after ``<prefix>.``, the role may join, commit and delete; the
    #: last one is where its assign-only consumers' group ids go (:func:`group_id`).
    groups: tuple[str, ...] = ()
    #: True: the role may describe every group of the prefix (their lag, their members).
    describes_groups: bool = False
    #: Streams (catalog names) the role may read; None: every topic of the prefix.
    reads: tuple[str, ...] | None = None

    @property
    def user(self) -> str:
        return f"sy-{self.name}"

    @property
    def secret_name(self) -> str:
        return f"kafka-{self.name}"


ROLES: dict[str, Role] = {r.name: r for r in (
    # admin: a router started with its own config (a file, --mode) records it as the next
    # RouterConfigChanged version, which replay reads back; ACLs cannot narrow that to one type.
    # router.: the group ids its assign-only consumers name (its view's tail, its followers,
    # its readers); it joins no group.
    Role("router", ("requests", "snapshots", "deadletter", "admin"), groups=("router.",),
         reads=("kv", "workers", "requests", "admin", "snapshots")),
    Role("worker", ("kv", "workers", "requests", "deadletter"), groups=("worker.",), reads=("kv", "workers")),
    Role("planner", ("planner", "snapshots", "deadletter"), owns=("load-view.",), groups=("load-view.", "planner."),
         reads=("requests", "workers", "admin", "snapshots")),
    # The admin API and the processor read every stream: the audit, traces and replay jobs are
    # the operator's read surface; the metrics count every stream, dead letters included.
    Role("admin", ("admin", "deadletter"), groups=("admin.",)),
    Role("processor", ("snapshots", "deadletter"), groups=("metrics.", "processor."), describes_groups=True),
)}

#: Where the super user's (the operator's tools') assign-only consumers put their group ids.
OPERATOR_GROUPS = "ops."


def role_of_user(user: str) -> Role | None:
    """The role a SCRAM user is (None: the super user or an operator's own user)."""
    return next((r for r in ROLES.values() if r.user == user), None)


def group_id(topic_prefix: str, user: str, name: str) -> str:
    """A group id under ``user``'s role's own group prefix: ``<prefix>.<role's last group
    prefix><name>`` (``<prefix>.ops.<name>`` for any other user)."""
    r = role_of_user(user)
    return f"{topic_prefix}.{r.groups[-1] if r is not None and r.groups else OPERATOR_GROUPS}{name}"


def role(name: str) -> Role:
    try:
        return ROLES[name]
    except KeyError:
        raise ValueError(f"unknown Kafka role {name!r}; known: {sorted(ROLES)}") from None
