"""What the scripts that study ``bench e2e`` runs' logs share (``ttft_terms``, ``ttft_queue_ab``,
``ttft_engine_bound``): the ``requests`` stream of a run read from the broker, the command line
(topic prefixes), one line per run and the ``RESULT`` line of the worst case over the runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from common.log.catalog import Catalog
from common.log.reader import KafkaLogReader, scan_events
from common.settings import BusSettings
from control_plane.replay.reconcile import _quantile
from schemas import EventCodec
from schemas.envelope import Envelope


def requests_log(prefix: str) -> list[Envelope]:
    """The ``requests`` stream of the run on topic prefix ``prefix``, read from the broker."""
    bus = BusSettings.from_env(topic_prefix=prefix)
    codec = EventCodec(verifier=bus.verifier())
    with KafkaLogReader(bus.bootstrap) as reader:
        return [env for _, env in scan_events(reader, Catalog(prefix).topic("requests"), codec=codec)]


def quantile(xs: list[float], p: float) -> float:
    """The ``p`` quantile of ``xs`` (unsorted), NaN when empty: reconcile's rule."""
    return _quantile(sorted(xs), p) if xs else float("nan")


def over_runs(doc: str, per_run: Callable[[list[Envelope]], dict], describe: Callable[[dict], str],
              worst: dict[str, str]) -> None:
    """The scripts' ``main``: for each topic prefix on the command line, ``per_run`` of its log,
    printed as ``prefix: describe(row)``; then ``RESULT logs=N`` and, for each ``name: key`` of
    ``worst``, the largest ``row[key]`` over the runs (``+key``: the largest in magnitude, signed;
    ``#key``: how many runs have ``row[key]`` true)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("prefixes", nargs="+", help="topic prefixes of bench e2e runs (e2ekv..., e2ero..., e2epl...)")
    rows = []
    for prefix in ap.parse_args().prefixes:
        row = per_run(requests_log(prefix))
        rows.append(row)
        print(f"{prefix}: {describe(row)}", flush=True)
    parts = [f"logs={len(rows)}"]
    for name, key in worst.items():
        if key.startswith("#"):
            parts.append(f"{name}={sum(bool(r[key[1:]]) for r in rows)}")
        elif key.startswith("+"):
            parts.append(f"{name}={max((r[key[1:]] for r in rows), key=abs):+.3f}")
        else:
            parts.append(f"{name}={max(r[key] for r in rows):.3f}")
    print("RESULT " + " ".join(parts))
