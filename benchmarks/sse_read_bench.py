"""A worker's streamed answer read for the relay: the crate (``worker_calls.sse_events``,
``native/src/sse.rs``, what the router runs) against the Python loop it replaced (lines split in
Python, each ``data:`` line decoded by msgspec; kept here only as the baseline), each making the
same ``Chunk`` list; and ``relay``: the answer folded whole by the crate (``PiecesRelay``, the fold
a non-streamed answer gets: ``native/src/sse.rs`` ``Relay``; fed from Python here, piece by piece,
where the worker call feeds it on its own thread). CPU per answer of 1, 16 and 256 tokens (vLLM-shaped chunks, then usage
and ``[DONE]``), the body arriving in n/2 pieces; best of three runs each, alternating.

``python -m benchmarks.sse_read_bench``; last line ``RESULT``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import msgspec

from control_plane.router.proxy import Chunk
from control_plane.router.worker_calls import SSE_BAD, SSE_CHUNK, SSE_DONE, SSE_ERROR, PiecesRelay, sse_events

_decode = msgspec.json.decode

def body(n):
    objs = [{"id": "cmpl-x", "object": "text_completion", "created": 1, "model": "m",
             "choices": [{"index": 0, "text": f" t{i}", "token_ids": [100 + i], "finish_reason": "length" if i == n - 1 else None}]} for i in range(n)]
    objs.append({"id": "cmpl-x", "choices": [], "usage": {"prompt_tokens": 256, "completion_tokens": n, "total_tokens": 256 + n}})
    return b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in objs) + b"data: [DONE]\n\n"

async def pieces(b, k):  # the body in k pieces, as wake-ups deliver it
    step = max(1, len(b) // k)
    for i in range(0, len(b), step):
        yield b[i:i + step]

async def lines(chunks):  # the replaced Python reading (baseline)
    rest = b""
    async for piece in chunks:
        if rest:
            piece = rest + piece
        *whole, rest = piece.split(b"\n")
        for line in whole:
            yield line[:-1] if line.endswith(b"\r") else line
    if rest:
        yield rest

async def old(b, k):
    out = []
    async for line in lines(pieces(b, k)):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        obj = _decode(data)
        if "error" in obj:
            raise ValueError
        choices = obj.get("choices") or []
        if choices:
            c = choices[0]
            out.append(Chunk(text=c.get("text", ""), token_ids=c.get("token_ids") or obj.get("token_ids") or [],
                             finish_reason=c.get("finish_reason"), usage=obj.get("usage")))
        elif obj.get("usage"):
            out.append(Chunk(usage=obj["usage"]))
    return out

async def new(b, k):
    out = []
    async for ev in sse_events(pieces(b, k)):
        kind = ev[0]
        if kind == SSE_CHUNK:
            out.append(Chunk(ev[1], ev[2], ev[3], None if ev[4] is None else _decode(ev[4])))
        elif kind == SSE_DONE:
            break
        elif kind == SSE_ERROR or kind == SSE_BAD:
            raise ValueError
        else:
            out.append(Chunk(usage=_decode(ev[1])))
    return out

async def relay(b, k):
    r = PiecesRelay(pieces(b, k))
    await r.first_token()
    whole = await r.end()
    return whole.text, _decode(whole.usage)

async def main():
    res = {}
    for n in (1, 16, 256):
        b = body(n)
        chunks = await new(b, 4)
        assert await old(b, 4) == chunks
        assert await relay(b, 4) == ("".join(c.text for c in chunks), chunks[-1].usage)
        for name, f in (("old", old), ("new", new), ("relay", relay)) * 3:
            reps = max(200, 20000 // n)
            t = time.process_time()
            for _ in range(reps):
                await f(b, max(1, n // 2))
            us = (time.process_time() - t) / reps * 1e6
            res[f"{name}_t{n}_us"] = min(res.get(f"{name}_t{n}_us", 1e9), us)
    print(f"load {os.getloadavg()[0]:.1f}")
    print("RESULT " + " ".join(f"{k}={v:.1f}" for k, v in res.items()))
if __name__ == "__main__":
    asyncio.run(main())
