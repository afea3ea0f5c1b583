"""Bounded label values: what a dead-lettered record or a failure reason may put in a label.

Any role may write the dead-letter topic and its headers, and failure reasons are free text: a
label taken from them as they are would make one series per record. Each maps to a fixed set.
"""

from __future__ import annotations

import re

from control_plane.metrics.catalog import EVENT_STREAMS

#: Label value for a pool the projection cannot name (a worker it never saw register).
UNKNOWN = "unknown"
#: What a dead-letter ``reason`` label may say: the kind before the first ":" of the header
#: (schemas/errors.py, schemas/signing.py, common/log/fold.py, the index), else ``other``. Any
#: role may write the dead-letter topic and its headers, so a label never carries them as they
#: are: 3,000 invented reasons would be 3,000 series. The header itself stays on the record.
DEADLETTER_REASONS = frozenset({"schema_error", "malformed", "unknown_type", "unsupported_version", "no_value",
                                "apply_failed", "index_rejected", "forged"})
OTHER = "other"


def deadletter_labels(reason: str, source: str) -> tuple[str, str]:
    """The (reason, source) labels of a dead-lettered record: each from a fixed set, ``other``
    for anything else (``unknown`` when the header is missing)."""
    kind = reason.split(":", 1)[0]
    return ((kind if kind in DEADLETTER_REASONS else OTHER) if reason else UNKNOWN,
            (source if source in EVENT_STREAMS else OTHER) if source else UNKNOWN)


def reason_class(reason: str) -> str:
    """A free-text failure reason reduced to a bounded label value: the text before the first
    ``:`` or ``(``, snake_cased, when it is a short phrase of letters (``"TransferTimeout: ..."``
    -> ``transfer_timeout``, ``"no free staging slots (3 needed)"`` -> ``no_free_staging_slots``);
    otherwise ``other`` (numbers and ids would make one series per failure)."""
    head = re.split(r"[:(\[]", reason, maxsplit=1)[0].strip()
    head = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", head).lower()
    if not re.fullmatch(r"[a-z][a-z _-]{0,39}", head):
        return "other"
    return re.sub(r"[ -]+", "_", head)
