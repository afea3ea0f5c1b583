"""The Dashboards page: every panel of ``dashboards/*.json`` (the Grafana files, where each
panel and its PromQL are defined once) evaluated against Prometheus. Grafana's variables take
the values the page's filters give (``$__rate_interval`` -> the window, ``$pool`` -> a regex)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.settings import repo_root

DASHBOARDS = repo_root() / "dashboards"


@dataclass
class Series:
    labels: str
    value: str
    #: A sparkline's SVG polyline points over the window (empty without a range).
    points: str = ""


@dataclass
class PanelResult:
    title: str
    description: str
    unit: str
    exprs: list[str]
    series: list[Series] = field(default_factory=list)
    error: str = ""


def dashboards(root: Path = DASHBOARDS) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(root.glob("*.json"))}


def panels(doc: dict) -> list[dict]:
    """Panels with queries, rows' nested panels included, in the file's order."""
    out = []
    for p in doc.get("panels", []):
        if p.get("targets"):
            out.append(p)
        out.extend(q for q in p.get("panels", []) if q.get("targets"))
    return out


def substitute(expr: str, rate_interval: str = "1m", pool: str = ".*") -> str:
    return expr.replace("$__rate_interval", rate_interval).replace("$pool", pool)


def _labels(metric: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(metric.items()) if k != "__name__") or "(total)"


def _fmt(v: str, unit: str) -> str:
    try:
        x = float(v)
    except ValueError:
        return v
    if math.isnan(x) or math.isinf(x):
        return v
    if unit == "percentunit":
        return f"{x * 100:.1f}%"
    if unit in ("s",):
        return f"{x:.3g} s"
    if unit == "ms":
        return f"{x:.3g} ms"
    if unit == "bytes":
        return f"{x:,.0f} B"
    return f"{x:.4g}"


def _sparkline(values: list[float], w: int = 120, h: int = 24) -> str:
    vs = [v for v in values if math.isfinite(v)]
    if len(vs) < 2:
        return ""
    lo, hi = min(vs), max(vs)
    span = (hi - lo) or 1.0
    n = len(values) - 1
    pts = []
    for i, v in enumerate(values):
        if math.isfinite(v):
            pts.append(f"{i * w / n:.1f},{h - (v - lo) / span * h:.1f}")
    return " ".join(pts)


def evaluate(prometheus_url: str, doc: dict, *, pool: str = ".*", window_s: int = 900, step_s: int = 30,
             now: float | None = None, timeout_s: float = 5.0) -> list[PanelResult]:
    """Every panel's queries over the last ``window_s`` (a range query: the sparkline and the
    last value)."""
    import time

    import httpx

    from concurrent.futures import ThreadPoolExecutor

    end = now if now is not None else time.time()
    ps = panels(doc)
    with httpx.Client(base_url=prometheus_url, timeout=timeout_s) as client:

        def one(p: dict) -> PanelResult:
            unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
            exprs = [substitute(t["expr"], pool=pool) for t in p["targets"]]
            res = PanelResult(title=p.get("title", ""), description=p.get("description", ""), unit=unit, exprs=exprs)
            for expr in exprs:
                try:
                    r = client.get("/api/v1/query_range", params={"query": expr, "start": end - window_s, "end": end,
                                                                    "step": step_s})
                    body: dict[str, Any] = r.json()
                except (httpx.HTTPError, ValueError) as e:
                    res.error = f"Prometheus at {prometheus_url}: {type(e).__name__}"
                    break
                if body.get("status") != "success":
                    res.error = str(body.get("error", body))[:300]
                    continue
                for s in body["data"]["result"]:
                    vals = [float(v) for _, v in s["values"]]
                    res.series.append(Series(labels=_labels(s["metric"]), value=_fmt(s["values"][-1][1], unit),
                                             points=_sparkline(vals)))
            return res

        # Prometheus answers panels concurrently; the page keeps the file's order.
        with ThreadPoolExecutor(max_workers=8) as ex:
            return list(ex.map(one, ps))
