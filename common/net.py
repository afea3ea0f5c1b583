"""Free loopback ports for the servers a process starts (the demo's router and workers, a
worker's side channels, tests' private stacks).

Chosen below the kernel's ephemeral range on purpose, never with ``bind(0)``: a client polling a
server that is not listening yet on an ephemeral port can "self-connect" (the kernel gives the
client that very port as its source, and the two ends of the connection are the same socket),
and then holds the port, so the server cannot bind it. Seen in CI as a router whose ``/health``
never answered, and earlier as a restarted broker that could not bind its own port.
"""

from __future__ import annotations

import random
import socket


def _ephemeral_low(default: int = 32768) -> int:
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return default


#: Below the kernel's ephemeral range wherever it starts (32768 on Debian's default).
_HIGH = min(32000, _ephemeral_low() - 1)
_LOW = max(1024, _HIGH - 12000)


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


#: Ports this test process handed out already (a pair counts both). A port is free only until its
#: service binds it, so two calls before the first service starts could otherwise return the same
#: port, or one call a pair's second port: a private stack's Redis once drew its Kafka's
#: controller port and refused to start.
_handed_out: set[int] = set()


def free_port(pair: bool = False, span: int | None = None) -> int:
    """A free port (and, with ``pair``, port + 1 free too: Kafka's controller listener; with
    ``span``, that many consecutive ports: a local Kafka cluster's), never one this process
    handed out before."""
    rng = random.Random()
    span = span or (2 if pair else 1)
    for _ in range(500):
        p = rng.randrange(_LOW, _HIGH - span)
        wanted = tuple(range(p, p + span))
        if any(q in _handed_out for q in wanted):
            continue
        if all(_is_free(q) for q in wanted):
            _handed_out.update(wanted)
            return p
    raise RuntimeError("no free port found")
