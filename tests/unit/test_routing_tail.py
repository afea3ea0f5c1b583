"""benchmarks/routing_tail.py: configs from the command line, and the per-request look at a run."""

from __future__ import annotations

import pytest

from benchmarks import tune_score
from benchmarks.routing_tail import idle_error_lines, parse_config, run_recorded, tail_lines
from control_plane.router import RouterConfig
from control_plane.router.errors import RouterConfigError
from data_plane.engines import load_profile
from workloads.sets import Case


def test_parse_config_types_each_field_over_the_default():
    c = parse_config("cost=ttft, prefill_load_scale=10,imbalance_guard=false")
    assert (c.cost, c.prefill_load_scale, c.imbalance_guard) == ("ttft", 10.0, False)
    assert parse_config("") == RouterConfig()
    with pytest.raises((RouterConfigError, ValueError)):
        parse_config("cost=latency")


def test_a_recorded_run_lists_its_slowest_requests_and_the_idle_predictions(tmp_path):
    prof = load_profile("mocker")
    case = Case("agentic", 2)
    _, reqs = tune_score.load_cases((case,), tmp_path, prof.block_size, duration_s=15)
    res, routed = run_recorded(reqs[case], RouterConfig(cost="ttft"), True)
    assert set(routed) == {r.request.request_id for r in res.records}
    lines = tail_lines(res, routed, 3)
    assert len(lines) == 4 and lines[0].split()[:2] == ["ttft", "wait"]
    ttfts = [float(line.split()[0]) for line in lines[1:]]
    assert ttfts == sorted(ttfts, reverse=True)
    idle = idle_error_lines(res, routed, prof, prof.block_size)
    assert idle[0].startswith("idle candidates") and len(idle) > 1
    # Each bucket's p10 <= p50 <= p90, all positive.
    for line in idle[1:]:
        words = line.split()
        p10, p50, p90 = (float(words[words.index(k) + 1]) for k in ("p10", "p50", "p90"))
        assert 0 < p10 <= p50 <= p90
