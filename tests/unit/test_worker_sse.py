"""The worker's SSE stream once its headers are sent: an engine failure mid-stream ends the
stream with an error event the router can read, never a torn chunked body."""

from __future__ import annotations

import asyncio
import json

from data_plane.workers.run import Token
from data_plane.workers.app import _sse
from common.tokenizer import HashTokenizer


class _FailingRun:
    """A run whose engine yields one token and then raises, as an engine core that died would."""

    request_id = "r-1"
    kv_transfer_params = None
    prompt_tokens = 3
    cached_tokens = 0
    completion_tokens = 1

    def __aiter__(self):
        async def gen():
            yield Token(index=0, token_id=5)
            raise RuntimeError("engine core died")
        return gen()


def _events(chunks: list[str]) -> list:
    return [c.removeprefix("data: ").strip() for c in chunks]


def test_an_unexpected_engine_error_ends_the_stream_with_a_server_error_event() -> None:
    async def collect() -> list[str]:
        return [c async for c in _sse(_FailingRun(), "m", False, HashTokenizer())]

    out = _events(asyncio.run(collect()))
    assert json.loads(out[0])["choices"][0]["token_ids"] == [5]
    err = json.loads(out[-1])["error"]
    assert err["type"] == "server_error" and err["code"] == 500
    assert "RuntimeError: engine core died" in err["message"]
    assert "[DONE]" not in out
