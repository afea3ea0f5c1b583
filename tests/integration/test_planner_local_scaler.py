"""Local-process scaler end to end: real ``switchyard worker`` processes started on free ports,
drained with SIGTERM while requests stream through them, and not one request lost.

Scale 0 -> 2 (both register and serve), then 2 -> 1 naming the victim while 12 requests are in
flight on it and more keep coming: every in-flight request completes with all its tokens, new
requests to the draining worker get 503 and are retried on the other (what the router does), the
victim exits 0 after WorkerDraining and WorkerDeregistered, and the stale-token decision of a
deposed planner is rejected without touching the workers.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from control_plane.planner.scalers import LocalProcessScaler, PoolLaunch
from common.settings import BusSettings, worker_credential, worker_token
from schemas.events import ScalingDecision, WorkerDeregistered, WorkerDraining, WorkerRegistered
from schemas.types import WorkerRole
from tests.support.events import read_stream
from tests.support.waits import until

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

MAX_TOKENS = 120


def _decision(to: int, frm: int, token: int, drain: str = "") -> ScalingDecision:
    return ScalingDecision(pool="agg", decision_id=f"d-{to}-{token}", role=WorkerRole.AGGREGATED, from_replicas=frm,
                           to_replicas=to, reason="test", inputs={"drain_workers": drain} if drain else {},
                           config_version=1, fencing_token=token)


async def _complete(client: httpx.AsyncClient, urls: dict[str, str], first: str, i: int,
                    decoding: set[tuple[int, str]] | None = None) -> tuple[str, int]:
    """One request, streamed; on 503 (draining), or when the worker is gone before it answers
    (a drained worker exits: connection refused, or a pooled keep-alive connection it closed),
    retried on another worker, like the router. Returns (worker that served it, tokens
    received). ``decoding`` gets (i, worker) at the first token."""
    order = [first] + [w for w in urls if w != first]
    for wid in order:
        body = {"prompt": list(range(1 + i, 600 + i)), "max_tokens": MAX_TOKENS, "stream": True,
                "request_id": f"req-{i}-{wid}"}
        answered = False
        try:
            async with client.stream("POST", f"{urls[wid]}/v1/completions", json=body,
                                     headers={"Authorization": f"Bearer {worker_token(worker_credential(), wid)}"}) as r:
                answered = True
                if r.status_code == 503:
                    continue
                assert r.status_code == 200, await r.aread()
                tokens, done = 0, False
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        assert '"error"' not in line, line
                        tokens += 1
                        if decoding is not None:
                            decoding.add((i, wid))
                assert done, f"request {i} on {wid} ended without [DONE]"
                return wid, tokens
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
            if answered:
                raise  # a stream cut after the worker answered is a lost request
    raise AssertionError(f"request {i}: every worker refused it")


def test_scale_up_and_drain_under_load_loses_no_request(bus: BusSettings, tmp_path) -> None:
    env_extra = {"SWITCHYARD_KAFKA_BOOTSTRAP": bus.bootstrap, "SWITCHYARD_TOPIC_PREFIX": bus.topic_prefix}
    import os

    applied = []
    scaler = LocalProcessScaler(
        tmp_path / "local",
        [PoolLaunch("agg", WorkerRole.AGGREGATED, "mocker", speedup=1.0,
                    extra_args=("--load-interval", "0.5", "--drain-timeout-s", "30"))],
        env={**os.environ, **env_extra}, emit=applied.append)
    try:
        out = scaler.apply(_decision(2, 0, token=5))
        assert out.success and out.replicas == 2 and out.scaler == "local"
        urls = scaler.wait_ready("agg", 2, timeout_s=60)
        assert scaler.status("agg").ready == 2
        victim, keeper = sorted(urls)

        async def scenario() -> list[tuple[str, int]]:
            async with httpx.AsyncClient(timeout=60) as client:
                decoding: set[tuple[int, str]] = set()
                inflight = [asyncio.create_task(_complete(client, urls, victim, i, decoding)) for i in range(12)]
                # The 12 requests are decoding on the victim now: each has its first token from it.
                await until(lambda: {(i, victim) for i in range(12)} <= decoding, timeout=60,
                            what=lambda: f"12 requests decoding on {victim}: {sorted(decoding)}")
                res = await asyncio.to_thread(scaler.apply, _decision(1, 2, token=5, drain=victim))
                assert res.success and res.replicas == 1
                # a deposed planner's decision (older token) changes nothing
                stale = await asyncio.to_thread(scaler.apply, _decision(3, 1, token=4))
                assert not stale.success and "stale fencing token 4 < newest seen 5" in stale.error
                later = [asyncio.create_task(_complete(client, urls, victim, 100 + i)) for i in range(6)]
                return await asyncio.gather(*inflight, *later)

        results = asyncio.run(scenario())
        assert all(tokens == MAX_TOKENS for _, tokens in results)
        served_by_victim = sum(1 for wid, _ in results[:12] if wid == victim)
        assert served_by_victim == 12, "requests in flight on the draining worker must finish there"
        assert all(wid == keeper for wid, _ in results[12:]), "new requests go to the remaining worker"
        codes = scaler.wait_gone([victim], timeout_s=30)
        assert codes[victim] == 0
        st = scaler.status("agg")
        assert (st.desired, st.running, st.ready) == (1, 1, 1)
        assert [a.success for a in applied] == [True, True, False]
    finally:
        scaler.close(stop_workers=True)

    events = read_stream(bus, "workers")
    kinds = [(type(e.data).__name__, e.data.worker_id) for e in events
             if isinstance(e.data, (WorkerRegistered, WorkerDraining, WorkerDeregistered))]
    for wid in (victim, keeper):
        mine = [k for k, w in kinds if w == wid]
        assert mine == ["WorkerRegistered", "WorkerDraining", "WorkerDeregistered"], (wid, mine)


def test_a_new_scaler_adopts_running_workers_and_the_fence(bus: BusSettings, tmp_path) -> None:
    """A new leader's scaler (same state dir) sees the workers the old one started and keeps
    rejecting the old leader's token."""
    import os

    env = {**os.environ, "SWITCHYARD_KAFKA_BOOTSTRAP": bus.bootstrap, "SWITCHYARD_TOPIC_PREFIX": bus.topic_prefix}
    launch = [PoolLaunch("agg", WorkerRole.AGGREGATED, extra_args=("--load-interval", "0.5"))]
    old = LocalProcessScaler(tmp_path / "local", launch, env=env)
    new = None
    try:
        assert old.apply(_decision(1, 0, token=1)).success
        old.wait_ready("agg", 1, timeout_s=60)
        new = LocalProcessScaler(tmp_path / "local", launch, env=env)
        assert new.desired() == {"agg": 1}
        assert new.apply(_decision(1, 1, token=2)).success
        assert not old.apply(_decision(2, 1, token=1)).success
        assert new.status("agg").running == 1
    finally:
        (new or old).close(stop_workers=True)
