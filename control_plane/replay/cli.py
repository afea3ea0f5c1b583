"""``switchyard replay ...``: point-in-time state, decision verification, counterfactuals.

Every command reads only the log: the broker (topic prefix from ``SWITCHYARD_TOPIC_PREFIX`` or
``--prefix``) or a file written by ``switchyard replay export`` (``--source FILE``).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn, Optional, TypeVar

import msgspec
import typer

if TYPE_CHECKING:
    from control_plane.replay.engine import ReplayEngine

T = TypeVar("T")

replay_app = typer.Typer(
    help="Rebuild state and re-execute decisions from the log alone (the Kafka log or an export).",
    no_args_is_help=True,
)

SourceOpt = Annotated[str, typer.Option("--source", help="'kafka' (the broker) or a .sylog file from `replay export`.")]
PrefixOpt = Annotated[Optional[str], typer.Option("--prefix", help="Topic prefix (default $SWITCHYARD_TOPIC_PREFIX or 'sy').")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the full result as JSON.")]
PlotOpt = Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG figure here.")]
QuietOpt = Annotated[bool, typer.Option("--no-progress", help="No progress bars (stderr).")]
ConfigsOpt = Annotated[Optional[list[Path]], typer.Option(
    "--config", help="RouterConfig file (JSON/TOML) the recorded decisions ran with; repeat for several "
                     "versions. A version without a file is assumed to be the router default.")]


def _fail(msg: str, code: int = 2) -> NoReturn:
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def _engine(source: str, prefix: str | None, quiet: bool):
    from control_plane.replay.engine import ReplayEngine
    from kernel.log.catalog import Catalog
    from kernel.log.reader import FileLogReader, KafkaLogReader
    from kernel.settings import BusSettings

    bus = BusSettings.from_env()
    catalog = Catalog(prefix or bus.topic_prefix)
    reader = KafkaLogReader(bus.bootstrap) if source == "kafka" else FileLogReader(source)
    return ReplayEngine(reader, catalog, progress=_tqdm_factory(quiet)), reader


def _tqdm_factory(quiet: bool):
    from control_plane.replay.engine import no_progress

    if quiet:
        return no_progress

    def make(desc: str, total: int | None):
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit="rec", file=sys.stderr, leave=False, disable=quiet,
                    mininterval=0.5)

    return make


def _book(paths: list[Path] | None):
    from control_plane.replay.engine import ConfigBook
    from control_plane.router.config import load_router_config

    configs = {}
    for p in paths or []:
        c = load_router_config(p)
        configs[c.version] = c
    return ConfigBook(configs)


def _close(reader) -> None:
    close = getattr(reader, "close", None)
    if close:
        close()


def _replay(source: str, prefix: str | None, quiet: bool, call: Callable[[ReplayEngine], T]) -> T:
    """``call`` on a replay engine over ``source``, whose reader is closed after; a replay or
    log-read error ends the command with its message."""
    from control_plane.replay.errors import ReplayError
    from kernel.errors import LogReadError

    engine, reader = _engine(source, prefix, quiet)
    try:
        return call(engine)
    except (ReplayError, LogReadError) as e:
        _fail(str(e))
    finally:
        _close(reader)


@replay_app.command("state")
def state_cmd(
    at: Annotated[str, typer.Option("--at", help="ISO time | epoch ms | topic:partition:offset | "
                                                "'{\"topic:partition\": offset}' | request:<id> | end.")] = "end",
    hash_algo: Annotated[str, typer.Option(help="Index hash algorithm (what the engines use).")] = "sha256",
    block_size: Annotated[int, typer.Option(help="Engine KV block size in tokens.")] = 64,
    no_snapshot: Annotated[bool, typer.Option("--no-snapshot", help="Fold from the start of the log.")] = False,
    export: Annotated[Optional[Path], typer.Option(help="Write the full state as JSON to this file.")] = None,
    source: SourceOpt = "kafka", prefix: PrefixOpt = None, as_json: JsonOpt = False, plot: PlotOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """Rebuild the prefix index, the worker registry and the load view as they were at --at."""
    state, _ = _replay(source, prefix, quiet, lambda engine: engine.state(
        at, hash_algo=hash_algo, block_size=block_size, use_snapshots=not no_snapshot))
    if export:
        export.write_text(json.dumps(state, indent=1, default=str))
    if plot:
        from control_plane.replay.plot import plot_state

        plot_state(state, plot)
    if as_json:
        typer.echo(json.dumps(state, default=str))
        return
    v = state["view"]
    typer.echo(f"state at {state['point']}: {v['applied']} records folded"
               + (f" (from snapshot at applied={state['snapshot']['applied']})" if state["snapshot"] else " (from the start)")
               + f" in {state['seconds']} s")
    typer.echo(f"index: {v['distinct_hashes']} distinct hashes, stale workers {v['stale_workers'] or 'none'}, "
               f"digest {v['digest'][:16]}")
    for wid, w in v["workers"].items():
        blocks = ", ".join(f"{t} {n}" for t, n in w["blocks"].items()) or "no blocks"
        load = (state.get("load") or {}).get("workers", {}).get(wid, {})
        typer.echo(f"  {wid:14s} {w['role']:10s} {w['state']:8s} epoch {w['epoch']}  {blocks};  running {w['running']} "
                   f"waiting {w['waiting']}  in flight {load.get('inflight', 0)}")
    if "load" in state:
        ld = state["load"]
        typer.echo(f"requests: {ld['admitted']} admitted, {ld['completed']} completed, {ld['failed']} failed, "
                   f"{ld['rejected']} rejected, {ld['inflight']} in flight")


@replay_app.command("verify")
def verify_cmd(
    frm: Annotated[str, typer.Option("--from", help="Start of the range (same forms as --at).")] = "start",
    to: Annotated[str, typer.Option("--to", help="End of the range, inclusive.")] = "end",
    config: ConfigsOpt = None,
    show: Annotated[int, typer.Option(help="Mismatches to print in full.")] = 5,
    source: SourceOpt = "kafka", prefix: PrefixOpt = None, as_json: JsonOpt = False, plot: PlotOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """Re-execute every recorded routing decision in the range; exit 1 unless all are identical."""
    try:
        book = _book(config)
    except (ValueError, OSError) as e:
        _fail(str(e))
    report = _replay(source, prefix, quiet,
                     lambda engine: engine.verify(frm, to, configs=book, keep_checks=plot is not None))
    if plot:
        from control_plane.replay.plot import plot_verify

        plot_verify(report, plot)
    if as_json:
        out = report.summary()
        out["mismatches"] = msgspec.to_builtins(report.mismatches)
        typer.echo(json.dumps(out))
    else:
        s = report.summary()
        typer.echo(f"verified {s['decisions']} decisions in {s['seconds']} s: {s['identical']} identical "
                   f"({s['identical_pct']}%), table {s['table_matches']}, state {s['state_matches']}, "
                   f"unverifiable {s['unverifiable']}")
        if s["configs_assumed"]:
            typer.echo(f"note: config versions {s['configs_assumed']} are not in the log; assumed router defaults "
                       "(pass --config FILE)")
        for m in report.mismatches[:show]:
            typer.echo(f"- {m.request_id} phase {m.phase} attempt {m.attempt} at {m.position}: recorded "
                       f"{m.recorded_worker}, table {m.table} ({m.table_worker}), state {m.state} ({m.state_worker})")
            for d in (m.input_diffs or [])[:8]:
                typer.echo(f"    input  {d}")
            for d in (m.state_diffs or m.table_diffs or [])[:8]:
                typer.echo(f"    output {d}")
            for n in m.notes:
                typer.echo(f"    note   {n}")
    raise typer.Exit(0 if report.identical == report.decisions else 1)


@replay_app.command("whatif")
def whatif_cmd(
    router_config: Annotated[Path, typer.Option("--router-config", help="The alternative RouterConfig (JSON/TOML).")],
    frm: Annotated[str, typer.Option("--from", help="Start of the range.")] = "start",
    to: Annotated[str, typer.Option("--to", help="End of the range, inclusive.")] = "end",
    config: ConfigsOpt = None,
    profile: Annotated[str, typer.Option(help="Simulated engine profile (mocker, h100_llama3_8b, or a TOML path).")] = "mocker",
    no_sim: Annotated[bool, typer.Option("--no-sim", help="Only re-score; skip the engine simulation.")] = False,
    source: SourceOpt = "kafka", prefix: PrefixOpt = None, as_json: JsonOpt = False, plot: PlotOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """Re-score the recorded traffic under another router config: changed choices, avoidable
    prefill tokens, and the TTFT/throughput effect on the simulated engine."""
    try:
        from control_plane.router.config import load_router_config

        alt = load_router_config(router_config)
        book = _book(config)
    except (ValueError, OSError) as e:
        _fail(str(e))
    report = _replay(source, prefix, quiet, lambda engine: engine.whatif(
        frm, to, alt, configs=book, profile=profile, simulate=not no_sim))
    if plot:
        from control_plane.replay.plot import plot_whatif

        plot_whatif(report, plot)
    if as_json:
        out = report.summary()
        out["examples"] = msgspec.to_builtins(report.examples)
        typer.echo(json.dumps(out, default=str))
        return
    s = report.summary()
    typer.echo(f"re-scored {s['rescored']} of {s['decisions']} decisions under {alt.mode.value} "
               f"(v{alt.version}): {s['changed']} change ({s['changed_pct']}%)")
    typer.echo(f"avoidable prefill tokens: recorded {s['avoidable_prefill_tokens_recorded']} -> alternative "
               f"{s['avoidable_prefill_tokens_alternative']} (of {s['prompt_tokens']} prompt tokens)")
    sim = s.get("simulation") or {}
    if sim.get("baseline"):
        for label in ("baseline", "alternative"):
            sm = sim[label]["summary"]
            typer.echo(f"sim {label:11s} ttft p50 {sm['ttft_p50_ms']:.1f} ms p99 {sm['ttft_p99_ms']:.1f} ms, "
                       f"{sm['output_tok_s']:.0f} output tok/s, reuse {sm['reuse']:.3f}, prefill tokens "
                       f"{sim[label]['prefill_tokens_computed']}")
    for n in s["notes"]:
        typer.echo(f"note: {n}")


@replay_app.command("export")
def export_cmd(
    out: Annotated[Path, typer.Argument(help="Output .sylog file.")],
    streams: Annotated[str, typer.Option(help="Comma-separated streams.")] = "kv,workers,requests,snapshots",
    prefix: PrefixOpt = None, quiet: QuietOpt = False,
) -> None:
    """Copy topics of the broker into a file that every replay command can read (--source)."""
    from kernel.log.catalog import Catalog
    from kernel.log.reader import KafkaLogReader, export_log
    from kernel.settings import BusSettings

    bus = BusSettings.from_env()
    cat = Catalog(prefix or bus.topic_prefix)
    with KafkaLogReader(bus.bootstrap) as reader:
        topics = [cat.topic(s.strip()) for s in streams.split(",") if s.strip()]
        bar = _tqdm_factory(quiet)("exporting", None)
        n = export_log(reader, topics, out, progress=bar.update)
        bar.close()
    typer.echo(f"wrote {n} records to {out}")


def main() -> None:  # python -m control_plane.replay.cli
    logging.basicConfig(level=logging.WARNING)
    replay_app()


if __name__ == "__main__":
    main()
