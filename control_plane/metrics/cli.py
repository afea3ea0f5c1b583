"""``switchyard metrics ...``: the event-derived metrics processor.

Registered by ``switchyard/cli.py`` as ``app.add_typer(metrics_app, name="metrics")``; also
runnable alone: ``python -m control_plane.metrics.cli run --port 59100``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from control_plane.clikit import setup_logging
from control_plane.planner.config import DEFAULT_ITL_SLO_MS, DEFAULT_TTFT_SLO_MS

metrics_app = typer.Typer(help="Event-derived metrics: fold the log into Prometheus metrics on /metrics.",
                          no_args_is_help=True)


@metrics_app.command("run")
def run(
    port: Annotated[int, typer.Option(help="HTTP port of /metrics and /health; 0 picks a free one (see READY).")] = 59100,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    processor_id: Annotated[Optional[str], typer.Option(help="Stable id: names consumer groups and the snapshot key.")] = None,
    hash_algo: Annotated[str, typer.Option(help="Prefix hash: sha256 | sha256_cbor | xxhash | xxhash_cbor (the router's --hash-algo).")] = "sha256",
    block_size: Annotated[int, typer.Option(help="Prefix index block size (the router's --block-size).")] = 64,
    ttft_slo_ms: Annotated[float, typer.Option(help="TTFT SLO of pools without a PoolUpdated SLO.")] = DEFAULT_TTFT_SLO_MS,
    itl_slo_ms: Annotated[float, typer.Option(help="ITL SLO of pools without a PoolUpdated SLO.")] = DEFAULT_ITL_SLO_MS,
    snapshot_every: Annotated[float, typer.Option(help="Seconds between checkpoints of the projection.")] = 10.0,
    probe_every: Annotated[float, typer.Option(help="Seconds between broker probes (watermarks, consumer groups).")] = 5.0,
    fresh: Annotated[bool, typer.Option("--fresh", help="Ignore snapshots: fold the whole log from the start.")] = False,
    targets_dir: Annotated[Optional[Path], typer.Option(help="Write a Prometheus file_sd target for this processor here.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Fold every event stream (kv, requests, workers, planner, admin) and the dead-letter topic
    into Prometheus metrics: request rates, TTFT/ITL, goodput per pool SLO, prefix hits by tier,
    avoidable prefill, index size and staleness, tier occupancy and moves, KV transfers,
    scaling decisions, consumer lag per group and dead letters. Resumes from its newest
    checkpoint; SIGTERM checkpoints and exits."""
    setup_logging(verbose, libraries=("faust", "aiokafka", "mode"))
    # lazy: start-up time: loads switchyard_native, xxhash only when called
    from control_plane.metrics.projection import ProjectionConfig
    # lazy: start-up time: loads confluent_kafka, prometheus_client, switchyard_native ... only when called
    from control_plane.metrics.stream import MetricsSettings, run_metrics
    # lazy: start-up time: loads switchyard_native, xxhash only when called
    from common.hashing import HashAlgo, HashConfig
    # lazy: CLI start-up: the command's modules load only when it runs
    from common.settings import BusSettings

    kw = {"processor_id": processor_id} if processor_id else {}
    try:
        # The wire form the engines put in their events (as the router computes it).
        wire_algo = HashConfig(HashAlgo(hash_algo), block_size).hash_algo
        projection = ProjectionConfig(hash_algo=wire_algo, block_size=block_size,
                                      default_ttft_slo_ms=ttft_slo_ms, default_itl_slo_ms=itl_slo_ms)
        settings = MetricsSettings(host=host, port=port, projection=projection,
                                   snapshot_every_s=snapshot_every, probe_every_s=probe_every,
                                   restore=not fresh, targets_dir=targets_dir, **kw)
    except ValueError as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(run_metrics(settings, BusSettings.from_env(role="processor")))


@metrics_app.command("list")
def list_metrics() -> None:
    """Print every metric the processor exposes: name, type, labels."""
    # lazy: CLI start-up: the command's modules load only when it runs
    from control_plane.metrics.catalog import SPECS

    for s in SPECS:
        typer.echo(f"{s.name:52s} {s.kind.value:9s} {','.join(s.labels)}")


if __name__ == "__main__":
    metrics_app()
