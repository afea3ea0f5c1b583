"""NIXL's progress thread, paced: a vLLM general plugin (entry point ``vllm.general_plugins``,
run by vLLM in each of its processes, the engine core and every model worker among them).

NIXL's Python API builds every agent with ``pthrDelay = 0`` (``nixl/_api.py``, in every release
we have read through the newest). Its UCX backend's progress thread then polls its workers'
event fds with a 0 ms timeout: when nothing happens it spins. One agent is one busy core.
vLLM's ``NixlConnector`` creates its agent with the progress thread on, and offers no setting
for the delay. On a GPU host that costs a core nobody counts. On this 2-core box, a prefill
and a decode worker burned both cores while idle (measured: 100% of a core per idle agent),
the box starved, and the vLLM tier failed its 30 s delivery and connect deadlines at random.

The thread arms its workers' event fds before it waits. A transfer's completion or a peer's
request wakes it through those fds at once. The delay only bounds how long a missed wakeup
waits (the reason NIXL's own source gives for polling at all). With 1000 us, an idle agent used
3.8% of a core here; with 10 ms, 0.6% (tests/vllm/test_vllm_nixl_pacing.py measures it).

``SWITCHYARD_NIXL_PROGRESS_DELAY_US`` overrides the floor (0 restores NIXL's busy polling, for
a host with cores to spare). The floor is applied where NIXL sets the field: the agent config
class its ``_api`` module instantiates is replaced by a subclass whose ``pthrDelay`` never goes
below the floor; every other field is NIXL's. Without NIXL installed this does nothing.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

ENV = "SWITCHYARD_NIXL_PROGRESS_DELAY_US"
DEFAULT_DELAY_US = 1000


def floor_us() -> int:
    """The floor from ``SWITCHYARD_NIXL_PROGRESS_DELAY_US`` (default 1000 us)."""
    raw = os.environ.get(ENV, "")
    try:
        value = int(raw) if raw.strip() else DEFAULT_DELAY_US
    except ValueError:
        raise ValueError(f"{ENV}={raw!r} is not a whole number of microseconds") from None
    if value < 0:
        raise ValueError(f"{ENV}={raw!r} is negative")
    return value


def register() -> None:
    """The plugin: pace every NIXL agent this process creates from now on."""
    pace(floor_us())


def pace(delay_us: int) -> bool:
    """Every NIXL agent created after this call polls with at least ``delay_us``; True if NIXL
    is installed. Calling it again changes the floor (vLLM may load plugins more than once)."""
    # vLLM sets this (against a UCX registration-cache leak) only if NIXL is not imported yet;
    # importing NIXL here first must not lose it.
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    try:
        from nixl import _api
    except ImportError:
        return False
    bindings = _api.nixlBind
    current = bindings.nixlAgentConfig
    if getattr(current, "switchyard_floor_us", None) is None:
        base = current

        class PacedAgentConfig(base):  # type: ignore[misc, valid-type]
            """NIXL's agent config; ``pthrDelay`` is raised to :attr:`switchyard_floor_us`."""

            switchyard_floor_us = delay_us

            def __setattr__(self, name: str, value: object) -> None:
                if name == "pthrDelay":
                    value = max(int(value), type(self).switchyard_floor_us)  # type: ignore[call-overload]
                super().__setattr__(name, value)

        bindings.nixlAgentConfig = PacedAgentConfig
        current = PacedAgentConfig
    current.switchyard_floor_us = delay_us
    log.debug("NIXL progress threads poll at least every %d us", delay_us)
    return True
