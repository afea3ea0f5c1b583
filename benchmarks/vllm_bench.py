"""``switchyard bench vllm``: real vLLM workers behind the router, on the Mooncake trace.

Prompts: each trace ``hash_id`` becomes one fixed run of ``block_size`` token ids (seeded by
the id), so requests sharing hash ids share tokens, exactly block-aligned; the trace's 512-token
blocks are scaled down to ``block_size`` (32) tokens and ``input_length`` by the same factor,
capped so prompt + output fit the tiny model's ``max_model_len``. The scaling is printed.

Runs, in the same order on the same requests (sent one after another, so every decision sees
the previous requests' KV events and the comparison measures the index, not a race):

1. two aggregated vLLM workers, router in ``round_robin``;
2. two fresh aggregated vLLM workers on a fresh bus, router in ``kv`` (a bus per mode: a router
   takes its config from the log when there is one);
3. one prefill + one decode vLLM worker with vLLM's NixlConnector, router in ``kv``.

Reported: vLLM's own prefix-hit rate (``cached_tokens`` / prompt tokens), TTFT p50/p99 per run,
and the agreement between the router's predicted overlap (``RequestRouted`` score row of the
chosen worker, device tier, capped as :func:`expected_cached_tokens` says) and vLLM's
``num_cached_tokens`` for the same request. Each run's ``RequestRouted.mode`` is read back from
the log and must be the mode the run is named after (the bench fails otherwise: the first
version compared two round-robin runs without noticing). The slice's *ideal* hit rate (every
prompt on the worker holding its longest previously seen prefix) and the part of it beyond the
block every request shares are printed: kv routing can only beat round robin on the latter, and
the conversation trace has none in its first 100 requests (follow-up turns come later). Needs
the stack (``switchyard stack up``) and the vLLM environment (``scripts/vllm-env.sh``).

Last line: ``RESULT hit_rate_kv=... hit_rate_rr=... ttft_p50_gain=... overlap_agreement=...
disagg_completed=...``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx

from ops.demo.trace_tokens import TRACE_BLOCK, prompt_of
from ops.demo.up import WHOLE_TRACE, wait_http
from benchmarks.vllm_overlap import expected_cached_tokens
from data_plane.engines.trace import read_mooncake
from common.log.admin import apply_topics
from common.log.reader import read_events
from common.net import free_port
from common.settings import BusSettings
from schemas.events import KvTransferCompleted, KvTransferFailed, RequestAdmitted, RequestRouted

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = WHOLE_TRACE
WORKER_ENV = {"UCX_NET_DEVICES": "lo", "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1",
              "VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "1",
              # auto binds every engine to core 0 (and reserves core 1): let the OS spread them.
              "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def vllm_python() -> str:
    py = os.environ.get("SWITCHYARD_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(py).exists():
        sys.exit(f"no vLLM environment at {py}: run `bash scripts/vllm-env.sh`")
    return py


class Procs:
    def __init__(self, bus: BusSettings, logdir: Path) -> None:
        self.env = {**os.environ, "SWITCHYARD_KAFKA_BOOTSTRAP": bus.bootstrap,
                    "SWITCHYARD_TOPIC_PREFIX": bus.topic_prefix, "PYTHONUNBUFFERED": "1"}
        self.logdir = logdir
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, python: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        out = open(self.logdir / f"{name}.log", "ab")  # noqa: SIM115
        p = subprocess.Popen([python, "-m", "switchyard.cli", *args], cwd=ROOT, env={**self.env, **(env or {})},
                             stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True)
        out.close()
        self.procs.append(p)
        return p

    def stop(self, p: subprocess.Popen, timeout: float = 60) -> None:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:  # the process and its children (a vLLM worker's engine core)
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        p.wait(10)

    def close(self) -> None:
        for p in reversed(self.procs):
            self.stop(p)


def _worker(procs: Procs, wid: str, role: str, tmp: Path, extra: tuple[str, ...] = ()) -> str:
    port = free_port()
    procs.start(wid, vllm_python(), ["worker", "--worker-id", wid, "--role", role, "--port", str(port),
                                     "--data-dir", str(tmp / wid), "--engine", "vllm", *extra], WORKER_ENV)
    return f"http://127.0.0.1:{port}"


def _router(procs: Procs, mode: str, name: str) -> str:
    port = free_port()
    procs.start(name, sys.executable, ["router", "--port", str(port), "--router-id", name, "--mode", mode,
                                       "--block-size", "32", "--snapshot-every", "60", "--no-auth"])
    return f"http://127.0.0.1:{port}"


def _stream(client: httpx.Client, url: str, rid: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": "switchyard-sim", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "request_id": rid}
    t0 = time.monotonic()
    res = {"rid": rid, "prompt_tokens": len(prompt), "ok": False, "ttft_ms": None, "cached": 0, "tokens": 0}
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            res["error"] = f"HTTP {r.status_code}: {r.read()[:200]!r}"
            return res
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                res["ok"] = True
                break
            obj = json.loads(data)
            if "error" in obj:
                res["error"] = str(obj["error"])[:200]
                break
            if obj.get("choices"):
                if res["ttft_ms"] is None:
                    res["ttft_ms"] = (time.monotonic() - t0) * 1e3
                res["tokens"] += 1
            if obj.get("usage"):
                res["cached"] = int((obj["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return res


def _replay(url: str, prompts: list[list[int]], max_tokens: int, tag: str) -> list[dict]:
    out = []
    with httpx.Client(timeout=httpx.Timeout(600.0, connect=5.0)) as client:
        for i, p in enumerate(prompts):
            try:
                out.append(_stream(client, url, f"{tag}-{i}", p, max_tokens))
            except httpx.HTTPError as e:  # recorded as a failed request, the run goes on
                out.append({"rid": f"{tag}-{i}", "prompt_tokens": len(p), "ok": False, "ttft_ms": None,
                            "cached": 0, "tokens": 0, "error": f"{type(e).__name__}: {e}"})
    return out


def _read(bus: BusSettings, stream: str) -> list:
    return read_events(bus, stream)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def sharing(prompts: list[list[int]], block_size: int) -> dict:
    """What the slice allows: each prompt's longest block-aligned prefix seen in an earlier
    prompt (capped as vLLM serves it: never the last token), as a fraction of all prompt
    tokens, and the part of it beyond the first block (which every trace request shares, so
    any worker that served one request has it: round robin gets it too)."""
    seen: set[tuple[int, ...]] = set()
    total = hit = beyond = 0
    for p in prompts:
        full = len(p) // block_size
        k = 0
        while k < full and tuple(p[: (k + 1) * block_size]) in seen:
            k += 1
        k = min(k, (len(p) - 1) // block_size)
        total += len(p)
        hit += k * block_size
        beyond += max(k - 1, 0) * block_size
        seen.update(tuple(p[: (i + 1) * block_size]) for i in range(full))
    return {"ideal": hit / total if total else 0.0, "beyond_first_block": beyond / total if total else 0.0}


def _by_client_id(bus: BusSettings) -> dict[str, str]:
    """The router's request id -> the id this benchmark sent (``RequestAdmitted.client_request_id``)."""
    return {e.data.request_id: e.data.client_request_id for e in _read(bus, "requests")
            if isinstance(e.data, RequestAdmitted) and e.data.client_request_id}


def _score(bus: BusSettings, results: list[dict], block_size: int) -> dict:
    # The decision that placed the prompt's prefill: the prefill phase when disaggregated
    # (vLLM's decode side reports the prefill side's cached tokens), else the last attempt.
    routed: dict[str, RequestRouted] = {}
    modes: Counter[str] = Counter()
    client = _by_client_id(bus)
    for env in _read(bus, "requests"):
        if isinstance(env.data, RequestRouted):
            modes[env.data.mode.value] += 1
            rid = client.get(env.correlation_id, env.correlation_id)
            prev = routed.get(rid)
            if prev is None or prev.phase.value != "prefill":
                routed[rid] = env.data
    agree = 0
    misses = []
    for r in results:
        ev = routed.get(r["rid"])
        if ev is None or not r["ok"]:
            continue
        row = next((s for s in ev.scores if s.worker_id == ev.worker_id), None)
        overlap = row.overlap_by_tier.get("device", 0) if row else 0
        predicted = expected_cached_tokens(overlap, r["prompt_tokens"], block_size)
        r["predicted"] = predicted
        if predicted == r["cached"]:
            agree += 1
        else:
            misses.append((r["rid"], predicted, r["cached"]))
    ok = [r for r in results if r["ok"]]
    prompt_total = sum(r["prompt_tokens"] for r in ok)
    return {"completed": len(ok), "hit_rate": sum(r["cached"] for r in ok) / prompt_total if prompt_total else 0.0,
            "ttft_p50_ms": _pct([r["ttft_ms"] for r in ok], 0.5), "ttft_p99_ms": _pct([r["ttft_ms"] for r in ok], 0.99),
            "agreement": agree / len(ok) if ok else 0.0, "misses": misses[:10], "modes": dict(modes)}


def main(trace: Path = DEFAULT_TRACE, limit: int = 400, max_output: int = 4, block_size: int = 32,
         max_model_len: int = 2048, disagg_limit: int = 60) -> dict:
    records = read_mooncake(trace, limit)
    max_prompt = max_model_len - max_output - 1
    prompts = [prompt_of(r, block_size, max_prompt) for r in records]
    scale = TRACE_BLOCK / block_size
    print(f"{len(records)} requests of {trace.name}: each 512-token hash block -> {block_size} token ids "
          f"(lengths / {scale:g}), prompts capped at {max_prompt} tokens, {max_output} output tokens each; "
          f"prompt tokens mean {sum(map(len, prompts)) / len(prompts):.0f}, max {max(map(len, prompts))}")
    share = sharing(prompts, block_size)
    print(f"slice sharing: ideal hit rate {share['ideal']:.3f}, of which {share['beyond_first_block']:.3f} "
          "beyond the first block (the only part kv routing can win over round robin)")
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="sy-bench-vllm-") as tmpd:
        tmp = Path(tmpd)
        for mode in ("round_robin", "kv"):
            # One bus per mode: a router takes its config (mode included) from the log when the
            # log has one, so a second router on the first one's bus would route round robin
            # whatever its --mode says (the first version of this bench did exactly that).
            bus = BusSettings.from_env(topic_prefix=f"bv{mode[:2]}{uuid.uuid4().hex[:6]}")
            apply_topics(bus)
            procs = Procs(bus, tmp)
            try:
                t0 = time.monotonic()
                urls = [_worker(procs, f"bva-{i}", "aggregated", tmp / mode) for i in range(2)]
                for u in urls:
                    wait_http(f"{u}/health", lambda r: r.status_code == 200, timeout=1200)
                print(f"{mode}: 2 aggregated vLLM workers up in {time.monotonic() - t0:.0f} s")
                router = _router(procs, mode, f"bench-{mode}")
                wait_http(f"{router}/health", lambda r: r.status_code == 200 and r.json().get("workers") == 2,
                          timeout=180)
                res = _replay(router, prompts, max_output, f"bv-{mode}")
                runs[mode] = _score(bus, res, block_size)
                print(f"{mode}: RequestRouted modes in the log {runs[mode]['modes']}")
                if set(runs[mode]["modes"]) != {mode}:
                    raise SystemExit(f"the {mode} run was routed {runs[mode]['modes']}: not a {mode} run")
            finally:
                procs.close()
        bus = BusSettings.from_env(topic_prefix=f"bd{uuid.uuid4().hex[:8]}")
        apply_topics(bus)
        procs = Procs(bus, tmp)
        try:
            t0 = time.monotonic()
            nixl = ("--vllm-kv-connector", "nixl")
            pd = [_worker(procs, "bvp-0", "prefill", tmp, nixl), _worker(procs, "bvd-0", "decode", tmp, nixl)]
            for u in pd:
                wait_http(f"{u}/health", lambda r: r.status_code == 200, timeout=1200)
            print(f"1 prefill + 1 decode vLLM worker (NixlConnector, CPU buffers) up in {time.monotonic() - t0:.0f} s")
            router = _router(procs, "kv", "bench-disagg")
            wait_http(f"{router}/health", lambda r: r.status_code == 200 and r.json().get("workers") == 2, timeout=180)
            pd_prompts = prompts[:disagg_limit]
            res = _replay(router, pd_prompts, max_output, "bv-pd")
            s = _score(bus, res, block_size)
            client = _by_client_id(bus)
            moved = {client.get(e.correlation_id, e.correlation_id) for e in _read(bus, "requests")
                     if isinstance(e.data, KvTransferCompleted)}
            failed = {e.correlation_id for e in _read(bus, "requests") if isinstance(e.data, KvTransferFailed)}
            s["through_nixl"] = sum(1 for r in res if r["ok"] and r["rid"] in moved)
            s["transfer_failed"] = len(failed)
            s["short"] = sum(1 for p in pd_prompts if len(p) < block_size)
            s["sent"] = len(pd_prompts)
            runs["disagg"] = s
        finally:
            procs.close()

    print(f"{'run':<14}{'ok':>5}{'hit rate':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'agreement':>11}")
    for m, s in runs.items():
        print(f"{m:<14}{s['completed']:>5}{s['hit_rate']:>10.3f}{s['ttft_p50_ms']:>10.1f}{s['ttft_p99_ms']:>10.1f}"
              f"{s['agreement']:>11.3f}")
        if s["misses"]:
            print(f"  {m} disagreements (rid, predicted, vLLM cached): {s['misses']}")
    d = runs["disagg"]
    print(f"disaggregated: {d['through_nixl']} of {d['sent']} requests completed through the NixlConnector "
          f"({d['short']} prompts shorter than a block have nothing to move), {d['transfer_failed']} transfers failed")
    kv, rr = runs["kv"], runs["round_robin"]
    print(f"RESULT hit_rate_kv={kv['hit_rate']:.3f} hit_rate_rr={rr['hit_rate']:.3f} "
          f"ttft_p50_gain={rr['ttft_p50_ms'] / kv['ttft_p50_ms']:.3f} overlap_agreement={kv['agreement']:.3f} "
          f"disagg_completed={d['through_nixl']} disagg_sent={d['sent']} ideal_hit_rate={share['ideal']:.3f}")
    return runs
