"""Topic metadata asked of the broker with the patience a young topic or a loaded broker needs.

A topic created a moment ago may not be in the broker's metadata yet, and a consumer's own
metadata may lag the broker's listing; a loaded broker may drop a metadata connection. Both
were seen in CI and are asked again here, within a deadline; past it the error is raised.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition


def topic_partitions(client: Consumer | Producer, topic: str, *, timeout: float = 10.0,
                     unknown_for: float | None = None) -> list[int]:
    """The topic's partitions, sorted. Transport errors are retried for ``timeout``; a topic the
    broker does not list for ``unknown_for`` (default: ``timeout``), after which it is a
    :class:`RuntimeError` naming ``switchyard topics apply``."""

    def lookup(wait: float) -> tuple[list[int], str | None]:
        t = client.list_topics(topic, timeout=wait).topics.get(topic)
        if t is not None and t.error is None and t.partitions:
            return sorted(t.partitions), None
        return [], str(t.error) if t is not None else "not listed"

    return partitions_within(lookup, topic, timeout=timeout, unknown_for=unknown_for, transient=KafkaException)


def partitions_within(lookup: Callable[[float], tuple[list[int], str | None]], topic: str, *,
                      timeout: float = 10.0, unknown_for: float | None = None,
                      transient: type[Exception] | tuple[type[Exception], ...] = KafkaException) -> list[int]:
    """:func:`topic_partitions` over any client: ``lookup(wait)`` answers the sorted partitions,
    or none and why the topic is not listed, or raises ``transient`` (asked again)."""
    unknown_for = timeout if unknown_for is None else unknown_for
    t0 = time.monotonic()
    while True:
        waited = time.monotonic() - t0
        try:
            partitions, why = lookup(max(0.5, timeout - waited))
        except transient as e:
            if waited >= timeout:
                raise RuntimeError(f"no metadata for topic {topic} within {timeout:g}s: {e}") from e
        else:
            if partitions:
                return partitions
            if waited >= unknown_for:
                raise RuntimeError(f"topic {topic} does not exist ({why}); run `switchyard topics apply`")
        time.sleep(0.1)


def watermarks(c: Consumer, topic: str, partition: int, timeout: float = 10.0) -> tuple[int, int]:
    """(low, high) of a partition; ``_UNKNOWN_PARTITION`` (the consumer's metadata behind the
    broker's listing) is asked again until ``timeout``."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    while True:
        try:
            return c.get_watermark_offsets(TopicPartition(topic, partition), timeout=timeout)
        except KafkaException as e:
            if e.args[0].code() != KafkaError._UNKNOWN_PARTITION or time.monotonic() + delay > deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 1.0)
