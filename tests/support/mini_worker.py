"""A minimal OpenAI-speaking worker for router tests (not the product's worker).

It registers, holds the blocks of every prompt it served (LRU, bounded), publishes the matching
KV events through the real broker, and streams pseudo tokens. ``--die-after N`` makes it exit
abruptly (os._exit) after sending N tokens of its first request: a worker crash mid-stream.

Run: python -m tests.support.mini_worker --worker-id w1 --port 9001 (topic prefix from env).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from benchmarks.lru_blocks import LruBlocks
from common.hashing import HashAlgo, HashConfig, hash_blocks
from common.log.kafka import EventProducer
from common.settings import BusSettings
from common.tokenizer import HashTokenizer
from schemas.events import BlockRemoved, BlockStored, WorkerLoadReported, WorkerRegistered


def build(worker_id: str, port: int, capacity: int, die_after: int | None, token_delay: float) -> FastAPI:
    cfg = HashConfig(HashAlgo.SHA256, 64)
    producer = EventProducer(BusSettings.from_env(), worker_id)
    tok = HashTokenizer()
    held = LruBlocks(capacity)
    state = {"served": 0, "running": 0}
    app = FastAPI()

    @app.on_event("startup")
    async def _start() -> None:
        producer.publish(WorkerRegistered(worker_id=worker_id, role="aggregated", pool="default",
                                          endpoint=f"http://127.0.0.1:{port}", model="switchyard-sim",
                                          capacity={"device": capacity}, block_size=64, hash_algo=cfg.hash_algo))
        producer.flush(10)

        async def report() -> None:
            while True:
                producer.publish(WorkerLoadReported(worker_id=worker_id, running=state["running"], waiting=0,
                                                    tier_usage={"device": len(held) / capacity}))
                await asyncio.sleep(1.0)
        asyncio.get_running_loop().create_task(report())

    def store(tokens: list[int]) -> int:
        hashes = hash_blocks(tokens, cfg)
        cached = held.held_prefix(hashes)
        new, evicted = held.touch(hashes)
        if new:
            producer.publish(BlockStored(worker_id=worker_id, tier="device", block_hashes=new, block_size=64,
                                         hash_algo=cfg.hash_algo))
        if evicted:
            producer.publish(BlockRemoved(worker_id=worker_id, tier="device", block_hashes=evicted))
        producer.poll(0)
        return cached * 64

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        prompt = body.get("prompt")
        tokens = prompt if isinstance(prompt, list) else tok.encode(prompt or "")
        n = int(body.get("max_tokens") or 16)
        rid = body.get("request_id", "x")
        cached = store(tokens)
        state["running"] += 1
        first_request = state["served"] == 0
        state["served"] += 1
        usage = {"prompt_tokens": len(tokens), "completion_tokens": n, "total_tokens": len(tokens) + n,
                 "prompt_tokens_details": {"cached_tokens": cached}, "worker_id": worker_id}
        ids = [(hash((rid, i)) % 30000) + 256 for i in range(n)]
        if not body.get("stream"):
            await asyncio.sleep(token_delay * n)
            state["running"] -= 1
            return {"id": rid, "object": "text_completion", "model": body.get("model"),
                    "choices": [{"index": 0, "text": tok.decode(ids), "finish_reason": "length"}], "usage": usage}

        async def gen():
            try:
                for i, t in enumerate(ids):
                    if die_after is not None and first_request and i == die_after:
                        os._exit(9)
                    await asyncio.sleep(token_delay)
                    chunk = {"id": rid, "object": "text_completion",
                             "choices": [{"index": 0, "text": tok.decode([t]), "token_ids": [t],
                                          "finish_reason": "length" if i == n - 1 else None}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                yield f"data: {json.dumps({'id': rid, 'object': 'text_completion', 'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state["running"] -= 1
        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.get("/health")
    async def health():
        return JSONResponse({"status": "ok", "worker_id": worker_id})

    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker-id", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--capacity", type=int, default=4096)
    ap.add_argument("--die-after", type=int, default=None)
    ap.add_argument("--token-delay", type=float, default=0.002)
    a = ap.parse_args()
    uvicorn.run(build(a.worker_id, a.port, a.capacity, a.die_after, a.token_delay), host="127.0.0.1",
                port=a.port, log_level="warning", loop="asyncio")


if __name__ == "__main__":
    main()
