"""``switchyard doctor`` and ``switchyard console-check``: the doctor's report and a check of
the console's pages, both against a running admin API (by default the one ``switchyard up``
started, with the admin token it made: tooling beside the demo, so the admin context itself
never reads the demo's files)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from control_plane.admin.cli import AdminUrlOpt, TokenFileOpt, api_call
from control_plane.admin.console.browser import Browser
from control_plane.admin.console.dashboards import dashboards
from common.stack_settings import StackSettings


def _defaults(token_file: Path | None, url: str | None) -> tuple[Path | None, str | None]:
    """Without a token or URL, the running demo's (its 0600 ``admin-token`` file, its admin
    URL from ``procs.json``)."""
    import os

    # lazy: start-up time: loads httpx only when called
    from control_plane.admin.client import TOKEN_ENV, URL_ENV

    st = StackSettings.from_env()
    demo = st.state_dir / "demo"
    if token_file is None and not os.environ.get(TOKEN_ENV) and (demo / "admin-token").exists():
        token_file = demo / "admin-token"
    if url is None and not os.environ.get(URL_ENV):
        # lazy: start-up time: loads httpx, msgspec, prometheus_client ... only when called
        from ops.demo.up import Supervisor

        url = next((p.url for p in Supervisor(st).procs if p.name == "admin" and p.url), None)
    return token_file, url


def print_report(rep: dict) -> None:
    e = rep["expected"]
    typer.echo(f"expected: block size {e['block_size']}, hash {e['hash_algo']}, topic prefix {e['topic_prefix']}, "
               f"tiers {', '.join(e['tiers'])}")
    for a in rep["agreement"]:
        tiers = "; ".join(f"{t}: {b} both / {i} index only / {w} worker only" for t, (b, i, w) in a["tiers"].items())
        typer.echo(f"  {a['worker_id']}: agreement {a['agreement']:.1%}" + (f" ({tiers})" if tiers else " (both empty)"))
    for m in rep["mismatches"]:
        typer.secho(f"MISMATCH {m['worker_id']} {m['check']}: found {m['found']}, expected {m['expected']}",
                    fg=typer.colors.RED)
        typer.echo(f"  fix: {m['fix']}")
    typer.echo(f"doctor: {len(rep['mismatches'])} mismatches, {rep['checked_workers']} workers compared")


def doctor_cmd(token_file: TokenFileOpt = None, admin_url: AdminUrlOpt = None,
               as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False) -> None:
    """The router's index against each worker's own cache, and configuration mismatches (block
    size, hash algorithm and seed, tier names, topic prefix), each with what to change. Exit 1 on
    any mismatch (viewer token; default: the running demo's)."""
    token_file, admin_url = _defaults(token_file, admin_url)
    rep = api_call(token_file, admin_url, lambda c: c.doctor())
    if as_json:
        typer.echo(json.dumps(rep, indent=2))
    else:
        print_report(rep)
    if rep["mismatches"]:
        raise typer.Exit(1)


def _p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]


def console_check_cmd(
    token_file: TokenFileOpt = None,
    admin_url: AdminUrlOpt = None,
    repeat: Annotated[int, typer.Option(help="Loads of each page for its p95.")] = 20,
    requests: Annotated[int, typer.Option(help="Request pages checked (the newest completed requests).")] = 5,
    browser: Annotated[bool, typer.Option(help="Also load every page in headless Chromium and count console errors.")] = True,
    screenshots: Annotated[Optional[Path], typer.Option(help="Save a screenshot of each page in this directory.")] = None,
) -> None:
    """Every console page against the running deployment: server time per page (p95 over
    REPEAT loads), console errors in headless Chromium, the doctor's mismatches, and how many
    requests the log holds. Ends with a RESULT line; exit 1 on a console error, a page that is
    not 200, or a doctor mismatch."""
    import httpx

    token_file, admin_url = _defaults(token_file, admin_url)
    # lazy: start-up time: loads httpx only when called
    from control_plane.admin.client import admin_url as resolve_url
    # lazy: start-up time: loads httpx only when called
    from control_plane.admin.client import load_token

    base = resolve_url(admin_url)
    token = load_token(token_file)
    h = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=base, timeout=60, headers=h) as api:
        admitted = api.get("/events", params={"type": "RequestAdmitted", "limit": 1}).json()["total"]
        done = api.get("/events", params={"type": "RequestCompleted", "limit": requests}).json()["items"]
        rep = api.get("/doctor").json()
    from urllib.parse import quote

    pages = ["/console/fleet", "/console/requests", "/console/planner", "/console/doctor"]
    pages += [f"/console/requests/{quote(e['request_id'], safe='')}" for e in done]
    pages += [f"/console/dashboards?d={d}" for d in dashboards()]
    lat: dict[str, list[float]] = {p: [] for p in pages}
    bad: list[str] = []
    with httpx.Client(base_url=base, timeout=60, cookies={"sy_console": token}) as web:
        for _ in range(repeat):
            for p in pages:
                t0 = time.perf_counter()
                r = web.get(p)
                lat[p].append((time.perf_counter() - t0) * 1000)
                if r.status_code != 200:
                    bad.append(f"{p}: {r.status_code}")
    errors: list[str] = []
    if browser:
        b = Browser.start()
        try:
            b.login(base, token)
            b.console()
            for i, p in enumerate(pages):
                b.get(base + p)
                if screenshots is not None:
                    b.screenshot(screenshots / f"{i:02d}-{p.split('/')[2].split('?')[0]}.png")
                errors.extend(f"{p}: {e}" for e in b.new_errors())
        finally:
            b.close()
    for p in pages:
        typer.echo(f"{_p95(lat[p]):8.1f} ms p95  {p}")
    for x in bad + errors:
        typer.secho(x, fg=typer.colors.RED)
    if rep.get("mismatches"):
        print_report(rep)
    worst = max(_p95(v) for v in lat.values())
    typer.echo(f"RESULT pages={len(pages)} loads={len(pages) * repeat} p95_ms={worst:.0f} "
               f"console_errors={len(errors) if browser else 'unchecked'} doctor_mismatches={len(rep.get('mismatches', []))} "
               f"requests_in_log={admitted} non_200={len(bad)}")
    if bad or errors or rep.get("mismatches"):
        raise typer.Exit(1)
