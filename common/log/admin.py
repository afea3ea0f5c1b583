"""Create or update the catalog's topics through Kafka's admin API, idempotently."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from confluent_kafka import KafkaException, TopicPartition
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewPartitions,
    NewTopic,
    OffsetSpec,
)

from common.log.catalog import Catalog, replication_for
from common.log.principals import apply_principals
from common.settings import BusSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TopicChange:
    topic: str
    action: str  # "created" | "updated" | "unchanged" | "partitions_increased" | "warning"
    detail: str = ""


def apply_topics(settings: BusSettings, catalog: Catalog | None = None, timeout: float = 30, *,
                 replication_factor: int | None = None) -> list[TopicChange]:
    """Make the broker match the catalog. Safe to run any number of times.

    Never deletes a topic and never lowers a partition count (that would re-key every worker's
    history): a topic with more partitions than the catalog says is reported, not changed.

    New topics get ``replication_factor`` replicas, by default min(3, brokers in the metadata)
    with ``min.insync.replicas`` 2 when that is 3 (:func:`replication_for`): one broker keeps
    today's single replica, a three-broker cluster survives the loss of any one. Run it with
    every broker up: a broker that is down is not in the metadata. An existing topic with fewer
    replicas is reported, not reassigned.

    Returns only once every partition it created is led, i.e. answers a ListOffsets (see
    :func:`wait_led`). It also gives every component role its credential and its ACLs on these
    topics (:func:`common.log.principals.apply_principals`): run it as the stack's super user.
    """
    catalog = catalog or Catalog(settings.topic_prefix)
    admin = AdminClient({**settings.client_conf(),
                         "logger": logging.getLogger("switchyard.rdkafka")})
    md = admin.list_topics(timeout=timeout)
    rf = replication_factor or replication_for(len(md.brokers))[0]
    wanted = catalog.all_topics()
    changes: list[TopicChange] = []

    missing = [NewTopic(t, spec.partitions, rf, config=spec.configs(rf))
               for t, spec in wanted.items() if t not in md.topics]
    new_partitions: list[TopicPartition] = []
    if missing:
        for t, fut in admin.create_topics(missing, operation_timeout=timeout).items():
            try:
                fut.result(timeout)
                changes.append(TopicChange(t, "created", f"{wanted[t].partitions} partitions, {rf} replicas"))
                new_partitions += [TopicPartition(t, p) for p in range(wanted[t].partitions)]
            except KafkaException as e:
                if "TOPIC_ALREADY_EXISTS" in str(e):  # a concurrent apply won the race
                    changes.append(TopicChange(t, "unchanged", "created concurrently"))
                else:
                    raise

    existing = {t: spec for t, spec in wanted.items() if t in md.topics}
    grow = []
    for t, spec in existing.items():
        have = len(md.topics[t].partitions)
        replicas = _replicas(md.topics[t], rf)
        if replicas < rf:
            changes.append(TopicChange(t, "warning", f"has {replicas} replicas, the cluster wants {rf}; left alone "
                                       "(reassign with kafka-reassign-partitions)"))
        if have < spec.partitions:
            grow.append(NewPartitions(t, spec.partitions))
        elif have > spec.partitions:
            changes.append(TopicChange(t, "warning", f"has {have} partitions, catalog says {spec.partitions}; left alone"))
    if grow:
        for t, fut in admin.create_partitions(grow, operation_timeout=timeout).items():
            fut.result(timeout)
            changes.append(TopicChange(t, "partitions_increased", f"to {wanted[t].partitions}"))
            new_partitions += [TopicPartition(t, p) for p in range(len(md.topics[t].partitions), wanted[t].partitions)]
    wait_led(admin, new_partitions, timeout)

    if existing:
        resources = [ConfigResource(ConfigResource.Type.TOPIC, t) for t in existing]
        current = {}
        for res, fut in admin.describe_configs(resources).items():
            current[res.name] = {k: v.value for k, v in fut.result(timeout).items()}
        to_alter = []
        for t, spec in existing.items():
            diff = {k: v for k, v in spec.configs(_replicas(md.topics[t], rf)).items() if current[t].get(k) != v}
            if diff:
                to_alter.append(ConfigResource(
                    ConfigResource.Type.TOPIC, t,
                    incremental_configs=[ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET)
                                         for k, v in diff.items()]))
                changes.append(TopicChange(t, "updated", ", ".join(f"{k}={v}" for k, v in diff.items())))
            elif not any(c.topic == t for c in changes):
                changes.append(TopicChange(t, "unchanged"))
        if to_alter:
            for _res, fut in admin.incremental_alter_configs(to_alter).items():
                fut.result(timeout)
    if settings.security_protocol.upper().startswith("SASL"):
        apply_principals(admin, catalog.prefix, settings.secrets_dir, settings.bootstrap, timeout)
    return changes


def replication_factor(settings: BusSettings, timeout: float = 10) -> int:
    """What :func:`apply_topics` gives a new topic: min(3, brokers in the metadata). For topics
    made elsewhere (a Faust table's changelog)."""
    admin = AdminClient({**settings.client_conf(), "logger": logging.getLogger("switchyard.rdkafka")})
    return replication_for(len(admin.list_topics(timeout=timeout).brokers))[0]


def _replicas(topic_md, default: int) -> int:
    """The fewest replicas any partition of the topic has (its configs follow that)."""
    return min((len(p.replicas) for p in topic_md.partitions.values()), default=default)


def wait_led(admin: AdminClient, partitions: list[TopicPartition], timeout: float = 30) -> None:
    """Wait until every partition answers a ListOffsets, i.e. its leader has taken it over.

    A topic is in the broker's metadata (so producers send to it) a moment before its leader
    serves it. A produce in that moment fails with NOT_LEADER_OR_FOLLOWER and is retried, but the
    idempotent producer's *next* batch can land first: the broker accepts any first sequence
    number from a producer it has no state for, and librdkafka then reports the earlier batch as
    "implicitly acked" (offset -1) although it was never written. Writes to a topic that
    ``apply_topics`` has returned from cannot hit that window.
    """
    deadline = time.monotonic() + timeout
    pending = list(partitions)
    while pending:
        # list_offsets finds leaders in the client's metadata cache, which knows nothing of a
        # topic created a moment ago: refresh it for the topics still waited for.
        for topic in {tp.topic for tp in pending}:
            admin.list_topics(topic, timeout=max(1.0, timeout / 10))
        futs = admin.list_offsets({tp: OffsetSpec.latest() for tp in pending}, request_timeout=max(1.0, timeout / 10))
        failed = []
        for tp, fut in futs.items():
            try:
                fut.result()
            except KafkaException as e:
                failed.append((tp, e))
        pending = [tp for tp, _ in failed]
        if pending:
            if time.monotonic() > deadline:
                tp, e = failed[0]
                raise KafkaException(f"{len(pending)} partitions have no leader after {timeout:.0f} s "
                                     f"(first: {tp.topic}:{tp.partition}: {e})")
            time.sleep(0.05)
