from __future__ import annotations

import pytest

from common.log.catalog import Catalog
from schemas.events import ALL_EVENT_TYPES


def test_every_event_stream_has_a_topic() -> None:
    c = Catalog("sy")
    for cls in ALL_EVENT_TYPES:
        assert c.topic(cls.STREAM).startswith("sy.")


def test_stream_of_inverts_topic_and_refuses_foreign_prefixes() -> None:
    c = Catalog("t123")
    assert c.stream_of(c.topic("kv")) == "kv"
    with pytest.raises(KeyError):
        c.stream_of("other.kv")


def test_snapshot_topic_is_compacted_and_event_topics_are_not() -> None:
    c = Catalog()
    assert c.spec("snapshots").configs()["cleanup.policy"] == "compact"
    assert c.spec("kv").configs()["cleanup.policy"] == "delete"


@pytest.mark.parametrize("brokers, rf, min_isr", [(1, 1, 1), (2, 2, 1), (3, 3, 2), (5, 3, 2)])
def test_replication_follows_the_cluster_size(brokers: int, rf: int, min_isr: int) -> None:
    """min(3, brokers) replicas; 2 in sync only with 3, so that one loss keeps writes going."""
    from common.log.catalog import replication_for

    assert replication_for(brokers) == (rf, min_isr)
    assert Catalog().spec("kv").configs(rf)["min.insync.replicas"] == str(min_isr)


def test_the_bootstrap_lists_every_broker_of_a_local_cluster() -> None:
    """Broker i on kafka_port + 2i: 28092, 28094, 28096; one broker is the old single address."""
    from common.stack_settings import StackSettings
    from common.settings import BusSettings

    env = {"SWITCHYARD_KAFKA_PORT": "28092", "SWITCHYARD_KAFKA_BROKERS": "3"}
    want = "127.0.0.1:28092,127.0.0.1:28094,127.0.0.1:28096"
    assert StackSettings.from_env(env).kafka_bootstrap == want
    assert BusSettings.from_env(env).bootstrap == want
    assert BusSettings.from_env({"SWITCHYARD_KAFKA_PORT": "28092"}).bootstrap == "127.0.0.1:28092"
    assert StackSettings.from_env({}).kafka_bootstrap == "127.0.0.1:19092"
    with pytest.raises(ValueError, match="kafka_brokers"):
        StackSettings(kafka_brokers=0)
