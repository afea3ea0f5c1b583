"""``switchyard workload ...``: generate a seeded workload, print any trace's statistics."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from control_plane.clikit import fail

workload_app = typer.Typer(
    help="Seeded workload families (chat, agentic, rag, long-context, mixed) as Mooncake-format "
         "traces, and any trace's statistics (docs/workloads.md).",
    no_args_is_help=True,
)


@workload_app.command("generate")
def generate_cmd(
    family: Annotated[str, typer.Option(help="chat | agentic | rag | long-context | mixed.")],
    seed: Annotated[int, typer.Option(help="Same family, seed and options: the same bytes on any machine.")],
    duration: Annotated[float, typer.Option(help="Seconds of arrivals.")] = 600.0,
    rate: Annotated[Optional[float], typer.Option(help="Mean requests/s (default: the family's).")] = None,
    arrival: Annotated[str, typer.Option(help="poisson | bursty | diurnal | step | ramp | flash.")] = "poisson",
    cv: Annotated[float, typer.Option(help="Inter-arrival coefficient of variation of --arrival bursty.")] = 2.0,
    knob: Annotated[Optional[list[str]], typer.Option(
        help="A family knob, name=value (repeatable; `switchyard workload knobs` lists them).")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Write the trace here (default: stdout, unless --stats).")] = None,
    stats: Annotated[bool, typer.Option("--stats", help="Print the trace's statistics and a RESULT line.")] = False,
) -> None:
    """Write a generated Mooncake-format trace (jsonl: timestamp ms, input_length, output_length,
    hash_ids of 512-token blocks, session_id, turn; priority and tenant for mixed)."""
    # lazy: start-up time: loads msgspec, numpy, switchyard_native ... only when called
    from workloads.generator import Spec, dumps, generate
    # lazy: start-up time: loads msgspec, numpy, switchyard_native ... only when called
    from workloads.stats import trace_stats

    pairs = []
    for k in knob or []:
        name, sep, value = k.partition("=")
        if not sep:
            fail(f"--knob {k!r}: expected name=value", 2)
        pairs.append((name.strip(), value.strip()))
    try:
        records = generate(Spec(family, seed, duration_s=duration, rate=rate, arrival=arrival, cv=cv,
                                knobs=tuple(pairs)))
    except ValueError as e:
        fail(str(e), 2)
    text = dumps(records)
    if out is not None:
        out.write_text(text)
        typer.echo(f"wrote {len(records):,} requests to {out}", err=True)
    elif not stats:
        typer.echo(text, nl=False)
    if stats:
        if not records:
            fail("no requests generated (raise --duration or --rate)")
        s = trace_stats(records)
        typer.echo(s.report())
        typer.echo(s.result_line())


@workload_app.command("stats")
def stats_cmd(
    trace: Annotated[Path, typer.Argument(help="Any Mooncake-format trace (generated or real).")],
    caches: Annotated[str, typer.Option(help="Round-robin cache counts for the ideal hit rate.")] = "1,4,8",
) -> None:
    """ISL/OSL percentiles, rate, shared-block fraction and the ideal prefix hit rate with one
    infinite cache and round robin over N, then a RESULT line."""
    # lazy: start-up time: loads msgspec, numpy, switchyard_native ... only when called
    from data_plane.engines.errors import TraceFormatError
    # lazy: start-up time: loads msgspec, numpy, switchyard_native ... only when called
    from data_plane.engines.trace import read_mooncake
    # lazy: start-up time: loads msgspec, numpy, switchyard_native ... only when called
    from workloads.stats import trace_stats

    if not trace.exists():
        fail(f"trace {trace} not found", 2)
    try:
        ns = tuple(int(c) for c in caches.split(",") if c.strip())
        records = read_mooncake(trace)
        s = trace_stats(records, ns)
    except TraceFormatError as e:
        fail(f"bad trace: {e}")
    except ValueError as e:
        fail(str(e), 2)
    typer.echo(s.report())
    typer.echo(s.result_line())


@workload_app.command("knobs")
def knobs_cmd(family: Annotated[Optional[str], typer.Argument(help="One family (default: all).")] = None) -> None:
    """Each family's knobs with their defaults."""
    # lazy: start-up time: loads msgspec, numpy, switchyard_native ... only when called
    from workloads.families import FAMILIES, MIXED_TENANTS

    names = [family] if family else [*FAMILIES, "mixed"]
    for name in names:
        if name == "mixed":
            typer.echo("mixed: weights=" + ",".join(f"{t.family}:{t.weight:g}" for t in MIXED_TENANTS)
                       + "  (and <family>.<knob> for a tenant's family); tenants: "
                       + ", ".join(f"{t.name} ({t.family}, priority {t.priority})" for t in MIXED_TENANTS))
            continue
        if name not in FAMILIES:
            fail(f"unknown family {name!r}", 2)
        cls = FAMILIES[name]
        typer.echo(f"{name} (default rate {cls.default_rate:g} req/s):")
        for k, (default, help_) in cls.knobs().items():
            typer.echo(f"  {k:<24} {default!s:<10} {help_}")
