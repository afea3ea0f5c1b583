"""``switchyard bench e2e``: the full stack, ``kv`` vs ``round_robin``, same trace slice, same
workers (fresh caches for each run).

Each run starts, on a fresh topic prefix: 2 prefill + 2 decode simulated workers (mocker
profile, real NIXL handoffs) and a router in the given mode, all real processes on the local
broker; then replays the first ``limit`` requests of the trace at ``rate``x through the
router's OpenAI API (``ops.demo.loadgen``). Needs ``switchyard stack up``.

Defaults are the demo's (trace slice, limit, rates, output cap). Each run also prints what the
cluster simulator predicts for the same requests (``ops.demo.runcheck``), failures and
rejections by reason, the handoff ratio and the CPU load; when the observed TTFT is more than
2x the prediction it says where the time went instead of trusting the gain.

Where the gain comes from: a third run, ``placement``, routes by the kv cost with every tier weight
at 0 (the same load terms, no cache credit, in-flight overlap included). Its gain over round
robin is what load placement alone buys; the rest of kv's gain is the prefix hits'. The split is
printed for the observed runs and for the simulator's prediction of the same three.

The modes' order rotates between rounds (``repeats``), so no mode always runs first on a cold
or last on a warm machine.

Last line: ``RESULT ttft_p50_gain=<rr/kv> ttft_p99_gain=... hit_rate=<kv> ideal_hit_rate=...
completed=... failed=... rejected=... ttft_p50_ms=<kv> ttft_p50_predicted_ms=<kv>
handoff_ratio=<kv> within_2x_of_prediction=0|1 gain_from_placement=... gain_from_prefix_hits=...
prefill_hit_rate=... prefill_hit_rate_rr=... overlap_exact=... prediction_err_p50=... prediction_err_p90=...
prediction_err_top=...``
(the two shares of the observed TTFT p50 difference rr - kv; they sum to 1). ``hit_rate`` is the
client's usage, which in disaggregated serving is the decode worker's engine; ``prefill_hit_rate``
is the prefill workers' own, from ``switchyard replay reconcile`` over the run's log, with the share
of decisions whose overlap equals the cached blocks and the error of the recorded TTFT prediction
(``RequestRouted.predicted_ttft_ms``, under the model the router fitted from the run's own log;
``prediction_err_top`` is reconcile's TTFT blame with the largest share of the error).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
import uuid
from pathlib import Path

import msgspec

from ops.demo.loadgen import run_trace
from ops.demo.runcheck import EXPLAIN_ABOVE, CpuSampler, breakdown, explain, now_ms, predict
from ops.demo.up import DEMO_DEFAULTS, DEMO_TRACE, Supervisor, wait_http
from control_plane.replay.reconcile import KvRecord, reconcile
from control_plane.router import RouterConfig, TierWeights
from common.stack_settings import StackSettings
from common.log.admin import apply_topics
from common.log.catalog import Catalog
from common.log.reader import KafkaLogReader, scan_events
from common.net import free_port
from common.settings import BusSettings
from schemas import EventCodec
from schemas.types import RoutingMode

#: The demo's workload and load by default, so the bench meets the same bounds as the demo.
DEFAULT_TRACE = DEMO_TRACE
#: The three configs: round robin, kv, and kv without any cache credit (load placement alone).
MODES = {
    "round_robin": RouterConfig(mode=RoutingMode.ROUND_ROBIN),
    "kv": RouterConfig(mode=RoutingMode.KV),
    "placement": RouterConfig(mode=RoutingMode.KV, tier_weights=TierWeights(device=0.0, host=0.0, disk=0.0, object=0.0)),
}


def one_run(mode: str, trace: Path, limit: int, rate: float, max_output: int, speedup: float) -> dict:
    config = MODES[mode]
    prefix = f"e2e{mode[:2]}{uuid.uuid4().hex[:6]}"
    bus = BusSettings.from_env(topic_prefix=prefix)
    apply_topics(bus)
    env_backup = os.environ.get("SWITCHYARD_TOPIC_PREFIX")
    os.environ["SWITCHYARD_TOPIC_PREFIX"] = prefix
    with tempfile.TemporaryDirectory(prefix="sy-e2e-") as tmp:
        sup = Supervisor(StackSettings.from_env(state_dir=Path(tmp)))
        try:
            for role in ("prefill", "decode"):
                for i in range(2):
                    sup.start(f"worker-{role}-{i}", ["worker", "--worker-id", f"{role}-{i}", "--role", role,
                                                     "--port", str(free_port()), "--speedup", str(speedup),
                                                     "--data-dir", f"{tmp}/{role}-{i}", "--lease-s", "10"])
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            config_file = Path(tmp) / "router.json"
            config_file.write_bytes(msgspec.json.encode(config))
            sup.start("router", ["router", "--port", str(port), "--router-id", f"e2e-{mode}", "--config",
                                 str(config_file), "--no-auth"])
            wait_http(f"{url}/health", lambda r: r.status_code == 200 and r.json().get("workers") == 4, timeout=120)
            t0 = time.monotonic()
            since = now_ms() - 1000
            cpu = CpuSampler().start()
            s = asyncio.run(run_trace(url, trace, limit=limit, speedup=rate, max_output=max_output, progress=False))
            s.update(cpu.stop())
            s["run_s"] = time.monotonic() - t0
            s["breakdown"] = breakdown(bus, s["id_prefix"], since)
            s["reconciled"] = reconciled(bus)
            s["predicted"] = predict(trace, limit=limit, rate=rate, speedup=speedup, max_output=max_output,
                                     prefill=2, decode=2, config=config)
            return s
        finally:
            sup.stop_all(grace=15)
            if env_backup is None:
                os.environ.pop("SWITCHYARD_TOPIC_PREFIX", None)
            else:
                os.environ["SWITCHYARD_TOPIC_PREFIX"] = env_backup


def main(trace: Path = DEFAULT_TRACE, limit: int = DEMO_DEFAULTS.limit, rate: float = DEMO_DEFAULTS.rate,
         max_output: int = DEMO_DEFAULTS.max_output, speedup: float = DEMO_DEFAULTS.speedup,
         repeats: int = 1) -> dict:
    """``repeats`` rounds; the order of the modes rotates between rounds so none always runs on
    the coldest or the warmest machine. Each mode's figures are from its last run."""
    runs: dict[str, dict] = {}
    order = list(MODES)
    for i in range(repeats):
        for m in order[i % len(order):] + order[:i % len(order)]:
            runs[m] = one_run(m, Path(trace), limit, rate, max_output, speedup)
    runs = {m: runs[m] for m in order}
    print(f"full stack, 2 prefill + 2 decode workers (mocker profile at {speedup}x), {limit} requests at {rate}x")
    print(f"{'router':<12}{'ok':>5}{'fail':>5}{'rej':>5}{'TTFT p50':>10}{'pred p50':>10}{'TTFT p99':>10}"
          f"{'ITL p50':>9}{'tok/s':>8}{'hit rate':>10}{'handoff':>9}{'CPU':>6}")
    for m, s in runs.items():
        print(f"{m:<12}{s['completed']:>5}{s['failed']:>5}{s['rejected']:>5}{s['ttft_p50_ms']:>10.0f}"
              f"{s['predicted']['ttft_p50_ms']:>10.0f}{s['ttft_p99_ms']:>10.0f}{s['itl_p50_ms']:>9.1f}"
              f"{s['output_tokens_per_s']:>8.0f}{s['hit_rate']:>10.3f}{s['breakdown']['handoff_ratio']:>9.2f}"
              f"{s['cpu_busy'] * 100:>5.0f}%")
        if s["failures_by_reason"]:
            print(f"  {m} failures by reason: {s['failures_by_reason']}")
        if s["rejections_by_reason"]:
            print(f"  {m} rejections by reason: {s['rejections_by_reason']}")
        rc = s["reconciled"]
        print(f"  {m}: prefill workers' hit rate {rc['prefill_hit_rate']:.3f} (the client's usage, the decode "
              f"workers': {s['hit_rate']:.3f}); the decision's overlap equals the cached blocks in {rc['exact']} of "
              f"{rc['requests']}; TTFT prediction error p50 {_f(rc['prediction_err_p50'])} p90 "
              f"{_f(rc['prediction_err_p90'])}")
        if rc.get("to_worker_ms_p50") is not None:
            print(f"  {m}: TTFT after the decision, p50 / p90 ms: to the prefill worker {_f(rc['to_worker_ms_p50'])} / "
                  f"{_f(rc['to_worker_ms_p90'])}, on it {_f(rc['worker_ms_p50'])} / {_f(rc['worker_ms_p90'])}, after "
                  f"it {_f(rc['after_worker_ms_p50'])} / {_f(rc['after_worker_ms_p90'])}; {rc['reordered']} of "
                  f"{rc['requests']} reached their worker out of the router's order")
            print(f"  {m}: TTFT p50 ms as the client felt it {s['ttft_p50_ms']:.0f}, as the router saw it after its "
                  f"decision (what the prediction is judged on) {_f(rc['observed_ttft_p50'])}")
        for src, g in rc.get("ttft_error_by", {}).items():
            print(f"  {m}: TTFT error on {src}: {g['n']} predictions, error p50 {_f(g['err_p50'])}, signed p50 "
                  f"{_f(g['bias_p50'])}, {100 * g['share']:.0f}% of the summed error")
        for line in explain(s["ttft_p50_ms"], s["predicted"]["ttft_p50_ms"], s["breakdown"]):
            print(f"  {m}: {line}")
    rr, kv, pl = runs["round_robin"], runs["kv"], runs["placement"]
    split = _split(rr["ttft_p50_ms"], pl["ttft_p50_ms"], kv["ttft_p50_ms"])
    psplit = _split(rr["predicted"]["ttft_p50_ms"], pl["predicted"]["ttft_p50_ms"], kv["predicted"]["ttft_p50_ms"])
    print(f"where kv's TTFT p50 gain comes from: observed {rr['ttft_p50_ms']:.0f} -> {pl['ttft_p50_ms']:.0f} "
          f"(placement) -> {kv['ttft_p50_ms']:.0f} ms (prefix hits): {100 * split[0]:.0f}% placement, "
          f"{100 * split[1]:.0f}% prefix hits; predicted {100 * psplit[0]:.0f}% / {100 * psplit[1]:.0f}%")
    within = all(s["ttft_p50_ms"] <= EXPLAIN_ABOVE * s["predicted"]["ttft_p50_ms"] for s in runs.values())
    if not within:
        print("observed TTFT is more than 2x the prediction: the gains below measure this box's load, "
              "not the routing (see where the time went above)")
    print(f"RESULT ttft_p50_gain={rr['ttft_p50_ms'] / kv['ttft_p50_ms']:.3f} "
          f"ttft_p99_gain={rr['ttft_p99_ms'] / kv['ttft_p99_ms']:.3f} hit_rate={kv['hit_rate']:.3f} "
          f"ideal_hit_rate={kv['ideal_hit_rate']:.3f} hit_rate_rr={rr['hit_rate']:.3f} "
          f"completed={sum(s['completed'] for s in runs.values())} failed={sum(s['failed'] for s in runs.values())} "
          f"rejected={sum(s['rejected'] for s in runs.values())} ttft_p50_ms={kv['ttft_p50_ms']:.0f} "
          f"ttft_p50_predicted_ms={kv['predicted']['ttft_p50_ms']:.0f} "
          f"handoff_ratio={kv['breakdown']['handoff_ratio']:.3f} within_2x_of_prediction={int(within)} "
          f"gain_from_placement={split[0]:.3f} gain_from_prefix_hits={split[1]:.3f} "
          f"prefill_hit_rate={kv['reconciled']['prefill_hit_rate']:.3f} "
          f"prefill_hit_rate_rr={rr['reconciled']['prefill_hit_rate']:.3f} "
          f"overlap_exact={kv['reconciled']['exact'] / max(kv['reconciled']['requests'], 1):.3f} "
          f"prediction_err_p50={_f(kv['reconciled']['prediction_err_p50'])} "
          f"prediction_err_p90={_f(kv['reconciled']['prediction_err_p90'])} "
          f"prediction_err_top={_top(kv['reconciled'].get('ttft_error_by', {}))}")
    return {m: {k: v for k, v in s.items() if k != "results"} for m, s in runs.items()}


def _top(by: dict) -> str:
    """The source with the largest share of the summed TTFT prediction error ("-" when none)."""
    return max(by, key=lambda k: by[k]["share"]) if by else "-"


def reconciled(bus: BusSettings) -> dict:
    """``switchyard replay reconcile``'s summary of the run's log. Its hit rate is the prefill
    workers' (the cached tokens each reported for the prefill it was routed): the client's usage,
    ``hit_rate``, is the decode worker's engine in disaggregated serving (docs/router.md)."""
    cat, codec = Catalog(bus.topic_prefix), EventCodec(verifier=bus.verifier())
    with KafkaLogReader(bus.bootstrap) as reader:
        requests = [env for _, env in scan_events(reader, cat.topic("requests"), codec=codec)]
        kv = [KvRecord(r.topic, r.partition, r.offset, env) for r, env in scan_events(reader, cat.topic("kv"), codec=codec)]
    out = reconcile(requests, kv).summary()
    out["prefill_hit_rate"] = out["cached_tokens"] / out["prompt_tokens"] if out["prompt_tokens"] else float("nan")
    return out


def _f(x: float | None) -> str:
    return "nan" if x is None else f"{x:.3f}"


def _split(rr: float, placement: float, kv: float) -> tuple[float, float]:
    """Shares of ``rr - kv`` that load placement (``rr - placement``) and prefix hits
    (``placement - kv``) account for; (nan, nan) when kv gained nothing."""
    total = rr - kv
    if total <= 0:
        return float("nan"), float("nan")
    return (rr - placement) / total, (placement - kv) / total

