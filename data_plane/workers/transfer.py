"""The worker's NIXL region: one host DRAM buffer, registered once, holding the KVBM host pool
(G2) followed by the staging slots handoffs use.

::

    region = [ host pool: host_blocks slots | staging: transfer_blocks slots ]
              ^ KVBM HostStore                ^ SlotPool(first=host_blocks)

A prefill worker copies a held request's blocks into staging slots (the simulated device pool
has no bytes; block bytes are a pure function of the block hash, :mod:`data_plane.kvbm.content`)
and publishes the slot indices; a decode worker READs them into its own staging slots, verifies
every block against its hash, and sends the done notification.

Blocking methods (NIXL is synchronous): call them from a thread. Slot bookkeeping
(``slots``) is not thread-safe: the worker touches it only from its event loop.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import numpy as np

from data_plane.kvbm import content
from data_plane.transfer import EndpointMetadata, NixlEndpoint, PeerName, TransferResult
from data_plane.workers.handoff import SlotPool

log = logging.getLogger(__name__)


class TransferPlane:
    def __init__(self, agent_name: str, region: np.ndarray, bytes_per_block: int, *,
                 staging_first: int, staging_count: int) -> None:
        if region.nbytes != (staging_first + staging_count) * bytes_per_block:
            raise ValueError("the region must hold the host pool and the staging slots exactly")
        self.bytes_per_block = bytes_per_block
        self._blocks = region.reshape(-1, bytes_per_block)
        self.endpoint = NixlEndpoint.from_array(agent_name, region, bytes_per_block)
        self.slots = SlotPool(staging_first, staging_count)
        self.agent_name = agent_name

    # -- what peers need ----------------------------------------------------------------------

    def metadata(self) -> EndpointMetadata:
        return self.endpoint.metadata()

    # -- holder side --------------------------------------------------------------------------

    def fill(self, slots: Sequence[int], block_hashes: Sequence[int]) -> None:
        """Write each block's bytes into its slot (what copying it out of the device would)."""
        for s, h in zip(slots, block_hashes, strict=True):
            content.fill(h, self._blocks[s])

    def slot_rows(self, slots: Sequence[int]) -> list[np.ndarray]:
        """Writable views of these slots (a holder copies blocks into them; a reader's slots
        hold what it READ)."""
        return [self._blocks[s] for s in slots]

    def poll(self) -> dict[PeerName, list[bytes]]:
        """Drain notifications; also drives READs peers issue against this region."""
        return self.endpoint.notifications()

    # -- reader side --------------------------------------------------------------------------

    def read(self, peer: EndpointMetadata, remote_slots: Sequence[int], local_slots: Sequence[int],
             timeout_s: float) -> TransferResult:
        name = self.endpoint.add_peer(peer)
        return self.endpoint.read_blocks(name, list(remote_slots), list(local_slots), timeout=timeout_s)

    def corrupt(self, local_slots: Sequence[int], block_hashes: Sequence[int]) -> list[int]:
        """Positions of the blocks whose bytes are not their hash's content."""
        return [i for i, (s, h) in enumerate(zip(local_slots, block_hashes, strict=True))
                if not content.verify(h, self._blocks[s])]

    def notify(self, peer_agent: str, msg: bytes) -> None:
        self.endpoint.send_notif(peer_agent, msg)

    def close(self) -> None:
        self.endpoint.close()


class NotificationPoller:
    """Background thread polling the endpoint: delivers done notifications to ``deliver`` and,
    just as important, progresses the READs peers run against our region (NIXL's progress
    thread is off). Polls every ``fast_s`` while ``busy()`` (blocks are held), else ``idle_s``."""

    def __init__(self, plane: TransferPlane, deliver: Callable[[str, bytes], None],
                 busy: Callable[[], bool], *, fast_s: float = 0.0002, idle_s: float = 0.01) -> None:
        self._plane = plane
        self._deliver = deliver
        self._busy = busy
        self._fast_s = fast_s
        self._idle_s = idle_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"nixl-poll-{plane.agent_name}",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for peer, messages in self._plane.poll().items():
                    for msg in messages:
                        self._deliver(peer, msg)
            except Exception:  # a poll must never kill the thread that frees held blocks
                if self._stop.is_set():
                    return
                log.exception("polling NIXL notifications failed")
                self._stop.wait(0.1)
            self._stop.wait(self._fast_s if self._busy() else self._idle_s)
