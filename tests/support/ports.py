"""Free loopback ports for private stacks, so concurrent test runs never collide.

Chosen below the kernel's ephemeral range on purpose: clients that keep reconnecting to a
killed broker on an ephemeral port can "self-connect" (source port == destination port) and
hold the port, so the restarted broker could not bind it.
"""

from __future__ import annotations

import random
import socket

_LOW, _HIGH = 20000, 32000


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port(pair: bool = False) -> int:
    """A free port (and, with ``pair``, port + 1 free too: Kafka's controller listener)."""
    rng = random.Random()
    for _ in range(500):
        p = rng.randrange(_LOW, _HIGH)
        if _is_free(p) and (not pair or _is_free(p + 1)):
            return p
    raise RuntimeError("no free port found")
