"""Where a decode worker finds a prefill peer's NIXL metadata.

First choice: the log. Every worker publishes its :class:`EndpointMetadata` in
``WorkerRegistered.transfer``; a background thread follows the ``workers`` topic (only records
whose ``sy-type`` header says WorkerRegistered or WorkerDeregistered are decoded) and keeps them
by agent name. Fallback, for a peer registered after we last polled: its side channel,
``GET http://<remote_host>:<remote_port>/kv/metadata`` (raw :meth:`EndpointMetadata.encode`
bytes, behind the peer's bearer, which the lookup derives from the cluster's worker secret). Either way the agent name must be the one the handoff names: a prefill worker that
restarted is a new agent and the old handoff's blocks are gone.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable

import httpx

from data_plane.transfer import EndpointMetadata, InvalidTransfer, PeerLost
from common.fleet import GONE, Change, Fleet
from common.log.catalog import Catalog
from common.log.principals import group_id
from common.settings import worker_token
from schemas import EventCodec, SchemaError

log = logging.getLogger(__name__)

_WANTED = {b"WorkerRegistered", b"WorkerDeregistered"}


class PeerDirectory:
    """``on_forget(agent_name)`` runs (in the follower thread) when an agent's worker
    deregistered or re-registered as a new incarnation, so the endpoint can drop the peer."""

    def __init__(self, on_forget: Callable[[str], None] | None = None, credential: str | None = None) -> None:
        self._on_forget = on_forget
        #: The cluster's worker secret: each peer's bearer derives from it (:meth:`headers`).
        self._secret = credential
        self._by_agent: dict[str, EndpointMetadata] = {}
        #: worker id -> its current agent name (to forget it on deregistration).
        self._agent_of: dict[str, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.from_log = 0
        self.from_side_channel = 0
        #: Records skipped: undecodable, bad transfer info, or a fold error. Not dead-lettered:
        #: this is a cache every worker rebuilds from the start of the topic (each start would
        #: dead-letter the same record again), a miss falls back to the side channel, and the
        #: consumers that act on the workers topic dead-letter what they cannot apply.
        self.skipped = 0

    def headers(self, worker_id: str) -> dict[str, str]:
        """What a call to peer ``worker_id`` carries: its bearer (common.settings.worker_token)."""
        return {"Authorization": f"Bearer {worker_token(self._secret, worker_id)}"} if self._secret else {}

    # -- queries (any thread) ------------------------------------------------------------------

    def known(self, agent_name: str) -> EndpointMetadata | None:
        with self._lock:
            return self._by_agent.get(agent_name)

    def lookup(self, agent_name: str, host: str | None, port: int | None,
               timeout_s: float) -> EndpointMetadata:
        """The agent's metadata, from the log if seen, else from its side channel. Raises
        :class:`PeerLost` when neither has it (the peer is gone or restarted)."""
        md = self.known(agent_name)
        if md is not None:
            self.from_log += 1
            return md
        if not host or not port:
            raise PeerLost(f"no metadata for {agent_name!r} in the log and no side channel given")
        try:
            # The agent name is "<worker id>:<epoch>" (data_plane/workers/wiring.py).
            r = httpx.get(f"http://{host}:{port}/kv/metadata", timeout=timeout_s,
                          headers=self.headers(agent_name.rpartition(":")[0]))
            r.raise_for_status()
            md = EndpointMetadata.decode(r.content)
        except (httpx.HTTPError, InvalidTransfer) as e:
            raise PeerLost(f"side channel {host}:{port} for {agent_name!r}: {type(e).__name__}: {e}") from e
        if md.agent_name != agent_name:
            raise PeerLost(f"{host}:{port} is now agent {md.agent_name!r}, the handoff names "
                           f"{agent_name!r} (the holder restarted; its blocks are gone)")
        self.from_side_channel += 1
        self._remember(md)
        return md

    # -- the log follower ----------------------------------------------------------------------

    def _remember(self, md: EndpointMetadata, worker_id: str | None = None) -> None:
        old = None
        with self._lock:
            self._by_agent[md.agent_name] = md
            if worker_id is not None:
                old = self._agent_of.get(worker_id)
                if old == md.agent_name:
                    old = None
                elif old is not None:
                    self._by_agent.pop(old, None)
                self._agent_of[worker_id] = md.agent_name
        if old is not None:
            self._forgotten(old)

    def apply(self, ch: Change) -> None:
        """Follow one lifecycle change of the fleet (common/fleet.py): an admitted registration's
        agent is remembered unless the log already says it is gone; a gone incarnation's agent is
        forgotten. Raises :class:`InvalidTransfer` for a registration's bad transfer info."""
        reg = ch.registration
        if ch.state == GONE:
            self._forget_worker(ch.worker_id, ch.after.registered)
        elif reg is not None and reg.transfer is not None:
            self._remember(EndpointMetadata.from_transfer_info(reg.transfer), reg.worker_id)

    def _forget_worker(self, worker_id: str, epoch: int) -> None:
        with self._lock:
            agent = self._agent_of.get(worker_id)
            if agent is None or agent != f"{worker_id}:{epoch}":
                return
            self._by_agent.pop(agent, None)
            del self._agent_of[worker_id]
        self._forgotten(agent)

    def _forgotten(self, agent: str) -> None:
        if self._on_forget is not None:
            try:
                self._on_forget(agent)
            except Exception:
                log.exception("dropping peer %s failed", agent)

    def follow(self, bus) -> None:
        """Start following the workers topic (from its beginning) in a daemon thread."""
        self._thread = threading.Thread(target=self._run, args=(bus,), name="peer-directory",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self, bus) -> None:
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition


        fleet = Fleet()
        topic = Catalog(bus.topic_prefix).topic("workers")
        codec = EventCodec(verifier=bus.verifier())  # a forged registration is skipped
        # Under the worker role's own group prefix (common/log/principals.py).
        c = Consumer({**bus.client_conf(), "group.id": group_id(bus.topic_prefix, bus.username, f"peers.{uuid.uuid4().hex}"),
                      "enable.auto.commit": False, "fetch.wait.max.ms": 500,
                      "logger": logging.getLogger("switchyard.rdkafka")})
        try:
            md = c.list_topics(topic, timeout=10).topics.get(topic)
            if md is None or not md.partitions:
                log.error("peer directory: topic %s missing; only the side channel will work", topic)
                return
            c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in md.partitions])
            while not self._stop.is_set():
                for m in c.consume(500, 0.2):
                    if m.error() or m.value() is None:
                        continue
                    kind = dict(m.headers() or ()).get("sy-type")
                    if kind not in _WANTED:
                        continue
                    try:
                        # common/fleet.py: a copy of a registration, or one of an
                        # incarnation the log says is gone, never brings its agent back.
                        ch = fleet.fold(codec.decode(m.value()))
                        if ch is not None:
                            self.apply(ch)
                    except Exception as e:  # one bad record never stops the directory
                        self.skipped += 1
                        level = logging.WARNING if isinstance(e, (SchemaError, InvalidTransfer)) else logging.ERROR
                        log.log(level, "peer directory skips %s:%d:%d: %s: %s", m.topic(), m.partition(),
                                m.offset(), type(e).__name__, e)
        except Exception:
            log.exception("peer directory stopped; only the side channel will work")
        finally:
            c.close()
