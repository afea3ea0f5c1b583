from __future__ import annotations

import pytest

from kernel.log.catalog import Catalog
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
