"""The NIXL pacing floor: its setting parsed strictly, and the agent config's ``pthrDelay``
raised to the floor (with NIXL's bindings, installed in the project environment too)."""

from __future__ import annotations

import pytest

from data_plane.vllm import nixl_pacing


@pytest.mark.parametrize(("raw", "want"), [("", 1000), ("  ", 1000), ("0", 0), ("20000", 20000)])
def test_floor_us_reads_the_setting(monkeypatch: pytest.MonkeyPatch, raw: str, want: int) -> None:
    monkeypatch.setenv(nixl_pacing.ENV, raw)
    assert nixl_pacing.floor_us() == want


@pytest.mark.parametrize("raw", ["1ms", "1.5", "-1"])
def test_floor_us_refuses_what_is_not_microseconds(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(nixl_pacing.ENV, raw)
    with pytest.raises(ValueError, match=nixl_pacing.ENV):
        nixl_pacing.floor_us()


def test_pace_raises_pthr_delay_to_the_floor_and_can_move_it() -> None:
    from nixl import _api

    bindings = _api.nixlBind
    original = bindings.nixlAgentConfig
    try:
        assert nixl_pacing.pace(5000)
        cfg = bindings.nixlAgentConfig()
        cfg.pthrDelay = 0
        assert cfg.pthrDelay == 5000
        cfg.pthrDelay = 70000
        assert cfg.pthrDelay == 70000
        cfg.lthrDelay = 0
        assert cfg.lthrDelay == 0
        assert nixl_pacing.pace(0)
        assert bindings.nixlAgentConfig.__mro__[1] is original  # wrapped once, not twice
        cfg = bindings.nixlAgentConfig()
        cfg.pthrDelay = 0
        assert cfg.pthrDelay == 0
    finally:
        bindings.nixlAgentConfig = original
