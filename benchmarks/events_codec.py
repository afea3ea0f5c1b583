"""In-process throughput of the event codec: envelope encode and decode, per event type.

Payloads are the frozen samples in ``tests/samples/`` (BlockStored with 21 chained hashes and
336 token ids, RequestRouted with an 8-row score table, WorkerRegistered with NIXL metadata...),
so the figures describe the shapes the system really sends rather than minimal structs.

Encode is ``EventCodec.encode`` of a ready envelope; decode is ``EventCodec.decode`` of the
sample's bytes, i.e. envelope, payload validation and, for superseded versions, the upcast
(``WorkerLoadReported.v1`` therefore measures the read path of old records). No broker, no I/O
inside the timed loops; ``switchyard bench events`` adds the Kafka round trip on top.

Run: ``uv run python -m benchmarks.events_codec [-n 200000]``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import msgspec

from schemas.envelope import Envelope, EventCodec, fill_key_field
from schemas.events import ALL_EVENT_TYPES, Event

SAMPLES_DIR = Path(__file__).resolve().parents[1] / "tests" / "samples"


def load_samples(
    directory: Path = SAMPLES_DIR, codec: EventCodec | None = None
) -> dict[str, tuple[Envelope[Event], bytes]]:
    """``{"<Type>.v<N>": (envelope at that exact version, its bytes)}`` in registry order.

    The envelope is decoded with its own version's struct (not via the codec, which would
    upcast), so that encoding it reproduces what that version's producers write.
    """
    codec = codec or EventCodec()
    out = {}
    for cls in ALL_EVENT_TYPES:
        name = f"{cls.TYPE}.v{cls.VERSION}"
        path = Path(directory) / f"{name}.msgpack"
        if not path.is_file():
            raise FileNotFoundError(f"{path} missing; run scripts/make_event_samples.py")
        buf = path.read_bytes()
        env = msgspec.msgpack.decode(buf, type=Envelope[codec.payload_type(cls.TYPE, cls.VERSION)])
        fill_key_field(env.data, env.key)  # a request event's id is its key (v2 on)
        out[name] = (env, buf)
    return out


def _seconds(fn: Callable[[Any], object], arg: Any, n: int) -> float:
    """Wall time of ``n`` calls, with the collector off as ``timeit`` does, so a collection
    triggered by an earlier row's garbage is not billed to this one."""
    for _ in range(min(n, 2_000)):
        fn(arg)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(n):
            fn(arg)
        return time.perf_counter() - start
    finally:
        if was_enabled:
            gc.enable()


def run(
    n: int = 200_000, *, samples_dir: Path = SAMPLES_DIR, out: TextIO | None = sys.stdout
) -> dict[str, Any]:
    """Encode and decode every sample ``n`` times; print a table to ``out`` (None: silent).

    Returns ``{"n", "types": {name: {bytes, encode_per_s, decode_per_s, encode_us,
    decode_us}}, "overall": {...}}``. In ``overall``, ``mean_*_per_s`` is the plain mean of the
    per-type rates; ``mixed_*_per_s`` is the rate of a stream with equal counts of each type
    (total events over total time), which weights the slow, large types more.
    """
    if n <= 0:
        raise ValueError("n must be positive")
    codec = EventCodec()
    types: dict[str, dict[str, float]] = {}
    total_enc = total_dec = 0.0
    for name, (env, buf) in load_samples(samples_dir, codec).items():
        enc = _seconds(codec.encode, env, n)
        dec = _seconds(codec.decode, buf, n)
        total_enc += enc
        total_dec += dec
        types[name] = {
            "bytes": len(buf),
            "encode_per_s": n / enc,
            "decode_per_s": n / dec,
            "encode_us": enc / n * 1e6,
            "decode_us": dec / n * 1e6,
        }
    events = n * len(types)
    result = {
        "n": n,
        "types": types,
        "overall": {
            "mean_bytes": statistics.fmean(t["bytes"] for t in types.values()),
            "mean_encode_per_s": statistics.fmean(t["encode_per_s"] for t in types.values()),
            "mean_decode_per_s": statistics.fmean(t["decode_per_s"] for t in types.values()),
            "mixed_encode_per_s": events / total_enc,
            "mixed_decode_per_s": events / total_dec,
        },
    }
    if out is not None:
        print(format_table(result), file=out)
    return result


def format_table(result: dict[str, Any]) -> str:
    head = f"{'event':<24}{'bytes':>7}{'encode/s':>13}{'decode/s':>13}{'enc µs':>9}{'dec µs':>9}"
    lines = [f"codec throughput, n={result['n']:,} per type", head, "-" * len(head)]
    for name, t in result["types"].items():
        lines.append(
            f"{name:<24}{t['bytes']:>7}{t['encode_per_s']:>13,.0f}{t['decode_per_s']:>13,.0f}"
            f"{t['encode_us']:>9.2f}{t['decode_us']:>9.2f}"
        )
    o = result["overall"]
    lines.append("-" * len(head))
    lines.append(
        f"{'mean of types':<24}{o['mean_bytes']:>7.0f}"
        f"{o['mean_encode_per_s']:>13,.0f}{o['mean_decode_per_s']:>13,.0f}"
    )
    lines.append(
        f"{'equal-count mix':<24}{'':>7}"
        f"{o['mixed_encode_per_s']:>13,.0f}{o['mixed_decode_per_s']:>13,.0f}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Event codec encode/decode throughput")
    parser.add_argument("-n", type=int, default=200_000, help="iterations per type and direction")
    run(parser.parse_args(argv).n)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
