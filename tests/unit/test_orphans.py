from __future__ import annotations

from control_plane.router.orphans import open_requests
from schemas import Envelope
from schemas.events import RequestAdmitted, RequestCompleted, RequestFailed


def _env(payload, producer="r1", epoch=1) -> Envelope:
    return Envelope(event_id="x", type=payload.TYPE, version=payload.VERSION, key=payload.key(), producer=producer,
                    epoch=epoch, seq=0, occurred_at_ns=0, data=payload)


def _adm(rid: str) -> RequestAdmitted:
    return RequestAdmitted(request_id=rid, model="m", prompt_tokens=1, max_tokens=1, block_size=16, hash_algo="a")


def test_only_earlier_incarnations_unended_requests_are_orphans() -> None:
    """a: ended; b: only a retried failure (still open); c: admitted by the current epoch;
    d: admitted by another router. Only b is this router's orphan."""
    events = [
        _env(_adm("a")), _env(RequestCompleted(request_id="a", worker_id="w", prompt_tokens=1, output_tokens=1,
                                               ttft_ms=1, e2e_ms=2)),
        _env(_adm("b")), _env(RequestFailed(request_id="b", reason="x", code="worker_lost", retried=True)),
        _env(_adm("c"), epoch=2),
        _env(_adm("d"), producer="r2"),
    ]
    assert open_requests(events, "r1", current_epoch=2) == ["b"]
