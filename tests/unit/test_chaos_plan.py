"""The chaos plan (ops/chaos/plan.py): pure, seeded, every fault once, spaced."""

from __future__ import annotations

import pytest

from ops.chaos.plan import FAULT_KINDS, PlanConfig, PlanError, make_plan, parse_faults


def _config(**overrides) -> PlanConfig:
    base = {"seed": 3, "duration_s": 120.0, "warmup_s": 5.0, "gap_s": 8.0, "overload_s": 20.0}
    return PlanConfig(**{**base, **overrides})


def test_same_seed_same_plan_other_seed_other_plan() -> None:
    assert make_plan(_config()) == make_plan(_config())
    assert make_plan(_config(seed=4)).faults != make_plan(_config()).faults


def test_every_requested_fault_is_scheduled_once() -> None:
    plan = make_plan(_config())
    assert sorted(f.kind for f in plan.faults) == sorted(FAULT_KINDS)
    some = ("router_kill", "broker_kill")
    assert sorted(f.kind for f in make_plan(_config(faults=some)).faults) == sorted(some)


@pytest.mark.parametrize("seed", range(20))
def test_spacing_warmup_and_overload_are_respected(seed: int) -> None:
    """7 faults, gap 8 s: the window is [5, 120 - 20 - 8] = [5, 92]; 6 gaps take 48 s of it."""
    plan = make_plan(_config(seed=seed))
    times = [f.at_s for f in plan.faults]
    assert times == sorted(times)
    assert times[0] >= 5.0
    assert all(b - a >= 8.0 - 1e-3 for a, b in zip(times, times[1:]))
    assert plan.overload is not None and (plan.overload.start_s, plan.overload.end_s) == (100.0, 120.0)
    assert times[-1] <= plan.overload.start_s - 8.0 + 1e-3


def test_in_order_keeps_the_order_evenly_spaced() -> None:
    """3 faults in [5, 120 - 20 - 8 = 92]: at 5, 48.5, 92."""
    kinds = ("decode_kill", "broker_hang", "router_kill")
    plan = make_plan(_config(faults=kinds, in_order=True))
    assert [f.kind for f in plan.faults] == list(kinds)
    assert [f.at_s for f in plan.faults] == [5.0, 48.5, 92.0]


def test_overload_factor_applies_only_in_its_phase() -> None:
    plan = make_plan(_config(overload_factor=6.0))
    assert plan.rate_factor(99.9) == 1.0
    assert plan.rate_factor(100.0) == 6.0
    assert plan.rate_factor(120.0) == 1.0
    assert make_plan(_config(overload_s=0)).rate_factor(119) == 1.0


def test_shifted_moves_the_rest_of_the_plan_not_the_past() -> None:
    plan = make_plan(_config(faults=("router_kill", "decode_kill"), in_order=True))
    later = plan.shifted(0, 10.0)
    assert later.faults[0] == plan.faults[0]
    assert later.faults[1].at_s == plan.faults[1].at_s + 10.0
    assert later.overload.start_s == plan.overload.start_s + 10.0 and later.duration_s == 130.0


def test_bad_fault_names_say_which_and_what_is_known() -> None:
    with pytest.raises(PlanError, match=r"unknown fault\(s\) 'power_cut'.*known: broker_kill"):
        parse_faults("router_kill,power_cut")
    with pytest.raises(PlanError, match="given twice"):
        _config(faults=("router_kill", "router_kill"))
    assert parse_faults("all") == FAULT_KINDS and parse_faults(" decode_kill , router_kill") == (
        "decode_kill", "router_kill")


def test_too_short_a_run_and_a_hang_below_the_session_timeout_are_refused() -> None:
    """5 + 8 x 8 + 20 = 89 s needed; 60 s given."""
    with pytest.raises(PlanError, match="too short for 8 faults.*= 89 s"):
        make_plan(_config(duration_s=60.0))
    with pytest.raises(PlanError, match="must exceed the brokers' session timeout"):
        _config(hang_s=1.5)


def test_the_plan_knows_the_brokers_session_timeout() -> None:
    from ops.stack.kafka import BROKER_SESSION_TIMEOUT_MS

    assert PlanConfig().session_timeout_s * 1000 == BROKER_SESSION_TIMEOUT_MS


def test_a_process_records_an_exit_nobody_asked_for_once(tmp_path) -> None:
    import sys

    from ops.chaos.system import Proc

    p = Proc("x", [], {}, tmp_path)
    p.popen = __import__("subprocess").Popen([sys.executable, "-c", "import os; os.abort()"],
                                             start_new_session=True)
    p.popen.wait(30)
    p.note_crash()
    p.kill9()  # a fault meeting the dead process: no second record
    assert p.crashes == ["x start 0 exited -6"]
    p.popen = __import__("subprocess").Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                                             start_new_session=True)
    p._ended_by_us = False
    p.kill9()
    p.note_crash()
    assert p.crashes == ["x start 0 exited -6"]  # killed by us: not a crash
