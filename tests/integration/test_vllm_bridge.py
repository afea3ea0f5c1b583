"""KvEventBridge against a real ZMQ publisher speaking vLLM's protocol, in-process on loopback.

``FakeVllmPublisher`` is a small stand-in for vLLM's ``ZmqEventPublisher``: PUB frames
``[topic, seq8, payload]`` numbered from 0, a replay buffer of ``buffer_steps`` batches served
on a ROUTER socket exactly as vLLM does, and the end marker. Payloads are byte-exact vLLM
batches (the fixtures). It can lose a batch on the PUB side (still buffered, as when a
subscriber misses it) and serves replays in the 0.33 (``[topic, seq, payload]``) or the older
(``[seq, payload]``) reply layout.

It binds an XPUB socket rather than PUB: identical on the wire to the subscriber, but it tells
us when the subscription has arrived, so "no loss on the normal path" is deterministic instead
of depending on ZMQ's slow-joiner window.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
import pytest
import zmq

from data_plane.vllm.bridge import BridgeSettings, KvEventBridge
from data_plane.vllm.kv_events import VllmSource
from common.log.sink import MemorySink
from schemas.events import AllBlocksCleared, BlockStored
from schemas.types import WorkerId
from tests.fixtures.vllm.generate import V033BlockStored, V033EventBatch

pytestmark = pytest.mark.timeout(30)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"
TOPIC = b"kv-events"
END_SEQ = b"\xff" * 8


class FakeVllmPublisher:
    """PUB + ROUTER replay on 127.0.0.1 ephemeral ports, serviced by one thread."""

    def __init__(self, *, buffer_steps: int = 100, replay: bool = True,
                 legacy_replay: bool = False) -> None:
        self.buffer_steps = buffer_steps
        self.legacy_replay = legacy_replay
        self.replay_requests: list[int] = []
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        port = self._pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._router: zmq.Socket | None = None
        self.replay_endpoint: str | None = None
        if replay:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            rport = self._router.bind_to_random_port("tcp://127.0.0.1")
            self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._cmds: queue.Queue = queue.Queue()
        self._subscribed = threading.Event()
        self._running = True
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pub, zmq.POLLIN)
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        while self._running:
            for sock, _ in poller.poll(5):
                if sock is self._pub:
                    msg = self._pub.recv()
                    if msg[:1] == b"\x01":
                        self._subscribed.set()
                elif sock is self._router:
                    self._serve_replay()
            while True:
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    break
                cmd()
        self._pub.close(linger=0)
        if self._router is not None:
            self._router.close(linger=0)

    def _serve_replay(self) -> None:
        # As vLLM's ZmqEventPublisher._service_replay.
        assert self._router is not None
        frames = self._router.recv_multipart()
        if len(frames) != 3:
            return
        client, _, start_b = frames
        start = int.from_bytes(start_b, "big")
        self.replay_requests.append(start)
        for seq, payload in self._buffer:
            if seq >= start:
                seq_b = seq.to_bytes(8, "big")
                if self.legacy_replay:
                    self._router.send_multipart([client, b"", seq_b, payload])
                else:
                    self._router.send_multipart([client, b"", TOPIC, seq_b, payload])
        self._router.send_multipart([client, b"", END_SEQ, b""])

    def wait_subscribed(self, timeout: float = 5.0) -> None:
        assert self._subscribed.wait(timeout), "subscriber never connected"

    def publish(self, payload: bytes, *, lose: bool = False) -> int:
        """Number and buffer a batch; send it unless ``lose`` (then only replay has it)."""
        seq = self._next_seq
        self._next_seq += 1
        done = threading.Event()

        def cmd() -> None:
            if not lose:
                self._pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])
            self._buffer.append((seq, payload))
            done.set()

        self._cmds.put(cmd)
        assert done.wait(5)
        return seq

    def restart(self) -> None:
        """A new engine process: numbering from 0 again, empty buffer."""
        done = threading.Event()

        def cmd() -> None:
            self._buffer.clear()
            self._next_seq = 0
            done.set()

        self._cmds.put(cmd)
        assert done.wait(5)

    def close(self) -> None:
        self._running = False
        self._thread.join(5)
        self._ctx.term()


def batch(*hashes: int, ts: float = 1700000100.0) -> bytes:
    """A vLLM 0.33 batch with one BlockStored per hash (encoded with the 0.33 mirror)."""
    return msgspec.msgpack.encode(V033EventBatch(ts=ts, data_parallel_rank=0, events=[
        V033BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=list(range(16)),
                        block_size=16, lora_id=None, medium="GPU", lora_name=None, group_idx=0)
        for h in hashes
    ]))


def stored(sink: MemorySink) -> list[int]:
    return [h for e in sink.events if isinstance(e, BlockStored) for h in e.block_hashes]


def kinds(sink: MemorySink) -> list[str]:
    return [type(e).__name__ for e in sink.events]


def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError("condition not reached in time")


SOURCE = VllmSource(worker_id=WorkerId("vllm-0"), hash_algo="sha256", block_size=16)


@pytest.fixture
def publisher():
    pubs: list[FakeVllmPublisher] = []

    def make(**kw) -> FakeVllmPublisher:
        p = FakeVllmPublisher(**kw)
        pubs.append(p)
        return p

    yield make
    for p in pubs:
        p.close()


@pytest.fixture
def dead_replay_endpoint():
    """A replay endpoint nobody serves: a replay request to it goes unanswered."""
    ctx = zmq.Context()
    dead = ctx.socket(zmq.ROUTER)
    dead_port = dead.bind_to_random_port("tcp://127.0.0.1")
    yield f"tcp://127.0.0.1:{dead_port}"
    dead.close(linger=0)
    ctx.term()


@contextmanager
def running_bridge(pub: FakeVllmPublisher, sink: MemorySink, **settings) -> Iterator[KvEventBridge]:
    """A bridge subscribed to ``pub`` (its replay endpoint unless ``settings`` name another),
    stopped on leaving the block whatever happened inside it."""
    settings.setdefault("replay_endpoint", pub.replay_endpoint)
    bridge = KvEventBridge(SOURCE, BridgeSettings(endpoint=pub.endpoint, **settings), sink)
    bridge.start()
    try:
        pub.wait_subscribed()
        yield bridge
    finally:
        bridge.stop()


def test_normal_flow_republishes_byte_exact_batches_in_order(publisher):
    pub, sink = publisher(), MemorySink()
    with running_bridge(pub, sink) as bridge:
        pub.publish((FIXTURES / "sample_v0_33.msgpack").read_bytes())
        pub.publish((FIXTURES / "cpu_storage_media_v0_33.msgpack").read_bytes())
        pub.publish(batch(101, 102))
        wait_until(lambda: bridge.stats().batches_applied == 3)
    assert kinds(sink) == [
        "BlockStored", "BlockRemoved", "AllBlocksCleared",       # seq 0: the 0.33 sample
        "BlockStored", "BlockStored", "BlockRemoved", "BlockStored",  # seq 1: CPU/STORAGE/nil
        "BlockStored", "BlockStored",                             # seq 2
    ]
    assert stored(sink) == [1403909460543360175, 1643945449041937783, 11, 12, 11, 13, 101, 102]
    assert all(e.worker_id == "vllm-0" for e in sink.events)
    st = bridge.stats()
    assert (st.gaps, st.replays, st.resyncs, st.duplicates) == (0, 0, 0, 0)
    assert pub.replay_requests == []
    assert not bridge.running and bridge.error is None


def test_lost_batch_is_replayed_and_applied_in_order(publisher):
    pub, sink = publisher(), MemorySink()
    with running_bridge(pub, sink) as bridge:
        pub.publish(batch(1))
        pub.publish(batch(2), lose=True)
        pub.publish(batch(3), lose=True)
        pub.publish(batch(4))       # seq 3 arrives: gap 1..2 -> replay from 1
        pub.publish(batch(5))       # after the gap: normal again
        wait_until(lambda: stored(sink) == [1, 2, 3, 4, 5])
    assert pub.replay_requests == [1]
    st = bridge.stats()
    assert (st.gaps, st.replays, st.resyncs) == (1, 1, 0)
    assert st.batches_applied == 5
    assert not any(isinstance(e, AllBlocksCleared) for e in sink.events)


def test_older_two_frame_replay_replies_are_understood(publisher):
    pub, sink = publisher(legacy_replay=True), MemorySink()
    with running_bridge(pub, sink) as bridge:
        pub.publish(batch(1))
        pub.publish(batch(2), lose=True)
        pub.publish(batch(3))
        wait_until(lambda: stored(sink) == [1, 2, 3])
    assert bridge.stats().resyncs == 0


def test_exhausted_replay_buffer_resyncs_with_all_blocks_cleared(publisher):
    """Buffer of 2: seqs 1..3 lost on PUB; when seq 4 arrives the buffer holds 3 and 4 only.
    Seqs 1..2 are gone: AllBlocksCleared, then 3 and 4 from the replay."""
    pub, sink = publisher(buffer_steps=2), MemorySink()
    with running_bridge(pub, sink) as bridge:
        pub.publish(batch(10))
        for h in (11, 12, 13):
            pub.publish(batch(h), lose=True)
        pub.publish(batch(14))
        wait_until(lambda: 14 in stored(sink))
    assert kinds(sink) == ["BlockStored", "AllBlocksCleared", "BlockStored", "BlockStored"]
    assert stored(sink) == [10, 13, 14]
    clear = sink.events[1]
    assert clear == AllBlocksCleared(worker_id=WorkerId("vllm-0"), tier=None, dp_rank=0)
    st = bridge.stats()
    assert (st.gaps, st.replays, st.resyncs) == (1, 1, 1)


@pytest.mark.parametrize("replay", ["none", "unanswered"])
def test_a_gap_that_cannot_be_replayed_resyncs(publisher, request, replay):
    """The publisher has no replay endpoint, or the bridge's replay request is never answered
    (timeout 0.3 s): the lost batch is given up with an AllBlocksCleared."""
    if replay == "none":
        pub, settings = publisher(replay=False), {}
    else:
        pub = publisher()
        settings = {"replay_endpoint": request.getfixturevalue("dead_replay_endpoint"), "replay_timeout_s": 0.3}
    sink = MemorySink()
    with running_bridge(pub, sink, **settings):
        pub.publish(batch(1))
        pub.publish(batch(2), lose=True)
        pub.publish(batch(3))
        wait_until(lambda: 3 in stored(sink))
    assert kinds(sink) == ["BlockStored", "AllBlocksCleared", "BlockStored"]


def test_publisher_restart_resyncs_and_follows_the_new_numbering(publisher):
    pub, sink = publisher(), MemorySink()
    with running_bridge(pub, sink) as bridge:
        pub.publish(batch(1))
        pub.publish(batch(2))
        wait_until(lambda: stored(sink) == [1, 2])
        pub.restart()
        pub.publish(batch(7))      # seq 0 again
        pub.publish(batch(8))
        wait_until(lambda: 8 in stored(sink))
    assert kinds(sink) == ["BlockStored", "BlockStored", "AllBlocksCleared", "BlockStored",
                           "BlockStored"]
    assert stored(sink) == [1, 2, 7, 8]
    assert bridge.stats().restarts == 1


def test_late_joiner_catches_up_from_seq_zero(publisher):
    """Batches published before the bridge existed are fetched from the replay buffer."""
    pub, sink = publisher(), MemorySink()
    pub.publish(batch(1))
    pub.publish(batch(2))
    with running_bridge(pub, sink) as bridge:
        pub.publish(batch(3))
        wait_until(lambda: stored(sink) == [1, 2, 3])
    assert pub.replay_requests == [0]
    assert bridge.stats().resyncs == 0


def test_undecodable_batch_resyncs_and_continues(publisher):
    pub, sink = publisher(), MemorySink()
    with running_bridge(pub, sink) as bridge:
        pub.publish(batch(1))
        pub.publish(b"\xc1 not msgpack")
        pub.publish(batch(3))
        wait_until(lambda: 3 in stored(sink))
    assert kinds(sink) == ["BlockStored", "AllBlocksCleared", "BlockStored"]
    assert bridge.stats().decode_errors == 1


def test_sink_failure_stops_the_bridge_and_keeps_the_error(publisher):
    class Broken(MemorySink):
        def publish(self, payload, **kw):
            raise RuntimeError("broker gone")

    pub = publisher()
    with running_bridge(pub, Broken()) as bridge:
        pub.publish(batch(1))
        wait_until(lambda: not bridge.running)
    assert isinstance(bridge.error, RuntimeError)


def test_stop_is_prompt_and_idempotent(publisher):
    pub = publisher()
    with running_bridge(pub, MemorySink(), poll_interval_s=0.05) as bridge:
        t0 = time.monotonic()
        bridge.stop()
        bridge.stop()
        assert time.monotonic() - t0 < 1.0
    assert not bridge.running


def test_stop_during_a_replay_is_prompt_and_publishes_no_resync(publisher, dead_replay_endpoint):
    pub, sink = publisher(), MemorySink()
    with running_bridge(pub, sink, replay_endpoint=dead_replay_endpoint, replay_timeout_s=30.0,
                        poll_interval_s=0.05) as bridge:
        pub.publish(batch(1), lose=True)
        pub.publish(batch(2))              # gap at seq 1: the replay request hangs
        wait_until(lambda: bridge.stats().gaps == 1)
        t0 = time.monotonic()
        bridge.stop()
        assert time.monotonic() - t0 < 1.0
    assert sink.events == [] and bridge.error is None
