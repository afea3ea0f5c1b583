"""Feeds a running vLLM's KV cache events into our log: ZMQ SUB in, :class:`EventSink` out.

Protocol (vLLM's ``ZmqEventPublisher``, ``vllm/distributed/kv_events.py``): the publisher
sends ``[topic, seq (8 bytes, big-endian), payload]`` on a PUB socket, numbering batches from 0
per publisher, and keeps the last ``buffer_steps`` batches for a ROUTER replay socket. We ask
the replay socket from a DEALER: ``[b"", start_seq]``; it answers one message per buffered batch
with ``seq >= start`` (``[b"", topic, seq, payload]`` in 0.33, ``[b"", seq, payload]`` before),
then the end marker ``[b"", b"\\xff" * 8, b""]``.

Ordering and loss. Batches are applied strictly in sequence order: ``expected`` is the next seq
to apply, starting at 0 (so a bridge that joins late, or loses the first messages to ZMQ's
slow-joiner window, catches up from the publisher's buffer like any other gap).

* ``seq == expected``: decode, translate, publish, ``expected += 1``.
* ``seq < expected``: already applied through a replay: dropped.
* ``seq > expected``: a gap. Ask the replay socket for ``expected..``; apply what it returns in
  order. If its buffer no longer starts at ``expected`` (exhausted), or it does not answer, or
  there is no replay endpoint, the missing batches are gone: publish **AllBlocksCleared**
  (``tier=None``) for this worker as a *resync point* and carry on from what we have. The index
  then under-reports this worker (blocks stored before the gap are unknown until the engine
  re-sends them: vLLM re-announces prefix hits as stores) instead of claiming residency that
  may be gone. That is the only safe direction: a missed cache hit costs a prefill, a false one
  sends a request to a worker that must recompute anyway and skews load.
* A seq at or below the last one the SUB socket delivered means the publisher restarted (a new
  engine process numbers from 0 again, with an empty cache): resync, then treat it as a fresh
  stream (``expected = 0``).
* A batch that does not decode is treated as lost: resync and move past it.

Limit: vLLM's stream carries no incarnation id, so a publisher restart whose first message to
reach us already has a *higher* seq than the last one we saw looks like an ordinary gap (the
replay then returns the new incarnation's batches). The new engine process re-registers
(``WorkerRegistered``, new epoch), which drops the worker's volatile tiers in the index anyway.

The bridge runs on its own thread (not asyncio) because the sink (the Kafka producer) is
synchronous and the bridge should keep draining ZMQ even when a host event loop is busy. If
the sink raises, the bridge stops and keeps the exception in :attr:`KvEventBridge.error`:
continuing would leave a hole in the log that nobody knows about.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace

import zmq

from data_plane.vllm.kv_events import (
    KvEventTranslator,
    VllmDecodeError,
    VllmSource,
    decode_batch,
)
from common.log.sink import EventSink

logger = logging.getLogger(__name__)

#: vLLM's replay end marker: seq -1 as 8 signed big-endian bytes.
END_SEQ = b"\xff" * 8


@dataclass(frozen=True)
class BridgeSettings:
    """Where the vLLM publisher is and how patiently to talk to it."""

    #: The publisher's PUB endpoint as reachable from here, e.g. ``tcp://10.0.0.5:5557``
    #: (vLLM binds ``tcp://*:5557`` by default; DP rank r is on port + r). We connect, unless
    #: ``bind``.
    endpoint: str
    #: Bind ``endpoint`` instead of connecting to it. vLLM *connects* its PUB socket to an
    #: endpoint that names a host (only ``*``, ``::``, ``ipc://`` and ``inproc://`` are bound
    #: by vLLM), so a bridge for ``tcp://127.0.0.1:PORT`` must be the one that binds, and it
    #: must be bound before the engine starts: vLLM drops batches nobody is connected for.
    bind: bool = False
    #: First publisher seq this bridge applies (a restarted bridge that knows how far its
    #: predecessor got; earlier seqs are duplicates). 0 for a fresh bridge.
    start_seq: int = 0
    #: The publisher's replay ROUTER endpoint (vLLM's ``replay_endpoint``); None if the engine
    #: has none, in which case every gap is a resync.
    replay_endpoint: str | None = None
    #: Topic prefix to subscribe to (vLLM's ``topic``; "" takes everything).
    topic: str = ""
    #: A replay that goes this long without a message is abandoned (and the gap resynced).
    replay_timeout_s: float = 2.0
    #: How often the thread checks for stop() while idle.
    poll_interval_s: float = 0.1
    #: SUB receive high-water mark (vLLM's PUB default is 100,000).
    rcvhwm: int = 100_000

    def __post_init__(self) -> None:
        if not self.endpoint:
            raise ValueError("endpoint must be set")
        if self.replay_timeout_s <= 0 or self.poll_interval_s <= 0:
            raise ValueError("replay_timeout_s and poll_interval_s must be positive")


@dataclass(frozen=True)
class BridgeStats:
    """Counters since start. ``resyncs`` counts AllBlocksCleared the bridge itself published."""

    batches_applied: int = 0
    events_published: int = 0
    duplicates: int = 0
    gaps: int = 0
    replays: int = 0
    replayed_batches: int = 0
    resyncs: int = 0
    restarts: int = 0
    decode_errors: int = 0
    malformed_messages: int = 0


class _ReplayFailed(Exception):
    pass


class _Stopping(Exception):
    """stop() was called mid-replay: leave without publishing a resync for a gap we did not
    finish looking at (the next bridge for this worker will see the gap itself)."""


class KvEventBridge:
    """Subscribes to one vLLM KV event publisher and republishes its batches as our events.

    Use ``start()`` / ``stop()`` or ``with KvEventBridge(...) as bridge:``. One bridge per vLLM
    publisher (per DP rank); ``source.dp_rank`` should be that rank.
    """

    def __init__(self, source: VllmSource, settings: BridgeSettings, sink: EventSink) -> None:
        self.source = source
        self.settings = settings
        self._sink = sink
        self._translator = KvEventTranslator(source)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx: zmq.Context | None = None
        self._dealer: zmq.Socket | None = None
        self._lock = threading.Lock()
        self._stats = BridgeStats()
        self._expected = settings.start_seq
        self._last_sub_seq: int | None = None
        self.error: BaseException | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("bridge already started")
        self._ctx = zmq.Context()
        # Sockets are created and used on the bridge thread only (ZMQ sockets are not
        # thread-safe); the subscription is made before start() returns so a caller can rely on
        # "started" meaning "connecting".
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, self.settings.rcvhwm)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.settings.topic.encode())
        if self.settings.bind:
            sub.bind(self.settings.endpoint)
        else:
            sub.connect(self.settings.endpoint)
        self._thread = threading.Thread(target=self._run, args=(sub,),
                                        name=f"kv-bridge-{self.source.worker_id}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and close the sockets. Idempotent."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
            if t.is_alive():
                logger.error("kv bridge for %s did not stop within %.1f s",
                             self.source.worker_id, timeout)
                return
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def __enter__(self) -> KvEventBridge:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> BridgeStats:
        with self._lock:
            return self._stats

    @property
    def expected_seq(self) -> int:
        """The next publisher seq the bridge will apply."""
        return self._expected

    @property
    def dropped(self) -> dict[str, int]:
        """Events the translator dropped, by reason (see :class:`KvEventTranslator`)."""
        return dict(self._translator.dropped)

    # -- thread ----------------------------------------------------------------------------

    def _count(self, **inc: int) -> None:
        with self._lock:
            s = self._stats
            self._stats = replace(s, **{k: getattr(s, k) + v for k, v in inc.items()})

    def _run(self, sub: zmq.Socket) -> None:
        poll_ms = max(1, int(self.settings.poll_interval_s * 1000))
        try:
            while not self._stop.is_set():
                if not sub.poll(poll_ms):
                    continue
                self._on_message(sub.recv_multipart())
        except _Stopping:
            pass
        except BaseException as e:  # noqa: BLE001 - kept for the owner, the thread must end
            if not self._stop.is_set():
                self.error = e
                logger.exception("kv bridge for %s stopped on an error", self.source.worker_id)
        finally:
            sub.close(linger=0)
            self._close_dealer()

    def _on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._count(malformed_messages=1)
            logger.warning("kv bridge for %s: ignoring a %d-frame message that is not "
                           "[topic, seq8, payload]", self.source.worker_id, len(frames))
            return
        _, seq_b, payload = frames
        seq = int.from_bytes(seq_b, "big")
        last = self._last_sub_seq
        self._last_sub_seq = seq
        if last is not None and seq <= last:
            # PUB delivers each seq once, in order: going back means a new publisher.
            self._count(restarts=1)
            self._resync(f"publisher restarted (seq {seq} after {last})")
            self._expected = 0
        if seq < self._expected:
            self._count(duplicates=1)
            return
        if seq > self._expected:
            self._fill_gap(seq)
            if seq < self._expected:
                return
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except VllmDecodeError as e:
            self._count(decode_errors=1)
            self._expected = seq + 1
            self._resync(f"batch {seq} does not decode: {e}")
            return
        events = self._translator.translate(batch)
        for ev in events:
            self._sink.publish(ev)
        self._expected = seq + 1
        self._count(batches_applied=1, events_published=len(events))

    def _resync(self, reason: str) -> None:
        logger.warning("kv bridge for %s: resync (AllBlocksCleared): %s",
                       self.source.worker_id, reason)
        self._sink.publish(self._translator.resync())
        self._count(resyncs=1, events_published=1)

    def _fill_gap(self, seen: int) -> None:
        """Recover ``expected..seen-1`` (and whatever the replay has beyond) before ``seen``."""
        start = self._expected
        self._count(gaps=1)
        logger.info("kv bridge for %s: gap, expected seq %d, got %d", self.source.worker_id,
                    start, seen)
        if self.settings.replay_endpoint is None:
            self._resync(f"seqs {start}..{seen - 1} lost and no replay endpoint")
            self._expected = seen
            return
        try:
            batches = self._replay(start)
        except _ReplayFailed as e:
            self._resync(f"seqs {start}..{seen - 1} lost: {e}")
            self._expected = seen
            return
        self._count(replays=1, replayed_batches=len(batches))
        for seq, payload in batches:
            if seq < self._expected:
                continue
            if seq > self._expected:
                # The buffer no longer reaches back to what we miss (or skips: same thing).
                self._resync(f"seqs {self._expected}..{seq - 1} are no longer in the "
                             "publisher's replay buffer")
                self._expected = seq
            self._apply(seq, payload)
        if self._expected < seen:
            self._resync(f"replay from {start} ended at {self._expected - 1}, before {seen}")
            self._expected = seen

    # -- replay client ---------------------------------------------------------------------

    def _close_dealer(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None

    def _replay(self, start: int) -> list[tuple[int, bytes]]:
        """Every buffered batch with seq >= start, in the publisher's order."""
        assert self._ctx is not None and self.settings.replay_endpoint is not None
        if self._dealer is None:
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.connect(self.settings.replay_endpoint)
        dealer = self._dealer
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out: list[tuple[int, bytes]] = []
        timeout = self.settings.replay_timeout_s
        deadline = time.monotonic() + timeout
        while True:
            if self._stop.is_set():
                self._close_dealer()
                raise _Stopping()
            left = deadline - time.monotonic()
            if left <= 0:
                # Replies that straggle in later would answer the wrong request: start afresh.
                self._close_dealer()
                raise _ReplayFailed(f"replay from {start} stalled after {len(out)} batches "
                                    f"({timeout:.1f} s without a message)")
            if not dealer.poll(max(1, int(min(left, self.settings.poll_interval_s) * 1000))):
                continue
            frames = dealer.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]
            if len(frames) == 3:  # 0.33: [topic, seq, payload]
                seq_b, payload = frames[1], frames[2]
            elif len(frames) == 2:  # earlier: [seq, payload]; also the end marker
                seq_b, payload = frames
            else:
                self._count(malformed_messages=1)
                continue
            if seq_b == END_SEQ:
                return out
            if len(seq_b) != 8:
                self._count(malformed_messages=1)
                continue
            out.append((int.from_bytes(seq_b, "big"), payload))
            deadline = time.monotonic() + timeout
