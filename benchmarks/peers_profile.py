"""Where one request's CPU goes in our router (issue 37, item 3): ``switchyard bench peers
--profile``.

Two simulated workers at engine speed x1000 and one router replica (kv mode) on the local
broker, as in ``benchmarks.peers_bench``; ``n`` sequential 4,096-word string-prompt completions
(1 output token) after a warm-up. While they run, ``py-spy`` (``.venv-peers``) samples the
router's threads at 1 kHz, only while a thread holds the GIL (``--gil``: Python running, or C
called from Python without releasing it), so each sample is about 1 ms of the process's CPU in
Python; the process's whole CPU (``/proc``, kernel time and GIL-free native code included) and
the broker's (its idle rate over an equal quiet window before subtracted) are read beside it.

Each sample goes to the first stage (``STAGES``, in order) whose patterns its stack contains:
event production and consumption first (they run under the request's frames or on their own),
then the request's own stages from the innermost out. On a loaded box a thread preempted while
holding the GIL still counts, so the shares are better than the absolute sample times: the
table scales them to the /proc CPU per request.

Floors, measured in the same run on the same prompt: tokenizing 4,096 words with our tokenizer's
Python specification (``HashTokenizer.encode_reference``), natively as the router does (tokenize
and hash in one call, ``control_plane.router.prompt.tokenize_prompt``), and with Hugging Face's
Rust ``tokenizers`` (a WordLevel model over the same words);
hashing the 64 blocks natively (our Rust extension, the path the router takes). The HTTP and
proxy floors come from ``bench peers``'s sides: ``pyfloor`` (a bare Python proxy on the router's
HTTP server and worker port) and ``vllmrouter_rr``/``nginx`` (Rust/C, round robin).

Last line: ``RESULT profile_cpu_ms_per_req=... profile_gil_ms_per_req=... <stage>_ms=...
broker_cpu_ms_per_req=...``.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

from benchmarks.peers_bench import (FAST, PEERS_VENV, PROMPT_WORDS, _fire, broker_cpu_s, broker_idle_rate, broker_pids,
                                    dynamo_model_dir, launch, prompts, start_workers)
from ops.demo.loadgen import word_prompt
from control_plane.router.prompt import tokenize_prompt
from common.hashing import HashAlgo, HashConfig, hash_blocks
from common.tokenizer import HashTokenizer

#: (stage, substrings of a py-spy stack, any of which puts a sample there), first match wins.
STAGES: list[tuple[str, tuple[str, ...]]] = [
    ("event production", ("EventProducer", "aiokafka/producer", "EnvelopeFactory")),
    ("event consumption (view fold)", ("aiokafka/consumer", "faust/", "router/view.py", "router/stream.py",
                                       "common/log/fold.py", "mode/threads.py", "control_plane/streaming.py",
                                       "common/log/reader.py")),
    ("tokenization", ("common/tokenizer.py",)),
    ("hashing", ("common/hashing.py", "router/prompt.py")),
    ("auth and limits", ("router/limits.py", "router/keys.py", "router/admission.py", "router/shared_gate.py",
                         "_client_id")),
    ("ledger", ("router/ledger.py",)),
    ("decision", ("router/decision.py", "router/inputs.py")),
    ("proxy hop (to the worker and back)", ("aiohttp/", "router/worker_calls.py")),
    ("response", ("RequestResponseCycle.send", "starlette/responses.py", "_Exchange.send")),
    ("HTTP parsing and app", ("uvicorn/", "starlette/", "fastapi/", "common/http_server.py", "common/native_http.py",
                              "router/server.py",
                              "router/serving.py", "router/protocol.py", "router/proxy.py", "httptools")),
    ("metrics", ("prometheus_client",)),
]
OTHER = "event loop and other"
RATE = 1000


def classify(stack: str) -> str:
    for stage, patterns in STAGES:
        if any(p in stack for p in patterns):
            return stage
    return OTHER


def stage_samples(raw: Path) -> Counter:
    """Samples per stage from py-spy's raw (collapsed) output: ``frame;frame;... count``."""
    out: Counter = Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            out[classify(stack)] += int(n)
    return out


def _timed(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) * 1000 / reps


def floors(tmp: Path) -> dict[str, float]:
    """ms per call, on one 4,096-word prompt."""
    import random

    rng = random.Random(1)
    text = word_prompt(rng.randrange(32_000) for _ in range(PROMPT_WORDS))
    tok = HashTokenizer()
    ids = tok.encode(text)
    out = {"tokenize_python_ms": _timed(lambda: tok.encode_reference(text), 50),
           "tokenize_native_ms": _timed(lambda: tokenize_prompt(tok, text, HashConfig(HashAlgo.SHA256, 64)), 200)}
    # Hugging Face's Rust tokenizer lives in the peers' environment (Dynamo's), not ours.
    model = dynamo_model_dir(tmp / "floor-model")
    (tmp / "floor.txt").write_text(text)
    code = ("import sys, time; from tokenizers import Tokenizer; t = Tokenizer.from_file(sys.argv[1]); "
            "s = open(sys.argv[2]).read(); t.encode(s, add_special_tokens=False); t0 = time.perf_counter(); "
            "[t.encode(s, add_special_tokens=False) for _ in range(50)]; print((time.perf_counter() - t0) * 1000 / 50)")
    r = subprocess.run([str(PEERS_VENV / "bin" / "python"), "-c", code, str(model / "tokenizer.json"),
                        str(tmp / "floor.txt")], capture_output=True, text=True, timeout=120)
    out["tokenize_rust_ms"] = float(r.stdout.strip()) if r.returncode == 0 else float("nan")
    if r.returncode != 0:
        print(f"Rust tokenizer floor not measured: {r.stderr.strip()[-300:]}")
    config = HashConfig(HashAlgo.SHA256, 64)
    out["hash_native_ms"] = _timed(lambda: hash_blocks(ids, config), 200)
    return out


def main(n: int = 300, warmup: int = 30) -> dict:
    spy_bin = PEERS_VENV / "bin" / "py-spy"
    if not spy_bin.exists():
        raise RuntimeError(f"{spy_bin} missing: bash scripts/peers-env.sh")
    brokers = broker_pids()
    bodies = prompts(warmup + n, seed=38)
    with tempfile.TemporaryDirectory(prefix="sy-profile-") as t:
        tmp = Path(t)
        fl = floors(tmp)
        w = start_workers(tmp, FAST)
        try:
            side = launch("ours", w, tmp, FAST)
            try:
                asyncio.run(_fire(side.url, bodies[:warmup], 1))
                # The broker's background rate (other topics, other clients) over a quiet window.
                idle_rate = broker_idle_rate(brokers)
                raw = tmp / "raw.txt"
                spy = subprocess.Popen([str(spy_bin), "record", "--pid", str(side.procs[0].pid), "--rate", str(RATE),
                                        "--format", "raw", "--output", str(raw), "--gil", "--nonblocking"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                time.sleep(1.0)  # py-spy attached
                c0, b0, t0 = side.cpu_s(), broker_cpu_s(brokers), time.monotonic()
                lat, _, errors = asyncio.run(_fire(side.url, bodies[warmup:], 1))
                wall = time.monotonic() - t0
                cpu = (side.cpu_s() - c0) * 1000 / n
                broker = ((broker_cpu_s(brokers) - b0) - idle_rate * wall) * 1000 / n
                spy.send_signal(signal.SIGINT)
                _, err = spy.communicate(timeout=60)
                if not raw.exists():
                    raise RuntimeError(f"py-spy wrote no profile: {err.decode(errors='replace')[-500:]}")
                samples = stage_samples(raw)
            finally:
                side.stop()
        finally:
            w.stop()
    # Samples outside the measured requests (py-spy ran ~1 s before them, idle but for the view's
    # fold and the loop) are few; per request they are sample-ms / n.
    total = sum(samples.values())
    gil_ms = total * (1000 / RATE) / n
    print(f"router CPU per request (/proc): {cpu:.2f} ms; in Python with the GIL (py-spy --gil, {total} samples "
          f"at {RATE} Hz): {gil_ms:.2f} ms; broker: {broker:.2f} ms (idle rate {idle_rate * 1000:.0f} ms/s "
          f"subtracted); errors {errors}")
    print(f"{'stage':<36}{'share':>8}{'ms/req':>9}")
    result = {}
    for stage in [s for s, _ in STAGES] + [OTHER]:
        share = samples.get(stage, 0) / total if total else 0.0
        ms = share * cpu
        result[stage] = ms
        print(f"{stage:<36}{share:>8.1%}{ms:>9.2f}")
    print(f"{'broker (per request, same run)':<36}{'':>8}{broker:>9.2f}")
    print(f"floors, one {PROMPT_WORDS}-word prompt: tokenize Python {fl['tokenize_python_ms']:.2f} ms, ours natively "
          f"with its 64 block hashes {fl['tokenize_native_ms']:.2f} ms, Rust "
          f"(HF tokenizers WordLevel) {fl['tokenize_rust_ms']:.2f} ms; hash 64 blocks natively "
          f"{fl['hash_native_ms'] * 1000:.0f} us")
    keys = " ".join(f"{s.split(' (')[0].replace(' ', '_')}_ms={v:.2f}" for s, v in result.items())
    print(f"RESULT profile_cpu_ms_per_req={cpu:.2f} profile_gil_ms_per_req={gil_ms:.2f} {keys} "
          f"broker_cpu_ms_per_req={broker:.2f} tokenize_python_ms={fl['tokenize_python_ms']:.2f} "
          f"tokenize_native_ms={fl['tokenize_native_ms']:.3f} tokenize_rust_ms={fl['tokenize_rust_ms']:.2f}")
    return {"cpu_ms": cpu, "gil_ms": gil_ms, "stages": result, "broker_ms": broker, "floors": fl}
