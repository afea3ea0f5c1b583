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
    typer.secho(f"error: {' '.join(msg.split())}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


#: Largest KV block a replay can be asked to hash with (vLLM's block sizes are at most a few
#: hundred tokens).
MAX_BLOCK_SIZE = 65_536


def _check_args(*, source: str | None = None, points: dict[str, str] | None = None, range_: tuple[str, str] | None = None,
                block_size: int | None = None, hash_algo: str | None = None,
                outputs: dict[str, Path | None] | None = None) -> None:
    """Refuse nonsense before reading anything: one line naming the option, exit 2."""
    # lazy: CLI start-up: the command's modules load only when it runs
    from control_plane.replay.errors import BadPoint
    # lazy: CLI start-up: the command's modules load only when it runs
    from control_plane.replay.points import check_range, parse_point
    # lazy: start-up time: loads switchyard_native, xxhash only when called
    from common.hashing import HashAlgo

    if source is not None and source != "kafka":
        path = Path(source)
        if not path.is_file():
            _fail(f"--source {source[:200]!r}: no such file (give 'kafka' or a .sylog file from `replay export`)")
    try:
        parsed = {opt: parse_point(text) for opt, text in (points or {}).items()}
        if range_ is not None:
            check_range(parsed[range_[0]], parsed[range_[1]])
    except BadPoint as e:
        _fail(str(e))
    if block_size is not None and not 1 <= block_size <= MAX_BLOCK_SIZE:
        _fail(f"--block-size {block_size}: must be between 1 and {MAX_BLOCK_SIZE} tokens")
    if hash_algo is not None and hash_algo not in {a.value for a in HashAlgo}:
        _fail(f"--hash-algo {hash_algo[:40]!r}: one of {', '.join(a.value for a in HashAlgo)}")
    for opt, path in (outputs or {}).items():
        if path is None:
            continue
        if path.is_dir() or not path.parent.is_dir():
            _fail(f"{opt} {str(path)[:200]!r}: not a file in an existing directory")


def _engine(source: str, prefix: str | None, quiet: bool):
    # lazy: start-up time: loads switchyard_native, xxhash only when called
    from control_plane.replay.engine import ReplayEngine
    # lazy: CLI start-up: the command's modules load only when it runs
    from common.log.catalog import Catalog
    # lazy: CLI start-up: the command's modules load only when it runs
    from common.log.reader import FileLogReader, KafkaLogReader
    # lazy: CLI start-up: the command's modules load only when it runs
    from common.settings import BusSettings

    bus = BusSettings.from_env()
    catalog = Catalog(prefix or bus.topic_prefix)
    reader = KafkaLogReader(bus) if source == "kafka" else FileLogReader(source)
    return ReplayEngine(reader, catalog, progress=_tqdm_factory(quiet)), reader


def _tqdm_factory(quiet: bool):
    # lazy: start-up time: loads switchyard_native, xxhash only when called
    from control_plane.replay.engine import no_progress

    if quiet:
        return no_progress

    def make(desc: str, total: int | None):
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit="rec", file=sys.stderr, leave=False, disable=quiet,
                    mininterval=0.5)

    return make


def _book(paths: list[Path] | None):
    # lazy: start-up time: loads switchyard_native, xxhash only when called
    from control_plane.replay.engine import ConfigBook
    # lazy: start-up time: loads switchyard_native, xxhash only when called
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
    # lazy: CLI start-up: the command's modules load only when it runs
    from control_plane.replay.errors import ReplayError
    # lazy: CLI start-up: the command's modules load only when it runs
    from common.errors import LogReadError

    try:
        engine, reader = _engine(source, prefix, quiet)
    except (LogReadError, OSError, ValueError) as e:
        _fail(f"--source {source[:200]!r}: {e}")
    try:
        return call(engine)
    except (ReplayError, LogReadError) as e:
        _fail(str(e))
    finally:
        _close(reader)


def _write(opt: str, path: Path, write: Callable[[Path], None]) -> None:
    try:
        write(path)
    except OSError as e:
        _fail(f"{opt} {str(path)[:200]!r}: {e.strerror or e}")


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
    _check_args(source=source, points={"--at": at}, block_size=block_size, hash_algo=hash_algo,
                outputs={"--export": export, "--plot": plot})
    state, _ = _replay(source, prefix, quiet, lambda engine: engine.state(
        at, hash_algo=hash_algo, block_size=block_size, use_snapshots=not no_snapshot))
    if export:
        _write("--export", export, lambda p: p.write_text(json.dumps(state, indent=1, default=str)))
    if plot:
        # lazy: CLI start-up: the command's modules load only when it runs
        from control_plane.replay.plot import plot_state

        _write("--plot", plot, lambda p: plot_state(state, p))
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
    _check_args(source=source, points={"--from": frm, "--to": to}, range_=("--from", "--to"),
                outputs={"--plot": plot})
    try:
        book = _book(config)
    except (ValueError, OSError) as e:
        _fail(str(e))
    report = _replay(source, prefix, quiet,
                     lambda engine: engine.verify(frm, to, configs=book, keep_checks=plot is not None))
    if plot:
        # lazy: CLI start-up: the command's modules load only when it runs
        from control_plane.replay.plot import plot_verify

        _write("--plot", plot, lambda p: plot_verify(report, p))
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
    _check_args(source=source, points={"--from": frm, "--to": to}, range_=("--from", "--to"),
                outputs={"--plot": plot})
    try:
        # lazy: start-up time: loads switchyard_native, xxhash only when called
        from control_plane.router.config import load_router_config

        alt = load_router_config(router_config)
        book = _book(config)
    except (ValueError, OSError) as e:
        _fail(str(e))
    report = _replay(source, prefix, quiet, lambda engine: engine.whatif(
        frm, to, alt, configs=book, profile=profile, simulate=not no_sim))
    if plot:
        # lazy: CLI start-up: the command's modules load only when it runs
        from control_plane.replay.plot import plot_whatif

        _write("--plot", plot, lambda p: plot_whatif(report, p))
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


@replay_app.command("reconcile")
def reconcile_cmd(
    show: Annotated[int, typer.Option(help="Shortfalls to print, one line each.")] = 10,
    source: SourceOpt = "kafka", prefix: PrefixOpt = None, as_json: JsonOpt = False, quiet: QuietOpt = False,
) -> None:
    """Per routed prefill: the overlap the decision saw on the chosen worker against the cached
    tokens the engine reported, with a blame for each shortfall (stale index, stored after
    routing, speculative not hit, evicted after routing)."""
    _check_args(source=source)
    # lazy: CLI start-up: the command's modules load only when it runs
    from control_plane.replay.reconcile import BLAMES, KvRecord, reconcile
    # lazy: CLI start-up: the command's modules load only when it runs
    from common.log.reader import scan_events

    def run(engine: ReplayEngine):
        requests = [env for _, env in scan_events(engine.reader, engine.catalog.topic("requests"), codec=engine.codec)]
        kv = [KvRecord(r.topic, r.partition, r.offset, env)
              for r, env in scan_events(engine.reader, engine.catalog.topic("kv"), codec=engine.codec)]
        return reconcile(requests, kv)

    report = _replay(source, prefix, quiet, run)
    s = report.summary()
    if as_json:
        s["checks"] = msgspec.to_builtins(report.checks)
        typer.echo(json.dumps(s))
        return
    typer.echo(f"reconciled {s['requests']} routed prefills ({s['unmatched']} without an outcome): predicted "
               f"{s['predicted_blocks']} cached blocks, engines reported {s['cached_blocks']}; "
               f"{s['cached_tokens']} of {s['prompt_tokens']} prompt tokens cached")
    typer.echo(f"exact {s['exact']}; " + ", ".join(f"{b} {s[b]}" for b in BLAMES)
               + f"; routed past a longer cached prefix (load) {s['routed_past_cache']} "
               f"({s['blocks_left_elsewhere']} blocks left elsewhere)")
    if s["ttft_predictions"]:
        typer.echo(f"TTFT: {s['ttft_predictions']} predictions, |predicted - observed| / observed p50 "
                   f"{s['prediction_err_p50']:.3f}, p90 {s['prediction_err_p90']:.3f}")
    for c in [c for c in report.checks if c.blame][:show]:
        typer.echo(f"- {c.request_id} on {c.worker_id}: saw {c.seen_blocks} (+{c.speculative_blocks} in flight), "
                   f"engine cached {c.cached_blocks}, unfolded {c.unfolded_blocks}: {c.blame}")


@replay_app.command("export")
def export_cmd(
    out: Annotated[Path, typer.Argument(help="Output .sylog file.")],
    streams: Annotated[str, typer.Option(help="Comma-separated streams.")] = "kv,workers,requests,snapshots",
    prefix: PrefixOpt = None, quiet: QuietOpt = False,
) -> None:
    """Copy topics of the broker into a file that every replay command can read (--source)."""
    _check_args(outputs={"OUT": out})
    # lazy: CLI start-up: the command's modules load only when it runs
    from common.log.catalog import Catalog
    # lazy: CLI start-up: the command's modules load only when it runs
    from common.log.reader import KafkaLogReader, export_log
    # lazy: CLI start-up: the command's modules load only when it runs
    from common.settings import BusSettings

    bus = BusSettings.from_env()
    cat = Catalog(prefix or bus.topic_prefix)
    with KafkaLogReader(bus) as reader:
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
