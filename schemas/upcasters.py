"""Upcasters: pure functions lifting an old payload (as builtins) one version up.

Keyed by ``(type name, from version)``. The codec chains them, v1 -> v2 -> ... -> latest, so each
step only ever knows about its two neighbours.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Doc = dict[str, Any]


def worker_load_reported_v1_to_v2(doc: Doc) -> Doc:
    """v1 had one device usage fraction ``kv_usage``; v2 reports usage per tier."""
    out = dict(doc)
    out["tier_usage"] = {"device": float(out.pop("kv_usage"))}
    return out


def request_v1_to_v2(doc: Doc) -> Doc:
    """v1 request events carried ``request_id`` in the payload besides the envelope key; v2 has
    it only as the key (the codec fills the payload's field from it). The fields are the same,
    so the payload is kept as it is: its own ``request_id``, which the codec checks against the
    key as it does for v2."""
    return doc


#: The request events whose v2 took the request id out of the payload (schemas/events.py).
REQUEST_ID_FROM_KEY_V2 = ("RequestAdmitted", "RequestRouted", "PrefillCompleted", "KvTransferStarted",
                          "KvTransferCompleted", "KvTransferFailed", "RequestCompleted", "RequestFailed",
                          "RequestRejected")

def admission_terms_v2_to_v3(doc: Doc) -> Doc:
    """v3 of ``RequestRouted`` and ``RequestRejected`` adds the TTFT budget test's terms
    (``admission``, optional): a v2 payload is a v3 one without them."""
    return doc


UPCASTERS: dict[tuple[str, int], Callable[[Doc], Doc]] = {
    ("RequestRouted", 2): admission_terms_v2_to_v3,
    ("RequestRejected", 2): admission_terms_v2_to_v3,
    ("WorkerLoadReported", 1): worker_load_reported_v1_to_v2,
    **{(name, 1): request_v1_to_v2 for name in REQUEST_ID_FROM_KEY_V2},
}
