"""``switchyard planner ...``: run a planner replica, backtest a config on recorded load. (``pin``
and ``unpin`` act through the admin API: control_plane/admin/cli.py adds them to this group in
``switchyard``.) Imports stay lazy so ``--help`` is instant."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated, Optional

import typer

from control_plane.clikit import fail, setup_logging

planner_app = typer.Typer(
    help="SLO planner: sizes prefill/decode/aggregated pools from the load view, one active "
         "replica at a time (Redis lease + fencing token); every decision is a ScalingDecision event.",
    no_args_is_help=True,
)


@planner_app.command("run")
def run(
    config: Annotated[Optional[Path], typer.Option(help="Planner config (TOML/JSON); default: one aggregated pool 'default'.")] = None,
    scaler: Annotated[str, typer.Option(help="local (worker processes) | kubernetes | virtual (in memory).")] = "local",
    planner_id: Annotated[Optional[str], typer.Option(help="Replica id (consumer group, producer, lease value).")] = None,
    state_dir: Annotated[Optional[Path], typer.Option(help="Local scaler records, fencing file, Faust data (default .stack/planner).")] = None,
    lease: Annotated[str, typer.Option(help="Lease name: replicas sharing it elect one leader.")] = "default",
    lease_ttl_ms: Annotated[int, typer.Option(help="Lease time-to-live; a dead leader is replaced within about this.")] = 3000,
    dry_run: Annotated[bool, typer.Option(help="Kubernetes: send every write with dryRun=All.")] = False,
    namespace: Annotated[str, typer.Option(help="Kubernetes namespace of the pool Deployments.")] = "default",
    kube_host: Annotated[Optional[str], typer.Option(help="Kubernetes API URL (no kubeconfig).")] = None,
    kubeconfig: Annotated[Optional[str], typer.Option(help="Kubeconfig file.")] = None,
    in_cluster: Annotated[bool, typer.Option(help="Use the pod's service account.")] = False,
    worker_arg: Annotated[Optional[list[str]], typer.Option(help="Extra `switchyard worker` argument for local workers (repeatable).")] = None,
    virtual_startup_s: Annotated[float, typer.Option(help="Virtual scaler: seconds until a new replica is ready.")] = 0.0,
    redis_url: Annotated[Optional[str], typer.Option(envvar="SWITCHYARD_REDIS_URL", help="Redis holding the leader lease (default: the local stack's).")] = None,
    health_host: Annotated[str, typer.Option(help="Address of GET /health.")] = "127.0.0.1",
    health_port: Annotated[Optional[int], typer.Option(help="Port of GET /health (200 once the load view caught up); unset: none.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Run a planner replica: fold the load view, elect a leader, and (as leader) decide every
    tick and apply the decisions through the scaler."""
    setup_logging(verbose, libraries=("faust", "aiokafka", "mode"))
    # lazy: CLI start-up: the command's modules load only when it runs
    from control_plane.planner.errors import PlannerConfigError
    # lazy: CLI start-up: the command's modules load only when it runs
    from control_plane.planner.runner import PlannerSettings, run_planner
    # lazy: CLI start-up: the command's modules load only when it runs
    from common.settings import BusSettings

    kw = {}
    if planner_id:
        kw["planner_id"] = planner_id
    if state_dir:
        kw["state_dir"] = state_dir
    if redis_url:
        kw["redis_url"] = redis_url
    try:
        settings = PlannerSettings(config_path=config, scaler=scaler, lease_name=lease, lease_ttl_ms=lease_ttl_ms,
                                   dry_run=dry_run, namespace=namespace, kube_host=kube_host,
                                   kubeconfig=kubeconfig, in_cluster=in_cluster,
                                   worker_args=tuple(worker_arg or ()), virtual_startup_s=virtual_startup_s,
                                   health_host=health_host, health_port=health_port, **kw)
        raise typer.Exit(run_planner(settings, BusSettings.from_env(role="planner")))
    except PlannerConfigError as e:
        fail(str(e), 2)


@planner_app.command("backtest")
def backtest(
    from_: Annotated[str, typer.Option("--from", help="Start: ISO time, unix seconds, or relative like -30m.")],
    to: Annotated[str, typer.Option("--to", help="End: ISO time, unix seconds, relative, or 'now'.")] = "now",
    config: Annotated[Optional[Path], typer.Option(help="Candidate planner config (default: the built-in one).")] = None,
    predictor: Annotated[Optional[str], typer.Option(help="Override every pool's predictor: constant | moving_average | holt_winters | kalman.")] = None,
    png: Annotated[Optional[Path], typer.Option(help="Write a chart (load vs forecast, replicas, SLO attainment).")] = None,
    startup_s: Annotated[float, typer.Option(help="Seconds a new replica takes to become ready in the replay.")] = 30.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Replay recorded load (the requests/workers topics between --from and --to) through the
    planner core with another config or predictor; report its decisions, predicted vs actual
    load, estimated SLO attainment and replica-seconds against what was recorded."""
    logging.basicConfig(level=logging.WARNING)
    # lazy: CLI start-up: the command's modules load only when it runs
    from control_plane.planner.backtest import parse_time, read_log, run_backtest
    # lazy: CLI start-up: the command's modules load only when it runs
    from control_plane.planner.config import load_config
    # lazy: CLI start-up: the command's modules load only when it runs
    from control_plane.planner.errors import PlannerConfigError
    # lazy: CLI start-up: the command's modules load only when it runs
    from control_plane.planner.runner import default_config
    # lazy: CLI start-up: the command's modules load only when it runs
    from common.settings import BusSettings

    try:
        cfg = load_config(config) if config else default_config()
        start_ns, end_ns = parse_time(from_), parse_time(to)
        if end_ns <= start_ns:
            fail("--to must be after --from")
        events = read_log(BusSettings.from_env(), start_ns, end_ns)
        report = run_backtest(events, cfg, start_ns=start_ns, end_ns=end_ns, predictor=predictor,
                              startup_s=startup_s)
    except PlannerConfigError as e:
        fail(str(e), 2)
    if png is not None:
        report.plot(png)
    if as_json:
        typer.echo(json.dumps(report.as_dict(), indent=2))
    else:
        typer.echo(report.text())
    if png is not None:
        typer.echo(f"chart: {png}")
