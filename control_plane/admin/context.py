"""What the admin routes and handlers need, built once by :func:`control_plane.admin.wiring.build_admin`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone

from sqlalchemy.orm import Session, sessionmaker

from control_plane.admin.audit.consumer import AuditConsumer
from control_plane.admin.audit.store import AuditStore
from control_plane.admin.liveview import LiveView
from control_plane.admin.ports import EventLog, JobRunner
from control_plane.admin.ratelimit import FailureLimiter
from control_plane.admin.settings import AdminSettings
from common.log.catalog import Catalog
from common.log.reader import LogReader


@dataclass
class AdminContext:
    settings: AdminSettings
    sessions: sessionmaker[Session]
    events: EventLog
    catalog: Catalog
    #: A new log reader per replay job (each job reads on its own thread).
    reader_factory: Callable[[], LogReader]
    jobs: JobRunner
    live: LiveView | None = None
    audit: AuditConsumer | None = None
    store: AuditStore = field(default_factory=AuditStore)
    #: Serialises actions that mint versions (config versions, pool versions): one writer.
    write_lock: threading.Lock = field(default_factory=threading.Lock)
    on_close: list[Callable[[], None]] = field(default_factory=list)
    #: Unix seconds now: token expiry and the rate limit read the time only through this
    #: (tests pass a fake clock).
    clock: Callable[[], float] = time.time
    #: Failed authentications per client address and token id (default: from the settings).
    auth_limiter: FailureLimiter | None = None

    def __post_init__(self) -> None:
        if self.auth_limiter is None:
            self.auth_limiter = FailureLimiter(self.settings.auth_fail_burst, self.settings.auth_fail_per_s)

    def now(self) -> datetime:
        return datetime.fromtimestamp(self.clock(), timezone.utc)
