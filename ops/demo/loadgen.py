"""Trace-driven load through the router's OpenAI API (``switchyard loadgen``).

Reads a Mooncake-format trace (jsonl: ``timestamp`` ms, ``input_length``, ``output_length``,
``hash_ids`` of 512-token blocks), turns each line into a token-id prompt whose shared prefixes
follow the hash ids exactly (``data_plane.engines.trace``), and sends it at its arrival time
divided by ``speedup``, streaming, measuring TTFT, ITL and end-to-end latency at the client.
The report compares the prefix-cache hit rate the workers achieved (``cached_tokens`` in the
usage they return) with the trace's ideal hit rate (one infinite cache seeing every request).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from control_plane.router.admission import ADMISSION_CODES
from data_plane.engines.trace import MooncakeTrace, TraceRecord, read_mooncake
from common.hashing import HashAlgo, HashConfig
from workloads.stats import ideal_hit_rate


@dataclass
class Result:
    index: int
    request_id: str
    prompt_tokens: int
    ok: bool = False
    ttft_ms: float = 0.0
    itls_ms: list[float] = field(default_factory=list)
    e2e_ms: float = 0.0
    output_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""
    #: HTTP status of the answer (0: no answer).
    status: int = 0
    #: Machine-readable reason of a failure or rejection (the router's error code, or the
    #: client-side exception name).
    code: str = ""
    #: Refused at admission with a reason (429, or 503 from the router's queue): load shed on
    #: purpose, reported apart from failures.
    rejected: bool = False
    #: The router's id of the request (its ``X-Request-Id`` header; empty: no answer came).
    router_request_id: str = ""


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


@dataclass(frozen=True)
class Prepared:
    """One request, encoded before the clock starts (so the load generator's own loop never
    stalls on building a 100k-token body at its arrival time)."""

    index: int
    request_id: str
    at_s: float
    prompt_tokens: int
    body: bytes


def word_prompt(ids: Sequence[int]) -> str:
    """Token ids as a string prompt, one word per id (``w<id>``): what a router that only takes
    text (the peer routers of ``switchyard bench peers``) can carry. Every tokenizer that splits
    on words keeps one token per word, so shared id prefixes stay shared token prefixes: our
    :class:`~common.tokenizer.HashTokenizer` maps each word to one id, and a WordLevel tokenizer
    whose vocabulary is ``w0 .. w<vocab-1>`` maps it back to the same id."""
    return " ".join(f"w{i}" for i in ids)


def prepare(records: list[TraceRecord], *, block_size: int = 64, speedup: float = 1.0,
            max_output: int | None = None, model: str = "switchyard-sim", id_prefix: str = "lg",
            text: bool = False) -> list[Prepared]:
    """``text``: each prompt as a string (:func:`word_prompt`) instead of token ids, and only
    OpenAI's fields in the body (no ``request_id``: Dynamo's frontend refuses unknown fields)."""
    mt = MooncakeTrace(HashConfig(HashAlgo.SHA256, block_size))
    t_first = records[0].timestamp_ms if records else 0
    out = []
    for i, rec in enumerate(records):
        ids = mt.prompt(rec)[:]
        prompt: list[int] | str = word_prompt(ids) if text else ids
        n_out = rec.output_length if max_output is None else min(rec.output_length, max_output)
        rid = f"{id_prefix}-{i}"
        body = {"model": model, "prompt": prompt, "max_tokens": max(n_out, 1), "stream": True,
                "stream_options": {"include_usage": True}}
        if not text:
            body["request_id"] = rid
        out.append(Prepared(i, rid, (rec.timestamp_ms - t_first) / 1000 / speedup, len(ids),
                            json.dumps(body, separators=(",", ":")).encode()))
    return out


def refusal(res: Result, status: int, raw: bytes) -> None:
    """``res`` refused with HTTP ``status`` and body ``raw``: its code, message, and whether it
    was load shed on purpose (429, or one of the router's admission codes)."""
    res.status = status
    try:
        err = json.loads(raw).get("error") or {}
    except (ValueError, AttributeError):
        err = {}
    res.code = str(err.get("code") or f"http_{status}")
    res.error = f"HTTP {status} {res.code}: {str(err.get('message') or raw[:200].decode(errors='replace'))[:200]}"
    res.rejected = status == 429 or res.code in ADMISSION_CODES


def read_sse_line(res: Result, line: str, t0: float, last: float | None, now: float) -> tuple[bool, float | None]:
    """Fold one line of the router's SSE answer into ``res`` (sent at ``t0``, its previous token
    read at ``last``, this line read at ``now``; monotonic seconds): the first token's TTFT, the
    ITLs, the usage, an error event. Returns (the stream is over, the last token's time)."""
    if not line.startswith("data:"):
        return False, last
    data = line[5:].strip()
    if data == "[DONE]":
        res.ok = True
        return True, last
    obj = json.loads(data)
    if "error" in obj:
        res.error = obj["error"].get("message", "error")
        res.code = str(obj["error"].get("code") or "stream_error")
        return True, last
    if obj.get("choices") and obj["choices"][0].get("text"):
        if last is None:
            res.ttft_ms = (now - t0) * 1000
        else:
            res.itls_ms.append((now - last) * 1000)
        last = now
        res.output_tokens += 1
    if obj.get("usage"):
        res.cached_tokens = int((obj["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return False, last


def end_result(res: Result, t0: float, now: float) -> Result:
    """Close ``res``: a stream that ended without ``[DONE]`` nor an error says so; e2e from ``t0``."""
    if not res.ok and not res.code:
        res.code = "stream_ended_early"
        res.error = res.error or "the stream ended without [DONE]"
    res.e2e_ms = (now - t0) * 1000
    return res


async def send_one(client: httpx.AsyncClient, url: str, p: Prepared) -> Result:
    """Send one prepared request (streaming) to ``url`` and measure it at the client: TTFT, ITL,
    end-to-end; a refusal's status and error code, or the exception's name when no answer came."""
    return await _one(client, url, p)


async def _one(client: httpx.AsyncClient, url: str, p: Prepared) -> Result:
    res = Result(p.index, p.request_id, p.prompt_tokens)
    t0 = time.monotonic()
    last = None
    try:
        async with client.stream("POST", url, content=p.body, headers={"Content-Type": "application/json"}) as r:
            res.router_request_id = r.headers.get("x-request-id", "")
            if r.status_code != 200:
                refusal(res, r.status_code, await r.aread())
                return res
            res.status = 200
            async for line in r.aiter_lines():
                over, last = read_sse_line(res, line, t0, last, time.monotonic())
                if over:
                    break
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
        res.code = type(e).__name__
    return end_result(res, t0, time.monotonic())


async def run_trace(
    url: str,
    trace: Path,
    *,
    limit: int | None = None,
    speedup: float = 1.0,
    max_output: int | None = None,
    block_size: int = 64,
    model: str = "switchyard-sim",
    concurrency: int = 1024,
    progress: bool = True,
    id_prefix: str | None = None,
    api_key: str | None = None,
    text: bool = False,
) -> dict:
    """Replay the trace; ``id_prefix`` (default: unique per run) names requests ``<prefix>-<i>``,
    so a second run against the same log never reuses a request id. ``api_key``: the router API
    key every request carries (a router with auth off takes none). ``text``: string prompts
    (:func:`word_prompt`), for routers that take no token ids."""
    records = read_mooncake(trace, limit)
    prefix = id_prefix or f"lg-{uuid.uuid4().hex[:8]}"
    prepared = await asyncio.to_thread(prepare, records, block_size=block_size, speedup=speedup,
                                       max_output=max_output, model=model, id_prefix=prefix, text=text)
    sem = asyncio.Semaphore(concurrency)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(records), desc="requests", unit="req")
    endpoint = f"{url.rstrip('/')}/v1/completions"

    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0),
                                 limits=httpx.Limits(max_connections=concurrency),
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else None) as client:
        start = time.monotonic()

        async def fire(p: Prepared) -> Result:
            delay = p.at_s - (time.monotonic() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            async with sem:
                r = await _one(client, endpoint, p)
            if bar is not None:
                bar.update(1)
            return r

        results = await asyncio.gather(*(fire(p) for p in prepared))
    if bar is not None:
        bar.close()
    wall = time.monotonic() - start
    ok = [r for r in results if r.ok]
    rejected = [r for r in results if r.rejected]
    failed = [r for r in results if not r.ok and not r.rejected]
    itls = [x for r in ok for x in r.itls_ms]
    prompt_total = sum(r.prompt_tokens for r in ok)
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(failed),
        "rejected": len(rejected),
        "failures_by_reason": dict(Counter(r.code for r in failed).most_common()),
        "rejections_by_reason": dict(Counter(r.code for r in rejected).most_common()),
        "errors": sorted({r.error for r in failed + rejected if r.error})[:5],
        "id_prefix": prefix,
        "wall_s": wall,
        "ttft_p50_ms": _pct([r.ttft_ms for r in ok], 0.5),
        "ttft_p90_ms": _pct([r.ttft_ms for r in ok], 0.9),
        "ttft_p99_ms": _pct([r.ttft_ms for r in ok], 0.99),
        "itl_p50_ms": _pct(itls, 0.5),
        "itl_p99_ms": _pct(itls, 0.99),
        "e2e_p50_ms": _pct([r.e2e_ms for r in ok], 0.5),
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / wall if wall else 0.0,
        "hit_rate": sum(r.cached_tokens for r in ok) / prompt_total if prompt_total else 0.0,
        "ideal_hit_rate": ideal_hit_rate(records),
        "results": results,
    }


def _reasons(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items())


def format_summary(s: dict) -> str:
    return "\n".join([
        f"requests      {s['completed']}/{s['requests']} completed, {s['failed']} failed, "
        f"{s.get('rejected', 0)} rejected in {s['wall_s']:.1f} s",
    ] + ([f"failed        {_reasons(s['failures_by_reason'])}"] if s.get("failures_by_reason") else [])
      + ([f"rejected      {_reasons(s['rejections_by_reason'])}"] if s.get("rejections_by_reason") else []) + [
        f"TTFT          p50 {s['ttft_p50_ms']:.0f} ms  p90 {s['ttft_p90_ms']:.0f} ms  p99 {s['ttft_p99_ms']:.0f} ms",
        f"ITL           p50 {s['itl_p50_ms']:.1f} ms  p99 {s['itl_p99_ms']:.1f} ms",
        f"throughput    {s['output_tokens_per_s']:.0f} output tokens/s",
        f"prefix hits   {s['hit_rate']:.3f} of prompt tokens (ideal, one infinite cache: {s['ideal_hit_rate']:.3f})",
    ] + ([f"errors        {'; '.join(s['errors'])}"] if s["errors"] else []))


def plot(s: dict, path: Path, title: str = "Switchyard load run") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in s["results"] if r.ok]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ttft = sorted(r.ttft_ms for r in ok)
    if ttft:
        axes[0].plot(ttft, [i / len(ttft) for i in range(len(ttft))])
    axes[0].set(title="TTFT CDF", xlabel="ms", ylabel="fraction")
    axes[1].scatter([r.index for r in ok], [r.ttft_ms for r in ok], s=4)
    axes[1].set(title="TTFT by request", xlabel="request #", ylabel="ms")
    hits = [r.cached_tokens / r.prompt_tokens if r.prompt_tokens else 0 for r in ok]
    axes[2].hist(hits, bins=20)
    axes[2].set(title=f"prefix hit fraction (mean {statistics.fmean(hits) if hits else 0:.2f})", xlabel="fraction")
    fig.suptitle(f"{title}: {s['completed']}/{s['requests']} ok, TTFT p50 {s['ttft_p50_ms']:.0f} ms, "
                 f"hit rate {s['hit_rate']:.2f} (ideal {s['ideal_hit_rate']:.2f})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
