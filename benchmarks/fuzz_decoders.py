"""Fuzzing the two decoders that read bytes from outside the process.

* **envelope**: :meth:`schemas.envelope.EventCodec.decode`, which every consumer runs on every
  record it reads from Kafka. A record decodes, or the decoder raises a
  :class:`~schemas.errors.SchemaError` (the consumer dead-letters it). A decoded envelope must
  survive ``encode`` then ``decode`` unchanged: what a consumer accepted, a producer can write.
* **signed**: the owner-signature check every live consumer runs before it decodes
  (:class:`schemas.signing.Verifier`): it passes or raises ``ForgedEvent``, and a decodable
  envelope signed by its owner verifies and decodes unchanged.
* **vllm**: the vLLM KV-event path of a worker's bridge: :func:`data_plane.vllm.kv_events.decode_batch`
  on a ZMQ payload, :class:`~data_plane.vllm.kv_events.KvEventTranslator` on the batch, then
  each payload stamped into an envelope and encoded, as the bridge publishes it. A payload
  decodes, or raises :class:`~data_plane.vllm.kv_events.VllmDecodeError` (the bridge resyncs);
  translation and publishing must not raise at all (an exception there ends the bridge thread),
  and what is published must decode back to the same envelope.

Any other exception is a **crash**; an input that takes longer than ``--hang-ms`` is a **hang**
(measured in-process, per input). Both are written to ``--out`` as files, one per finding.

The inputs are mutations of the checked-in seeds (``tests/samples/*.msgpack``, the frozen
sample of every event type and version; ``tests/fixtures/vllm/*.msgpack``, byte-exact payloads
of several vLLM releases): byte-level mutations (bit flips, interesting bytes, insertions,
deletions, truncation, splices of two inputs, msgpack headers that announce huge lengths) and
structure-level ones (the msgpack tree decoded, one node replaced by an interesting value of
another type, a key dropped or an unknown one added, then re-encoded; for envelopes the
payload's own tree inside its ``data`` bytes as well). Feedback without coverage
instrumentation: an input joins the corpus when its outcome is new (decoded type, or the error
class and message with the numbers taken out), so the mutations keep exploring past each new
way to fail. Deterministic for a seed.

    uv run python -m benchmarks.fuzz_decoders --inputs 1000000 --seed 1

Last line: ``RESULT target=envelope inputs=... crashes=0 hangs=0 ... target=vllm ...``.
"""

from __future__ import annotations

import argparse
import logging
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from data_plane.vllm.kv_events import KvEventTranslator, VllmDecodeError, VllmSource, decode_batch
from common.settings import repo_root
from schemas.envelope import EnvelopeFactory, EventCodec
from schemas.errors import SchemaError
from schemas.signing import ForgedEvent, Signer, Verifier, about_of

#: A target runs one input. It returns an outcome label (``ok:<type>`` or ``err:<class>:<msg>``)
#: for expected results and raises for a crash.
Target = Callable[[bytes], str]

_DIGITS = re.compile(r"\d+")
_INTERESTING_BYTES = [0x00, 0x7F, 0x80, 0xC0, 0xC1, 0xC2, 0xC3, 0xCC, 0xCF, 0xD3, 0xD9, 0xDB, 0xDC, 0xDD, 0xDE,
                      0xDF, 0xE0, 0xFF, 0x90, 0x80, 0xA0, 0xC4, 0xC6, 0xD4, 0xC7, 0xC9]
# msgpack headers that announce far more than follows: array32, map32, str32, bin32, ext32.
_HUGE_HEADERS = [b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\x7f\xff\xff\xff",
                 b"\xc6\xff\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x01", b"\xdc\xff\xff", b"\xde\xff\xff"]
_INTERESTING_VALUES: list[object] = [
    None, True, False, 0, -1, 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, -(2**63), -(2**31),
    0.5, float("nan"), float("inf"), -float("inf"), "", "x" * 300, "\ud7ff\u0000\uffff", "é" * 70,
    b"", b"\x00" * 32, b"\xff" * 9, [], [0] * 40, [None], {}, {"": None}, {"type": 1},
    [[[[[]]]]], list(range(-3, 3)), [2**64 - 1, -(2**63)], "BlockStored", "AllBlocksCleared",
]


def _outcome_key(label: str) -> str:
    """The outcome with numbers taken out: two inputs failing the same way at different offsets
    count once."""
    return _DIGITS.sub("#", label)[:120]


# ---------------------------------------------------------------------------------------------
# Targets
# ---------------------------------------------------------------------------------------------


def envelope_target() -> Target:
    codec = EventCodec()

    def run(buf: bytes) -> str:
        try:
            env = codec.decode(buf)
        except SchemaError as e:
            return f"err:{type(e).__name__}:{str(e)[:60]}"
        wire = codec.encode(env)
        if codec.encode(codec.decode(wire)) != wire:  # bytes, not ==: a NaN in a free-form dict
            raise AssertionError(f"{env.type}: decode(encode(decoded)) differs from the decoded {env!r}")
        return f"ok:{env.type}"

    return run


def signed_target() -> Target:
    """The owner check every live consumer runs first (schemas/signing.py): on any bytes it
    passes or raises ``ForgedEvent``; and an envelope that decodes, once signed by its owner,
    verifies and decodes to the same envelope (unless its key is not its worker's)."""
    master = b"fuzz-master-secret"
    codec, verifying = EventCodec(), EventCodec(verifier=Verifier(master))
    signer = Signer.master(master)

    def run(buf: bytes) -> str:
        try:
            verifying.check_owner(buf)
            verdict = "pass"
        except ForgedEvent as e:
            verdict = e.reason
        try:
            env = codec.decode(buf)
        except SchemaError as e:
            return f"err:{type(e).__name__}:{verdict}:{str(e)[:40]}"
        signed = signer.sign(env.type, env.key, codec.encode(env), about_of(env.data))
        try:
            again = verifying.decode(signed)
        except ForgedEvent as e:
            if e.reason != "forged:key_not_worker":
                raise AssertionError(f"{env.type} signed by its owner does not verify: {e}") from None
            return f"ok:{env.type}:{verdict}:key_not_worker"
        if codec.encode(again) != codec.encode(env):
            raise AssertionError(f"{env.type}: the signed envelope decodes differently")
        return f"ok:{env.type}:{verdict}"

    return run


def vllm_target() -> Target:
    codec = EventCodec()
    source = VllmSource(worker_id="fuzz-w", hash_algo="sha256", block_size=16)

    def run(buf: bytes) -> str:
        try:
            batch = decode_batch(buf)
        except VllmDecodeError as e:
            return f"err:VllmDecodeError:{str(e)[:60]}"
        # A fresh translator per input: what one input taught it must not hide the next's bug.
        events = KvEventTranslator(source).translate(batch)
        factory = EnvelopeFactory("fuzz-w", 0, time.time_ns)
        for ev in events:
            wire = codec.encode(factory.wrap(ev))
            env = codec.decode(wire)
            if codec.encode(env) != wire:
                raise AssertionError(f"{env.type}: the published envelope decodes differently")
        return f"ok:{batch.form.value}:{len(events)}:{'+'.join(sorted({type(e).__name__ for e in events}))}"

    return run


def _seeds(pattern: str) -> list[bytes]:
    files = sorted(repo_root().glob(pattern))
    if not files:
        raise FileNotFoundError(f"no seed files match {pattern} under {repo_root()}")
    return [f.read_bytes() for f in files]


TARGETS: dict[str, tuple[Callable[[], Target], str]] = {
    "envelope": (envelope_target, "tests/samples/*.msgpack"),
    "signed": (signed_target, "tests/samples/*.msgpack"),
    "vllm": (vllm_target, "tests/fixtures/vllm/*.msgpack"),
}


# ---------------------------------------------------------------------------------------------
# Mutations
# ---------------------------------------------------------------------------------------------


class Mutator:
    """Byte- and structure-level mutations of msgpack inputs, from one seeded generator."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def mutate(self, buf: bytes, other: bytes) -> bytes:
        r = self.rng
        if r.random() < 0.45:
            out = self.structural(buf)
            if out is not None:
                return out
        out = bytearray(buf)
        for _ in range(1 + int(r.expovariate(1.0))):
            self._byte_op(out, other)
        return bytes(out)

    def _byte_op(self, out: bytearray, other: bytes) -> None:
        r = self.rng
        op = r.randrange(8)
        n = len(out)
        if op == 0 and n:
            i = r.randrange(n)
            out[i] ^= 1 << r.randrange(8)
        elif op == 1 and n:
            out[r.randrange(n)] = r.choice(_INTERESTING_BYTES)
        elif op == 2:
            i = r.randrange(n + 1)
            out[i:i] = bytes(r.randrange(256) for _ in range(r.randint(1, 8)))
        elif op == 3 and n:
            i = r.randrange(n)
            del out[i:i + r.randint(1, 16)]
        elif op == 4 and n:
            del out[r.randrange(n):]  # truncated
        elif op == 5 and other:
            i, j = r.randrange(n + 1), r.randrange(len(other))
            out[i:] = other[j:]  # splice: this input's head, another's tail
        elif op == 6:
            i = r.randrange(n + 1)
            out[i:i] = r.choice(_HUGE_HEADERS)
        elif n:
            i = r.randrange(n)
            k = r.randint(1, min(32, n - i))
            out[i:i] = out[i:i + k] * r.randint(1, 4)  # a repeated range

    def structural(self, buf: bytes) -> bytes | None:
        try:
            tree = msgspec.msgpack.decode(buf)
        except (msgspec.DecodeError, ValueError, TypeError):
            return None
        tree = self._mutate_tree(tree, depth=0)
        try:
            return msgspec.msgpack.encode(tree)
        except (TypeError, OverflowError, ValueError):
            return None

    def _mutate_tree(self, node: object, depth: int) -> object:
        r = self.rng
        # An envelope's payload is msgpack inside ``data``: mutate the inner tree too.
        if isinstance(node, bytes) and node and r.random() < 0.5:
            inner = self.structural(node)
            if inner is not None:
                return inner
        children = (list(node.keys()) if isinstance(node, dict) else list(range(len(node)))
                    if isinstance(node, list) else [])
        if not children or (depth > 0 and r.random() < 0.3):
            return self._value(node)
        if isinstance(node, dict):
            roll = r.random()
            if roll < 0.1:
                node.pop(r.choice(children))
                return node
            if roll < 0.2:
                node[r.choice(["extra", "type", "data", "block_hashes", "x" * 40])] = r.choice(_INTERESTING_VALUES)
                return node
        elif r.random() < 0.1:
            node.insert(r.randrange(len(node) + 1), r.choice(_INTERESTING_VALUES))
            return node
        # An envelope's header fields are few and simple: half the time, go for its payload.
        k = "data" if isinstance(node, dict) and "data" in node and r.random() < 0.5 else r.choice(children)
        node[k] = self._mutate_tree(node[k], depth + 1)
        return node

    def _value(self, node: object) -> object:
        r = self.rng
        if isinstance(node, int) and not isinstance(node, bool) and r.random() < 0.5:
            return r.choice([node + 1, node - 1, -node, node * 2**32, node ^ (1 << r.randrange(64))])
        if isinstance(node, str) and r.random() < 0.5:
            return r.choice([node * 50, node[:-1], node + "\x00", node.upper(), ""])
        v = r.choice(_INTERESTING_VALUES)
        return list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------


@dataclass
class Finding:
    kind: str  # crash | hang
    detail: str
    input: bytes


@dataclass
class FuzzStats:
    target: str
    inputs: int = 0
    seconds: float = 0.0
    crashes: int = 0
    hangs: int = 0
    max_input_ms: float = 0.0
    corpus: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    findings: list[Finding] = field(default_factory=list)

    @property
    def accepted(self) -> int:
        return sum(n for k, n in self.outcomes.items() if k.startswith("ok:"))

    @property
    def rejected(self) -> int:
        return sum(n for k, n in self.outcomes.items() if k.startswith("err:"))


def fuzz(name: str, target: Target, seeds: list[bytes], *, inputs: int, seed: int, hang_ms: float = 1000.0,
         max_corpus: int = 4096, keep_findings: int = 20) -> FuzzStats:
    """Run ``inputs`` mutated inputs through ``target`` (the seeds themselves first)."""
    rng = random.Random(seed)
    mut = Mutator(rng)
    corpus = list(seeds)
    seen: set[str] = set()
    stats = FuzzStats(name)
    t_start = time.perf_counter()
    for i in range(inputs):
        if i < len(seeds):
            buf = seeds[i]
        else:
            # Half from a seed, which is valid: one mutation of it mostly reaches the payload
            # decoders; half from the corpus, to go on from each new way to fail.
            base = seeds[rng.randrange(len(seeds))] if rng.random() < 0.5 else corpus[rng.randrange(len(corpus))]
            buf = mut.mutate(base, corpus[rng.randrange(len(corpus))])
        t0 = time.perf_counter()
        try:
            label = target(buf)
        except Exception as e:  # noqa: BLE001 - every other exception is the finding
            label = f"crash:{type(e).__name__}:{str(e)[:60]}"
            stats.crashes += 1
            if len(stats.findings) < keep_findings:
                stats.findings.append(Finding("crash", f"{type(e).__name__}: {e}", buf))
        elapsed_ms = (time.perf_counter() - t0) * 1000
        stats.max_input_ms = max(stats.max_input_ms, elapsed_ms)
        if elapsed_ms > hang_ms:
            stats.hangs += 1
            if len(stats.findings) < keep_findings:
                stats.findings.append(Finding("hang", f"{elapsed_ms:.0f} ms", buf))
        key = _outcome_key(label)
        stats.outcomes[key] += 1
        if key not in seen:
            seen.add(key)
            if len(corpus) < max_corpus and len(buf) <= 1 << 16:
                corpus.append(buf)
    stats.inputs = inputs
    stats.seconds = time.perf_counter() - t_start
    stats.corpus = len(corpus)
    return stats


def run_target(name: str, *, inputs: int, seed: int, hang_ms: float = 1000.0) -> FuzzStats:
    make, pattern = TARGETS[name]
    return fuzz(name, make(), _seeds(pattern), inputs=inputs, seed=seed, hang_ms=hang_ms)


def _write_findings(stats: FuzzStats, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for n, f in enumerate(stats.findings):
        (out / f"{stats.target}-{f.kind}-{n}.msgpack").write_bytes(f.input)
        (out / f"{stats.target}-{f.kind}-{n}.txt").write_text(f.detail + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inputs", type=int, default=1_000_000, help="inputs per target")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--targets", default=",".join(TARGETS), help=f"comma list of {sorted(TARGETS)}")
    ap.add_argument("--hang-ms", type=float, default=1000.0, help="an input slower than this is a hang")
    ap.add_argument("--out", type=Path, default=Path("fuzz-findings"), help="where findings are written")
    args = ap.parse_args(argv)
    # The translator warns once per unknown type or medium, and every input has a fresh one.
    logging.getLogger("data_plane.vllm").setLevel(logging.ERROR)
    parts = []
    bad = 0
    for name in args.targets.split(","):
        if name not in TARGETS:
            ap.error(f"unknown target {name!r}; known: {sorted(TARGETS)}")
        s = run_target(name, inputs=args.inputs, seed=args.seed, hang_ms=args.hang_ms)
        print(f"{name}: {s.inputs} inputs in {s.seconds:.1f} s ({s.inputs / s.seconds:,.0f}/s): "
              f"{s.accepted} decoded, {s.rejected} rejected with the documented error, {s.crashes} crashes, "
              f"{s.hangs} hangs; slowest input {s.max_input_ms:.1f} ms; {len(s.outcomes)} distinct outcomes, "
              f"corpus {s.corpus}")
        for key, n in s.outcomes.most_common(8):
            print(f"  {n:>9}  {key}")
        if s.findings:
            _write_findings(s, args.out)
            print(f"  findings written to {args.out}/")
            for f in s.findings[:5]:
                print(f"  {f.kind}: {f.detail[:200]}")
        bad += s.crashes + s.hangs
        parts.append(f"target={name} inputs={s.inputs} crashes={s.crashes} hangs={s.hangs} "
                     f"accepted={s.accepted} rejected={s.rejected} outcomes={len(s.outcomes)} "
                     f"inputs_per_s={s.inputs / s.seconds:.0f} max_input_ms={s.max_input_ms:.1f}")
    print("RESULT " + " ".join(parts))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
