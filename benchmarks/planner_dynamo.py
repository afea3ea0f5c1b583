"""Dynamo's planner in ``switchyard bench planner``, set up the way its own guide says.

Dynamo's guide (``docs/benchmarks/planner-replay-benchmarking.md`` in ai-dynamo/dynamo, its
disaggregated quick start) runs the planner in its offline replay with both loops on
(``enable_throughput_scaling`` and ``enable_load_scaling``), throughput decisions every 300 s and
load decisions every 10 s, a performance model of the engine (there: AIC timing given as
``aic_*`` engine arguments, which makes its bootstrap install benchmark forward passes), and the
engine's start-up time. Here, against ours:

* **The same engine and its profile.** Dynamo runs on its own mocker with its polynomial timing,
  the model our simulator reproduces (``data_plane/engines/profiles/mocker.toml``), with the
  same limits and ``max_model_len`` (:func:`model_len`). Its SLA target gets that engine's
  profile: :func:`profile_fpms` evaluates our profile's timing model (the one the simulator
  steps with) at a grid of prefill and decode forward passes, and the driver installs them as
  its benchmark FPMs. Its bootstrap status must read ``installed``; anything else marks the
  comparison not valid.
* **Every optimization target** Dynamo's ``PlannerConfig`` has: ``throughput`` (its default) and
  ``latency`` (static queue/KV thresholds, relative to ``max_model_len`` and KV capacity),
  ``load`` (user thresholds on queued prefill tokens and decode KV use), ``sla`` (its
  performance model toward TTFT/ITL targets). Dynamo forces load scaling on and throughput
  scaling off for the first three.
* **The same routing.** Dynamo's replay routes round robin or by its KV router; ours routes
  least-loaded. The comparison runs both round robin: ours through :class:`RoundRobinSim`
  (the bench's simulator, each pool cycled like Dynamo's ``router_mode="round_robin"``).
* **The same tuning budget.** Each target tries the first ``budget`` configs of
  :data:`CANDIDATES` (the first is the guide's) on the tune loads, and keeps the one with the
  best worst-case attainment there (ties: fewer replica-seconds); only that one is scored.
* **Its own reference.** Each Dynamo row is read against the best static split on Dynamo's
  mocker under the same routing (the best round-robin split of our simulator and its two
  neighbours, run on Dynamo's mocker), and as a ratio to the oracle's replica-seconds
  (``planner_oracle``: fewest replica-seconds matching static's attainment with perfect
  foresight, on our simulator).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.planner_bench import (
    PlannerConfig,
    Req,
    Row,
    Sim,
    SimResult,
    Worker,
    _fresh,
    best_static_split,
    initial_split,
    max_gpus,
    reversals,
)
from data_plane.engines import load_profile
from data_plane.engines.timing import StepShape

ROOT = Path(__file__).resolve().parent.parent
DYNAMO_ENV = ROOT / ".venv-dynamo"
DYNAMO_DRIVER = Path(__file__).resolve().parent / "dynamo_planner_replay.py"

#: The guide's planner settings (its disagg quick start): both loops, its intervals.
GUIDE: Mapping[str, object] = {"enable_throughput_scaling": True, "enable_load_scaling": True,
                               "throughput_adjustment_interval_seconds": 300,
                               "load_adjustment_interval_seconds": 10}
#: The served model's context length, given to the mocker as ``max_model_len`` (Dynamo's planner
#: reads it as ``context_length``): a 128k-context model. The shipped trace's longest request is
#: 126,527 tokens; a load with longer requests (the long-context and mixed workload families reach
#: about 200k) is served by a 256k-context model (:data:`LONG_MODEL_LEN`); :func:`dynamo_job`
#: refuses a load longer than that.
MAX_MODEL_LEN = 131072
LONG_MODEL_LEN = 262144


def model_len(reqs: Sequence[Req]) -> int:
    """The context length of the model serving ``reqs``: :data:`MAX_MODEL_LEN` when every request
    fits, else :data:`LONG_MODEL_LEN` (a ``ValueError`` when one does not fit that either)."""
    longest = max((len(r.engine.prompt) + r.osl for r in reqs), default=0)
    for n in (MAX_MODEL_LEN, LONG_MODEL_LEN):
        if longest <= n:
            return n
    worst = max(reqs, key=lambda r: len(r.engine.prompt) + r.osl)
    raise ValueError(f"request {worst.rid}: {len(worst.engine.prompt)} + {worst.osl} tokens exceed max_model_len "
                     f"{LONG_MODEL_LEN}")
#: Dynamo's optimization targets (``PlannerConfig.optimization_target``).
TARGETS = ("throughput", "latency", "load", "sla")
#: Configs tuning tries per target, in order (the first is the guide's). ``ttft_scale`` and
#: ``itl_scale`` set the planner's SLA targets as a fraction of the scored SLOs; every other key
#: is a ``PlannerConfig`` field. Queue thresholds in tokens (a prefill worker clears about 55k
#: prompt tokens/s here, so 64k queued is a bit over 1 s of TTFT); KV rates in percent;
#: ``min_endpoint`` a floor of replicas per pool (the easy targets scale a quiet pool down to 1).
CANDIDATES: Mapping[str, Sequence[Mapping[str, object]]] = {
    "throughput": ({}, {"load_adjustment_interval_seconds": 5}, {"load_adjustment_interval_seconds": 30},
                   {"load_adjustment_interval_seconds": 5, "min_endpoint": 2}),
    "latency": ({}, {"load_adjustment_interval_seconds": 5}, {"load_adjustment_interval_seconds": 30},
                {"load_adjustment_interval_seconds": 5, "min_endpoint": 2}),
    "load": ({"prefill_scale_up_queue_tokens": 65536, "prefill_scale_down_queue_tokens": 16384,
              "decode_scale_up_kv_rate": 70, "decode_scale_down_kv_rate": 30},
             {"prefill_scale_up_queue_tokens": 32768, "prefill_scale_down_queue_tokens": 8192,
              "decode_scale_up_kv_rate": 50, "decode_scale_down_kv_rate": 20},
             {"prefill_scale_up_queue_tokens": 16384, "prefill_scale_down_queue_tokens": 2048,
              "decode_scale_up_kv_rate": 50, "decode_scale_down_kv_rate": 20, "load_adjustment_interval_seconds": 5},
             {"prefill_scale_up_queue_tokens": 131072, "prefill_scale_down_queue_tokens": 32768,
              "decode_scale_up_kv_rate": 85, "decode_scale_down_kv_rate": 50}),
    "sla": ({}, {"ttft_scale": 0.5, "itl_scale": 0.8},
            {"ttft_scale": 0.5, "itl_scale": 0.8, "throughput_adjustment_interval_seconds": 60},
            {"ttft_scale": 0.25, "itl_scale": 0.6, "throughput_adjustment_interval_seconds": 60,
             "load_adjustment_interval_seconds": 5}),
}
#: Configs per target tried on the tune loads (ours gets the same number).
TUNE_BUDGET = 4


def planner(target: str, knobs: Mapping[str, object], ttft_slo_ms: float, itl_slo_ms: float) -> dict:
    """Dynamo's ``PlannerConfig`` fields for one target and one candidate (see CANDIDATES)."""
    cfg: dict = {**GUIDE, "optimization_target": target, "ttft_ms": ttft_slo_ms, "itl_ms": itl_slo_ms}
    for k, v in knobs.items():
        if k == "ttft_scale":
            cfg["ttft_ms"] = ttft_slo_ms * float(v)
        elif k == "itl_scale":
            cfg["itl_ms"] = itl_slo_ms * float(v)
        else:
            cfg[k] = v
    return cfg


def profile_fpms(profile_name: str = "mocker") -> dict:
    """Benchmark forward passes of the engine, from the profile's own timing model: prefill, one
    fresh prompt of ``T`` tokens per pass (up to the step budget); decode, ``n`` requests of
    context ``c`` each (within the KV capacity). ``{"prefill": [[T, s]], "decode": [[n, n*c, s]]}``."""
    prof = load_profile(profile_name)
    cap = prof.kv_capacity_tokens
    prefill = []
    for t in range(512, prof.max_num_batched_tokens + 1, 512):
        shape = StepShape(prefill_tokens=t, prefill_seqs=1, prefill_attention_pairs=t * (t + 1) / 2,
                          prefill_kv_tokens=t, kv_capacity_tokens=cap)
        prefill.append([t, prof.timing.step_ms(shape) / 1000.0])
    decode = []
    for c in (500, 2000, 4000, 8000, 16000, 32000):
        for n in (1, 8, 32, 64, 128, 256):
            if n > prof.max_num_seqs or n * c > cap:
                continue
            shape = StepShape(decode_seqs=n, decode_context_tokens=n * c, kv_capacity_tokens=cap)
            decode.append([n, n * c, prof.timing.step_ms(shape) / 1000.0])
    return {"prefill": prefill, "decode": decode}


@dataclass(frozen=True)
class Run:
    """One replay in a job: its row label, first split, Dynamo planner config (None: static)."""

    label: str
    prefill: int
    decode: int
    planner: dict | None


def dynamo_job(reqs: Sequence[Req], runs: Sequence[Run], *, budget: int, ttft_slo_ms: float, itl_slo_ms: float,
               startup_s: float, router_mode: str = "round_robin") -> dict:
    """One load as the JSON job ``dynamo_planner_replay.py`` reads: the same requests (arrival,
    lengths, and each block's prefix identity as an integer hash id, equal digests equal ids), our
    ``mocker`` profile's engine limits and :func:`model_len`, its profile FPMs, the same
    SLOs, start-up time and GPU budget, and the runs."""
    prof = load_profile("mocker")
    ids: dict[object, int] = {}
    rows = []
    max_model_len = model_len(reqs)
    for r in reqs:
        digests = r.engine.prompt_digests or r.engine.prompt_hashes or ()
        hash_ids = [ids.setdefault(d, len(ids)) for d in digests]
        while len(hash_ids) * prof.block_size < len(r.engine.prompt):
            hash_ids.append(ids.setdefault((r.rid, len(hash_ids)), len(ids)))  # a partial last block: its own id
        rows.append({"t_ms": r.arrival_ms, "isl": len(r.engine.prompt), "osl": r.osl, "hash_ids": hash_ids})
    return {"requests": rows,
            "engine": {"block_size": prof.block_size, "num_gpu_blocks": prof.num_device_blocks,
                       "max_num_seqs": prof.max_num_seqs, "max_num_batched_tokens": prof.max_num_batched_tokens,
                       "max_model_len": max_model_len},
            "startup_s": startup_s, "ttft_ms": ttft_slo_ms, "itl_ms": itl_slo_ms, "gpu_budget": budget,
            "router_mode": router_mode, "profile_fpms": profile_fpms(),
            "runs": [{"prefill": r.prefill, "decode": r.decode, "planner": r.planner} for r in runs]}


def dynamo_result(reqs: Sequence[Req], out: dict, end_arrival_ms: float, start: tuple[int, int]) -> SimResult:
    """One run of Dynamo's replay as a :class:`SimResult`, so one scorer serves both sides.
    Dynamo's clock starts at the trace's first (integer ms) timestamp, so its times are shifted
    by that much back onto ours. Requests pair up by (arrival ms as the job wrote it, prompt
    length, output length), in order among equals. Workers come from the planner's per-tick
    topology counts (Dynamo's 5 s ticks), starting from ``start``: a pool's count rising starts
    workers at that tick, falling ends them, so replica-seconds and max GPUs are at that
    resolution; decisions are changes of a pool's target (active + starting)."""
    mine = _fresh(list(reqs))
    base = min((round(r.arrival_ms) for r in mine), default=0)
    waiting: dict[tuple[int, int, int], list[Req]] = {}
    for r in sorted(mine, key=lambda r: r.arrival_ms):
        waiting.setdefault((round(r.arrival_ms) - base, len(r.engine.prompt), r.osl), []).append(r)
    for d in sorted(out["per_request"], key=lambda x: x["arrival_ms"]):
        same = waiting.get((round(d["arrival_ms"]), d["isl"], d["osl"]))
        if not same:
            raise ValueError(f"Dynamo's replay returned a request the job did not send: {d}")
        r = same.pop(0)
        if d["status"] == "completed":
            r.first_ms, r.last_ms, r.outputs = d["first_ms"] + base, d["last_ms"] + base, d["outputs"]
    workers: list[Worker] = []
    alive: dict[str, list[Worker]] = {"prefill": [], "decode": []}
    target: dict[str, int] = {}
    decisions: list[tuple[float, str, int, int]] = []
    ticks = [{"at_ms": 0.0, **{p: {"active": n, "starting": 0, "draining": 0} for p, n in
                                (("prefill", start[0]), ("decode", start[1]))}}]
    ticks += [{**t, "at_ms": t["at_ms"] + base} for t in out["ticks"]]
    for t in ticks:
        for pool in ("prefill", "decode"):
            c = t[pool]
            n = c["active"] + c["starting"] + c["draining"]
            while len(alive[pool]) < n:
                w = Worker(f"{pool}-{len(workers)}", pool, None, t["at_ms"])  # type: ignore[arg-type]
                alive[pool].append(w)
                workers.append(w)
            while len(alive[pool]) > n:
                alive[pool].pop().gone_ms = t["at_ms"]
            want = c["active"] + c["starting"]
            if pool in target and want != target[pool]:
                decisions.append((t["at_ms"], pool, target[pool], want))
            target[pool] = want
    return SimResult("dynamo", mine, workers, end_arrival_ms, decisions)


@dataclass
class Outcome:
    """One Dynamo run: its result (None: it failed, ``error`` says how), its planner's bootstrap
    metadata and the warnings Dynamo logged."""

    run: Run
    result: SimResult | None
    bootstrap: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    error: str = ""

    @property
    def status(self) -> str:
        return str(self.bootstrap.get("status", "failed" if self.error else "?"))


def run_dynamo(reqs: Sequence[Req], runs: Sequence[Run], **job_args) -> list[Outcome]:
    """The runs on this load, in one child process in ``.venv-dynamo`` (created by
    scripts/dynamo-planner-env.sh when missing). A failure is every run's ``error``, with the
    exact text; never a number."""
    env = subprocess.run(["bash", str(ROOT / "scripts" / "dynamo-planner-env.sh")], capture_output=True, text=True)
    if env.returncode != 0:
        err = f"scripts/dynamo-planner-env.sh failed ({env.returncode}): {env.stderr.strip()[-2000:]}"
        return [Outcome(r, None, error=err) for r in runs]
    try:
        job = dynamo_job(reqs, runs, **job_args)
    except ValueError as e:  # a load Dynamo's engine refuses (a request over max_model_len): said, never scored
        return [Outcome(r, None, error=str(e)) for r in runs]
    # Dynamo's runtime writes a logging config to a temporary file per start and leaves it.
    with tempfile.TemporaryDirectory(prefix="switchyard-dynamo-") as tmp:
        proc = subprocess.run([str(DYNAMO_ENV / "bin" / "python"), str(DYNAMO_DRIVER)], input=json.dumps(job),
                              capture_output=True, text=True, env={**os.environ, "TMPDIR": tmp})
    if proc.returncode != 0:
        err = f"dynamo_planner_replay.py failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}"
        return [Outcome(r, None, error=err) for r in runs]
    end = max(r.arrival_ms for r in reqs)
    return [Outcome(r, dynamo_result(reqs, o, end, (r.prefill, r.decode)), o["bootstrap"], o["warnings"])
            for r, o in zip(runs, json.loads(proc.stdout)["runs"])]


class RoundRobinSim(Sim):
    """The bench's simulator routed round robin in each pool, as Dynamo's replay with
    ``router_mode="round_robin"``: each arrival (prefill) or hand-off (decode) goes to the next
    ready worker of the pool in turn."""

    ROUTING = "round robin"

    def __init__(self, *args, **kwargs) -> None:
        self._turn = {"prefill": 0, "decode": 0}
        super().__init__(*args, **kwargs)

    def _pick(self, pool: str) -> Worker | None:
        ready = [w for w in self.workers.values() if w.pool == pool and w.state == "ready"]
        if not ready:
            return None
        w = ready[self._turn[pool] % len(ready)]
        self._turn[pool] += 1
        return w


@dataclass(frozen=True)
class Tuned:
    """A target's config chosen on the tune loads, and what each candidate scored there."""

    target: str
    knobs: Mapping[str, object]
    tried: tuple[tuple[int, float, float], ...]  # (candidate index, worst attainment, mean replica-s)
    statuses: tuple[str, ...]


def tune(tune_loads: Sequence[tuple[str, list[Req]]], cfg: PlannerConfig, *, budget: int, ttft_slo_ms: float,
         itl_slo_ms: float, startup_s: float, configs: int = TUNE_BUDGET, jobs: int = 1) -> dict[str, Tuned]:
    """Each target's best of its first ``configs`` candidates on the tune loads: the highest
    worst-case attainment, then the fewest mean replica-seconds. A candidate that fails on any
    tune load is out. ``jobs`` loads replay at once (each its own child process)."""
    from concurrent.futures import ThreadPoolExecutor

    scores: dict[tuple[str, int], list[tuple[float, float]]] = {}
    statuses: dict[str, list[str]] = {t: [] for t in TARGETS}

    def replay(load: tuple[str, list[Req]]) -> list[Outcome]:
        reqs = load[1]
        p0, d0 = initial_split(cfg, reqs)
        runs = [Run(f"{t}#{i}", p0, d0, planner(t, k, ttft_slo_ms, itl_slo_ms))
                for t in TARGETS for i, k in enumerate(CANDIDATES[t][:configs])]
        return run_dynamo(reqs, runs, budget=budget, ttft_slo_ms=ttft_slo_ms, itl_slo_ms=itl_slo_ms,
                          startup_s=startup_s)

    with ThreadPoolExecutor(max_workers=max(jobs, 1)) as pool:
        replays = list(pool.map(replay, tune_loads))
    for (name, _reqs), outcomes in zip(tune_loads, replays):
        for o in outcomes:
            t, i = o.run.label.split("#")
            statuses[t].append(o.status)
            if o.result is None:
                print(f"  [tune {name}] dynamo ({t}) config {i}: not run: {o.error}", flush=True)
                scores.setdefault((t, int(i)), []).append((math.nan, math.nan))
                continue
            att, rs = o.result.attainment(ttft_slo_ms, itl_slo_ms), o.result.replica_seconds()
            scores.setdefault((t, int(i)), []).append((att, rs))
            print(f"  [tune {name}] dynamo ({t}) config {i} {dict(CANDIDATES[t][int(i)])}: attainment {att:.4f}, "
                  f"replica-seconds {rs:.0f}, bootstrap {o.status}", flush=True)
    out = {}
    for t in TARGETS:
        tried = []
        for i in range(min(configs, len(CANDIDATES[t]))):
            s = scores.get((t, i), [])
            if not s or any(math.isnan(a) for a, _ in s):
                continue
            tried.append((i, min(a for a, _ in s), sum(r for _, r in s) / len(s)))
        best = max(tried, key=lambda x: (x[1], -x[2]), default=None)
        out[t] = Tuned(t, CANDIDATES[t][best[0]] if best else {}, tuple(tried), tuple(statuses[t]))
        print(f"  [tune] dynamo ({t}): keeps config {best[0] if best else 'none'} {dict(out[t].knobs)}", flush=True)
    return out


def chosen(indices: Mapping[str, int]) -> dict[str, Tuned]:
    """An earlier tuning's choice (target -> candidate index, as ``tune`` printed it), for a rerun
    of the scoring alone; every target must be named."""
    missing = set(TARGETS) - set(indices)
    if missing:
        raise ValueError(f"no tuned config for {sorted(missing)}")
    return {t: Tuned(t, CANDIDATES[t][indices[t]], (), ("reused",)) for t in TARGETS}


def oracle_replica_seconds(reqs: list[Req], static_att: float, static_res: SimResult, *, budget: int,
                           ttft_slo_ms: float, itl_slo_ms: float, startup_s: float) -> float:
    """The oracle's fewest replica-seconds reaching ``static_att`` on this load (planner_oracle's
    schedule and sizing; hold 0 and 30 s), NaN if none of its runs reaches it."""
    # lazy: the module imports this one back (a cycle listed in tests/unit/test_import_graph.py)
    from benchmarks import planner_oracle as po
    # lazy: the module imports this one back (a cycle listed in tests/unit/test_import_graph.py)
    from benchmarks.planner_bench import planner_config

    ocfg = planner_config(budget, ttft_slo_ms, itl_slo_ms, "kalman", lead_time_s=startup_s, slo_quantile=0.8,
                          max_utilization=0.85)
    needs = po.window_needs(reqs, static_res, ocfg, 10.0)
    best = math.inf
    for hold in (0.0, 30.0):
        runs = po.frontier(lambda f, hold=hold: po.run_oracle(
            reqs, needs, ocfg, factor=f, hold_s=hold, startup_s=startup_s, window_s=10.0,
            ttft_slo_ms=ttft_slo_ms, itl_slo_ms=itl_slo_ms), static_att)
        best = min([best] + [r.replica_seconds for r in runs if r.attainment >= static_att])
    return best if math.isfinite(best) else math.nan


@dataclass(frozen=True)
class Setup:
    """What the scored loads need from Dynamo's side: each target's tuned config, and the oracle's
    ratio to the best static split per load where ``planner_oracle`` already measured it
    (``oracle_ratio_<load>`` of its RESULT; other loads run the oracle here)."""

    tuned: Mapping[str, Tuned]
    oracle_ratio: Mapping[str, float] = field(default_factory=dict)


def rows(name: str, reqs: list[Req], cfg: PlannerConfig, setup: Setup, case: dict, *, budget: int,
         ttft_slo_ms: float, itl_slo_ms: float, startup_s: float) -> list[Row]:
    """The same-routing comparison on one scored load: ours and the best static split, both
    round robin on our simulator; Dynamo's tuned config of every target and the best static
    split on Dynamo's mocker, round robin. Each note reads the row against its own static split
    and the oracle. Puts ``dynamo`` (per target: attainment, replica-seconds, its static's
    attainment, oracle ratio, bootstrap status) into ``case``."""
    p0, d0 = case["start"]
    ours = RoundRobinSim(_fresh(reqs), prefill=p0, decode=d0, planner=cfg, startup_s=startup_s,
                         label="planner, round robin").run()
    st_att, st_res, tried = best_static_split(name, reqs, cfg, budget, ttft_slo_ms=ttft_slo_ms,
                                              itl_slo_ms=itl_slo_ms, sim=RoundRobinSim)
    tuned = setup.tuned
    oracle = case.get("oracle_replica_seconds")
    if oracle is None and name in setup.oracle_ratio:
        oracle = case["oracle_replica_seconds"] = setup.oracle_ratio[name] * case["static"].replica_seconds()
    if oracle is None:
        oracle = oracle_replica_seconds(reqs, case["rows"][1].attainment, case["static"], budget=budget,
                                        ttft_slo_ms=ttft_slo_ms, itl_slo_ms=itl_slo_ms, startup_s=startup_s)
        case["oracle_replica_seconds"] = oracle
    sp = sum(1 for w in st_res.workers if w.pool == "prefill")
    runs = [Run(f"dynamo ({t})", p0, d0, planner(t, tuned[t].knobs, ttft_slo_ms, itl_slo_ms)) for t in TARGETS]
    runs += [Run(f"dynamo mocker, static {p}P+{budget - p}D", p, budget - p, None)
             for p in (sp - 1, sp, sp + 1) if 1 <= p <= budget - 1]
    outs = run_dynamo(reqs, runs, budget=budget, ttft_slo_ms=ttft_slo_ms, itl_slo_ms=itl_slo_ms, startup_s=startup_s)
    statics = [o for o in outs if o.run.planner is None and o.result is not None]
    dyn_static = max(statics, key=lambda o: o.result.attainment(ttft_slo_ms, itl_slo_ms), default=None)
    dyn_st_att = dyn_static.result.attainment(ttft_slo_ms, itl_slo_ms) if dyn_static else math.nan

    def vs(att: float, ref: float, rs: float) -> str:
        return f"{att - ref:+.4f} vs its static; {rs / oracle:.3f}x oracle"

    ours_att = ours.attainment(ttft_slo_ms, itl_slo_ms)
    out = [Row("ours, round robin", ours_att, ours.replica_seconds(), reversals(ours.decisions), max_gpus(ours),
               len(ours.decisions), vs(ours_att, st_att, ours.replica_seconds())),
           Row(f"static {st_res.label.split()[-1]}, round robin", st_att, st_res.replica_seconds(), 0,
               max_gpus(st_res), 0, f"our simulator, of P in {tried}")]
    if dyn_static is not None:
        out.append(Row(dyn_static.run.label, dyn_st_att, dyn_static.result.replica_seconds(), 0,
                       max_gpus(dyn_static.result), 0, f"Dynamo's mocker, round robin, best of "
                       f"{[o.run.label.split()[-1] for o in statics]}"))
    case["dynamo"] = {}
    for o in outs:
        if o.run.planner is None:
            continue
        t = o.run.planner["optimization_target"]
        for w in o.warnings:
            print(f"  [{name}] {o.run.label} warning: {w}", flush=True)
        print(f"  [{name}] {o.run.label}: bootstrap {json.dumps(o.bootstrap, sort_keys=True)}", flush=True)
        if o.result is None:
            print(f"  [{name}] {o.run.label}: not run: {o.error}", flush=True)
            out.append(Row(o.run.label, math.nan, math.nan, 0, 0, 0, "not run (see log)"))
            case["dynamo"][t] = (math.nan, math.nan, dyn_st_att, math.nan, o.status)
            continue
        att, rs = o.result.attainment(ttft_slo_ms, itl_slo_ms), o.result.replica_seconds()
        out.append(Row(o.run.label, att, rs, reversals(o.result.decisions), max_gpus(o.result),
                       len(o.result.decisions), f"{vs(att, dyn_st_att, rs)}; bootstrap {o.status}"))
        case["dynamo"][t] = (att, rs, dyn_st_att, rs / oracle, o.status)
    return out


def bootstrap_status(cases: Sequence[dict]) -> str:
    """Dynamo's SLA target's bootstrap status over the cases that ran it: ``installed`` when it
    is so in every one, else the first other status (``not_run`` when none ran it)."""
    sla = [c["dynamo"]["sla"][4] for c in cases if c.get("dynamo") and "sla" in c["dynamo"]]
    return next((s for s in sla if s != "installed"), "installed" if sla else "not_run")


def result_keys(cases: Sequence[dict]) -> str:
    """The RESULT keys of Dynamo's side over the scored cases that ran it: its SLA target's
    bootstrap status (``installed`` in every case, else the first other status), the target
    with the best worst-case attainment, that attainment, and its largest replica-seconds over
    the oracle's; ``dynamo_valid=0`` when the bootstrap is not installed everywhere or a run
    failed."""
    ran = [c["dynamo"] for c in cases if c.get("dynamo")]
    if not ran:
        return "dynamo_bootstrap=not_run dynamo_valid=0"
    bootstrap = bootstrap_status(cases)
    worst = {t: min((d[t][0] for d in ran if t in d), default=math.nan) for t in TARGETS}
    ok = {t: a for t, a in worst.items() if not math.isnan(a)}
    best = max(ok, key=ok.get) if ok else None
    valid = bootstrap == "installed" and len(ok) == len(TARGETS) and all(
        not math.isnan(d[t][0]) for d in ran for t in d)
    ratio = max((d[best][3] for d in ran if best in d), default=math.nan) if best else math.nan
    return (f"dynamo_bootstrap={bootstrap} dynamo_valid={int(valid)} dynamo_best_target={best} "
            f"dynamo_best_slo_attainment={ok.get(best, math.nan):.4f} dynamo_replica_seconds_vs_oracle={ratio:.4f}")
