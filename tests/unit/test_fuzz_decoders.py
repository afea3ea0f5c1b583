"""The decoders that read outside bytes, fuzzed in CI on a smaller budget than the benchmark's
million inputs per target (``benchmarks/fuzz_decoders.py``, where the mutations are described):
every input decodes, or is refused with the documented error; nothing else is raised."""

from __future__ import annotations

import pytest

from benchmarks.fuzz_decoders import TARGETS, envelope_target, fuzz, run_target, _seeds
from schemas.envelope import EventCodec

INPUTS = 25_000


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_no_input_crashes_or_hangs_a_decoder(name: str) -> None:
    s = run_target(name, inputs=INPUTS, seed=7)
    assert (s.crashes, s.hangs) == (0, 0), [f.detail[:300] for f in s.findings]
    # The mutations reach past the first check: some inputs still decode, many ways to fail.
    assert s.accepted > 100 and s.rejected > INPUTS / 2
    assert len(s.outcomes) > 50


def test_the_fuzzer_finds_a_planted_bug() -> None:
    """A decoder that mishandles one accepted value (an empty producer) is caught and the input
    that did it kept."""
    inner, codec = envelope_target(), EventCodec()  # one codec: building one per input took minutes

    def planted(buf: bytes) -> str:
        label = inner(buf)
        if label.startswith("ok:"):
            if codec.peek(buf).producer == "":
                raise KeyError("producer")
        return label

    s = fuzz("planted", planted, _seeds(TARGETS["envelope"][1]), inputs=INPUTS, seed=7)
    assert s.crashes > 0
    assert s.findings and s.findings[0].kind == "crash" and "KeyError" in s.findings[0].detail
    with pytest.raises(KeyError):
        planted(s.findings[0].input)
