"""Faust app folding every event stream into :class:`MetricsProjection`, served on ``/metrics``.

Like the planner's load view (:mod:`control_plane.planner.stream`): one consumer group
per processor *incarnation* (``<prefix>.metrics.<processor id>.<start ms>``), whose offsets are
seeded before the app joins from the positions stored in the newest snapshot of the projection
(or the start of the log when there is none). So a restarted processor resumes where its last
checkpoint stopped and its counters continue instead of resetting: the metrics are a fold of
the whole log, checkpointed, not a tally since the process started.

The fold is pure (:mod:`control_plane.metrics.projection`); this module only does I/O:

* the agent decodes each record (dead-letter records are read by their headers) and applies it
  on the event loop;
* a timer probes the broker in a thread (high watermarks of every partition, every consumer
  group under this topic prefix with its members and committed offsets) and swaps in the new
  :class:`BrokerState`;
* a timer writes the projection to the compacted ``snapshots`` topic;
* an aiohttp server on the same loop answers ``/metrics`` (prometheus_client text format, a
  registry of its own) and ``/health``: a scrape sees one consistent state of the fold.

Undecodable records are not dead-lettered here: this processor only observes, the consumers
that act on a stream dead-letter what they cannot decode, and their dead letters are what it
counts. What it does dead-letter is a record its own fold raised on (reason
``apply_failed:<error>``, at once: the fold is pure, a retry would fail the same way); the
position is already past the record, so the stream goes on. A record of the dead-letter topic
itself is never dead-lettered again (that would loop).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from control_plane.metrics.catalog import CONSUMED_STREAMS
from control_plane.metrics.exposition import build_registry, write_targets
from control_plane.metrics.families import BrokerState, Family, lag, processor_families
from control_plane.metrics.projection import MetricsProjection, ProjectionConfig
from common.stack_settings import StackSettings
from control_plane.streaming import FoldProcessor
from common.log.catalog import Catalog
from common.log.fold import apply_failed_reason
from common.log.kafka import H_DLQ_REASON, H_DLQ_SOURCE
from common.log.snapshots import SnapshotStore
from common.settings import BusSettings
from schemas import SchemaError

log = logging.getLogger(__name__)
_rdkafka_log = logging.getLogger("switchyard.rdkafka")


@dataclass(frozen=True)
class MetricsSettings:
    """One metrics processor; built once at start-up."""

    #: Stable id: names the consumer groups and the snapshot key. Two processors with the same id
    #: share checkpoints.
    processor_id: str = field(default_factory=lambda: f"metrics-{socket.gethostname()}")
    #: Address of the ``/metrics`` and ``/health`` HTTP server; port 0 picks a free one.
    host: str = "127.0.0.1"
    port: int = 59100
    #: How the fold interprets events (the prefix index's hash algorithm and block size: the
    #: router's ``--hash-algo`` and ``--block-size``; the SLOs of pools no PoolUpdated has set).
    #: The projection's own config, not a copy of its fields, so the two cannot drift apart.
    projection: ProjectionConfig = field(default_factory=ProjectionConfig)
    #: Seconds between checkpoints of the projection to the snapshots topic.
    snapshot_every_s: float = 10.0
    #: Seconds between broker probes (watermarks, consumer groups and their offsets).
    probe_every_s: float = 5.0
    #: Seconds between commits of the processor's own group offsets (only its lag shows them;
    #: restarts resume from snapshots).
    commit_every_s: float = 2.0
    #: Start from the newest snapshot (else fold the whole log from the start).
    restore: bool = True
    #: Faust's data directory (per incarnation, removed at stop).
    data_dir: Path = field(default_factory=lambda: StackSettings.from_env().state_dir / "metrics")
    #: When set, a Prometheus file_sd target for this processor is written here at start and
    #: removed at stop (see control_plane.metrics.exposition.write_targets).
    targets_dir: Path | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port {self.port} is not a TCP port")
        for name in ("snapshot_every_s", "probe_every_s", "commit_every_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")

    @property
    def snapshot_key(self) -> str:
        return f"metrics:{self.processor_id}:{self.projection.hash_algo}:{self.projection.block_size}"


# -- the broker probe ---------------------------------------------------------------------------


#: Run by :meth:`BrokerProbe._members` in a child process: {"conf", "groups", "timeout"} on
#: stdin, {group: members} on stdout.
_DESCRIBE_GROUPS = """
import json, sys
from confluent_kafka.admin import AdminClient
a = json.load(sys.stdin)
admin = AdminClient(a["conf"])
out = {}
for gid, fut in admin.describe_consumer_groups(a["groups"], request_timeout=a["timeout"]).items():
    try:
        out[gid] = len(fut.result().members)
    except Exception:
        pass
print(json.dumps(out))
"""


class BrokerProbe:
    """Long-lived admin client answering: where does each partition end, which consumer groups
    exist under this prefix, how many members do they have and what did they commit."""

    def __init__(self, bus: BusSettings, catalog: Catalog, streams=CONSUMED_STREAMS, timeout: float = 10.0) -> None:
        self.catalog = catalog
        self.topics = [catalog.topic(s) for s in streams]
        self.group_prefix = f"{catalog.prefix}."
        self.timeout = timeout
        self._conf = bus.client_conf()
        self._admin = AdminClient({**self._conf, "logger": _rdkafka_log})
        self._offset_readers: dict[str, Consumer] = {}

    def end_offsets(self) -> dict[tuple[str, int], int]:
        md = self._admin.list_topics(timeout=self.timeout)
        request = {}
        for t in self.topics:
            tmd = md.topics.get(t)
            if tmd is None or tmd.error is not None:
                raise RuntimeError(f"topic {t} does not exist; run `switchyard topics apply`")
            for p in tmd.partitions:
                request[TopicPartition(t, p)] = OffsetSpec.latest()
        out = {}
        for tp, fut in self._admin.list_offsets(request, request_timeout=self.timeout).items():
            out[(self.catalog.stream_of(tp.topic), tp.partition)] = fut.result().offset
        return out

    def probe(self) -> BrokerState:
        ends = self.end_offsets()
        listed = self._admin.list_consumer_groups(request_timeout=self.timeout).result()
        groups = sorted(g.group_id for g in listed.valid if g.group_id.startswith(self.group_prefix))
        members: dict[str, int] = {}
        offsets: dict[str, dict[tuple[str, int], int]] = {}
        if groups:
            members = self._members(groups)
            tps = [TopicPartition(self.catalog.topic(stream), p) for stream, p in ends]
            for gid in groups:
                try:
                    res = self._offset_reader(gid).committed(tps, timeout=self.timeout)
                except KafkaException as e:
                    log.debug("offsets of %s: %s", gid, e)
                    continue
                offsets[gid] = {(self.catalog.stream_of(tp.topic), tp.partition): tp.offset
                                for tp in res if tp.error is None and tp.offset >= 0}
        for gid in set(self._offset_readers) - set(groups):  # the group is gone
            self._offset_readers.pop(gid).close()
        return BrokerState(end_offsets=ends, group_members=members, group_offsets=offsets)

    def _members(self, groups: list[str]) -> dict[str, int]:
        """Members of each group, asked by a short-lived child process. Not in this process:
        when a connection drops under a coordinator request (a broker killed or stopped),
        librdkafka's ``describe_consumer_groups`` frees the request's handle twice and aborts
        (``rd_kafka_enq_once_del_source_return: Assertion `eonce->refcnt > 0' failed``;
        librdkafka issues #4605, #5397), seen here under `switchyard chaos`; aiokafka's admin
        client cannot decode the answer for Faust's groups (``Buffer underrun decoding
        string``). A child that aborts costs one probe's member counts, nothing else. The
        client settings (a password among them) go through its stdin, never its command line."""
        import subprocess
        import sys

        try:
            r = subprocess.run([sys.executable, "-c", _DESCRIBE_GROUPS], input=json.dumps(
                {"conf": self._conf, "groups": groups, "timeout": self.timeout}), capture_output=True, text=True,
                timeout=self.timeout * 3)
        except subprocess.TimeoutExpired:
            log.warning("describing consumer groups timed out: members unknown until the next probe")
            return {}
        if r.returncode != 0:
            log.warning("describing consumer groups failed (exit %s): %s", r.returncode, r.stderr.strip()[-300:])
            return {}
        return {str(k): int(v) for k, v in json.loads(r.stdout).items()}

    def _offset_reader(self, group_id: str) -> Consumer:
        """A consumer of ``group_id`` that never subscribes (so it never joins the group) and
        only reads what the group committed. Not ``AdminClient.list_consumer_group_offsets``:
        when the group's coordinator moves (a broker fault, a loaded broker), librdkafka's admin
        path answers NOT_COORDINATOR through a consumer-group handle an admin client does not
        have, and the process dies of SIGSEGV (librdkafka issue #5040, open; seen here in 2.16:
        ``rd_kafka_cgrp_op + 65``, the metrics processor killed under `switchyard chaos`)."""
        c = self._offset_readers.get(group_id)
        if c is None:
            c = self._offset_readers[group_id] = Consumer({
                **self._conf, "group.id": group_id, "enable.auto.commit": False, "logger": _rdkafka_log})
        return c

    def close(self) -> None:
        for c in self._offset_readers.values():
            c.close()
        self._offset_readers.clear()


# -- the processor ------------------------------------------------------------------------------


def _header(headers, name: str) -> str:
    if not headers:
        return ""
    items = headers.items() if isinstance(headers, dict) else headers
    for k, v in items:
        if k == name:
            return v.decode(errors="replace") if isinstance(v, (bytes, bytearray)) else str(v)
    return ""


class MetricsProcessor(FoldProcessor):
    """Owns the Faust app and the HTTP server; ``projection`` is mutated only by the agent."""

    KIND = "metrics"
    STREAMS = CONSUMED_STREAMS

    def __init__(self, bus: BusSettings, settings: MetricsSettings, projection: MetricsProjection) -> None:
        super().__init__(bus, settings.processor_id, snapshot_every_s=settings.snapshot_every_s,
                         datadir=settings.data_dir, commit_every_s=settings.commit_every_s)
        self.settings = settings
        self.projection = projection
        self.probe = BrokerProbe(bus, self.catalog)
        self.broker = BrokerState()
        self.registry = build_registry(self.families)
        self.port = settings.port
        self.fold_errors = 0
        self._target_file: Path | None = None
        self._runner = None

    # -- lifecycle ----------------------------------------------------------------------------

    @staticmethod
    def load_projection(bus: BusSettings, settings: MetricsSettings) -> MetricsProjection:
        """The newest checkpoint of this processor's projection, or an empty one."""
        config = settings.projection
        if settings.restore:
            data = SnapshotStore(bus).load_latest(settings.snapshot_key)
            if data is not None:
                try:
                    p = MetricsProjection.restore(data, config)
                    log.info("restored metrics projection: %d events applied", p.applied)
                    return p
                except ValueError as e:
                    log.warning("ignoring metrics snapshot %s (%s): folding the log from the start",
                                settings.snapshot_key, e)
        return MetricsProjection(config)

    @property
    def snapshot_key(self) -> str:
        return self.settings.snapshot_key

    def positions(self) -> dict[tuple[str, int], int]:
        """The projection keeps positions per stream; the processor works in topics."""
        return {(self.catalog.topic(st), p): o for (st, p), o in self.projection.positions.items()}

    def applied(self) -> int:
        return self.projection.applied

    def snapshot_bytes(self) -> bytes:
        return self.projection.snapshot()

    async def log_end(self) -> dict[tuple[str, int], int]:
        self.broker = await asyncio.to_thread(self.probe.probe)
        return {(self.catalog.topic(st), p): o for (st, p), o in self.broker.end_offsets.items()}

    def extend(self, app, topic) -> None:
        @app.timer(interval=self.settings.probe_every_s)
        async def probe() -> None:
            await self.refresh_broker()

    def fold_message(self, m) -> None:
        try:
            self.on_record(m.topic, m.partition, m.offset, m.value, m.headers, int((m.timestamp or 0) * 1000))
        except Exception as e:  # a bug in the fold must not stop the stream: count, dead-letter, go on
            self.fold_errors += 1
            log.exception("fold of %s:%d:%d failed", m.topic, m.partition, m.offset)
            if m.topic != self.catalog.deadletter:
                self.dead_letter(m.value, m.key, apply_failed_reason(e), f"{type(e).__name__}: {e}",
                                 f"{m.topic}:{m.partition}:{m.offset}")

    async def start(self) -> None:
        await super().start()
        await self._serve_http()
        if self.settings.targets_dir is not None:
            self._target_file = write_targets(
                self.settings.targets_dir, f"metrics-{self.settings.processor_id}",
                [f"{self.settings.host}:{self.port}"], {"processor_id": self.settings.processor_id})

    async def stop(self) -> None:
        if self._target_file is not None:
            self._target_file.unlink(missing_ok=True)
        if self._runner is not None:
            await self._runner.cleanup()
        await super().stop()
        self.probe.close()

    async def _serve_http(self) -> None:
        from aiohttp import web

        async def metrics(_request):
            return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

        async def health(_request):
            body = self.health()
            return web.json_response(body, status=200 if body["state"] != "LOADING" else 503)

        web_app = web.Application()
        web_app.router.add_get("/metrics", metrics)
        web_app.router.add_get("/health", health)
        self._runner = web.AppRunner(web_app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.settings.host, self.settings.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        log.info("metrics processor %s serving /metrics on %s:%d (group %s)", self.settings.processor_id,
                 self.settings.host, self.port, self.group)

    # -- folding ------------------------------------------------------------------------------

    def on_record(self, topic: str, partition: int, offset: int, value: bytes | None, headers, ts_ms: int) -> str:
        stream = self.catalog.stream_of(topic)
        if stream == "deadletter":
            source = _header(headers, H_DLQ_SOURCE).split(":", 1)[0]
            try:
                source = self.catalog.stream_of(source)
            except KeyError:
                pass  # a topic outside this prefix: keep its name
            outcome = self.projection.deadletter(partition, offset, _header(headers, H_DLQ_REASON), source, ts_ms)
        else:
            try:
                if value is None:
                    raise SchemaError("record has no value")
                env = self.codec.decode(value)
            except SchemaError:
                outcome = self.projection.undecodable(stream, partition, offset, ts_ms)
            else:
                outcome = self.projection.apply(env, stream, partition, offset, ts_ms)
        return outcome

    # -- timers -------------------------------------------------------------------------------

    async def refresh_broker(self) -> None:
        try:
            self.broker = await asyncio.to_thread(self.probe.probe)
        except (KafkaException, RuntimeError) as e:
            log.warning("broker probe failed: %s", e)

    # -- reading ------------------------------------------------------------------------------

    def families(self) -> list[Family]:
        return self.projection.families() + processor_families(self.broker, self.projection.positions,
                                                               self.fold_errors)

    def health(self) -> dict:
        behind = lag(self.projection.positions, self.broker.end_offsets)
        stopped = self.stopped_reason()
        return {"state": "LOADING" if not self.caught_up else "DEGRADED" if stopped else "OK",
                "reasons": [stopped] if stopped else [], "processor_id": self.settings.processor_id,
                "group": self.group, "applied": self.projection.applied, "lag_records": sum(behind.values()),
                "in_flight_requests": self.projection.in_flight, "fold_errors": self.fold_errors}


def run_metrics(settings: MetricsSettings, bus: BusSettings) -> int:
    """Run until SIGTERM/SIGINT; checkpoint on the way out. Prints ``READY port=<n>`` once
    ``/metrics`` answers."""

    async def main() -> None:
        projection = await asyncio.to_thread(MetricsProcessor.load_projection, bus, settings)
        proc = MetricsProcessor(bus, settings, projection)
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        await proc.start()
        print(f"READY port={proc.port}", flush=True)
        try:
            await stopping.wait()
        finally:
            try:
                await proc.checkpoint()
            except Exception as e:  # the broker may be gone; the next start replays a longer tail
                log.warning("final checkpoint failed: %s", e)
            await proc.stop()

    asyncio.run(main())
    return 0
