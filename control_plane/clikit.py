"""What every ``switchyard`` command shares: its logging set-up and how it fails."""

from __future__ import annotations

import logging
from typing import NoReturn

import typer

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(verbose: bool = False, *, libraries: tuple[str, ...] = ()) -> None:
    """INFO (DEBUG with ``verbose``) in one format. librdkafka's own log is off: the clients report
    its errors themselves. ``libraries`` (e.g. Faust's) log at WARNING unless ``verbose``."""
    level = logging.DEBUG if verbose else logging.INFO
    logging.basicConfig(level=level, format=LOG_FORMAT)
    logging.getLogger("switchyard.rdkafka").setLevel(logging.CRITICAL)
    for name in libraries:
        logging.getLogger(name).setLevel(logging.DEBUG if verbose else logging.WARNING)


def fail(msg: str, code: int = 1) -> NoReturn:
    """``error: msg`` on stderr, and exit ``code`` (2: the call's arguments are wrong)."""
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)
