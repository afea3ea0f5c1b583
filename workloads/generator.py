"""``generate(family, seed, ...)``: a seeded workload as Mooncake-format trace records.

The same family, seed and options give the same records, and :func:`dumps` the same bytes, on
any machine: all randomness comes from named :class:`~workloads.rng.Draws` streams (one for the
arrivals, one per session), hash ids are numbered in a fixed order, and the JSON holds only
integers and strings in a fixed key order.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from data_plane.engines.trace import TraceRecord
from workloads.arrivals import ARRIVALS, arrival_times
from workloads.blocks import BlockSpace
from workloads.families import FAMILIES, MIXED_TENANTS, Family, Tenant
from workloads.rng import Draws

#: Every family ``generate`` takes.
FAMILY_NAMES: tuple[str, ...] = (*FAMILIES, "mixed")


@dataclass(frozen=True)
class Spec:
    """What to generate (the CLI's options)."""

    family: str
    seed: int
    duration_s: float = 600.0
    #: Mean requests/s; None: the family's default.
    rate: float | None = None
    arrival: str = "poisson"
    #: Inter-arrival coefficient of variation of ``bursty``.
    cv: float = 2.0
    #: Family knobs by name (``mixed``: ``weights`` = ``chat:0.5,agentic:0.25,...`` and
    #: ``<family>.<knob>`` for its tenants' families).
    knobs: tuple[tuple[str, str], ...] = ()


def family_model(name: str, knobs: Mapping[str, str] | None = None) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown family {name!r}; one of {', '.join(FAMILY_NAMES)}")
    return FAMILIES[name]().with_knobs(knobs or {})


def default_rate(family: str) -> float:
    if family == "mixed":
        return sum(t.weight * FAMILIES[t.family].default_rate for t in MIXED_TENANTS)
    return family_model(family).default_rate


def generate(spec: Spec) -> list[TraceRecord]:
    """The requests of ``spec`` in arrival order (timestamps in whole ms from 0)."""
    if spec.family not in FAMILY_NAMES:
        raise ValueError(f"unknown family {spec.family!r}; one of {', '.join(FAMILY_NAMES)}")
    if spec.arrival not in ARRIVALS:
        raise ValueError(f"unknown arrival process {spec.arrival!r}; one of {', '.join(ARRIVALS)}")
    if spec.duration_s <= 0:
        raise ValueError(f"duration must be > 0 s, got {spec.duration_s}")
    rate = spec.rate if spec.rate is not None else default_rate(spec.family)
    knobs = dict(spec.knobs)
    space = BlockSpace()
    rows: list[tuple[int, int, int, TraceRecord]] = []
    if spec.family == "mixed":
        tenants = _tenants(knobs.pop("weights", None))
        for ti, tenant in enumerate(tenants):
            own = {k.split(".", 1)[1]: v for k, v in knobs.items() if k.startswith(tenant.family + ".")}
            model = family_model(tenant.family, own)
            rows += _family_rows(model, spec, rate * tenant.weight, space, tenant, ti)
        unknown = [k for k in knobs if k.split(".", 1)[0] not in {t.family for t in tenants}]
        if unknown:
            raise ValueError(f"mixed: knobs must be weights=... or <family>.<knob>; got {', '.join(unknown)}")
    else:
        rows = _family_rows(family_model(spec.family, knobs), spec, rate, space, None, 0)
    rows.sort(key=lambda r: r[:3])
    return [r[3] for r in rows]


def _tenants(weights: str | None) -> tuple[Tenant, ...]:
    if not weights:
        return MIXED_TENANTS
    by_family = {t.family: t for t in MIXED_TENANTS}
    out = []
    for part in weights.split(","):
        fam, _, w = part.partition(":")
        if fam not in by_family:
            raise ValueError(f"mixed weights: unknown family {fam!r}")
        out.append(Tenant(by_family[fam].name, fam, float(w), by_family[fam].priority))
    total = sum(t.weight for t in out)
    if total <= 0:
        raise ValueError("mixed weights must add up to more than 0")
    return tuple(Tenant(t.name, t.family, t.weight / total, t.priority) for t in out if t.weight > 0)


def _family_rows(model: Family, spec: Spec, rate: float, space: BlockSpace, tenant: Tenant | None,
                 order: int) -> list[tuple[int, int, int, TraceRecord]]:
    tag = tenant.name if tenant else model.name
    starts = arrival_times(spec.arrival, rate / model.mean_requests_per_session(), spec.duration_s,
                           Draws(model.name, spec.seed, tag, "arrivals"), cv=spec.cv,
                           start_s=-min(model.warmup_s(), spec.duration_s))
    end_ms = int(spec.duration_s * 1000)
    rows = []
    for sid, t0 in enumerate(starts):
        d = Draws(model.name, spec.seed, tag, "session", sid)
        for t, segs, osl, turn in model.session(sid, t0, d, tag):
            ts = int(t * 1000.0 // 1)
            if not 0 <= ts < end_ms:
                continue
            ids = space.hash_ids(segs)
            rec = TraceRecord(
                timestamp_ms=ts, input_length=sum(n for _, n in segs), output_length=osl, hash_ids=tuple(ids),
                session_id=f"{tag}-{sid}", turn=turn,
                priority=tenant.priority if tenant else None, tenant=tenant.name if tenant else None,
            )
            rows.append((ts, order, sid * 4096 + turn, rec))
    return rows


def record_json(rec: TraceRecord) -> str:
    """One Mooncake jsonl line (fixed key order; optional fields only when set)."""
    obj: dict[str, object] = {"timestamp": int(rec.timestamp_ms), "input_length": rec.input_length,
                              "output_length": rec.output_length, "hash_ids": list(rec.hash_ids)}
    for k in ("session_id", "turn", "priority", "tenant"):
        v = getattr(rec, k)
        if v is not None:
            obj[k] = v
    return json.dumps(obj, separators=(", ", ": "))


def dumps(records: Iterable[TraceRecord]) -> str:
    return "".join(record_json(r) + "\n" for r in records)


def write(records: Iterable[TraceRecord], path: str | Path) -> None:
    Path(path).write_text(dumps(records))
