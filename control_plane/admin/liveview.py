"""The prefix index and worker registry for the admin API's index endpoints, folded from the log.

Why fold the log rather than read the audit tables: residency is the fold of every
BlockStored/Removed/Moved/Cleared with the index's epoch and gap rules; re-deriving that in SQL
would be a second implementation of :class:`~control_plane.index.native.NativePrefixIndex`.
This keeps exactly one: the view starts from the newest router snapshot (plus the tail) and
catches up with the log end when a query finds it older than ``max_age_s``. It is the same fold
``switchyard replay state --at end`` runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from control_plane.replay.engine import VIEW_STREAMS, ReplayEngine, ViewAdvancer
from control_plane.router.view import RouterView


class LiveView:
    def __init__(self, engine: ReplayEngine, hash_algo: str, block_size: int, max_age_s: float = 0.5) -> None:
        self.engine = engine
        self.hash_algo = hash_algo
        self.block_size = block_size
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        self._adv: ViewAdvancer | None = None
        self._at = 0.0

    @contextmanager
    def read(self) -> Iterator[RouterView]:
        """The view, caught up if stale; hold it only inside the ``with`` block."""
        with self._lock:
            now = time.monotonic()
            if self._adv is None or now - self._at > self.max_age_s:
                self._catch_up()
                self._at = time.monotonic()
            yield self._adv.view

    def _catch_up(self) -> None:
        eng = self.engine
        ends = eng.resolve("end", eng.topics(VIEW_STREAMS))
        if self._adv is None:
            view, _ = eng.new_view(self.hash_algo, self.block_size, ends)
            self._adv = ViewAdvancer(eng, view)
        else:
            self._adv.refresh()
        self._adv.advance_to(ends)

    @property
    def age_ms(self) -> float:
        """How long ago the view last caught up with the log end."""
        return (time.monotonic() - self._at) * 1000 if self._at else 0.0
