"""Parts of ``switchyard security-check``'s HTTP probes that run without a system: the replay
CLI probe against this checkout's CLI, and the p99 the flood probe reports."""

from __future__ import annotations

import pytest

from ops.security.check import REFUSED
from ops.security.probes_http import Flood, p99, probe_replay_cli


def test_every_replay_cli_nonsense_is_refused() -> None:
    got = probe_replay_cli()
    assert got and all(p.verdict == REFUSED for p in got), [p for p in got if p.verdict != REFUSED]


def test_p99_is_the_99th_percentile_sample() -> None:
    """200 samples: the 198th smallest (ceil(0.99 x 200) = 198)."""
    assert p99(list(range(1, 201))) == 198
    assert p99([5.0]) == 5.0


def test_the_flood_targets_loopback_only() -> None:
    with pytest.raises(ValueError, match="loopback only"):
        Flood(["http://10.0.0.1:8000"])
