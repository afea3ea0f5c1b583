"""The workload generator (``workloads``): same seed, same bytes; each family's statistics
within stated tolerances of its knobs; the files round-trip through the trace reader and the
simulator; ``workload stats`` reproduces the shipped conversation trace's published figures."""

from __future__ import annotations

import hashlib
import math
import statistics
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from data_plane.engines import simulate
from data_plane.engines.core import default_hash_config
from data_plane.engines.trace import MooncakeTrace, read_mooncake
from workloads import (
    FAMILY_NAMES, SCORE_SET, TUNE_SET, Case, Spec, check_apart, default_rate, dumps, generate, ideal_hit_rate, parse_cases,
    score_summary, trace_stats,
)
from workloads.arrivals import arrival_times, fitted
from workloads.blocks import BlockSpace
from workloads.families import Agentic, Chat, LongContext, Rag
from workloads.rng import Draws

ROOT = Path(__file__).resolve().parents[2]
CONVERSATION = ROOT / "traces" / "mooncake_conversation_trace.jsonl"


def _gen(family: str, seed: int, duration_s: float = 600.0, **kw) -> list:
    return generate(Spec(family, seed, duration_s=duration_s, **kw))


# -- determinism --------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_same_seed_same_bytes_other_seed_other_bytes(family):
    a = dumps(_gen(family, 7, 120))
    assert a and a == dumps(_gen(family, 7, 120))
    assert a != dumps(_gen(family, 8, 120))


def test_bytes_are_pinned():
    """The digest of one generated file, computed once: a change to any distribution, the id
    numbering or the JSON layout changes it (and must say so: every published figure on a
    generated workload moves with it)."""
    text = dumps(_gen("mixed", 3, 60))
    assert hashlib.sha256(text.encode()).hexdigest()[:16] == PINNED_MIXED_3_60S


PINNED_MIXED_3_60S = "48aa2c976cee56c8"


def test_same_bytes_in_a_fresh_interpreter(tmp_path):
    """Another process (other hash seed, so any set/dict-order dependence would show) writes the
    same file through the CLI."""
    out = tmp_path / "a.jsonl"
    env = {"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-m", "switchyard", "workload", "generate", "--family", "rag", "--seed", "5",
                    "--duration", "60", "--out", str(out)], check=True, cwd=ROOT, env=env, capture_output=True)
    assert out.read_text() == dumps(_gen("rag", 5, 60))


# -- each family against its knobs ----------------------------------------------------------------


def _lognormal_mean(median: float, sigma: float) -> float:
    return median * math.exp(sigma ** 2 / 2)


def test_poisson_rate_within_10_percent():
    for family in ("chat", "rag"):
        recs = _gen(family, 1, 600, rate=5.0)
        assert abs(len(recs) / 600 - 5.0) / 5.0 < 0.10, (family, len(recs))


def test_bursty_arrivals_have_the_asked_cv():
    """Gamma gaps with cv 3: the measured cv within 15% over 20,000 gaps, the rate within 5%."""
    ts = arrival_times("bursty", 10.0, 2000.0, Draws("t", 1), cv=3.0)
    gaps = [b - a for a, b in zip(ts, ts[1:])]
    cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
    assert abs(cv - 3.0) / 3.0 < 0.15
    assert abs(len(ts) / 2000.0 - 10.0) / 10.0 < 0.05


@pytest.mark.parametrize("process", ["diurnal", "step", "ramp", "flash"])
def test_shaped_arrivals_follow_their_curve(process):
    """The planner's curves, stretched to the run: the overall rate within 5% of the asked mean,
    and each tenth of the run within 20% of the curve's mean over it."""
    rate, dur = 20.0, 1000.0
    ts = arrival_times(process, rate, dur, Draws("shape", process))
    assert abs(len(ts) / dur - rate) / rate < 0.05
    curve = fitted(process, rate, dur)
    for k in range(10):
        lo, hi = k * dur / 10, (k + 1) * dur / 10
        want = sum(curve.rate(lo + (i + 0.5) * (hi - lo) / 100) for i in range(100)) / 100 * (hi - lo)
        got = sum(1 for t in ts if lo <= t < hi)
        assert abs(got - want) / want < 0.2, (k, got, want)


def test_chat_follows_its_knobs():
    k = Chat()
    recs = _gen("chat", 2, 1800)
    osl = [r.output_length for r in recs]
    # Answers: log-normal mean within 10%.
    assert abs(statistics.fmean(osl) / _lognormal_mean(k.output_tokens_median, k.output_tokens_sigma) - 1) < 0.10
    # Turns per conversation: geometric with mean turns_mean, for conversations begun and
    # ended inside the run (within 15%).
    by_session: dict[str, list] = {}
    for r in recs:
        by_session.setdefault(r.session_id, []).append(r)
    whole = [s for s in by_session.values() if s[0].turn == 0 and s[-1].timestamp_ms < 1_200_000]
    assert abs(statistics.fmean(len(s) for s in whole) / k.turns_mean - 1) < 0.15
    # Each turn's prompt extends the last one: its blocks start with the previous prompt's
    # full blocks.
    for s in whole:
        for a, b in zip(s, s[1:]):
            full = a.input_length // 512
            assert b.hash_ids[:full] == a.hash_ids[:full]
            assert b.input_length > a.input_length + a.output_length


def test_agentic_matches_mooncake_toolagent_means():
    """Mooncake's toolagent trace: 8,596 input and 182 output tokens per request on average;
    over three seeds the defaults land within 15% of both."""
    recs = [r for s in (1, 2, 3) for r in _gen("agentic", s, 600)]
    assert abs(statistics.fmean(r.input_length for r in recs) / 8596 - 1) < 0.15
    assert abs(statistics.fmean(r.output_length for r in recs) / 182 - 1) < 0.15


def test_agentic_sub_agents_share_the_parent_prefix():
    recs = _gen("agentic", 4, 600, knobs=(("fanout_prob", "1.0"),))
    by_session: dict[str, list] = {}
    for r in recs:
        by_session.setdefault(r.session_id, []).append(r)
    # The parallel sub-agents of a fan-out start at one instant with the parent's context and a
    # sub-task of their own (log-normal, median 200 tokens: under 4 blocks in practice), so their
    # prompts agree on all but their last few blocks.
    same_start = 0
    for s in by_session.values():
        starts: dict[int, list] = {}
        for r in s:
            starts.setdefault(r.timestamp_ms, []).append(r)
        for group in starts.values():
            if len(group) >= 2:
                first = group[0].hash_ids
                common = 0
                while all(len(g.hash_ids) > common and g.hash_ids[common] == first[common] for g in group):
                    common += 1
                assert common >= min(len(g.hash_ids) for g in group) - 4
                same_start += 1
    assert same_start > 10


def test_rag_documents_follow_zipf():
    """With Zipf(1) over the corpus, the most popular document leads about 1/H(N) of the
    questions (H: harmonic number); within 25%."""
    k = Rag()
    recs = _gen("rag", 3, 1800)
    # The system prompt's block, then the first document's first block.
    top = Counter(r.hash_ids[0:2] for r in recs).most_common(1)[0][1]
    h_n = sum(1 / i for i in range(1, k.corpus_docs + 1))
    assert abs(top / len(recs) / (1 / h_n) - 1) < 0.25
    mean_in = k.system_prompt_tokens + k.docs_per_request * _lognormal_mean(k.doc_tokens_median, 0.3) \
        + _lognormal_mean(k.question_tokens_median, k.question_tokens_sigma)
    # Within 10%: each document has one length, and the popular ones weigh more.
    assert abs(statistics.fmean(r.input_length for r in recs) / mean_in - 1) < 0.10


def test_long_context_has_a_heavy_tail_and_little_sharing():
    k = LongContext()
    s = trace_stats(_gen("long-context", 1, 1800))
    assert abs(s.isl_p50 / k.doc_tokens_median - 1) < 0.15
    assert s.isl_p99 > 8 * k.doc_tokens_median  # median * e^(2.33 sigma) = 10x at sigma 1
    assert s.isl_max <= k.max_input_tokens
    assert s.shared_block_frac < 2 * k.revisit_prob


def test_mixed_shares_requests_by_tenant_weight():
    recs = _gen("mixed", 1, 1200)
    s = trace_stats(recs)
    share = {t: n / s.requests for t, n in s.tenants.items()}
    assert abs(share["assistant"] - 0.5) < 0.08 and abs(share["agents"] - 0.25) < 0.08
    assert {r.priority for r in recs} == {1, 2, 3}


def test_block_space_shares_exactly_the_common_prefix():
    space = BlockSpace()
    a = space.hash_ids([("sys", 1000), ("u1", 100)])          # blocks: [sys 0-512], [sys 512-1000 + u1 0-24], [u1 24-100]
    b = space.hash_ids([("sys", 1000), ("u1", 100), ("a1", 500)])
    c = space.hash_ids([("sys", 1000), ("other", 100)])
    assert len(a) == 3 and len(b) == 4
    assert b[:2] == a[:2] and b[2] != a[2]  # the partly filled block changes once text follows it
    assert c[0] == a[0] and c[1] != a[1]


def test_unknown_family_knob_and_process_are_refused():
    with pytest.raises(ValueError, match="unknown family"):
        _gen("video", 1)
    with pytest.raises(ValueError, match="no knob"):
        _gen("chat", 1, knobs=(("turns", "3"),))
    with pytest.raises(ValueError, match="arrival"):
        _gen("chat", 1, arrival="weekly")


# -- round trips ----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_round_trip_through_the_trace_reader(family, tmp_path):
    recs = _gen(family, 11, 90)
    path = tmp_path / "t.jsonl"
    path.write_text(dumps(recs))
    assert read_mooncake(path) == recs


def test_round_trip_through_the_simulator(tmp_path):
    """A generated chat trace, read back and run on one simulated worker: every request
    finishes with its output length, and the engine's prefix hits reach the trace's ideal
    (one infinite cache), never more (engine blocks of 64 tokens; the last token is never a hit)."""
    recs = _gen("chat", 6, 120, rate=2.0)
    path = tmp_path / "chat.jsonl"
    path.write_text(dumps(recs))
    back = read_mooncake(path)
    reqs = list(MooncakeTrace(default_hash_config(64)).requests(back))
    res = simulate(reqs, "mocker", num_workers=1)
    assert len(res.requests) == len(recs) and all(r.finished for r in res.requests)
    assert [r.output_tokens for r in res.requests] == [max(r.output_length, 1) for r in recs]
    hit = sum(r.cached_tokens for r in res.requests) / sum(r.input_length for r in recs)
    ideal = ideal_hit_rate(recs)
    assert 0.9 * ideal <= hit <= ideal + 1e-9, (hit, ideal)


# -- stats of the shipped trace ---------------------------------------------------------------------


def test_stats_reproduce_the_conversation_trace_figures():
    """docs/workloads.md and ../shared/docs/anchors.md: 12,031 requests, 37% of blocks seen
    before, ideal hit rate 0.374 with one infinite cache, 0.196 / 0.139 round robin over 4 / 8."""
    s = trace_stats(read_mooncake(CONVERSATION), (1, 4, 8))
    assert s.requests == 12031
    assert round(s.shared_block_frac, 2) == 0.37
    assert (round(s.ideal_hit[1], 3), round(s.ideal_hit[4], 3), round(s.ideal_hit[8], 3)) == (0.374, 0.196, 0.139)
    assert round(s.isl_mean) == 12035 and s.isl_p50 == 6909


def test_cli_generate_stats_ends_with_the_result_line():
    out = subprocess.run([sys.executable, "-m", "switchyard", "workload", "generate", "--family", "agentic",
                          "--seed", "1", "--duration", "120", "--stats"], check=True, cwd=ROOT,
                         capture_output=True, text=True).stdout
    last = out.strip().splitlines()[-1]
    assert last.startswith("RESULT requests=")
    keys = [kv.split("=")[0] for kv in last.split()[1:]]
    assert keys == ["requests", "isl_p50", "isl_p99", "osl_p50", "shared_block_frac", "ideal_hit_1", "ideal_hit_rr8"]


def test_cli_stats_refuses_a_bad_trace(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10}\n')
    p = subprocess.run([sys.executable, "-m", "switchyard", "workload", "stats", str(bad)], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode == 1 and "bad.jsonl:1" in p.stderr


# -- tune / score sets ----------------------------------------------------------------------------


def test_tune_and_score_sets_cover_every_family_with_disjoint_seeds():
    assert {c.family for c in TUNE_SET} == {c.family for c in SCORE_SET} == set(FAMILY_NAMES)
    assert not {c.seed for c in TUNE_SET} & {c.seed for c in SCORE_SET}
    check_apart(TUNE_SET, SCORE_SET)
    with pytest.raises(ValueError, match="share chat:1"):
        check_apart(TUNE_SET, (Case("chat", 1),))


def test_parse_cases():
    assert parse_cases("chat:1, rag:4") == (Case("chat", 1), Case("rag", 4))
    assert parse_cases("all:9") == tuple(Case(f, 9) for f in FAMILY_NAMES)
    for bad in ("chat", "video:1", "chat:x", ""):
        with pytest.raises(ValueError):
            parse_cases(bad)


def test_score_summary_names_the_worst_case():
    scores = {Case("chat", 2): {"gain": 1.3, "p99": 100.0}, Case("rag", 2): {"gain": 0.9, "p99": 300.0},
              Case("agentic", 2): {"gain": float("nan"), "p99": 5.0}}
    s = score_summary(scores, "gain", higher_is_better=True)
    assert s.worst == Case("agentic", 2)  # a NaN is the worst
    s = score_summary({c: v for c, v in scores.items() if c.family != "agentic"}, "gain", higher_is_better=True)
    assert s.worst == Case("rag", 2)
    assert s.result_fields == "score_cases=2 worst_case=rag:2 worst_gain=0.9000 worst_p99=300.0000"
    assert "<- worst" in s.table.splitlines()[2]


# -- the demo's --workload -------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_demo_workload_trace_holds_the_limit(family, tmp_path):
    """``switchyard up --demo --workload F`` replays the first ``--limit`` requests of this file."""
    from ops.demo.up import workload_trace

    path = workload_trace(family, 1, 200, tmp_path)
    assert path.parent == tmp_path / "demo"
    recs = read_mooncake(path)
    assert len(recs) >= 200 and recs == _gen(family, 1, 1.5 * 200 / default_rate(family) + 60.0)


def test_up_refuses_trace_and_workload_together():
    p = subprocess.run([sys.executable, "-m", "switchyard", "up", "--workload", "chat", "--trace", "x.jsonl"],
                       cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 2 and "not both" in p.stderr
