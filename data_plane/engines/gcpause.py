"""``paused_gc()``: the cyclic garbage collector off for a bulk run, back on after.

Trace replay builds and drops millions of small objects (requests, digests, blocks' event
lists) while a large set of long-lived ones (every request of the trace, the block pools) sits
in memory. CPython's collector is triggered by allocation counts and every older-generation
pass walks that whole long-lived set: measured on the Mooncake conversation trace, it was a
third of the loader's time. The engine makes no reference cycles on these paths (reference
counting frees all of it), so nothing accumulates while the collector is paused; whatever a
caller's code makes in between is collected as usual once it is back on.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused_gc() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
