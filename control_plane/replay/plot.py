"""PNG figures of replay results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import io
from pathlib import Path

_TIER_COLORS = {"device": "#1f77b4", "host": "#ff7f0e", "disk": "#2ca02c", "object": "#9467bd"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path | None) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    _plt().close(fig)
    data = buf.getvalue()
    if path is not None:
        Path(path).write_bytes(data)
    return data


def plot_state(state: dict, path: str | Path | None = None) -> bytes:
    """Blocks per worker by tier, and each worker's reported and routed load."""
    plt = _plt()
    view = state["view"]
    workers = sorted(set(view["workers"]) | set(view["blocks"]))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    bottom = [0] * len(workers)
    for tier, color in _TIER_COLORS.items():
        vals = [view["blocks"].get(w, {}).get(tier, 0) for w in workers]
        if any(vals):
            ax1.bar(workers, vals, bottom=bottom, label=tier, color=color)
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax1.set_title(f"KV blocks held at {state['at']}")
    ax1.set_ylabel("blocks")
    ax1.legend()
    ax1.tick_params(axis="x", rotation=45)
    load = (state.get("load") or {}).get("workers", {})
    running = [view["workers"].get(w, {}).get("running", 0) for w in workers]
    waiting = [view["workers"].get(w, {}).get("waiting", 0) for w in workers]
    inflight = [load.get(w, {}).get("inflight", 0) for w in workers]
    x = range(len(workers))
    ax2.bar([i - 0.25 for i in x], running, width=0.25, label="running (reported)")
    ax2.bar(list(x), waiting, width=0.25, label="waiting (reported)")
    ax2.bar([i + 0.25 for i in x], inflight, width=0.25, label="in flight (routed, not ended)")
    ax2.set_xticks(list(x), workers, rotation=45)
    ax2.set_title("Load view")
    ax2.legend()
    return _save(fig, path)


def plot_verify(report, path: str | Path | None = None) -> bytes:
    """Decisions over time: identical vs mismatched (needs ``keep_checks``)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 3.5))
    checks = report.checks
    if checks:
        t0 = min(c.at_ns for c in checks)
        ok = [(c.at_ns - t0) / 1e9 for c in checks if c.matched and c.seed_rule_ok]
        bad = [(c.at_ns - t0) / 1e9 for c in checks if not (c.matched and c.seed_rule_ok)]
        ax.scatter(ok, [1] * len(ok), marker="|", s=200, color="#2ca02c", label=f"identical ({len(ok)})")
        ax.scatter(bad, [0] * len(bad), marker="x", s=60, color="#d62728", label=f"mismatch ({len(bad)})")
        ax.legend(loc="center right")
    ax.set_yticks([0, 1], ["mismatch", "identical"])
    ax.set_ylim(-0.5, 1.5)
    ax.set_xlabel("seconds since the first decision in range")
    ax.set_title(f"replay verify: {report.identical}/{report.decisions} decisions identical")
    return _save(fig, path)


def plot_whatif(report, path: str | Path | None = None) -> bytes:
    """Choices per worker (recorded vs alternative) and, when simulated, the TTFT CDFs."""
    # lazy: start-up time: loads msgspec, numpy, switchyard_native ... only when called
    from control_plane.replay.whatif import ttft_cdf

    plt = _plt()
    sim = report.simulation or {}
    ncols = 2 if sim.get("ttft_ms") else 1
    fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols, 4.5))
    axes = axes if ncols > 1 else [axes]
    workers = sorted(set(report.per_worker_recorded) | set(report.per_worker_alternative))
    x = range(len(workers))
    axes[0].bar([i - 0.2 for i in x], [report.per_worker_recorded.get(w, 0) for w in workers], width=0.4,
                label="recorded")
    axes[0].bar([i + 0.2 for i in x], [report.per_worker_alternative.get(w, 0) for w in workers], width=0.4,
                label="alternative config")
    axes[0].set_xticks(list(x), workers, rotation=45)
    axes[0].set_title(f"choices ({report.changed}/{report.rescored} changed)")
    axes[0].legend()
    if ncols > 1:
        for label, vals in sim["ttft_ms"].items():
            xs, ys = ttft_cdf(vals)
            axes[1].plot(xs, ys, label=f"{label} (sim)")
        axes[1].set_xscale("log")
        axes[1].set_xlabel("TTFT ms (simulated engine)")
        axes[1].set_ylabel("fraction of requests")
        axes[1].set_title("TTFT CDF")
        axes[1].legend()
    return _save(fig, path)
