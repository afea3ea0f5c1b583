"""Smoke test of ``switchyard bench peers``'s harness on the sides CI has (the peers' own
environment, .venv-peers, is a 2 GB install the bench's users make with scripts/peers-env.sh):
direct, ours and nginx in front of the same two real simulated workers, a handful of requests
each, and one routing-quality run per side on fresh workers. It checks the harness measures and
asserts each side's mode, not any figure."""

from __future__ import annotations

import math

from benchmarks import peers_bench


def test_peers_bench_direct_ours_nginx(kafka_bootstrap, capsys):
    out = peers_bench.run(["ours", "nginx"], rounds=1, n=8, warmup=2, concurrent=64, limit=3, rates=(20.0,),
                          max_output=4)
    printed = capsys.readouterr().out
    summary = out["summary"]
    assert set(summary) == {"direct", "ours", "nginx"}
    for side in ("ours", "nginx"):
        row = summary[side]
        assert all(math.isfinite(x) for x in row["overhead_p50_ms"] + row["overhead_p99_ms"]), row
        assert row["cpu_ms_per_req"][0] >= 0
        assert row["rps_c32"][0] > 0 and row["rps_c128"][0] > 0
        assert 0.0 <= row["hit_rate_20.0"][0] <= 1.0
        assert row["ttft_p99_ms_20.0"][0] > 0
    # /proc counts 10 ms ticks: nginx's ~0.1 ms a request may read 0 over so few; ours' cannot.
    assert summary["ours"]["cpu_ms_per_req"][0] > 0
    # Every request answered, and each side's mode was asserted from its own start line/config.
    assert "errors 0, mode kv (its start line)" in printed
    assert "errors 0, mode round robin (its config)" in printed
    assert "3/3 ok" in printed
    result = [line for line in printed.splitlines() if line.startswith("RESULT ")]
    assert len(result) == 1
    keys = {kv.split("=")[0] for kv in result[0].split()[1:]}
    for side in ("ours", "nginx"):
        for k in ("overhead_p50_ms", "overhead_p99_ms", "cpu_ms_per_req", "rps_c128", "hit_rate", "ttft_p99_ms"):
            assert f"{side}_{k}" in keys
    assert out["health_p50_ms"] > 0
