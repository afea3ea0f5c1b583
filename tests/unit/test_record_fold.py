"""RecordFold: what a fold does with a record it cannot apply. Pure, no mocks."""

from __future__ import annotations

from common.log.fold import Poisoned, RecordFold
from common.log.reader import LogRecord
from schemas import MalformedEvent


def _rec(offset: int, value: bytes | None = b"ok", **overrides) -> LogRecord:
    fields = {"topic": "t", "partition": 0, "offset": offset, "ts_ms": 0, "key": None, "value": value, **overrides}
    return LogRecord(**fields)


def _fold(apply):
    poisoned: list[tuple[int, Poisoned]] = []
    positions: dict = {}

    def applied(rec: LogRecord):
        out = apply(rec)
        positions[(rec.topic, rec.partition)] = rec.offset + 1
        return out

    return RecordFold(positions, applied, lambda rec, e: poisoned.append((rec.offset, e))), poisoned


def test_any_apply_error_is_poison_at_once_and_the_fold_goes_on() -> None:
    """Offsets 0..4: 1 has no value, 2 does not decode, 3 is refused, 4 raises a fold bug. Each is
    poisoned once (the fold is pure: a retry would fail the same way), with its reason, and the
    position moves past it to 6 after the good record 5."""
    def apply(rec: LogRecord):
        if rec.value == b"undecodable":
            raise MalformedEvent("not an envelope")
        if rec.value == b"refused":
            raise Poisoned("index_rejected:algo", "another hash algorithm")
        if rec.value == b"bug":
            raise ValueError("worker id out of range")
        return rec.offset

    fold, poisoned = _fold(apply)
    values = [b"ok", None, b"undecodable", b"refused", b"bug", b"ok"]
    out = [fold(_rec(i, v)) for i, v in enumerate(values)]
    assert out == [0, None, None, None, None, 5]
    assert [(o, e.reason) for o, e in poisoned] == [(1, "no_value"), (2, "malformed"), (3, "index_rejected:algo"),
                                                   (4, "apply_failed:ValueError")]
    assert poisoned[-1][1].detail == "ValueError: worker id out of range"
    assert fold.positions == {("t", 0): 6}
    assert (fold.stats.applied, fold.stats.poisoned) == (2, 4)
