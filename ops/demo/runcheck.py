"""Predicted vs observed: what a live run should have shown, what it showed, and where the time
went. Used by ``switchyard up --demo`` and ``switchyard bench e2e``.

* :func:`predict` replays the same trace slice, with the same arrival compression, output cap,
  engine profile and topology, through the one cluster simulator
  (:mod:`control_plane.simulation`) in virtual time, and scales its times by the engines'
  speed-up, so the prediction is in the wall-clock milliseconds the client measures.
* :func:`breakdown` reads the run's own events back from the log (its request ids share one
  prefix) and splits each request's time into phases: the router's admission queue, the prefill
  (routed to ``PrefillCompleted``), the hop back to the router and the decode decision, the KV
  pull, and the rest until the first token. It also counts handoffs: disaggregated requests
  whose KV moved over NIXL (``KvTransferCompleted``) against all disaggregated requests.
* :class:`CpuSampler` measures the box's CPU use during the run (``/proc/stat``), so a summary
  can say how much headroom was left.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from control_plane.router import RouterConfig
from control_plane.simulation import Topology, run_cluster
from data_plane.engines import default_hash_config, load_profile
from data_plane.engines.trace import MooncakeTrace, read_mooncake
from common.log.reader import read_events
from common.settings import BusSettings

#: When observed TTFT p50 exceeds the prediction by this factor, the summary says where the
#: time went instead of printing a gain.
EXPLAIN_ABOVE = 2.0


def predict(trace: Path, *, limit: int, rate: float, speedup: float, max_output: int | None,
            prefill: int, decode: int, aggregated: int = 0, profile: str = "mocker",
            config: RouterConfig | None = None) -> dict[str, Any]:
    """The simulator's TTFT/ITL for this run, in wall-clock ms (virtual ms / ``speedup``)."""
    prof = load_profile(profile)
    records = read_mooncake(trace, limit)
    adapter = MooncakeTrace(default_hash_config(prof.block_size))
    t_first = records[0].timestamp_ms if records else 0
    reqs = []
    for r in adapter.requests(records, id_prefix="predict"):
        # Wall-clock arrival = trace time / rate; the engines run ``speedup`` x faster than the
        # profile, so in the profile's own (virtual) time the arrival is wall time x speedup.
        at = (r.arrival_ms - t_first) / rate * speedup
        out = r.max_tokens if max_output is None else max(1, min(r.max_tokens, max_output))
        reqs.append(dataclasses.replace(r, arrival_ms=at, max_tokens=out))
    topo = (Topology(f"{aggregated} aggregated", aggregated=aggregated) if aggregated
            else Topology(f"{prefill}P+{decode}D", prefill=prefill, decode=decode))
    s = run_cluster(reqs, topo, config or RouterConfig(), profile=prof).summary()
    scaled = {k: v / speedup for k, v in s.items() if k.endswith("_ms")}
    return {**scaled, "reuse": s["reuse"], "requests": s["requests"], "duration_s": s["duration_s"] / speedup}


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def breakdown(bus: BusSettings, request_prefix: str, since_ms: int) -> dict[str, Any]:
    """Per-phase medians (ms) and handoff counts of the run's requests, from the log alone."""
    by_rid: dict[str, list] = defaultdict(list)
    client: dict[str, str] = {}  # the router's request id -> the load generator's own id
    for env in read_events(bus, "requests", since_ms=since_ms):
        rid = env.correlation_id or env.key
        if rid:
            by_rid[rid].append(env)
            if env.type == "RequestAdmitted" and env.data.client_request_id:
                client[rid] = env.data.client_request_id
    by_req = {rid: evs for rid, evs in by_rid.items() if client.get(rid, rid).startswith(request_prefix)}
    phases: dict[str, list[float]] = defaultdict(list)
    disagg = moved = recomputed = 0
    fallback_reasons: dict[str, int] = defaultdict(int)
    for evs in by_req.values():
        evs.sort(key=lambda e: e.occurred_at_ns)
        first: dict[str, Any] = {}
        routed = []
        for e in evs:
            first.setdefault(e.type, e)
            if e.type == "RequestRouted":
                routed.append(e)
        adm = first.get("RequestAdmitted")
        if adm is None or not routed:
            continue

        def ms(a, b) -> float:  # noqa: ANN001
            return (b.occurred_at_ns - a.occurred_at_ns) / 1e6

        phases["queue"].append(routed[0].data.queued_ms)
        pc = first.get("PrefillCompleted")
        decode_routed = [r for r in routed if r.data.phase.value == "decode"]
        done = first.get("RequestCompleted")
        if pc is not None and decode_routed:
            disagg += 1
            phases["prefill"].append(ms(routed[0], pc))
            phases["to_decode"].append(ms(pc, decode_routed[0]))
            kc = first.get("KvTransferCompleted")
            if kc is not None:
                moved += 1
                phases["kv_pull"].append(ms(decode_routed[0], kc))
                if done is not None:
                    phases["after_pull"].append(done.data.ttft_ms - ms(adm, kc))
            else:
                recomputed += 1
                kf = first.get("KvTransferFailed")
                fallback_reasons[(kf.data.reason.split(":")[0] if kf else "no transfer recorded")] += 1
        if done is not None:
            phases["ttft_router"].append(done.data.ttft_ms)
    return {
        "requests": len(by_req),
        "disaggregated": disagg,
        "handoffs": moved,
        "recomputed": recomputed,
        "handoff_ratio": moved / disagg if disagg else float("nan"),
        "fallback_reasons": dict(fallback_reasons),
        "phase_p50_ms": {k: _median(v) for k, v in phases.items()},
    }


def explain(observed_p50: float, predicted_p50: float, bd: dict[str, Any]) -> list[str]:
    """Lines for a summary: the ratio, and the phases when it is off by more than 2x."""
    ratio = observed_p50 / predicted_p50 if predicted_p50 > 0 else float("inf")
    out = [f"TTFT p50 observed {observed_p50:.0f} ms vs predicted {predicted_p50:.0f} ms ({ratio:.2f}x)"]
    if ratio > EXPLAIN_ABOVE:
        p = bd.get("phase_p50_ms", {})
        names = {"queue": "router admission queue", "prefill": "prefill (routed -> PrefillCompleted)",
                 "to_decode": "prefill answer -> decode decision", "kv_pull": "decode decision -> KV pulled",
                 "after_pull": "KV pulled -> first token"}
        parts = [f"{names[k]} {p[k]:.0f} ms" for k in names if k in p]
        out.append("where the time went (per-request medians): " + "; ".join(parts))
    return out


class CpuSampler:
    """Busy fraction of all CPUs between ``start`` and ``stop`` (``/proc/stat``), plus its peak
    over 1 s windows."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._samples: list[float] = []
        self._first: tuple[float, float] | None = None
        self._last: tuple[float, float] | None = None
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    @staticmethod
    def _read() -> tuple[float, float]:
        try:
            with open("/proc/stat") as f:
                vals = [float(x) for x in f.readline().split()[1:]]
        except OSError:
            return (0.0, 0.0)
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0.0)
        return (sum(vals), idle)

    def _run(self) -> None:
        prev = self._read()
        while not self._stop.wait(self.interval_s):
            cur = self._read()
            dt = cur[0] - prev[0]
            if dt > 0:
                self._samples.append(1.0 - (cur[1] - prev[1]) / dt)
            prev = cur

    def start(self) -> CpuSampler:
        self._first = self._read()
        self._thread.start()
        return self

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join(5)
        self._last = self._read()
        assert self._first is not None
        total = self._last[0] - self._first[0]
        busy = 1.0 - (self._last[1] - self._first[1]) / total if total > 0 else float("nan")
        return {"cpu_busy": busy, "cpu_busy_peak": max(self._samples, default=busy),
                "cpu_headroom": 1.0 - busy}


def now_ms() -> int:
    return int(time.time() * 1000)
