"""Real NIXL (UCX backend) between two OS processes: a prefill-side holder and a decode-side
reader, metadata exchanged over a pipe, as it would be over the event log.

The holder process (``_holder_main``, started with ``spawn``) fills 256 blocks of 64 KiB with
content derived from each block's index, holds them for one request in a ``HoldTable``, drives
its endpoint (``notifications()``: with NIXL's progress thread off a READ completes only while
the source is polled) and reports each release back over the pipe. The failure tests kill or
freeze that process with signals and check the reader gets a clean error, never a hang.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
import uuid

import numpy as np
import pytest

from data_plane.transfer import (
    HoldTable,
    NixlEndpoint,
    PeerLost,
    TransferError,
    TransferTimeout,
    encode_done,
    parse_done,
)
from ops.stack.process import listening_sockets
from tests.support.waits import wait_for

BLOCK_LEN = 64 * 1024
N_BLOCKS = 256
REQUEST = "req-1"
pytestmark = pytest.mark.timeout(60)


def _in_flight(endpoint: NixlEndpoint) -> bool:
    """A transfer of another thread is in flight on ``endpoint``. NixlEndpoint has no public
    count of them, so this reads the one ``close`` waits on."""
    return endpoint._inflight > 0


def _block_content(block_id: int) -> np.ndarray:
    """Deterministic bytes of one source block: a different pseudo-random stream per index."""
    return np.random.default_rng(0x5EED_0000 + block_id).integers(0, 256, BLOCK_LEN, dtype=np.uint8)


def _holder_main(conn, agent_name: str, lease_s: float) -> None:
    """Prefill side: hold every block for REQUEST and free it on the done notification."""
    memory = np.concatenate([_block_content(i) for i in range(N_BLOCKS)])
    table = HoldTable()
    with NixlEndpoint.from_array(agent_name, memory, BLOCK_LEN) as endpoint:
        table.hold(REQUEST, range(N_BLOCKS), time.monotonic(), ttl=lease_s)
        conn.send(endpoint.metadata().encode())
        while True:
            now = time.monotonic()
            for peer, messages in endpoint.notifications().items():
                for msg in messages:
                    done = parse_done(msg)
                    released = done and table.notify(done.request_id, done.n_consumers, now)
                    conn.send(("notif", peer, msg, released and released.reason.value))
            for released in table.expire(now):
                conn.send(("expired", released.request_id))
            if conn.poll(0):  # (a poll timeout would round up to whole milliseconds)
                command, *args = conn.recv()
                if command == "stop":
                    return
                if command == "blocks":  # a copy of some blocks, to check what a WRITE did
                    conn.send(("blocks", memory.reshape(N_BLOCKS, BLOCK_LEN)[args[0]].copy()))
            else:
                time.sleep(0.0002)


class Holder:
    def __init__(self, lease_s: float = 30.0) -> None:
        self.agent_name = f"prefill-{uuid.uuid4().hex[:8]}"
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_holder_main, args=(child, self.agent_name, lease_s), daemon=True
        )
        self.process.start()
        child.close()
        assert self.conn.poll(30), "holder process did not publish its metadata"
        self.metadata: bytes = self.conn.recv()

    def signal(self, sig: int) -> None:
        os.kill(self.process.pid, sig)

    def kill(self) -> None:
        if self.process.is_alive():
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGKILL)
        self.process.join(5)

    def stop(self) -> None:
        """Graceful end (the holder closes its endpoint); SIGKILL if it does not comply."""
        if self.process.is_alive():
            self.signal(signal.SIGCONT)
            try:
                self.conn.send(("stop",))
            except OSError:
                pass
            self.process.join(5)
        self.kill()

    def blocks(self, block_ids: list[int]) -> np.ndarray:
        self.conn.send(("blocks", block_ids))
        while (message := self.next_message())[0] != "blocks":
            pass
        return message[1]

    def next_message(self, timeout: float = 5.0):
        assert self.conn.poll(timeout), "no message from the holder"
        return self.conn.recv()


@pytest.fixture
def holder():
    made: list[Holder] = []

    def make(**kwargs) -> Holder:
        made.append(Holder(**kwargs))
        return made[-1]

    yield make
    for h in made:
        h.stop()


@pytest.fixture
def reader():
    memory = np.zeros(N_BLOCKS * BLOCK_LEN, dtype=np.uint8)
    with NixlEndpoint.from_array(f"decode-{uuid.uuid4().hex[:8]}", memory, BLOCK_LEN) as endpoint:
        yield endpoint, memory.reshape(N_BLOCKS, BLOCK_LEN)


def test_read_256_blocks_verified_byte_for_byte_and_source_notified(holder, reader):
    endpoint, blocks = reader
    source = holder()
    peer = endpoint.add_peer(source.metadata)
    # A scattered mapping, so a wrong index on either side shows up as wrong bytes.
    remote_ids = np.random.default_rng(7).permutation(N_BLOCKS)
    local_ids = np.arange(N_BLOCKS)[::-1].copy()

    result = endpoint.read_blocks(
        peer, remote_ids, local_ids, notif=encode_done(REQUEST, 1), timeout=10
    )

    assert (result.blocks, result.bytes) == (N_BLOCKS, N_BLOCKS * BLOCK_LEN)
    for local, remote in zip(local_ids, remote_ids, strict=True):
        np.testing.assert_array_equal(blocks[local], _block_content(int(remote)))
    assert source.next_message() == ("notif", endpoint.name, encode_done(REQUEST, 1), "consumed")


def test_write_blocks_land_in_the_peer_which_is_notified(holder, reader):
    endpoint, blocks = reader
    source = holder()
    peer = endpoint.add_peer(source.metadata)
    blocks[:4] = [_block_content(1000 + i) for i in range(4)]

    result = endpoint.write_blocks(
        peer, [200, 201, 202, 203], [3, 2, 1, 0], notif=b"written", timeout=10
    )

    assert result.bytes == 4 * BLOCK_LEN
    assert source.next_message() == ("notif", endpoint.name, b"written", None)
    written = source.blocks([200, 201, 202, 203])
    for i in range(4):
        np.testing.assert_array_equal(written[i], _block_content(1000 + 3 - i))


def test_close_aborts_a_transfer_in_flight_in_another_thread(holder, reader):
    endpoint, _ = reader
    source = holder()
    peer = endpoint.add_peer(source.metadata)
    source.signal(signal.SIGSTOP)  # the READ cannot complete
    outcome: list[BaseException] = []

    def read() -> None:
        try:
            endpoint.read_blocks(peer, range(N_BLOCKS), range(N_BLOCKS), timeout=10)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    worker = threading.Thread(target=read)
    worker.start()
    wait_for(lambda: _in_flight(endpoint), timeout=10, what="the READ in flight")
    start = time.monotonic()
    endpoint.close()
    worker.join(5)

    assert time.monotonic() - start < 2 and not worker.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], TransferError), outcome


def test_removing_a_peer_lets_its_transfer_in_flight_finish(holder, reader):
    endpoint, blocks = reader
    source = holder()
    peer = endpoint.add_peer(source.metadata)
    source.signal(signal.SIGSTOP)
    results = []
    worker = threading.Thread(
        target=lambda: results.append(endpoint.read_blocks(peer, [9], [0], timeout=10))
    )
    worker.start()
    wait_for(lambda: _in_flight(endpoint), timeout=10, what="the READ in flight")

    endpoint.remove_peer(peer)
    source.signal(signal.SIGCONT)
    worker.join(5)

    assert [r.blocks for r in results] == [1]
    np.testing.assert_array_equal(blocks[0], _block_content(9))
    assert endpoint.peers() == []


def test_source_killed_before_the_read_fails_fast_with_peer_lost(holder, reader):
    endpoint, _ = reader
    source = holder()
    peer = endpoint.add_peer(source.metadata)
    source.kill()

    start = time.monotonic()
    with pytest.raises(PeerLost):
        endpoint.read_blocks(peer, range(N_BLOCKS), range(N_BLOCKS), timeout=10)
    assert time.monotonic() - start < 5
    # The peer is forgotten: later calls fail at once, without touching the transport.
    with pytest.raises(PeerLost):
        endpoint.read_blocks(peer, [0], [0], timeout=10)
    assert peer not in endpoint.peers()


def test_metadata_of_a_dead_source_is_refused_with_peer_lost(holder, reader):
    endpoint, _ = reader
    source = holder()
    source.kill()

    with pytest.raises(PeerLost):
        endpoint.add_peer(source.metadata)


def test_source_killed_mid_transfer_gives_an_error_not_a_hang(holder, reader):
    """SIGSTOP keeps the READ in flight (the frozen source cannot complete it), then SIGKILL
    lands while the reader is polling."""
    endpoint, _ = reader
    source = holder()
    peer = endpoint.add_peer(source.metadata)
    source.signal(signal.SIGSTOP)
    killer = threading.Timer(0.3, source.kill)
    killer.start()

    start = time.monotonic()
    try:
        with pytest.raises(TransferError) as caught:
            endpoint.read_blocks(peer, range(N_BLOCKS), range(N_BLOCKS), timeout=10)
    finally:
        killer.join()
    elapsed = time.monotonic() - start
    assert isinstance(caught.value, PeerLost), f"expected PeerLost, got {caught.value!r}"
    assert 0.25 < elapsed < 5


def test_frozen_source_times_out_and_a_later_read_succeeds(holder, reader):
    endpoint, blocks = reader
    source = holder()
    peer = endpoint.add_peer(source.metadata)
    source.signal(signal.SIGSTOP)

    start = time.monotonic()
    with pytest.raises(TransferTimeout):
        endpoint.read_blocks(peer, range(N_BLOCKS), range(N_BLOCKS), timeout=0.5)
    assert 0.5 <= time.monotonic() - start < 2

    source.signal(signal.SIGCONT)
    result = endpoint.read_blocks(peer, [5, 6], [0, 1], timeout=10)
    assert result.blocks == 2
    np.testing.assert_array_equal(blocks[0], _block_content(5))
    np.testing.assert_array_equal(blocks[1], _block_content(6))


def test_unread_hold_expires_on_the_source(holder):
    """A decode worker that never comes does not pin prefill memory beyond the lease."""
    source = holder(lease_s=0.3)
    assert source.next_message(timeout=5) == ("expired", REQUEST)


def test_an_endpoint_made_in_process_listens_on_loopback_only(monkeypatch):
    """UCX listens on every interface unless told otherwise; an endpoint made without
    ``UCX_NET_DEVICES`` (a test, a bench, anything but a worker bound off loopback) keeps to
    ``lo``: none of this process's sockets listens beyond loopback."""
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    memory = np.zeros(N_BLOCKS * BLOCK_LEN, dtype=np.uint8)
    with NixlEndpoint.from_array(f"lo-{uuid.uuid4().hex[:8]}", memory, BLOCK_LEN):
        outside = [s for s in listening_sockets([os.getpid()]) if not s.loopback]
    assert outside == []
