"""One prefill and one decode vLLM worker with vLLM's NixlConnector on CPU buffers, behind the
router: the two-phase flow (``kv_transfer_params`` from the prefill answer into the decode
request), a real NIXL READ over UCX on loopback, ``KvTransferStarted/Completed`` with bytes and
duration in the log, and a failed transfer recorded as ``KvTransferFailed(recompute)`` while
the request still completes."""

from __future__ import annotations

import os
import time

import httpx
import openai
import pytest

from common.net import free_port
from common.settings import BusSettings
from schemas.events import (
    KvTransferCompleted,
    KvTransferFailed,
    KvTransferStarted,
    PrefillCompleted,
    RequestCompleted,
    RequestFailed,
    RequestRouted,
)
from tests.integration.workerproc import WorkerProc
from tests.support.events import read_stream, router_ids
from tests.support.waits import wait_for
from tests.vllm.conftest import (
    BLOCK,
    WORKER_ENV,
    listeners_outside_loopback,
    serving,
    vllm_prompt,
    vllm_python,
)

# Two vLLM engines and the broker share two cores here: the log's acknowledgement of a handoff
# (PrefillCompleted) took over the workers' 10 s default in full-suite runs, so the tier gives it
# 30 s (a slow ack is logged with its wait either way). The cause, found later, was NIXL's
# progress threads spinning on both cores (test_idle_workers_leave_the_cores_alone).
NIXL = ("--engine", "vllm", "--vllm-kv-connector", "nixl", "--ack-timeout-s", "30")


@pytest.fixture(scope="module")
def pd(vbus: BusSettings, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-pd")
    py = vllm_python()
    prefill = WorkerProc(vbus, "vp-0", tmp / "p0", tmp, role="prefill", args=NIXL, python=py, env=WORKER_ENV)
    decode = WorkerProc(vbus, "vd-0", tmp / "d0", tmp, role="decode", args=NIXL, python=py, env=WORKER_ENV)
    with serving(vbus, [prefill, decode]) as base:
        yield prefill, decode, base


def _events(bus: BusSettings, rid: str) -> list:
    """``rid``'s events: a client id sent through the router is resolved to the router's id."""
    rid = router_ids(bus).get(rid, rid)
    return [e.data for e in read_stream(bus, "requests") if e.correlation_id == rid]


def _ended(bus: BusSettings, rid: str) -> list:
    """``rid``'s events once its end is on the log: the router records RequestCompleted as the
    stream closes, and the client can read the log before that record is delivered."""
    def ended():
        evs = _events(bus, rid)
        return evs if any(isinstance(e, (RequestCompleted, RequestFailed)) for e in evs) else None
    return wait_for(ended, timeout=30, what=f"the end of {rid} in the log")


def _session_cpu_s(sid: int) -> float:
    """CPU seconds used so far by every live process of session ``sid`` (a worker launched with
    ``start_new_session``: its engine core and model worker too)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # field 6 of stat, the session id
            total += int(fields[11]) + int(fields[12])
    return total / tick


def test_idle_workers_leave_the_cores_alone(pd) -> None:
    """An idle prefill and decode worker, NIXL agents included, use a fraction of a core. NIXL's
    UCX progress thread polls with a 0 ms timeout unless paced (data_plane/vllm/nixl_pacing.py):
    before that, these two burned both cores of this box while idle, and the tier failed its
    delivery and connect deadlines at random."""
    prefill, decode, _ = pd
    sids = {w.worker_id: w.proc.pid for w in (prefill, decode)}
    windows: list[dict[str, float]] = []

    def quiet_window() -> bool:
        before = {w: _session_cpu_s(sid) for w, sid in sids.items()}
        t0 = time.monotonic()
        time.sleep(2.0)
        dt = time.monotonic() - t0
        windows.append({w: round((_session_cpu_s(sid) - before[w]) / dt, 3) for w, sid in sids.items()})
        return all(cores < 0.5 for cores in windows[-1].values())

    wait_for(quiet_window, timeout=40, interval=0.0, what=lambda: f"idle workers under half a core: {windows}")


def test_two_phase_request_moves_real_kv_over_nixl(pd, vbus: BusSettings) -> None:
    """A two-phase request moves its prompt's KV over NIXL. The first READ between two engines
    also pays the NIXL handshake, which a loaded box can fail: that is a recorded recompute
    (the request still completes), so up to three requests are sent and the first one whose KV
    moved is checked in full; every one before it must have recorded its fallback."""
    prefill, decode, base = pd
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=300)
    for attempt in range(3):
        rid = f"pd-{attempt + 1}"
        prompt = vllm_prompt(7 + attempt, 10 * BLOCK + 5)  # 10 full blocks + 5 tokens
        out = list(client.completions.create(model="switchyard-sim", prompt=prompt, max_tokens=6, stream=True,
                                             extra_body={"request_id": rid}))
        assert sum(1 for c in out if c.choices and c.choices[0].text) == 6
        evs = _events(vbus, rid)
        routed = [e for e in evs if isinstance(e, RequestRouted)]
        assert [(r.phase.value, r.worker_id) for r in routed] == [("prefill", "vp-0"), ("decode", "vd-0")]
        pc = next(e for e in evs if isinstance(e, PrefillCompleted))
        assert pc.worker_id == "vp-0" and pc.kv_transfer_params.get("do_remote_prefill") is True
        started = next(e for e in evs if isinstance(e, KvTransferStarted))
        assert started.src_worker == "vp-0" and started.dst_worker == "vd-0"
        fin = next(e for e in evs if isinstance(e, RequestCompleted))
        assert fin.worker_id == "vd-0" and fin.output_tokens == 6
        done = [e for e in evs if isinstance(e, KvTransferCompleted)]
        if done:
            assert done[0].blocks == started.blocks >= 10 and done[0].bytes > 0 and done[0].duration_ms > 0
            assert not [e for e in evs if isinstance(e, KvTransferFailed)]
            break
        failed = [e for e in evs if isinstance(e, KvTransferFailed)]
        assert failed and failed[0].fallback == "recompute", evs
    else:
        raise AssertionError("three two-phase requests, none moved its KV over NIXL")
    # vLLM's own account of it: the decode engine did a NIXL transfer.
    assert decode.state()["vllm"]["nixl"]["transfers"] >= 1
    m = httpx.get(f"{decode.url}/metrics", timeout=10).text
    assert "switchyard_worker" in m or "vllm:" in m


def test_failed_transfer_is_recorded_and_recomputed(pd, vbus: BusSettings) -> None:
    """Decode params naming a holder that is not there (the prefill's side channel port
    refused): vLLM's handshake fails, it recomputes (kv_load_failure_policy=recompute), the
    worker records KvTransferFailed(fallback=recompute) and the request still completes."""
    prefill, decode, _ = pd
    prompt = vllm_prompt(8, 6 * BLOCK + 3)
    r = httpx.post(f"{prefill.url}/v1/completions", timeout=300, headers=prefill.credential(), json={
        "prompt": prompt, "max_tokens": 1, "request_id": "pd-fail-p",
        "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    params = dict(r.json()["kv_transfer_params"])
    params["remote_port"] = free_port()  # nobody listens there
    params["remote_engine_id"] = "no-such-engine"
    r = httpx.post(f"{decode.url}/v1/completions", timeout=300, headers=decode.credential(), json={
        "prompt": prompt, "max_tokens": 4, "request_id": "pd-fail", "kv_transfer_params": params})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["token_ids"]) == 4
    evs = _events(vbus, "pd-fail")
    failed = [e for e in evs if isinstance(e, KvTransferFailed)]
    assert failed and failed[0].fallback == "recompute" and "vLLM" in failed[0].reason
    assert not [e for e in evs if isinstance(e, KvTransferCompleted)]


def test_nixl_listeners_stay_on_loopback(pd) -> None:
    prefill, decode, _ = pd
    assert listeners_outside_loopback([prefill.proc.pid, decode.proc.pid]) == []
